// nopad's own Hopper GEMM (gemm_sm90.cu) for the two products whose outputs feed an elementwise GELU pass in the
// cuBLASLt path: the FFN-in forward (bias + GELU in the epilogue: the activation and its derivative written at once)
// and the FFN-out dx product (the saved derivative applied and the d_bias column partials taken in the epilogue).
// The exact erf GELU (which cuBLASLt's GELU epilogues do not offer) as well as the tanh form. Also the attention
// output projection's dx product, whose epilogue does the FMHA backward's first pass (kRowDot, GemmSideJobs).
//
// Problem (row-major, K contiguous in both operands):  C[M, N] = A[M, K] B[N, K]^T, fp32 accumulation, then
//   kBias:  out0 = round(C + bias)                                   (bias may be null)
//   kGelu:  pre = round(C + bias) (not stored);  out0 = round(gelu'(pre));  out1 = round(gelu(pre))
//   kScale: g = round(C);  out0 = round(g * aux);  partial[M/64 chunk][N] = column sums of the unrounded g * aux over
//           the chunk's 64 rows (fixed order); launch_column_finish adds the chunks.
//   kRowDot (launch_gemm_sm90_rowdot): out0 = g = round(C);  rowdot[c][row] = scale * sum over the 64 columns
//           64c .. 64c + 63 of g * aux (fp32, a fixed order): per head, the row dot products of an attention output
//           gradient with the attention output that the FMHA backward's first pass would compute (D = rowsum(dO O)).
// These are the values of the cuBLASLt product followed by the GELU / one-pass scale kernels (dense.cu), up to fp32
// summation order and, for the erf GELU, the normal CDF: a Chebyshev erfc fit (fractional error < 1.2e-7; every bf16
// input's bf16 GELU equals the double-precision one) instead of erff; with bf16 and gemm_sm90_gelu_table(), y and gelu'
// of 2^-12 <= |pre| < 16 are looked up (the exact values, correctly rounded: ops/gelu_table.h) except in the words
// gemm_sm90_gelu_arith_words() computes with a cheaper fit (within one bf16 step of them). The CPU twins are
// dense_forward / dense_backward_through_act (ops/cpu/cpu_backend.cpp).
//
// Requirements (gemm_sm90_supported): the sm_90a build on a compute-capability 9.0 device, N % 256 == 0, K % 64 == 0,
// 1 <= M < 2^31, every pointer 16-byte aligned. The caller falls back to cuBLASLt otherwise.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace nopad::cuda {

enum class GemmEpilogue { kBias, kGelu, kScale };  // launch_gemm_sm90_rowdot is kRowDot's own launcher

bool gemm_sm90_available();  // sm_90a code in this build and a compute-capability 9.0 device
bool gemm_sm90_supported(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* out0,
                         const void* out1, const void* aux, const void* bias);

// T = bf or hf (kernels.cuh). partial: kScale only, fp32 [ceil(m / 64), n], or null (no column sums). tanh: kGelu
// only (the tanh GELU instead of erf). sm_count: the device's multiprocessors (one persistent CTA each).
int gemm_sm90_row_chunks(int64_t m);  // rows of partial: ceil(m / 64)

// Memory work that the producer warpgroup's three otherwise idle warps do beside a kRowDot product (its DRAM traffic
// then overlaps the products instead of costing a memory-bound pass of its own): zero `zero_bytes` bytes
// at `zero` (16-byte aligned, a multiple of 16), and mul_dst[i] = mul_src[i] * mul_by for i < mul_count (fp32).
// Unordered with the product's own reads and writes: the ranges must not overlap its operands or outputs.
struct GemmSideJobs {
  void* zero = nullptr;
  size_t zero_bytes = 0;
  const float* mul_src = nullptr;
  float* mul_dst = nullptr;
  int64_t mul_count = 0;
  float mul_by = 1.0f;
};
template <class T>
void launch_gemm_sm90(GemmEpilogue epi, const T* a, const T* b, int64_t m, int32_t n, int32_t k, const T* bias,
                      T* out0, T* out1, const T* aux, float* partial, bool tanh, int sm_count, cudaStream_t stream);
// kRowDot: out0 [m, n] = round(a b^T), rowdot [n / 64, rowdot_ld] (rowdot_ld >= m) as above, aux [m, n], and the side
// jobs. Same requirements as launch_gemm_sm90 (gemm_sm90_supported with aux).
template <class T>
void launch_gemm_sm90_rowdot(const T* a, const T* b, int64_t m, int32_t n, int32_t k, T* out0, const T* aux,
                             float* rowdot, int64_t rowdot_ld, float rowdot_scale, const GemmSideJobs& jobs,
                             int sm_count, cudaStream_t stream);
// kGelu: how many of a tile's four 64-column box columns the consumer warpgroups compute the GELU of themselves (one
// 16-row unit per k-block of their next main loop), 0 to 4; the three epilogue warps take the others. -1 (the
// default): 2 where the launch uses the GELU table, else 1 (the fastest of each, measured). Process-wide, host-side;
// NOPAD_GEMM_CONSUMER_COLUMNS=0..4 sets it at start.
int& gemm_sm90_consumer_columns();
// kGelu with bf16: y and gelu' from the lookup table of ops/gelu_table.h (one shared-memory load per element for
// 2^-12 <= |pre| < 16, the arithmetic GELU outside) instead of the arithmetic GELU everywhere. The table's values are
// the exact activations correctly rounded; the arithmetic form's agree with them except in the last bit of a few
// gelu' values. Process-wide, host-side; NOPAD_GELU_TABLE=0 turns it off at start (the default is on).
bool& gemm_sm90_gelu_table();
// kGelu with the table: of each 8-column chunk's four 2-element words, how many (the last ones) the epilogue computes
// with an arithmetic erf GELU (two MUFU ops, ~19 instructions; the tanh GELU's own form) instead of looking them up,
// which moves work from the shared-memory pipe, which the products' operands also use, to the FMA and MUFU pipes.
// The default is 2 (half the elements each way; 0: every word from the table). The arithmetic words' bf16 values may
// differ from the table's correctly rounded ones by one step where the exact value lies within ~1e-6 of a rounding
// boundary (~1% of them). Process-wide, host-side; NOPAD_GELU_ARITH_WORDS=0..4 at start.
int& gemm_sm90_gelu_arith_words();
// A measurement switch, 0 (off) by default and never set by the library: 1 = kGelu writes y = gelu' = pre (no
// activation), so that a benchmark can time the epilogue's data movement apart from its arithmetic; 2 = the same
// without the gelu' stores (what the second output costs). Process-wide, host-side.
int& gemm_sm90_gelu_probe();
// Uploads the GELU tables to the current device (once per device; a synchronous copy). The CUDA backend calls it at
// setup; a launch that finds the tables missing uploads them itself.
void gemm_sm90_prepare();
// Whether the consumers release a k-block's stage (the wgmma wait and the `empty` arrival) before the epilogue work
// they do between k-blocks (kGelu's units, kScale's aux load) rather than after it. Process-wide, host-side;
// NOPAD_GEMM_EARLY_RELEASE=0 sets false at start (the default is true).
bool& gemm_sm90_early_release();
// kScale / kRowDot: the k-block of each tile's main loop at which a consumer warpgroup loads its aux half into its
// staging (its thread 0 first waits there for the previous tile's stores to have read the staging, holding its warp,
// and with it the warpgroup's next products, until then). -1: the epilogue's default, else the k-block (clamped to
// the last). kRowDot's default is half-way through the main loop, kScale's three quarters of the way (the fastest of
// each, measured: docs/performance.md, 2026-11-27). Process-wide, host-side; NOPAD_GEMM_AUX_KB sets both at start,
// NOPAD_GEMM_SCALE_AUX_KB kScale's alone (it takes precedence).
int& gemm_sm90_aux_kblock();
int& gemm_sm90_scale_aux_kblock();

// out[cols, rows] = in[rows, cols]^T for 16-bit elements (the backward's B operand: W [n, k] -> W^T [k, n]).
template <class T>
void launch_transpose16(const T* in, int32_t rows, int32_t cols, T* out, cudaStream_t stream);

}  // namespace nopad::cuda
