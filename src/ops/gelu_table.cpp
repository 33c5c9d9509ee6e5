// The bf16 GELU lookup table (contract: gelu_table.h).
#include "ops/gelu_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace nopad::ops {

uint16_t bf16_bits_from_double(double v) {
  if (std::isnan(v)) return 0x7fc0u;
  const uint16_t sign = std::signbit(v) ? 0x8000u : 0u;
  const double a = std::fabs(v);
  if (a == 0.0) return sign;
  // bf16: 8 significant bits; the quantum at a is 2^(e - 7) for a = 1.f x 2^e, and 2^-133 below the normal range.
  const int q = std::max(std::ilogb(a) - 7, -133);
  const double r = std::ldexp(std::nearbyint(std::ldexp(a, -q)), q);  // nearbyint: ties to even (default mode)
  constexpr double kMax = 0x1.fep127;                                 // the largest finite bf16
  if (r > kMax) return static_cast<uint16_t>(sign | 0x7f80u);
  const float f = static_cast<float>(r);  // exact: r has at most 8 significant bits on the bf16 grid
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(sign | (u >> 16));
}

namespace {
constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kC = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kCubic = 0.044715;

double tanh_gate(double x) {  // (1 + tanh u) / 2 without the cancellation of 1 + tanh u for u << 0
  const double u = kC * (x + kCubic * x * x * x);
  return 1.0 / (1.0 + std::exp(-2.0 * u));
}
}  // namespace

double gelu_exact(double x, bool tanh) {
  if (tanh) return x * tanh_gate(x);
  return x * 0.5 * std::erfc(-x * kSqrtHalf);
}

double gelu_grad_exact(double x, bool tanh) {
  if (tanh) {
    const double s = tanh_gate(x);
    return s + 2.0 * x * s * (1.0 - s) * kC * (1.0 + 3.0 * kCubic * x * x);
  }
  return 0.5 * std::erfc(-x * kSqrtHalf) + x * std::exp(-0.5 * x * x) * kInvSqrt2Pi;
}

std::vector<uint32_t> gelu_table_bf16(bool tanh) {
  std::vector<uint32_t> table(kGeluTableEntries);
  for (uint32_t a = kGeluTableAbsLo; a < kGeluTableAbsHi; ++a)
    for (uint32_t s = 0; s < 2; ++s) {
      const uint16_t h = static_cast<uint16_t>(s << 15 | a);
      const uint32_t bits = uint32_t{h} << 16;
      float xf = 0.0f;
      std::memcpy(&xf, &bits, sizeof xf);
      const double x = xf;
      table[gelu_table_index(h)] =
          uint32_t{bf16_bits_from_double(gelu_exact(x, tanh))} | uint32_t{bf16_bits_from_double(gelu_grad_exact(x, tanh))} << 16;
    }
  return table;
}

}  // namespace nopad::ops
