// FP8 storage types and their exact conversions, host-only (no CUDA headers), the CPU definition that the FP8 cast
// kernels (ops/cuda/fp8_cast.h) and the FP8 products (ops/cuda/gemm_fp8.h) are tested against.
//
// Formats (OCP 8-bit floating point, as CUDA's cuda_fp8.h names them):
//   fp8e4m3  1 sign, 4 exponent (bias 7), 3 mantissa bits; the "fn" variant: no infinities, S.1111.111 (0x7F/0xFF)
//            is NaN, so the largest finite magnitude is S.1111.110 = 1.75 x 2^8 = 448; the smallest subnormal 2^-9.
//   fp8e5m2  1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like: S.11111.00 = +-inf, S.11111.xx (xx != 0) NaN;
//            largest finite 1.75 x 2^15 = 57344; smallest subnormal 2^-16.
// Both are one byte, layout-identical to __nv_fp8_e4m3 / __nv_fp8_e5m2 (whose only member is the byte), so device code
// reinterprets pointers.
//
// float -> fp8 (to_fp8e4m3 / to_fp8e5m2) is exactly __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt) of CUDA 13.0's
// cuda_fp8.hpp (its host path, which the sm_89+ instruction cvt.rn.satfinite.{e4m3,e5m2}x2.f32 matches; checked for all
// 2^32 floats against that header on the host, and on the GPU by tests/cuda/test_fp8.cu):
//   * round to nearest, ties to the even code (the one whose mantissa ends in 0), subnormal results included;
//   * saturation: any finite value that rounds beyond the largest finite magnitude, and +-inf, give +-max (448 or
//     57344), sign kept; so for E4M3 everything from 448 up maps to 448 (the tie 464 goes to the even code 448 too),
//     for E5M2 everything from 61440 (the tie between 57344 and 2^16) up maps to 57344. No fp8 infinity is produced;
//   * NaN (any sign, any payload) gives 0x7F, the positive all-ones NaN, in both formats (cuda_fp8.hpp canonicalises
//     the input NaN to 0x7FFFFFFF first, dropping its sign);
//   * -0 gives 0x80; a negative value that rounds to zero gives -0 (0x80); float subnormals give +-0.
// fp8 -> float is exact (every fp8 value is a float); NaN codes give a quiet NaN with the code's sign.
// bf16 -> fp8 goes through float, which is exact, so it is the float rule on the bf16's value.
//
// The scaled cast of a tensor (the delayed-scaling quantisation, docs/fp8.md): q[i] = fp8(float(x[i]) * scale) with the
// product rounded to float (round to nearest even) before the fp8 rounding, and amax = max_i |x[i]| of the unscaled
// input. amax is computed on the bit patterns of |x| (sign cleared), which orders every non-negative float and puts
// every NaN above +inf: so any NaN in the input makes amax a NaN (the one with the largest payload, deterministic),
// an inf without NaN makes it +inf, and the result is independent of the order of the elements (the kernels' atomicMax
// on the same bits gives the identical value).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace nopad {

struct fp8e4m3 {
  uint8_t bits = 0;
};
struct fp8e5m2 {
  uint8_t bits = 0;
};

enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1 };

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;
inline constexpr float fp8_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? kFp8E4M3Max : kFp8E5M2Max; }
inline constexpr const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }

namespace fp8_detail {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round |x| (float bits, sign cleared, not NaN) to the fp8 code of a format with `ebits` exponent bits, `mbits`
// mantissa bits and exponent bias `bias`, ties to even, then clamp to the largest finite code `max_code`. Codes are
// ordered like the values they stand for, so clamping the code is saturating the value.
inline uint32_t round_magnitude(uint32_t abs, int mbits, int bias, uint32_t max_code) {
  const int exp_field = static_cast<int>(abs >> 23);
  if (exp_field == 0) return 0;  // zero or a float subnormal (< 2^-126): far below half the smallest fp8 subnormal
  const int e = exp_field - 127;  // |x| = 1.m x 2^e
  const uint32_t mant = abs & 0x7FFFFFu;
  uint32_t code;
  if (e >= 1 - bias) {  // a normal fp8 exponent (or beyond the range: saturated below)
    const int drop = 23 - mbits;
    code = (static_cast<uint32_t>(e + bias) << mbits) | (mant >> drop);
    const uint32_t rem = mant & ((1u << drop) - 1), half = 1u << (drop - 1);
    if (rem > half || (rem == half && (code & 1u))) ++code;  // a carry moves into the exponent, as it should
  } else {
    // Subnormal fp8: |x| in units of the smallest subnormal 2^(1 - bias - mbits) is m24 x 2^-shift, m24 = 1.m x 2^23.
    const int shift = 24 - bias - mbits - e;  // > 23 - mbits here
    if (shift > 25) return 0;                 // |x| < 1/4 unit: rounds to zero
    const uint32_t m24 = mant | 0x800000u;
    code = m24 >> shift;
    const uint32_t rem = m24 & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (code & 1u))) ++code;  // 2^mbits = the smallest normal's code
  }
  return code > max_code ? max_code : code;
}

inline uint8_t encode(float x, Fp8Format f) {
  const uint32_t u = float_bits(x), abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7F;  // NaN -> the positive all-ones NaN (both formats)
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t code = f == Fp8Format::kE4M3 ? round_magnitude(abs, 3, 7, 0x7Eu) : round_magnitude(abs, 2, 15, 0x7Bu);
  return static_cast<uint8_t>(sign | code);
}

inline float decode(uint8_t b, Fp8Format f) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const int mbits = f == Fp8Format::kE4M3 ? 3 : 2, bias = f == Fp8Format::kE4M3 ? 7 : 15;
  const uint32_t exp = (b & 0x7Fu) >> mbits, mant = b & ((1u << mbits) - 1), exp_max = (0x7Fu >> mbits);
  if (f == Fp8Format::kE4M3 && exp == exp_max && mant == 7) return bits_float(sign | 0x7FC00000u);
  if (f == Fp8Format::kE5M2 && exp == exp_max) return bits_float(sign | (mant == 0 ? 0x7F800000u : 0x7FC00000u));
  if (exp == 0) {  // subnormal: mant x 2^(1 - bias - mbits), exact in float
    const float v = static_cast<float>(mant) * bits_float(static_cast<uint32_t>(127 + 1 - bias - mbits) << 23);
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp - bias + 127) << 23) | (mant << (23 - mbits)));
}

}  // namespace fp8_detail

inline fp8e4m3 to_fp8e4m3(float x) { return fp8e4m3{fp8_detail::encode(x, Fp8Format::kE4M3)}; }
inline fp8e5m2 to_fp8e5m2(float x) { return fp8e5m2{fp8_detail::encode(x, Fp8Format::kE5M2)}; }
inline fp8e4m3 to_fp8e4m3(bf16 x) { return to_fp8e4m3(to_float(x)); }
inline fp8e5m2 to_fp8e5m2(bf16 x) { return to_fp8e5m2(to_float(x)); }
inline float to_float(fp8e4m3 x) { return fp8_detail::decode(x.bits, Fp8Format::kE4M3); }
inline float to_float(fp8e5m2 x) { return fp8_detail::decode(x.bits, Fp8Format::kE5M2); }

// The byte-level forms, for code that carries the format at run time.
inline uint8_t fp8_encode(float x, Fp8Format f) { return fp8_detail::encode(x, f); }
inline float fp8_decode(uint8_t code, Fp8Format f) { return fp8_detail::decode(code, f); }

// The amax rule above on one value and on a running maximum: bits of |x| (sign cleared).
inline uint32_t fp8_abs_bits(float x) { return fp8_detail::float_bits(x) & 0x7FFFFFFFu; }
inline uint32_t fp8_abs_bits(bf16 x) { return (static_cast<uint32_t>(x.bits) << 16) & 0x7FFFFFFFu; }

// The scaled cast of n values: q[i] = fp8(float(x[i]) * scale) (q may be null: amax only); returns amax = max |x[i]|
// (0 for n = 0; NaN/inf as stated at the top).
inline float fp8_quantize(const bf16* x, size_t n, float scale, Fp8Format f, uint8_t* q) {
  uint32_t amax_bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = fp8_abs_bits(x[i]);
    if (a > amax_bits) amax_bits = a;
    if (q != nullptr) q[i] = fp8_encode(to_float(x[i]) * scale, f);
  }
  return fp8_detail::bits_float(amax_bits);
}

}  // namespace nopad
