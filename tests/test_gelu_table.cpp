// The bf16 GELU table of the sm_90a GEMM's GELU epilogue (ops/gelu_table.h): the double -> bf16 rounding on
// hand-picked values and against the float path wherever that path rounds once; the table's layout and range; every
// entry against the CPU twin's activations (within one bf16 step, and exactly equal except in the twin's
// cancelling negative tail); the ends of the range against what the kernel's arithmetic GELU gives outside it.
#include "ops/gelu_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/cpu_gelu.h"

namespace nopad::ops {
namespace {

float bf16_value(uint16_t h) { return to_float(bf16{h}); }

TEST(GeluTable, RoundsDoubleToNearestEvenBf16) {
  EXPECT_EQ(bf16_bits_from_double(1.0), 0x3F80);
  EXPECT_EQ(bf16_bits_from_double(0.0), 0x0000);
  EXPECT_EQ(bf16_bits_from_double(-0.0), 0x8000);
  EXPECT_EQ(bf16_bits_from_double(1.0 + std::ldexp(1.0, -8)), 0x3F80);   // tie: down to the even 1.0
  EXPECT_EQ(bf16_bits_from_double(1.0 + std::ldexp(3.0, -8)), 0x3F82);   // tie: up to the even 1 + 2^-6
  EXPECT_EQ(bf16_bits_from_double(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)), 0x3F81);  // past the tie by
                                                                                                // less than float resolves
  EXPECT_EQ(bf16_bits_from_double(-(2.0 - std::ldexp(1.0, -9))), 0xC000);  // rounds up into the next binade
  EXPECT_EQ(bf16_bits_from_double(std::ldexp(1.0, -133)), 0x0001);         // the smallest subnormal
  EXPECT_EQ(bf16_bits_from_double(std::ldexp(1.0, -134)), 0x0000);         // half of it: tie to even (zero)
  EXPECT_EQ(bf16_bits_from_double(std::ldexp(3.0, -134)), 0x0002);         // 1.5 quanta: tie to even (2)
  EXPECT_EQ(bf16_bits_from_double(std::ldexp(1.0, -200)), 0x0000);
  EXPECT_EQ(bf16_bits_from_double(1e39), 0x7F80);
  EXPECT_EQ(bf16_bits_from_double(-1e39), 0xFF80);
  EXPECT_EQ(bf16_bits_from_double(std::nan("")), 0x7FC0);
  // Doubles that are floats: one rounding either way, so the float path (core/dtype.h) must agree bit for bit.
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFFFFFFu);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(bf16_bits_from_double(f), to_bf16(f).bits) << "float bits " << std::hex << u;
  }
}

TEST(GeluTable, LayoutAndRange) {
  EXPECT_EQ(kGeluTableEntries, 4096);
  EXPECT_EQ(bf16_value(kGeluTableAbsLo), std::ldexp(1.0f, -12));
  EXPECT_EQ(bf16_value(kGeluTableAbsHi), 16.0f);
  int covered = 0;
  std::vector<int> seen(kGeluTableEntries, 0);
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float x = std::fabs(bf16_value(b));
    const bool inside = x >= std::ldexp(1.0f, -12) && x < 16.0f;  // NaN: false
    ASSERT_EQ(gelu_table_covers(b), inside) << std::hex << h;
    if (!inside) continue;
    ++covered;
    const int i = gelu_table_index(b);
    ASSERT_GE(i, 0);
    ASSERT_LT(i, kGeluTableEntries);
    ++seen[i];
    // The byte offset the kernel computes: (a << 3 | s << 2) - 8 lo.
    const uint32_t off = (((h & 0x7FFFu) << 3) | ((h >> 13) & 4u)) - 8 * kGeluTableAbsLo;
    ASSERT_EQ(off, 4u * static_cast<uint32_t>(i)) << std::hex << h;
  }
  EXPECT_EQ(covered, kGeluTableEntries);
  for (int i = 0; i < kGeluTableEntries; ++i) EXPECT_EQ(seen[i], 1) << "entry " << i;
}

// Every entry against the CPU twin evaluated in double: within one bf16 step everywhere, bit-equal where the twin's
// form does not cancel (x > -4 for erf: 1 + erf(x / sqrt 2) keeps ~12 of double's digits there; for tanh the twin's
// 1 + tanh u likewise). Both tables, both outputs.
TEST(GeluTable, EntriesAreTheTwinsActivationsRounded) {
  for (const bool tanh : {false, true}) {
    SCOPED_TRACE(tanh ? "tanh GELU" : "erf GELU");
    const std::vector<uint32_t> table = gelu_table_bf16(tanh);
    ASSERT_EQ(static_cast<int>(table.size()), kGeluTableEntries);
    int exact_y = 0, exact_g = 0, compared = 0;
    for (uint32_t a = kGeluTableAbsLo; a < kGeluTableAbsHi; ++a)
      for (uint32_t s = 0; s < 2; ++s) {
        const uint16_t h = static_cast<uint16_t>(s << 15 | a);
        const double x = bf16_value(h);
        const uint32_t e = table[gelu_table_index(h)];
        const float y = bf16_value(static_cast<uint16_t>(e & 0xFFFFu)), g = bf16_value(static_cast<uint16_t>(e >> 16));
        const double ty = tanh ? cpu::gelu_tanh(x) : cpu::gelu(x);
        const double tg = tanh ? cpu::gelu_tanh_grad(x) : cpu::gelu_grad(x);
        // The rounded value is within half a step of the exact one; the twin in double within a hair of that.
        const double step_y = std::max(std::fabs(ty) * std::ldexp(1.0, -7), std::ldexp(1.0, -133));
        const double step_g = std::max(std::fabs(tg) * std::ldexp(1.0, -7), std::ldexp(1.0, -133));
        if (x > -4.0) {
          EXPECT_LE(std::fabs(y - ty), 0.5 * step_y + 1e-12 * std::fabs(ty)) << "x " << x;
          EXPECT_LE(std::fabs(g - tg), 0.5 * step_g + 1e-12) << "x " << x;
          ++compared;
          exact_y += bf16_bits_from_double(ty) == (e & 0xFFFFu);
          exact_g += bf16_bits_from_double(tg) == (e >> 16);
        } else {  // the twin cancels here: the table is the accurate one; both tiny
          EXPECT_LE(std::fabs(y), 2.5e-4) << "x " << x;
          EXPECT_LE(std::fabs(g), 2.5e-3) << "x " << x;
          // Half a step, and the twin's own cancellation error (~1e-16 |x|).
          EXPECT_LE(std::fabs(y - ty), std::ldexp(std::fabs(ty), -8) + 1e-14) << "x " << x;
        }
      }
    // Ties aside, the twin in double rounds to the same bf16.
    EXPECT_GE(exact_y, compared - 2);
    EXPECT_GE(exact_g, compared - 2);
  }
}

// The ends of the table meet what the kernel computes outside it: just below 2^-12 gelu(x) rounds to x / 2 and
// gelu' to 1/2, at 2^-12 too; at +16 y = x and gelu' = 1, at -16 both are (signed) zero, as at the last entries.
TEST(GeluTable, EndsMeetTheSaturatedValues) {
  for (const bool tanh : {false, true}) {
    SCOPED_TRACE(tanh ? "tanh GELU" : "erf GELU");
    const std::vector<uint32_t> table = gelu_table_bf16(tanh);
    auto entry = [&](float x) {
      const uint16_t h = to_bf16(x).bits;
      EXPECT_TRUE(gelu_table_covers(h)) << x;
      return table[gelu_table_index(h)];
    };
    const float lo = std::ldexp(1.0f, -12), top = 16.0f - std::ldexp(1.0f, -4);  // the largest bf16 below 16
    for (const float x : {lo, -lo}) {
      EXPECT_EQ(entry(x) & 0xFFFFu, to_bf16(x / 2).bits) << x;
      EXPECT_EQ(entry(x) >> 16, to_bf16(0.5f).bits) << x;
    }
    EXPECT_EQ(entry(top) & 0xFFFFu, to_bf16(top).bits);
    EXPECT_EQ(entry(top) >> 16, to_bf16(1.0f).bits);
    EXPECT_EQ(bf16_value(static_cast<uint16_t>(entry(-top) & 0xFFFFu)), 0.0f);
    EXPECT_EQ(bf16_value(static_cast<uint16_t>(entry(-top) >> 16)), 0.0f);
  }
}

}  // namespace
}  // namespace nopad::ops
