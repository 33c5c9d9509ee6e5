// FP8 on the CPU (core/fp8.h) and the delayed-scaling recipe (ops/fp8_recipe.h):
//   * the 256 codes of each format decode to the values the format defines and re-encode to themselves (NaN codes to
//     the canonical 0x7F, E5M2's infinities to the saturated +-57344);
//   * every bf16 bit pattern, and a million random float bit patterns, encode to what an independent reference gives:
//     the nearest of the format's finite values found by brute force over all codes, ties to the even code, NaN to
//     0x7F, the sign kept (so saturation falls out of "nearest finite value");
//   * hand-picked saturation, subnormal, tie, -0 and NaN cases; the scaled cast and its amax (NaN and inf propagation,
//     independence of the order);
//   * the recipe over sixteen steps of amaxes including 0, inf, NaN and a subnormal, against the scales worked out by
//     hand below, for the "max" rule with a ring of 3 and a margin, and the MLPerf default (most recent, ring of 1).
#include "core/fp8.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/fp8_recipe.h"

namespace nopad {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
uint8_t max_code(Fp8Format f) { return f == Fp8Format::kE4M3 ? 0x7E : 0x7B; }

bool is_nan_code(uint8_t c, Fp8Format f) {
  const uint8_t m = c & 0x7F;
  return f == Fp8Format::kE4M3 ? m == 0x7F : m > 0x7C;
}

// The reference encoder: brute force over the non-negative finite codes 0..max_code (whose values increase with the
// code), nearest in double, ties to the even code; computed from the decoded values only, not from any bit trick.
// From the largest finite value up the nearest is the largest (and the distances to it and to its neighbour would no
// longer differ in double for huge |x|); below it, the two candidates that can tie lie within a factor 2 of |x|, so
// their distances are exact in double.
uint8_t reference_encode(float x, Fp8Format f, const std::vector<double>& values) {
  if (std::isnan(x)) return 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= values.back()) return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | max_code(f));
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < static_cast<int>(values.size()); ++c) {
    const double d = std::fabs(values[static_cast<size_t>(c)] - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
}
std::vector<double> finite_values(Fp8Format f) {
  std::vector<double> v;
  for (int c = 0; c <= max_code(f); ++c) v.push_back(fp8_decode(static_cast<uint8_t>(c), f));
  return v;
}

TEST(Fp8Format, CodesDecodeToTheFormatsValues) {
  // E4M3: bias 7, 3 mantissa bits, S.1111.111 NaN; E5M2: bias 15, 2 mantissa bits, S.11111.00 inf, S.11111.xx NaN.
  EXPECT_EQ(fp8_decode(0x7E, Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(fp8_decode(0xFE, Fp8Format::kE4M3), -448.0f);
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::kE4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_decode(0x08, Fp8Format::kE4M3), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(fp8_decode(0x38, Fp8Format::kE4M3), 1.0f);
  EXPECT_EQ(fp8_decode(0x39, Fp8Format::kE4M3), 1.125f);
  EXPECT_EQ(fp8_decode(0x77, Fp8Format::kE4M3), 240.0f);  // 1.875 x 2^7
  EXPECT_TRUE(std::isnan(fp8_decode(0x7F, Fp8Format::kE4M3)));
  EXPECT_TRUE(std::isnan(fp8_decode(0xFF, Fp8Format::kE4M3)));
  EXPECT_EQ(fp8_decode(0x7B, Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::kE5M2), std::ldexp(1.0f, -16));
  EXPECT_EQ(fp8_decode(0x3C, Fp8Format::kE5M2), 1.0f);
  EXPECT_EQ(fp8_decode(0x7C, Fp8Format::kE5M2), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp8_decode(0xFC, Fp8Format::kE5M2), -std::numeric_limits<float>::infinity());
  for (const uint8_t c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(fp8_decode(c, Fp8Format::kE5M2)));
  EXPECT_EQ(bits_of(fp8_decode(0x80, Fp8Format::kE4M3)), 0x80000000u);  // -0
  EXPECT_EQ(bits_of(fp8_decode(0x80, Fp8Format::kE5M2)), 0x80000000u);
  EXPECT_TRUE(std::signbit(fp8_decode(0xFF, Fp8Format::kE4M3)));  // a NaN code keeps its sign when decoded
  for (const Fp8Format f : kFormats) {
    SCOPED_TRACE(fp8_format_name(f));
    EXPECT_EQ(fp8_decode(max_code(f), f), fp8_max(f));
    for (int c = 1; c <= max_code(f); ++c)  // strictly increasing over the non-negative finite codes
      EXPECT_LT(fp8_decode(static_cast<uint8_t>(c - 1), f), fp8_decode(static_cast<uint8_t>(c), f)) << c;
    for (int c = 0; c < 128; ++c) {  // negative codes are the mirror images
      if (is_nan_code(static_cast<uint8_t>(c), f)) continue;
      EXPECT_EQ(fp8_decode(static_cast<uint8_t>(c | 0x80), f), -fp8_decode(static_cast<uint8_t>(c), f)) << c;
    }
  }
}

TEST(Fp8Format, EveryCodeReencodesToItself) {
  for (const Fp8Format f : kFormats) {
    SCOPED_TRACE(fp8_format_name(f));
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = static_cast<uint8_t>(c);
      const uint8_t back = fp8_encode(fp8_decode(code, f), f);
      if (is_nan_code(code, f)) {
        EXPECT_EQ(back, 0x7F) << c;  // NaN -> the canonical positive NaN
      } else if (f == Fp8Format::kE5M2 && (code & 0x7F) == 0x7C) {
        EXPECT_EQ(back, (code & 0x80) | 0x7B) << c;  // +-inf saturates to +-57344
      } else {
        EXPECT_EQ(back, code) << c;
      }
    }
  }
}

TEST(Fp8Format, EveryBf16MatchesTheBruteForceReference) {
  for (const Fp8Format f : kFormats) {
    SCOPED_TRACE(fp8_format_name(f));
    const std::vector<double> values = finite_values(f);
    size_t bad = 0;
    for (uint32_t b = 0; b < 65536; ++b) {
      const bf16 x{static_cast<uint16_t>(b)};
      const uint8_t want = reference_encode(to_float(x), f, values);
      const uint8_t got = f == Fp8Format::kE4M3 ? to_fp8e4m3(x).bits : to_fp8e5m2(x).bits;
      EXPECT_EQ(got, fp8_encode(to_float(x), f));
      if (got != want && bad++ < 5) ADD_FAILURE() << "bf16 0x" << std::hex << b << ": got 0x" << int(got) << " want 0x"
                                                  << int(want);
    }
    EXPECT_EQ(bad, 0u);
  }
}

TEST(Fp8Format, RandomFloatsMatchTheBruteForceReference) {
  std::mt19937 rng(5);
  // Bit patterns uniform over the exponents that matter (|x| from 2^-20 to 2^20, where ties and subnormals live) plus
  // fully random ones (most of those saturate or flush to zero).
  std::uniform_int_distribution<uint32_t> any;
  std::uniform_int_distribution<uint32_t> exp_near(127 - 20, 127 + 20);
  for (const Fp8Format f : kFormats) {
    SCOPED_TRACE(fp8_format_name(f));
    const std::vector<double> values = finite_values(f);
    size_t bad = 0;
    for (int i = 0; i < 500000; ++i) {
      uint32_t u = any(rng);
      if (i % 2 == 0) u = (u & 0x807FFFFFu) | (exp_near(rng) << 23);
      if (i % 8 == 1) u &= 0xFFFF0000u | (u & 0x0000F000u);  // many exact ties: few low mantissa bits set
      const float x = from_bits(u);
      const uint8_t got = fp8_encode(x, f), want = reference_encode(x, f, values);
      if (got != want && bad++ < 5)
        ADD_FAILURE() << "float 0x" << std::hex << u << " (" << x << "): got 0x" << int(got) << " want 0x" << int(want);
    }
    EXPECT_EQ(bad, 0u);
  }
}

TEST(Fp8Format, SaturationSubnormalsTiesZeroAndNaN) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // E4M3: the step above 256 is 32, so 448 + 16 = 464 is the tie between 448 (even code 0x7E) and 480 (which would be
  // the NaN code): it goes to 448, and so does everything above.
  EXPECT_EQ(to_fp8e4m3(448.0f).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(449.0f).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(464.0f).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(479.0f).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(1e30f).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(FLT_MAX).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(inf).bits, 0x7E);
  EXPECT_EQ(to_fp8e4m3(-inf).bits, 0xFE);
  EXPECT_EQ(to_fp8e4m3(-500.0f).bits, 0xFE);
  EXPECT_EQ(to_fp8e4m3(432.0f).bits, 0x7E);  // the tie between 416 (0x7D) and 448 (0x7E): to the even code
  EXPECT_EQ(to_fp8e4m3(400.0f).bits, 0x7C);  // the tie between 384 (0x7C) and 416 (0x7D)
  // E5M2: 57344 = 1.75 x 2^15, the next step would be 2^16 (inf); 61440 is the tie and saturates.
  EXPECT_EQ(to_fp8e5m2(57344.0f).bits, 0x7B);
  EXPECT_EQ(to_fp8e5m2(61439.0f).bits, 0x7B);
  EXPECT_EQ(to_fp8e5m2(61440.0f).bits, 0x7B);
  EXPECT_EQ(to_fp8e5m2(65504.0f).bits, 0x7B);
  EXPECT_EQ(to_fp8e5m2(inf).bits, 0x7B);
  EXPECT_EQ(to_fp8e5m2(-inf).bits, 0xFB);
  // Subnormals: E4M3's unit is 2^-9. Half a unit ties to 0 (even), 1.5 units tie to 2 (even), 2.5 to 2.
  const float u4 = std::ldexp(1.0f, -9);
  EXPECT_EQ(to_fp8e4m3(u4).bits, 0x01);
  EXPECT_EQ(to_fp8e4m3(0.5f * u4).bits, 0x00);
  EXPECT_EQ(to_fp8e4m3(std::nextafter(0.5f * u4, 1.0f)).bits, 0x01);
  EXPECT_EQ(to_fp8e4m3(1.5f * u4).bits, 0x02);
  EXPECT_EQ(to_fp8e4m3(2.5f * u4).bits, 0x02);
  EXPECT_EQ(to_fp8e4m3(7.5f * u4).bits, 0x08);  // rounds up into the smallest normal 2^-6
  EXPECT_EQ(to_fp8e4m3(-0.25f * u4).bits, 0x80);  // rounds to -0
  const float u5 = std::ldexp(1.0f, -16);
  EXPECT_EQ(to_fp8e5m2(u5).bits, 0x01);
  EXPECT_EQ(to_fp8e5m2(0.5f * u5).bits, 0x00);
  EXPECT_EQ(to_fp8e5m2(3.0f * u5).bits, 0x03);
  EXPECT_EQ(to_fp8e5m2(3.5f * u5).bits, 0x04);  // the tie between 3 and 4 units: to the even code, the smallest normal
  // Ties in the normal range: E4M3's step at 1 is 1/8, E5M2's 1/4.
  EXPECT_EQ(to_fp8e4m3(1.0625f).bits, 0x38);  // 1 + 1/16: between 1 (0x38) and 1.125 (0x39) -> 1
  EXPECT_EQ(to_fp8e4m3(1.1875f).bits, 0x3A);  // 1 + 3/16: between 1.125 and 1.25 (0x3A) -> 1.25
  EXPECT_EQ(to_fp8e5m2(1.125f).bits, 0x3C);
  EXPECT_EQ(to_fp8e5m2(1.375f).bits, 0x3E);
  EXPECT_EQ(to_fp8e4m3(1.9999f).bits, 0x40);  // rounds up into the next binade (2.0)
  // Zeros, float subnormals, NaN of either sign.
  EXPECT_EQ(to_fp8e4m3(0.0f).bits, 0x00);
  EXPECT_EQ(to_fp8e4m3(-0.0f).bits, 0x80);
  EXPECT_EQ(to_fp8e5m2(-0.0f).bits, 0x80);
  EXPECT_EQ(to_fp8e4m3(from_bits(0x00000001u)).bits, 0x00);
  EXPECT_EQ(to_fp8e5m2(from_bits(0x80400000u)).bits, 0x80);
  EXPECT_EQ(to_fp8e4m3(nan).bits, 0x7F);
  EXPECT_EQ(to_fp8e4m3(-nan).bits, 0x7F);
  EXPECT_EQ(to_fp8e5m2(nan).bits, 0x7F);
  EXPECT_EQ(to_fp8e5m2(from_bits(0xFF800001u)).bits, 0x7F);  // a negative signalling NaN
  // bf16 inputs go through float exactly.
  EXPECT_EQ(to_fp8e4m3(to_bf16(3.0f)).bits, to_fp8e4m3(3.0f).bits);
  EXPECT_EQ(to_fp8e5m2(bf16{0xFF80}).bits, 0xFB);  // bf16 -inf
}

TEST(Fp8Quantize, ScaledCastAndAmax) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<bf16> x(1000);
  for (bf16& v : x) v = to_bf16(nd(rng));
  x[17] = to_bf16(-41.5f);  // the largest magnitude, negative
  for (const Fp8Format f : kFormats) {
    for (const float scale : {1.0f, 8.0f, 0.015625f, 1e-30f, 1e30f}) {
      std::vector<uint8_t> q(x.size(), 0xAA);
      const float amax = fp8_quantize(x.data(), x.size(), scale, f, q.data());
      EXPECT_EQ(amax, 41.5f);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(q[i], fp8_encode(to_float(x[i]) * scale, f)) << i;
    }
  }
  // The order does not matter; -0 counts as 0; inf and NaN propagate (NaN above inf).
  std::vector<bf16> y = x;
  std::reverse(y.begin(), y.end());
  EXPECT_EQ(bits_of(fp8_quantize(y.data(), y.size(), 1.0f, Fp8Format::kE4M3, nullptr)), bits_of(41.5f));
  const bf16 neg_zero{0x8000};
  EXPECT_EQ(bits_of(fp8_quantize(&neg_zero, 1, 1.0f, Fp8Format::kE4M3, nullptr)), 0u);
  EXPECT_EQ(fp8_quantize(x.data(), 0, 1.0f, Fp8Format::kE4M3, nullptr), 0.0f);
  y[3] = bf16{0xFF80};  // -inf
  EXPECT_EQ(fp8_quantize(y.data(), y.size(), 1.0f, Fp8Format::kE5M2, nullptr), std::numeric_limits<float>::infinity());
  y[500] = bf16{0xFFC1};  // a negative NaN
  y[900] = bf16{0x7FC0};
  const float nan_amax = fp8_quantize(y.data(), y.size(), 1.0f, Fp8Format::kE5M2, nullptr);
  EXPECT_TRUE(std::isnan(nan_amax));
  EXPECT_EQ(bits_of(nan_amax), 0x7FC10000u);  // the largest |bits|, whichever comes first
  std::swap(y[500], y[900]);
  EXPECT_EQ(bits_of(fp8_quantize(y.data(), y.size(), 1.0f, Fp8Format::kE5M2, nullptr)), 0x7FC10000u);
}

using ops::AmaxAlgo;
using ops::Fp8Recipe;

TEST(Fp8Recipe, DefaultsAreMlperfBerts) {
  const Fp8Recipe r;
  EXPECT_EQ(r.history_len, 1);
  EXPECT_EQ(r.algo, AmaxAlgo::kMostRecent);
  EXPECT_EQ(r.margin, 0);
  const ops::Fp8TensorScaling s = ops::make_fp8_scaling(r, Fp8Format::kE5M2);
  EXPECT_EQ(s.scale, 1.0f);
  EXPECT_EQ(s.scale_inv, 1.0f);
  ASSERT_EQ(s.history.size(), 1u);
  EXPECT_EQ(s.history[0], 0.0f);
  EXPECT_EQ(ops::parse_amax_algo("max"), AmaxAlgo::kMax);
  EXPECT_STREQ(ops::amax_algo_name(AmaxAlgo::kMostRecent), "most_recent");
  EXPECT_THROW(ops::parse_amax_algo("mean"), Error);
  EXPECT_THROW(ops::validate(Fp8Recipe{0, AmaxAlgo::kMax, 0}), Error);
  EXPECT_THROW(ops::validate(Fp8Recipe{4, AmaxAlgo::kMax, -1}), Error);
  try {
    ops::validate(Fp8Recipe{1, AmaxAlgo::kMax, 65});
    FAIL() << "margin 65 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("margin 65"), std::string::npos) << e.what();
  }
}

struct Step {
  float amax;
  float scale;  // expected after the update
};

void run_steps(const Fp8Recipe& r, Fp8Format f, const std::vector<Step>& steps) {
  ops::Fp8TensorScaling s = ops::make_fp8_scaling(r, f);
  for (size_t t = 0; t < steps.size(); ++t) {
    ops::fp8_update_scaling(r, steps[t].amax, s);
    EXPECT_EQ(bits_of(s.scale), bits_of(steps[t].scale)) << "step " << t + 1 << " amax " << steps[t].amax << ": scale "
                                                         << s.scale << ", want " << steps[t].scale;
    EXPECT_EQ(bits_of(s.scale_inv), bits_of(1.0f / steps[t].scale)) << "step " << t + 1;
  }
}

TEST(Fp8Recipe, MaxOverARingOfThreeWithMargin) {
  // E4M3, margin 1: the numerator is 448 / 2 = 224. The ring (3 slots, oldest overwritten) after each step:
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float tiny = 1e-40f;  // a float subnormal: finite and > 0, so recorded; 224 / tiny overflows -> FLT_MAX
  run_steps(Fp8Recipe{3, AmaxAlgo::kMax, 1}, Fp8Format::kE4M3,
            {{2.0f, 112.0f},          // [2, 0, 0]      max 2
             {0.0f, 112.0f},          // not recorded   max 2
             {8.0f, 28.0f},           // [2, 8, 0]      max 8
             {inf, 28.0f},            // not recorded   max 8
             {1.0f, 28.0f},           // [2, 8, 1]      max 8
             {0.5f, 28.0f},           // [0.5, 8, 1]    max 8 (2 dropped)
             {0.25f, 224.0f},         // [0.5, 0.25, 1] max 1 (8 dropped)
             {nan, 224.0f},           // not recorded   max 1
             {4.0f, 56.0f},           // [0.5, 0.25, 4] max 4
             {tiny, 56.0f},           // [tiny, 0.25, 4]
             {3.0f, 56.0f},           // [tiny, 3, 4]
             {3.0f, 224.0f / 3.0f},   // [tiny, 3, 3]   max 3: 74.666664 (float division)
             {0.0f, 224.0f / 3.0f},   // not recorded
             {tiny, 224.0f / 3.0f},   // [tiny, 3, 3]   (slot 0 again)
             {tiny, 224.0f / 3.0f},   // [tiny, tiny, 3]
             {tiny, FLT_MAX}});       // [tiny, tiny, tiny]: 224 / 1e-40 = inf in float -> FLT_MAX
}

TEST(Fp8Recipe, MostRecentMlperfDefault) {
  // E5M2 (gradients), margin 0: 57344 / amax; no amax yet keeps the initial scale 1.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  run_steps(Fp8Recipe{}, Fp8Format::kE5M2,
            {{0.0f, 1.0f},
             {1024.0f, 56.0f},
             {0.0f, 56.0f},
             {inf, 56.0f},
             {2.0f, 28672.0f},
             {nan, 28672.0f},
             {0.5f, 114688.0f},
             {3.0f, 57344.0f / 3.0f},
             {-inf, 57344.0f / 3.0f},
             {1e-35f, FLT_MAX},
             {57344.0f, 1.0f}});
  // most_recent with a longer ring still uses the step's own amax, not the ring's maximum.
  run_steps(Fp8Recipe{4, AmaxAlgo::kMostRecent, 2}, Fp8Format::kE4M3,
            {{8.0f, 14.0f}, {1.0f, 112.0f}, {0.0f, 112.0f}, {16.0f, 7.0f}});
}

}  // namespace
}  // namespace nopad
