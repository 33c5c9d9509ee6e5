// Storage types for reduced precision that host code can name without CUDA headers. nopad::bf16 and nopad::f16 are
// layout-identical to CUDA's __nv_bfloat16 and __half (16 bits), so device code reinterprets them. Conversions here
// round to nearest, ties to even, as the hardware does; NaN stays NaN.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace nopad {

struct bf16 {
  uint16_t bits = 0;
};
struct f16 {
  uint16_t bits = 0;
};

inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float to_float(f16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1Fu, mant = x.bits & 0x3FFu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 0x1F) {
    u = sign | 0x7F800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline f16 to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return f16{static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0))};
  if (abs >= 0x477FF000u) return f16{static_cast<uint16_t>(sign | 0x7C00u)};  // rounds to infinity
  if (abs < 0x38800000u) {  // subnormal or zero in f16
    // |f| = mant * 2^(e - 150) with the implicit bit in mant; in units of the f16 subnormal step 2^-24 that is
    // mant >> (126 - e).
    const uint32_t shift = 126 - (abs >> 23);
    if (shift > 24) return f16{sign};
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return f16{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xFFFu + ((r >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (r >> 13))};
}

// Converting assignment between any two storage types (float, double, bf16, f16).
template <class To, class From>
inline To convert(From x) {
  if constexpr (std::is_same_v<From, bf16> || std::is_same_v<From, f16>) {
    return convert<To>(to_float(x));
  } else if constexpr (std::is_same_v<To, bf16>) {
    return to_bf16(static_cast<float>(x));
  } else if constexpr (std::is_same_v<To, f16>) {
    return to_f16(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

// x[i] = float(bf16(x[i])) for i < n: the bf16 gradient reduction's rounding (dist.reduce = bf16), the CPU twin of
// ops/cuda/grad_cast.h.
inline void round_to_bf16(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = to_float(to_bf16(x[i]));
}

}  // namespace nopad
