// bf16 and f16 conversions (core/dtype.h): round to nearest even on hand-picked values, exact round trips of every
// 16-bit pattern, and f16 rounding of random floats against an independent reference.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

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
uint16_t bf16_bits(float f) { return to_bf16(f).bits; }
uint16_t f16_bits(float f) { return to_f16(f).bits; }

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  // bf16 keeps 7 mantissa bits: the spacing above 1 is 2^-7.
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3F80);  // tie: down to the even 1.0
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(3.0f, -8)), 0x3F82);  // tie: up to the even 1 + 2^-6
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(3.0f, -9)), 0x3F81);  // 3/4 of a step: up
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -9)), 0x3F80);  // 1/4 of a step: down
  EXPECT_EQ(bf16_bits(-1.0f), 0xBF80);
  EXPECT_EQ(bf16_bits(-(1.0f + std::ldexp(3.0f, -9))), 0xBF81);
  EXPECT_EQ(bf16_bits(-2.5f), 0xC020);
  // Large: 3e38 is representable to within a step; the largest float rounds up past the largest bf16 to infinity.
  EXPECT_NEAR(to_float(to_bf16(3.0e38f)), 3.0e38f, 3.0e38f / 256);
  EXPECT_EQ(bf16_bits(from_bits(0x7F7F7FFFu)), 0x7F7F);  // below the tie: largest finite bf16
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7F80);
  // Tiny: bf16 has float's exponent range, so float subnormals round within bf16 subnormals.
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::min()), 0x0080);
  EXPECT_EQ(bf16_bits(from_bits(0x00010000u)), 0x0001);
  EXPECT_EQ(bf16_bits(from_bits(0x00000001u)), 0x0000);
  EXPECT_EQ(bf16_bits(from_bits(0x00008000u)), 0x0000);  // tie: even 0
  EXPECT_EQ(bf16_bits(from_bits(0x00018000u)), 0x0002);  // tie: even 2
  EXPECT_EQ(bf16_bits(from_bits(0x80018001u)), 0x8002);
  // Infinities stay infinities; NaN stays NaN, including signalling NaNs whose payload sits in the dropped bits.
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC00000u, 0x7F80FFFFu}) {
    EXPECT_TRUE(std::isnan(to_float(to_bf16(from_bits(nan))))) << std::hex << nan;
    EXPECT_EQ(bf16_bits(from_bits(nan)) & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;  // sign kept
  }
}

TEST(Dtype, Bf16ToFloatIsTheUpperHalf) {
  EXPECT_EQ(to_float(bf16{0x3F80}), 1.0f);
  EXPECT_EQ(to_float(bf16{0xC020}), -2.5f);
  EXPECT_EQ(bits_of(to_float(bf16{0x8000})), 0x80000000u);
  EXPECT_EQ(to_float(bf16{0x7F80}), std::numeric_limits<float>::infinity());
}

TEST(Dtype, EveryBf16RoundTripsThroughFloat) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const bf16 x{static_cast<uint16_t>(b)};
    const float f = to_float(x);
    EXPECT_EQ(bits_of(f), b << 16);
    const bool is_nan = (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
      ASSERT_TRUE(std::isnan(to_float(to_bf16(f)))) << std::hex << b;
    } else {
      ASSERT_EQ(to_bf16(f).bits, b) << std::hex << b;
    }
  }
}

TEST(Dtype, EveryF16RoundTripsThroughFloat) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16 x{static_cast<uint16_t>(b)};
    const float f = to_float(x);
    const bool is_nan = (b & 0x7C00u) == 0x7C00u && (b & 0x3FFu) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
      ASSERT_TRUE(std::isnan(to_float(to_f16(f)))) << std::hex << b;
    } else {
      ASSERT_FALSE(std::isnan(f)) << std::hex << b;
      ASSERT_EQ(to_f16(f).bits, b) << std::hex << b;
    }
  }
  // Spot values of the decoding itself.
  EXPECT_EQ(to_float(f16{0x3C00}), 1.0f);
  EXPECT_EQ(to_float(f16{0xC000}), -2.0f);
  EXPECT_EQ(to_float(f16{0x7BFF}), 65504.0f);
  EXPECT_EQ(to_float(f16{0x0001}), std::ldexp(1.0f, -24));
  EXPECT_EQ(to_float(f16{0x03FF}), std::ldexp(1023.0f, -24));
  EXPECT_EQ(to_float(f16{0x0400}), std::ldexp(1.0f, -14));
  EXPECT_EQ(to_float(f16{0x7C00}), std::numeric_limits<float>::infinity());
  EXPECT_EQ(to_float(f16{0xFC00}), -std::numeric_limits<float>::infinity());
}

TEST(Dtype, F16SubnormalsAndOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie with zero: even 0
  EXPECT_EQ(f16_bits(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  EXPECT_EQ(f16_bits(std::ldexp(3.0f, -25)), 0x0002);  // tie between 1 and 2: even 2
  EXPECT_EQ(f16_bits(std::ldexp(5.0f, -25)), 0x0002);  // tie between 2 and 3: even 2
  EXPECT_EQ(f16_bits(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(f16_bits(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(f16_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f16_bits(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(f16_bits(std::ldexp(2047.0f, -25)), 0x0400);  // halfway from it to the smallest normal: even 0x400
  EXPECT_EQ(f16_bits(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(f16_bits(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie: even
  EXPECT_EQ(f16_bits(1.0f + std::ldexp(3.0f, -11)), 0x3C02);  // tie: even
  EXPECT_EQ(f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(f16_bits(65519.99f), 0x7BFF);  // below the tie with 65536
  EXPECT_EQ(f16_bits(65520.0f), 0x7C00);   // the tie rounds to even, which is infinity
  EXPECT_EQ(f16_bits(1e5f), 0x7C00);
  EXPECT_EQ(f16_bits(-1e5f), 0xFC00);
  EXPECT_EQ(f16_bits(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(f16_bits(inf), 0x7C00);
  EXPECT_EQ(f16_bits(-inf), 0xFC00);
  EXPECT_TRUE(std::isnan(to_float(to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(to_float(to_f16(from_bits(0x7F800001u)))));  // payload only in dropped bits
  EXPECT_TRUE(std::isnan(to_float(to_f16(from_bits(0xFF800001u)))));
}

// Independent reference: round |f| to a multiple of the f16 quantum at its exponent with nearbyint (ties to even in
// the default rounding mode), then encode the exact result.
uint16_t f16_reference(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0x7E00;
  double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return sign | 0x7C00;
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);                        // a = m 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
  const int quantum_exp = std::max(e - 1, -14) - 10;  // 10 fraction bits; subnormals share the 2^-24 quantum
  a = std::ldexp(std::nearbyint(std::ldexp(a, -quantum_exp)), quantum_exp);
  if (a >= 65536.0) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(std::ldexp(a, 24));  // subnormal or zero
  const double m = std::frexp(a, &e);
  const uint32_t frac = static_cast<uint32_t>(std::ldexp(m * 2.0 - 1.0, 10));
  return sign | static_cast<uint16_t>((static_cast<uint32_t>(e - 1 + 15) << 10) | frac);
}

TEST(Dtype, F16MatchesReferenceOnRandomFloats) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  std::mt19937 rng(20240611);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_int_distribution<uint32_t> f16_range_exp(127 - 27, 127 + 17);  // around f16's range, both edges
  int bad = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    uint32_t u = any_bits(rng);
    if (i % 4 != 0) u = (u & 0x807FFFFFu) | (f16_range_exp(rng) << 23);  // most draws where f16 is interesting
    if (i % 16 == 1) u &= 0xFFFFE000u | (1u << 12);  // exact ties at the normal rounding position
    const float f = from_bits(u);
    const uint16_t got = f16_bits(f);
    const uint16_t want = f16_reference(f);
#ifdef __FLT16_MAX__
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t compiler;
    std::memcpy(&compiler, &h, 2);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(static_cast<float>(h)));
    } else if (compiler != want && bad++ < 8) {
      ADD_FAILURE() << "reference disagrees with _Float16 for " << std::hexfloat << f << ": " << std::hex << want
                    << " vs " << compiler;
    }
#endif
    if (std::isnan(f)) {
      if (!std::isnan(to_float(f16{got})) && bad++ < 8) ADD_FAILURE() << std::hex << u << ": NaN lost";
    } else if (got != want && bad++ < 8) {
      ADD_FAILURE() << std::hexfloat << f << " (" << std::hex << u << "): got " << got << " want " << want;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, ConvertBetweenStorageTypes) {
  EXPECT_EQ(convert<float>(to_bf16(1.5f)), 1.5f);
  EXPECT_EQ(convert<double>(to_f16(-0.25f)), -0.25);
  EXPECT_EQ(convert<bf16>(1.0).bits, 0x3F80);
  EXPECT_EQ(convert<f16>(1.0).bits, 0x3C00);
  EXPECT_EQ(convert<f16>(to_bf16(2.0f)).bits, 0x4000);
  EXPECT_EQ(convert<bf16>(to_f16(-2.0f)).bits, 0xC000);
  EXPECT_EQ(convert<float>(3.0), 3.0f);
  static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);
}

// round_to_bf16 (the bf16 gradient reduction's rounding): in place, nearest even, inf and NaN kept, and the result
// is a fixed point (rounding twice changes nothing).
TEST(Dtype, RoundToBf16InPlace) {
  float x[] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -1.0f - 1.0f / 512, 3.4028235e38f,
               std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 0.1f, -0.0f};
  round_to_bf16(x, std::size(x));
  EXPECT_EQ(x[0], 1.0f);                     // tie -> even
  EXPECT_EQ(x[1], 1.0f + 4.0f / 256);        // tie -> even (up)
  EXPECT_EQ(x[2], -1.0f);                    // below half an ulp
  EXPECT_TRUE(std::isinf(x[3]) && x[3] > 0);  // beyond the largest bf16
  EXPECT_TRUE(std::isinf(x[4]));
  EXPECT_TRUE(std::isnan(x[5]));
  EXPECT_EQ(x[6], to_float(to_bf16(0.1f)));
  EXPECT_NE(x[6], 0.1f);
  EXPECT_TRUE(x[7] == 0.0f && std::signbit(x[7]));
  float again[std::size(x)];
  std::memcpy(again, x, sizeof x);
  round_to_bf16(again, std::size(again));
  for (size_t i = 0; i + 1 < std::size(x); ++i)
    if (!std::isnan(x[i])) {
      EXPECT_EQ(again[i], x[i]) << i;
    }
}

}  // namespace
}  // namespace nopad
