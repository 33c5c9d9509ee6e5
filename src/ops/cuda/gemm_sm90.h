// nopad's own Hopper GEMM (gemm_sm90.cu) for the two products whose outputs feed an elementwise GELU pass in the
// cuBLASLt path: the FFN-in forward (bias + GELU in the epilogue, pre-activation and activation written at once) and
// the FFN-out dx product (dGELU and the d_bias column partials in the epilogue). Exact erf GELU as well as the tanh
// form, which cuBLASLt's GELU epilogues cannot do.
//
// Problem (row-major, K contiguous in both operands):  C[M, N] = A[M, K] B[N, K]^T, fp32 accumulation, then
//   kBias:  out0 = round(C + bias)                                   (bias may be null)
//   kGelu:  out0 = pre = round(C + bias);  out1 = round(gelu(pre))  (pre as stored, so the backward sees the same)
//   kDGelu: g = round(C);  out0 = round(g * gelu'(aux));  partial[M/128 chunk][N] = column sums of the unrounded
//           g * gelu'(aux) over the chunk's 128 rows (fixed order); launch_column_finish adds the chunks.
// These are the values of the cuBLASLt product followed by the GELU / one-pass dGELU kernels (dense.cu), up to fp32
// summation order and, for the erf GELU, the normal CDF: a Chebyshev erfc fit (fractional error < 1.2e-7; every bf16
// input's bf16 GELU equals the double-precision one) instead of erff. The CPU twins are dense_forward /
// dense_backward_through_act (ops/cpu/cpu_backend.cpp).
//
// Requirements (gemm_sm90_supported): the sm_90a build on a compute-capability 9.0 device, N % 256 == 0, K % 64 == 0,
// 1 <= M < 2^31, every pointer 16-byte aligned. The caller falls back to cuBLASLt otherwise.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace nopad::cuda {

enum class GemmEpilogue { kBias, kGelu, kDGelu };

bool gemm_sm90_available();  // sm_90a code in this build and a compute-capability 9.0 device
bool gemm_sm90_supported(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* out0,
                         const void* out1, const void* aux, const void* bias);

// T = bf or hf (kernels.cuh). partial: kDGelu only, fp32 [ceil(m / 128), n], or null (no column sums). sm_count: the
// device's multiprocessors (one persistent CTA each).
template <class T>
void launch_gemm_sm90(GemmEpilogue epi, const T* a, const T* b, int64_t m, int32_t n, int32_t k, const T* bias,
                      T* out0, T* out1, const T* aux, float* partial, bool tanh, int sm_count, cudaStream_t stream);
int gemm_sm90_row_chunks(int64_t m);  // rows of partial: ceil(m / 128)

// out[cols, rows] = in[rows, cols]^T for 16-bit elements (the backward's B operand: W [n, k] -> W^T [k, n]).
template <class T>
void launch_transpose16(const T* in, int32_t rows, int32_t cols, T* out, cudaStream_t stream);

}  // namespace nopad::cuda
