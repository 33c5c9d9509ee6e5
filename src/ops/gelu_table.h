// The bf16 GELU lookup table of the sm_90a GEMM's GELU epilogue (ops/cuda/gemm_sm90.cu), plain C++ so that it is
// built and tested on the CPU.
//
// The epilogue rounds the pre-activation to bf16 before the activation (pre = round(x W^T + b)), so y = gelu(pre) and
// gelu'(pre) are functions of a 16-bit input, each rounded to bf16 again. For every bf16 x with 2^-12 <= |x| < 16
// (16 binades x 128 significands x 2 signs = 4,096 inputs: almost every pre-activation of a trained BERT) the table
// holds both results, correctly rounded from double precision, so the epilogue spends one shared-memory load per
// element instead of ~40 instructions of normal-CDF arithmetic; inputs outside the range (zero, tiny, |x| >= 16,
// Inf, NaN) are computed by the kernel's arithmetic GELU.
//
// Layout: entry 2 (a - kGeluTableAbsLo) + s for the input with bf16 bits h = s << 15 | a (s the sign), as
// y | gelu' << 16 (each a bf16 bit pattern). So the entry's byte offset from the table's start is
// (a << 3 | s << 2) - 8 kGeluTableAbsLo: two shifts and a merge of h.
//
// The functions are the CPU twin's (ops/cpu/cpu_gelu.h) evaluated in double, in forms that keep their relative
// accuracy in the negative tail (where the twin's 1 + erf(x / sqrt 2) cancels): erf GELU y = x Phi(x),
// Phi(x) = erfc(-x / sqrt 2) / 2, gelu' = Phi(x) + x phi(x); tanh GELU y = x s, s = 1 / (1 + exp(-2u)) (= (1 + tanh u)
// / 2), gelu' = s + 2 x s (1 - s) c (1 + 3 0.044715 x^2).
#pragma once
#include <cstdint>
#include <vector>

namespace nopad::ops {

constexpr uint32_t kGeluTableAbsLo = 115u << 7;  // bf16 bits of 2^-12
constexpr uint32_t kGeluTableAbsHi = 131u << 7;  // bf16 bits of 16 (first |x| outside)
constexpr int kGeluTableEntries = static_cast<int>(2 * (kGeluTableAbsHi - kGeluTableAbsLo));  // 4,096
constexpr int kGeluTableBytes = kGeluTableEntries * 4;                                     // 16 KB

// Whether the bf16 input with bits h has an entry, and its index (valid only then).
constexpr bool gelu_table_covers(uint16_t h) {
  const uint32_t a = h & 0x7fffu;
  return a >= kGeluTableAbsLo && a < kGeluTableAbsHi;
}
constexpr int gelu_table_index(uint16_t h) {
  return static_cast<int>(2 * ((h & 0x7fffu) - kGeluTableAbsLo) + (h >> 15));
}

// v rounded to the nearest bf16 (ties to even; subnormals; overflow to Inf; NaN to the canonical quiet NaN), as bits.
// One rounding from double (a conversion through float would round twice).
uint16_t bf16_bits_from_double(double v);

// The double-precision activations the table is rounded from (tanh: the "gelu_new" form).
double gelu_exact(double x, bool tanh);
double gelu_grad_exact(double x, bool tanh);

// The table: kGeluTableEntries entries as described above.
std::vector<uint32_t> gelu_table_bf16(bool tanh);

}  // namespace nopad::ops
