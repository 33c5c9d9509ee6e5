// Device helpers shared by the CUDA backend's kernels (embed.cu, layernorm.cu, dense.cu, heads.cu): bf16 <-> fp32
// vectors of 8 (one 16-byte load/store), warp and block reductions, exact-erf GELU, the dropout keep-scale drawn from
// core/philox.h exactly as the CPU twin draws it, and the row -> sequence lookup.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/philox.h"

namespace nopad::cuda {

using bf = __nv_bfloat16;

// 8 bf16 = 16 bytes: the unit of every vectorised load/store here (callers guarantee 16-byte alignment: H % 8 == 0
// and 256-byte aligned base pointers from cudaMalloc).
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void load8(const bf* p, float v[8]) {
  const Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(x.h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(bf* p, const float v[8]) {
  Bf16x8 x;
#pragma unroll
  for (int i = 0; i < 4; ++i) x.h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<Bf16x8*>(p) = x;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result. `smem` holds 32
// floats; the function ends with a barrier, so it may be called again with the same smem.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? smem[lane] : 0.0f;
  r = warp_sum(r);
  __syncthreads();
  return r;
}

// Exact-erf GELU (BERT's "gelu") and its derivative, as the CPU twin computes them.
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f)); }
__device__ __forceinline__ float gelu_erf_grad(float x) {
  const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
  const float pdf = expf(-0.5f * x * x) * 0.39894228040143267794f;
  return cdf + x * pdf;
}

// Dropout of one call, host-prepared: the mixed stream key and the keep-scale 1/(1-p) rounded to float the way the
// CPU twin rounds it (computed in double, then converted), so kept values match bit for bit before the LayerNorm.
struct DropoutArgs {
  uint64_t stream_key = 0;
  float p = 0.0f;
  float inv_keep = 1.0f;
};
// 1/(1-p) when kept, 0 when dropped, 1 without dropout.
__device__ __forceinline__ float dropout_scale(const DropoutArgs& d, uint64_t sample_id, uint64_t element) {
  if (d.p <= 0.0f) return 1.0f;
  return dropout_keep_key(d.stream_key, sample_id, element, d.p) ? d.inv_keep : 0.0f;
}
// Eight consecutive features j0..j0+7 (j0 % 4 == 0) of one row: two Philox blocks instead of eight, since one block
// serves the 4 elements (pos << 32 | j) with the same j / 4 (core/philox.h). Same bits as dropout_scale per element.
__device__ __forceinline__ void dropout_scale8(const DropoutArgs& d, uint64_t sample_id, uint32_t pos, uint32_t j0,
                                               float s[8]) {
  if (d.p <= 0.0f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = 1.0f;
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint64_t element = element_hidden(pos, j0 + 4 * half);
    const uint64_t block = element >> 2;
    const uint32_t counter[4] = {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                 static_cast<uint32_t>(sample_id), static_cast<uint32_t>(sample_id >> 32)};
    const uint32_t key[2] = {static_cast<uint32_t>(d.stream_key), static_cast<uint32_t>(d.stream_key >> 32)};
    const Philox4x32 r = philox4x32(counter, key);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[4 * half + i] = uniform_from_bits(r.v[i]) >= d.p ? d.inv_keep : 0.0f;
  }
}

// Sequence b holding row t: the last b with cu_seqlens[b] <= t (binary search over B+1 entries; B is small).
__device__ __forceinline__ int32_t row_to_seq(const int32_t* cu_seqlens, int32_t num_seqs, int64_t t) {
  int32_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (cu_seqlens[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// ------------------------------------------------------------------------------------------------ host launchers
// All enqueue on `stream`, check the launch, and never synchronise.

// layernorm.cu: the row-wise LayerNorm family, one warp per row. kPlain: LN(x). kEmbed: LN(word[tok] + position[pos]
// + token_type[seg]) then dropout. kResidual: LN(dropout(x + bias) + residual). Requires H % 8 == 0, H <= 1024.
enum class LnKind { kPlain, kEmbed, kResidual };
struct LnArgs {
  int64_t rows = 0;
  int32_t H = 0;
  float eps = 0.0f;
  const bf* gamma = nullptr;
  const bf* beta = nullptr;
  const bf* x = nullptr;  // kPlain, kResidual
  const bf* bias = nullptr;
  const bf* residual = nullptr;
  const int32_t* tokens = nullptr;  // kEmbed
  const int32_t* positions = nullptr;
  const int32_t* segments = nullptr;
  const bf* word = nullptr;
  const bf* position = nullptr;
  const bf* token_type = nullptr;
  const int32_t* cu_seqlens = nullptr;  // dropout keys (kEmbed, kResidual with p > 0)
  const uint64_t* sample_ids = nullptr;
  int32_t num_seqs = 0;
  DropoutArgs drop;
  bf* out = nullptr;  // forward
  float* mean_out = nullptr;
  float* rstd_out = nullptr;
  const bf* d_out = nullptr;  // backward
  const float* mean = nullptr;
  const float* rstd = nullptr;
  bf* dz = nullptr;   // gradient at the LN input (kPlain: d_x; kResidual: d_residual)
  bf* d_x = nullptr;  // kResidual: dz * mask
  float* d_word = nullptr;  // kEmbed scatter targets (+=, atomics)
  float* d_position = nullptr;
  float* d_token_type = nullptr;
  float* partial = nullptr;  // [blocks][nacc][H]: d_gamma | d_beta (| d_bias, kResidual) sums of each block
};
void launch_ln_forward(LnKind kind, const LnArgs& a, cudaStream_t stream);
// Blocks of the backward grid for `rows` (fixed for a given rows and device: the reduction order is deterministic).
int ln_backward_blocks(int64_t rows, int sm_count);
void launch_ln_backward(LnKind kind, const LnArgs& a, int blocks, cudaStream_t stream);
// out_q[j] += sum over b of partial[b][q][j] for q < nacc (fixed order; null outputs skipped). partial is [blocks][nacc][H].
void launch_column_finish(const float* partial, int blocks, int H, int nacc, float* out0, float* out1, float* out2,
                          cudaStream_t stream);

// dense.cu: elementwise GELU and column sums (the d_bias reduction, first stage).
void launch_gelu_forward(const bf* pre, bf* y, int64_t count, cudaStream_t stream);
void launch_gelu_backward(const bf* dy, const bf* pre, bf* dpre, int64_t count, cudaStream_t stream);
int column_sum_chunks(int64_t rows);
// partial[c][j] = sum of m[r][j] over the rows r of chunk c (m is [rows, n]).
void launch_column_sum_partial(const bf* m, int64_t rows, int32_t n, int chunks, float* partial, cudaStream_t stream);

// heads.cu
void launch_gather_rows(const bf* src, const int32_t* index, int32_t count, int32_t H, bf* dst, cudaStream_t stream);
void launch_scatter_add_rows(const bf* src, const int32_t* index, int32_t count, int32_t H, bf* dst,
                             cudaStream_t stream);
void launch_softmax_ce_forward(bf* logits, const int32_t* labels, int32_t rows, int32_t V, float* loss_sum,
                               int32_t* num_correct, cudaStream_t stream);
void launch_ce_backward(bf* probs, const int32_t* labels, int32_t rows, int32_t V, float scale, cudaStream_t stream);
void launch_tanh_forward(bf* x, int64_t count, cudaStream_t stream);
void launch_tanh_backward(bf* d, const bf* y, int64_t count, cudaStream_t stream);

}  // namespace nopad::cuda
