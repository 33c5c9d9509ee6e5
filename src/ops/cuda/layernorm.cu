// The LayerNorm family of the CUDA backend, forward and backward (CPU twins: layernorm_row / layernorm_row_backward
// and the embed_layernorm_dropout, bias_dropout_residual_layernorm and MLM-head LayerNorm code of
// ops/cpu/cpu_backend.cpp).
//
// One warp per row, 4 warps per block. A lane owns the 8-feature groups j0 = (c*32 + lane)*8, c < VPL, so the row
// lives in registers (VPL*8 floats per lane, H <= VPL*256) and is loaded with 16-byte vectors. fp32 math throughout;
// mean and variance are two-pass over the registers (as the CPU twin). Dropout bits are drawn per 4 features with
// the same Philox call the CPU twin makes per feature.
//
// Backward is deterministic except the embedding-table scatter: each warp keeps per-lane column accumulators for
// d_gamma, d_beta (and d_bias) over the rows it visits in a fixed order, the block combines its warps in a fixed
// order into partial[block][nacc][H] (nacc = 2, or 3 with d_bias), and launch_column_finish adds the block partials into the gradients in a fixed
// order. The embedding scatter-add into d_word/d_position/d_token_type uses fp32 atomics, so its summation order (and
// the last bits of those gradients) varies from run to run.
#include "ops/cuda/check.h"
#include "ops/cuda/kernels.cuh"

namespace nopad::cuda {
namespace {

constexpr int kWarps = 4;  // rows per block in flight (one per warp)

struct RowKey {
  uint64_t sample = 0;
  uint32_t pos = 0;
};
__device__ __forceinline__ RowKey row_key(const LnArgs& a, int64_t row) {
  RowKey k;
  const int32_t b = row_to_seq(a.cu_seqlens, a.num_seqs, row);
  k.sample = a.sample_ids[b];
  k.pos = static_cast<uint32_t>(row - a.cu_seqlens[b]);
  return k;
}

// The LayerNorm input z of features j0..j0+7 of `row` (before normalisation).
template <LnKind K>
__device__ __forceinline__ void load_input(const LnArgs& a, int64_t row, int j0, const RowKey& key, float z[8]) {
  const int64_t H = a.H;
  if constexpr (K == LnKind::kPlain) {
    load8(a.x + row * H + j0, z);
  } else if constexpr (K == LnKind::kEmbed) {
    float p[8], t[8];
    load8(a.word + int64_t{a.tokens[row]} * H + j0, z);
    load8(a.position + int64_t{a.positions[row]} * H + j0, p);
    load8(a.token_type + int64_t{a.segments[row]} * H + j0, t);
#pragma unroll
    for (int i = 0; i < 8; ++i) z[i] = (z[i] + p[i]) + t[i];  // the twin's order: word + position + token_type
  } else {
    float b[8], r[8], s[8];
    load8(a.x + row * H + j0, z);
    load8(a.bias + j0, b);
    load8(a.residual + row * H + j0, r);
    dropout_scale8(a.drop, key.sample, key.pos, static_cast<uint32_t>(j0), s);
#pragma unroll
    for (int i = 0; i < 8; ++i) z[i] = (z[i] + b[i]) * s[i] + r[i];
  }
}

template <LnKind K, int VPL>
__global__ void __launch_bounds__(kWarps * 32) ln_forward_kernel(const LnArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;  // whole warps leave together: no block barrier below
  const int H = a.H;
  RowKey key;
  if (K != LnKind::kPlain && a.drop.p > 0.0f) key = row_key(a, row);
  float z[VPL][8];
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < VPL; ++c) {
    const int j0 = (c * 32 + lane) * 8;
    if (j0 < H) {
      load_input<K>(a, row, j0, key, z[c]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += z[c][i];
    }
  }
  const float mean = warp_sum(sum) / static_cast<float>(H);
  float sq = 0.0f;
#pragma unroll
  for (int c = 0; c < VPL; ++c)
    if ((c * 32 + lane) * 8 < H)
#pragma unroll
      for (int i = 0; i < 8; ++i) sq += (z[c][i] - mean) * (z[c][i] - mean);
  const float var = warp_sum(sq) / static_cast<float>(H);
  const float rstd = 1.0f / sqrtf(var + a.eps);
#pragma unroll
  for (int c = 0; c < VPL; ++c) {
    const int j0 = (c * 32 + lane) * 8;
    if (j0 >= H) continue;
    float g[8], b[8], o[8];
    load8(a.gamma + j0, g);
    load8(a.beta + j0, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = (z[c][i] - mean) * rstd * g[i] + b[i];
    if constexpr (K == LnKind::kEmbed) {  // dropout after the LayerNorm
      float s[8];
      dropout_scale8(a.drop, key.sample, key.pos, static_cast<uint32_t>(j0), s);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] *= s[i];
    }
    store8(a.out + row * H + j0, o);
  }
  if (lane == 0) {
    a.mean_out[row] = mean;
    a.rstd_out[row] = rstd;
  }
}

__device__ __forceinline__ void atomic_add8(float* p, const float v[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));  // 16-byte vector atomics (sm_90)
  atomicAdd(reinterpret_cast<float4*>(p + 4), make_float4(v[4], v[5], v[6], v[7]));
#else
#pragma unroll
  for (int i = 0; i < 8; ++i) atomicAdd(p + i, v[i]);
#endif
}

template <LnKind K, int VPL>
__global__ void __launch_bounds__(kWarps * 32) ln_backward_kernel(const LnArgs a) {
  constexpr int kAcc = K == LnKind::kResidual ? 3 : 2;  // d_gamma, d_beta (, d_bias)
  __shared__ float combine[kWarps][VPL * 256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int H = a.H;
  float acc[kAcc][VPL][8];
#pragma unroll
  for (int q = 0; q < kAcc; ++q)
#pragma unroll
    for (int c = 0; c < VPL; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[q][c][i] = 0.0f;

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < a.rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    RowKey key;
    if (K != LnKind::kPlain && a.drop.p > 0.0f) key = row_key(a, row);
    const float mean = a.mean[row], rstd = a.rstd[row];
    float xhat[VPL][8], dy[VPL][8];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int c = 0; c < VPL; ++c) {
      const int j0 = (c * 32 + lane) * 8;
      if (j0 >= H) continue;
      float g[8];
      load_input<K>(a, row, j0, key, xhat[c]);
      load8(a.d_out + row * H + j0, dy[c]);
      load8(a.gamma + j0, g);
      if constexpr (K == LnKind::kEmbed) {  // the output dropout comes first in backward
        float s[8];
        dropout_scale8(a.drop, key.sample, key.pos, static_cast<uint32_t>(j0), s);
#pragma unroll
        for (int i = 0; i < 8; ++i) dy[c][i] *= s[i];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xhat[c][i] = (xhat[c][i] - mean) * rstd;
        const float gi = dy[c][i] * g[i];
        sum_g += gi;
        sum_gx += gi * xhat[c][i];
        acc[0][c][i] += dy[c][i] * xhat[c][i];
        acc[1][c][i] += dy[c][i];
      }
    }
    sum_g = warp_sum(sum_g) / static_cast<float>(H);
    sum_gx = warp_sum(sum_gx) / static_cast<float>(H);
#pragma unroll
    for (int c = 0; c < VPL; ++c) {
      const int j0 = (c * 32 + lane) * 8;
      if (j0 >= H) continue;
      float g[8], dz[8];
      load8(a.gamma + j0, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) dz[i] = rstd * (dy[c][i] * g[i] - sum_g - xhat[c][i] * sum_gx);
      if constexpr (K == LnKind::kPlain) {
        store8(a.dz + row * H + j0, dz);
      } else if constexpr (K == LnKind::kResidual) {
        float s[8], dx[8];
        dropout_scale8(a.drop, key.sample, key.pos, static_cast<uint32_t>(j0), s);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dx[i] = dz[i] * s[i];
          acc[kAcc - 1][c][i] += dx[i];  // d_bias from the unrounded dx, as the twin
        }
        store8(a.dz + row * H + j0, dz);
        store8(a.d_x + row * H + j0, dx);
      } else {
        atomic_add8(a.d_word + int64_t{a.tokens[row]} * H + j0, dz);
        atomic_add8(a.d_position + int64_t{a.positions[row]} * H + j0, dz);
        atomic_add8(a.d_token_type + int64_t{a.segments[row]} * H + j0, dz);
      }
    }
  }

  // Combine the warps' accumulators in warp order, one accumulator at a time (16 KiB of shared memory at H = 1024).
  float* out = a.partial + static_cast<int64_t>(blockIdx.x) * kAcc * H;
#pragma unroll
  for (int q = 0; q < kAcc; ++q) {
#pragma unroll
    for (int c = 0; c < VPL; ++c) {
      const int j0 = (c * 32 + lane) * 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) combine[warp][j0 + i] = acc[q][c][i];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += combine[w][j];
      out[q * H + j] = s;
    }
    __syncthreads();
  }
}

__global__ void column_finish_kernel(const float* __restrict__ partial, int blocks, int H, int nacc, float* out0,
                                     float* out1, float* out2) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;  // over nacc * H
  if (col >= nacc * H) return;
  const int q = col / H, j = col - q * H;
  float* out = q == 0 ? out0 : (q == 1 ? out1 : out2);
  if (out == nullptr) return;
  float s = 0.0f;
  for (int b = 0; b < blocks; ++b) s += partial[static_cast<int64_t>(b) * nacc * H + col];
  out[j] += s;
}

template <LnKind K, int VPL>
void launch_forward_vpl(const LnArgs& a, cudaStream_t stream) {
  ln_forward_kernel<K, VPL><<<ceil_div(a.rows, kWarps), kWarps * 32, 0, stream>>>(a);
  NOPAD_CUDA_CHECK_LAUNCH();
}
template <LnKind K, int VPL>
void launch_backward_vpl(const LnArgs& a, int blocks, cudaStream_t stream) {
  ln_backward_kernel<K, VPL><<<blocks, kWarps * 32, 0, stream>>>(a);
  NOPAD_CUDA_CHECK_LAUNCH();
}

void check_hidden(int32_t H) {
  NOPAD_CHECK(H > 0 && H % 8 == 0 && H <= 1024, "CUDA LayerNorm kernels need hidden % 8 == 0 and hidden <= 1024, got ",
              H);
}

template <LnKind K>
void dispatch_forward(const LnArgs& a, cudaStream_t stream) {
  if (a.H <= 256)
    launch_forward_vpl<K, 1>(a, stream);
  else if (a.H <= 512)
    launch_forward_vpl<K, 2>(a, stream);
  else
    launch_forward_vpl<K, 4>(a, stream);
}
template <LnKind K>
void dispatch_backward(const LnArgs& a, int blocks, cudaStream_t stream) {
  if (a.H <= 256)
    launch_backward_vpl<K, 1>(a, blocks, stream);
  else if (a.H <= 512)
    launch_backward_vpl<K, 2>(a, blocks, stream);
  else
    launch_backward_vpl<K, 4>(a, blocks, stream);
}

}  // namespace

void launch_ln_forward(LnKind kind, const LnArgs& a, cudaStream_t stream) {
  check_hidden(a.H);
  if (a.rows <= 0) return;
  switch (kind) {
    case LnKind::kPlain: dispatch_forward<LnKind::kPlain>(a, stream); break;
    case LnKind::kEmbed: dispatch_forward<LnKind::kEmbed>(a, stream); break;
    case LnKind::kResidual: dispatch_forward<LnKind::kResidual>(a, stream); break;
  }
}

int ln_backward_blocks(int64_t rows, int sm_count) {
  const int64_t wanted = (rows + kWarps - 1) / kWarps;
  const int64_t cap = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);  // a few rows per warp, small partials
  return static_cast<int>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

void launch_ln_backward(LnKind kind, const LnArgs& a, int blocks, cudaStream_t stream) {
  check_hidden(a.H);
  switch (kind) {
    case LnKind::kPlain: dispatch_backward<LnKind::kPlain>(a, blocks, stream); break;
    case LnKind::kEmbed: dispatch_backward<LnKind::kEmbed>(a, blocks, stream); break;
    case LnKind::kResidual: dispatch_backward<LnKind::kResidual>(a, blocks, stream); break;
  }
}

void launch_column_finish(const float* partial, int blocks, int H, int nacc, float* out0, float* out1, float* out2,
                          cudaStream_t stream) {
  if (H <= 0 || blocks <= 0) return;
  constexpr int kThreads = 256;
  column_finish_kernel<<<ceil_div(int64_t{nacc} * H, kThreads), kThreads, 0, stream>>>(partial, blocks, H, nacc,
                                                                                        out0, out1, out2);
  NOPAD_CUDA_CHECK_LAUNCH();
}

}  // namespace nopad::cuda
