// The LayerNorm family of the CUDA backend, forward and backward (CPU twins: layernorm_row / layernorm_row_backward
// and the embed_layernorm_dropout, bias_dropout_residual_layernorm and MLM-head LayerNorm code of
// ops/cpu/cpu_backend.cpp). Kinds: kPlain LN(x); kEmbed LN(word[tok] + position[pos] + token_type[seg]) then dropout;
// kResidual LN(dropout(x + bias) + residual). H % 8 == 0, H <= 1024. fp32 math throughout; mean and variance are
// two-pass over registers (as the twin). Dropout bits come from dropout_scale8, the twin's Philox draws. Every kernel
// is a template over the 16-bit element type E of activations and weights (bf16 or fp16); statistics, column partials
// and the embedding-table gradients are fp32 for both.
//
// Two implementations (KernelVariants::ln_forward / ln_backward in dense.h, kept until GPU timings pick one):
//  - Warp per row (the first one): 4 warps per block, a lane owns the 8-feature groups j0 = (c*32 + lane)*8,
//    c < VPL, so the row lives in registers (VPL*8 floats per lane). The backward grid is min(rows/4, 2 x SMs) blocks
//    striding over rows; it draws the dropout mask twice per row (for the LN input and for d_x).
//  - Row group: a row is owned by a group of T = 32*ceil(H / (256 V)) threads (the whole block), thread t owning the
//    V vectors j0 = (c*T + t)*8, c < V; a row sum is a warp shuffle plus, for T > 32, one exchange through shared
//    memory (one barrier). Each block walks a contiguous range of rows and loads row r+1 (raw 16-bit, plus its mean,
//    rstd and dropout key) before computing row r, so a row's loads are always in flight; the row -> sequence lookup
//    is a cursor that moves forward (no binary search per row). The dropout mask is drawn once per row and kept as
//    bits. Fewer accumulators per thread than the warp kernel (8V features instead of 32) leave room for more
//    resident warps.
//  - Pipelined (bias + dropout + residual LayerNorm only, LnVariant::stages = S): the row-group kernel with V = 1
//    whose row inputs are copied into a shared-memory ring by cp.async S - 1 rows ahead, so a block has S - 1 rows in
//    flight instead of one, at no register cost (the backward's default); and a pipelined warp-per-row forward.
//    Both kernels were issue-bound as much as latency-bound (ncu: ~65% of issue slots busy), so they also keep per-row
//    instructions down: dropout threshold and scale hoisted, gamma / beta / bias converted to fp32 once into shared
//    memory, row sums scaled by 1/H.
//
// Backward is deterministic except the embedding-table scatter. Column gradients (d_gamma, d_beta, and d_bias for
// kResidual) are per-thread register sums over the rows a block visits in increasing order, written per block to
// partial[block][nacc][H] (the warp kernel first combines its 4 warps in warp order), then launch_column_finish adds
// the block partials in a fixed order. Both grids are a pure function of (rows, H, variant, device), so the order is
// fixed per device and size. The embedding scatter-add into d_word/d_position/d_token_type uses fp32 atomics, so
// its summation order (and the last bits of those gradients) varies from run to run; the row-group kernel adds the
// token-type gradient once per run of equal segments in its rows (segments are runs of 0s then 1s per sequence)
// instead of once per row, which removes nearly all atomics on those 2 hot rows.
#include <algorithm>
#include <atomic>

#include "ops/cuda/check.h"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/dense.h"
#include "ops/cuda/kernels.cuh"

namespace nopad::cuda {
namespace {

constexpr int kWarps = 4;  // rows per block in flight (one per warp)

struct RowKey {
  uint64_t sample = 0;
  uint32_t pos = 0;
};
template <class E>
__device__ __forceinline__ RowKey row_key(const LnArgs<E>& a, int64_t row) {
  RowKey k;
  const int32_t b = row_to_seq(a.cu_seqlens, a.num_seqs, row);
  k.sample = a.sample_ids[b];
  k.pos = static_cast<uint32_t>(a.row_pos != nullptr ? a.row_pos[row] : row - a.cu_seqlens[b]);
  return k;
}

// The LayerNorm input z of features j0..j0+7 of `row` (before normalisation).
template <LnKind K, class E>
__device__ __forceinline__ void load_input(const LnArgs<E>& a, int64_t row, int j0, const RowKey& key, float z[8]) {
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

template <class E, LnKind K, int VPL>
__global__ void __launch_bounds__(kWarps * 32) ln_forward_kernel(const LnArgs<E> a) {
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

template <class E, LnKind K, int VPL>
__global__ void __launch_bounds__(kWarps * 32) ln_backward_kernel(const LnArgs<E> a) {
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

// ------------------------------------------------------------------------------------------------ row group

// One row's inputs as loaded (raw 16-bit vectors), so the next row's loads can be in flight while this one is
// computed.
template <class E, LnKind K, int V, bool kBackward>
struct RowIn {
  Vec8<E> a[V];   // x (kPlain, kResidual) or the word row (kEmbed)
  Vec8<E> b[V];   // residual (kResidual) or the position row (kEmbed)
  Vec8<E> c[V];   // the token-type row (kEmbed)
  Vec8<E> dy[V];  // d_out (backward)
  float mean, rstd;  // backward
  int32_t tok, pos, seg;  // kEmbed
  RowKey key;
};

// Which sequence the rows belong to, for dropout keys: rows only move forward within a block.
struct SeqCursor {
  int32_t b = 0;
  int64_t start = 0, end = 0;
  uint64_t sample = 0;
};
template <class E>
__device__ __forceinline__ void seq_cursor_init(const LnArgs<E>& a, int64_t row, SeqCursor& s) {
  s.b = row_to_seq(a.cu_seqlens, a.num_seqs, row);
  s.start = a.cu_seqlens[s.b];
  s.end = a.cu_seqlens[s.b + 1];
  s.sample = a.sample_ids[s.b];
}
template <class E>
__device__ __forceinline__ RowKey seq_cursor_key(const LnArgs<E>& a, int64_t row, SeqCursor& s) {
  while (row >= s.end && s.b + 1 < a.num_seqs) {  // sequences are non-empty: usually one step at a boundary
    ++s.b;
    s.start = s.end;
    s.end = a.cu_seqlens[s.b + 1];
    s.sample = a.sample_ids[s.b];
  }
  RowKey k;
  k.sample = s.sample;
  k.pos = static_cast<uint32_t>(a.row_pos != nullptr ? a.row_pos[row] : row - s.start);
  return k;
}

template <LnKind K, int V, bool kBackward, class E>
__device__ __forceinline__ void load_row(const LnArgs<E>& a, int64_t row, RowIn<E, K, V, kBackward>& in) {
  const int64_t H = a.H;
  const int T = blockDim.x, t = threadIdx.x;
  if constexpr (K == LnKind::kEmbed) {
    in.tok = a.tokens[row];
    in.pos = a.positions[row];
    in.seg = a.segments[row];
  }
#pragma unroll
  for (int c = 0; c < V; ++c) {
    const int j0 = (c * T + t) * 8;
    if (j0 >= H) continue;
    if constexpr (K == LnKind::kEmbed) {
      in.a[c] = ld16(a.word + int64_t{in.tok} * H + j0);
      in.b[c] = ld16(a.position + int64_t{in.pos} * H + j0);
      in.c[c] = ld16(a.token_type + int64_t{in.seg} * H + j0);
    } else {
      in.a[c] = ld16(a.x + row * H + j0);
      if constexpr (K == LnKind::kResidual) in.b[c] = ld16(a.residual + row * H + j0);
    }
    if constexpr (kBackward) in.dy[c] = ld16(a.d_out + row * H + j0);
  }
  if constexpr (kBackward) {
    in.mean = a.mean[row];
    in.rstd = a.rstd[row];
  }
}

// Keep bits of the thread's 8V features of one row (bit 8c + i: feature (c*T + t)*8 + i kept; all set without
// dropout) and the keep-scale of a kept feature. One draw per row (dropout_scale8, the twin's draws), used for the LN
// input and for d_x alike. The scale is taken from the draw itself (the largest of the 8V values: every kept one
// holds it), so this code follows dropout_scale8's definition of it; if all 8V features are dropped it is unused.
template <int V, class E>
__device__ __forceinline__ uint32_t keep_bits(const LnArgs<E>& a, const RowKey& key, float& scale) {
  static_assert(V * 8 <= 32, "keep bits fit one word");
  scale = 1.0f;
  if (a.drop.p <= 0.0f) return 0xffffffffu;
  uint32_t bits = 0;
  float kept = 0.0f;
  const int T = blockDim.x, t = threadIdx.x;
#pragma unroll
  for (int c = 0; c < V; ++c) {
    const int j0 = (c * T + t) * 8;
    if (j0 >= a.H) continue;
    float s[8];
    dropout_scale8(a.drop, key.sample, key.pos, static_cast<uint32_t>(j0), s);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      bits |= (s[i] != 0.0f ? 1u : 0u) << (c * 8 + i);
      kept = fmaxf(kept, s[i]);
    }
  }
  scale = kept;
  return bits;
}
__device__ __forceinline__ float keep_scale(uint32_t bits, int bit, float scale) {
  return (bits >> bit) & 1u ? scale : 0.0f;
}

// Sums over the row (the whole block of at most kMaxRowWarps warps: rg_threads <= 128 for H <= 1024). kTwo: x and y
// together. Every thread gets the same bits (xor butterfly, then the warps' sums added in warp order, in an unrolled
// loop). red is [2][2][32]; `parity` alternates the halves, so one barrier suffices: a half is rewritten only after
// the next reduction's barrier, which every reader of it has passed.
constexpr int kMaxRowWarps = 4;
template <bool kTwo>
__device__ __forceinline__ void row_sum(float& x, float& y, float (*red)[2][32], int& parity) {
  x = warp_sum(x);
  if constexpr (kTwo) y = warp_sum(y);
  const int nwarps = blockDim.x >> 5;
  if (nwarps == 1) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    red[parity][0][warp] = x;
    if constexpr (kTwo) red[parity][1][warp] = y;
  }
  __syncthreads();
  float sx = red[parity][0][0], sy = kTwo ? red[parity][1][0] : 0.0f;
#pragma unroll
  for (int w = 1; w < kMaxRowWarps; ++w)
    if (w < nwarps) {
      sx += red[parity][0][w];
      if constexpr (kTwo) sy += red[parity][1][w];
    }
  x = sx;
  if constexpr (kTwo) y = sy;
  parity ^= 1;
}

// Rows [blockIdx.x * rows_per_block, ...) of this block; the loop bounds are block-uniform (barriers inside).
template <class E, LnKind K, int V>
__global__ void __launch_bounds__(128 / V) ln_forward_rg_kernel(const LnArgs<E> a, int64_t rows_per_block) {
  __shared__ float red[2][2][32];
  int parity = 0;
  const int T = blockDim.x, t = threadIdx.x;
  const int H = a.H;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows;
  if (r0 >= r1) return;  // the whole block
  const bool keyed = K != LnKind::kPlain && a.drop.p > 0.0f;
  // gamma, beta and bias are re-read per row (L1 hits) rather than held: 12 V registers fewer.
  SeqCursor seq;
  RowIn<E, K, V, false> cur;
  if (keyed) {
    seq_cursor_init(a, r0, seq);
    cur.key = seq_cursor_key(a, r0, seq);
  }
  load_row<K, V, false>(a, r0, cur);
  for (int64_t row = r0; row < r1; ++row) {
    RowIn<E, K, V, false> next;
    if (row + 1 < r1) {  // in flight while this row is computed
      load_row<K, V, false>(a, row + 1, next);
      if (keyed) next.key = seq_cursor_key(a, row + 1, seq);
    }
    float inv_keep = 1.0f;
    const uint32_t bits = keyed ? keep_bits<V>(a, cur.key, inv_keep) : 0xffffffffu;
    float z[V][8];
    float sum = 0.0f, unused = 0.0f;
#pragma unroll
    for (int c = 0; c < V; ++c) {
      const int j0 = (c * T + t) * 8;
      if (j0 >= H) continue;
      unpack8(cur.a[c], z[c]);
      if constexpr (K == LnKind::kResidual) {
        float r[8], b[8];
        unpack8(cur.b[c], r);
        load8(a.bias + j0, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) z[c][i] = (z[c][i] + b[i]) * keep_scale(bits, c * 8 + i, inv_keep) + r[i];
      } else if constexpr (K == LnKind::kEmbed) {
        float p[8], tt[8];
        unpack8(cur.b[c], p);
        unpack8(cur.c[c], tt);
#pragma unroll
        for (int i = 0; i < 8; ++i) z[c][i] = (z[c][i] + p[i]) + tt[i];  // the twin's order
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += z[c][i];
    }
    row_sum<false>(sum, unused, red, parity);
    const float mean = sum / static_cast<float>(H);
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < V; ++c)
      if ((c * T + t) * 8 < H)
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += (z[c][i] - mean) * (z[c][i] - mean);
    row_sum<false>(sq, unused, red, parity);
    const float var = sq / static_cast<float>(H);
    const float rstd = 1.0f / sqrtf(var + a.eps);
#pragma unroll
    for (int c = 0; c < V; ++c) {
      const int j0 = (c * T + t) * 8;
      if (j0 >= H) continue;
      float g[8], b[8], o[8];
      load8(a.gamma + j0, g);
      load8(a.beta + j0, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        o[i] = (z[c][i] - mean) * rstd * g[i] + b[i];
        if constexpr (K == LnKind::kEmbed) o[i] *= keep_scale(bits, c * 8 + i, inv_keep);  // dropout after the LN
      }
      store8(a.out + row * H + j0, o);
    }
    if (t == 0) {
      a.mean_out[row] = mean;
      a.rstd_out[row] = rstd;
    }
    cur = next;
  }
}

// Register budget of the backward: at V = 1 (128 threads per row at H = 1024) six resident blocks, i.e. <= 80
// registers, which ptxas meets without spills for kPlain and kResidual (the embedding kernel, run once per step, gets
// five). V = 2 is left unconstrained (~170 registers, spills below that). V = 4 is not offered: it spills at 255.
template <LnKind K, int V>
constexpr int ln_backward_min_blocks() {
  return V == 1 ? (K == LnKind::kEmbed ? 5 : 6) : 1;
}

template <class E, LnKind K, int V>
__global__ void __launch_bounds__(128 / V, ln_backward_min_blocks<K, V>())
    ln_backward_rg_kernel(const LnArgs<E> a, int64_t rows_per_block) {
  constexpr int kAcc = K == LnKind::kResidual ? 3 : 2;  // d_gamma, d_beta (, d_bias)
  __shared__ float red[2][2][32];
  int parity = 0;
  const int T = blockDim.x, t = threadIdx.x;
  const int H = a.H;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows;
  const bool keyed = K != LnKind::kPlain && a.drop.p > 0.0f;
  float acc[kAcc][V][8];
#pragma unroll
  for (int q = 0; q < kAcc; ++q)
#pragma unroll
    for (int c = 0; c < V; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[q][c][i] = 0.0f;
  // gamma and bias are re-read per row (L1 hits) rather than held in registers.
  // kEmbed: the token-type gradient of the current run of equal segments, added with atomics when the run ends.
  int32_t run_seg = -1;
  float run[V][8];
#pragma unroll
  for (int c = 0; c < V; ++c)
#pragma unroll
    for (int i = 0; i < 8; ++i) run[c][i] = 0.0f;

  SeqCursor seq;
  RowIn<E, K, V, true> cur;
  if (r0 < r1) {
    if (keyed) {
      seq_cursor_init(a, r0, seq);
      cur.key = seq_cursor_key(a, r0, seq);
    }
    load_row<K, V, true>(a, r0, cur);
  }
  for (int64_t row = r0; row < r1; ++row) {
    RowIn<E, K, V, true> next;
    if (row + 1 < r1) {  // in flight while this row is computed
      load_row<K, V, true>(a, row + 1, next);
      if (keyed) next.key = seq_cursor_key(a, row + 1, seq);
    }
    float inv_keep = 1.0f;
    const uint32_t bits = keyed ? keep_bits<V>(a, cur.key, inv_keep) : 0xffffffffu;
    const float mean = cur.mean, rstd = cur.rstd;
    float gdy[V][8], xhat[V][8];  // dy * gamma and the normalised input, kept across the row sum
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int c = 0; c < V; ++c) {
      const int j0 = (c * T + t) * 8;
      if (j0 >= H) continue;
      float dy[8], g[8];
      unpack8(cur.dy[c], dy);
      load8(a.gamma + j0, g);
      unpack8(cur.a[c], xhat[c]);  // becomes the LN input z, then xhat
      if constexpr (K == LnKind::kResidual) {
        float r[8], b[8];
        unpack8(cur.b[c], r);
        load8(a.bias + j0, b);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          xhat[c][i] = (xhat[c][i] + b[i]) * keep_scale(bits, c * 8 + i, inv_keep) + r[i];
      } else if constexpr (K == LnKind::kEmbed) {
        float p[8], tt[8];
        unpack8(cur.b[c], p);
        unpack8(cur.c[c], tt);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xhat[c][i] = (xhat[c][i] + p[i]) + tt[i];
          dy[i] *= keep_scale(bits, c * 8 + i, inv_keep);  // the output dropout comes first in backward
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xhat[c][i] = (xhat[c][i] - mean) * rstd;
        gdy[c][i] = dy[i] * g[i];
        sum_g += gdy[c][i];
        sum_gx += gdy[c][i] * xhat[c][i];
        acc[0][c][i] += dy[i] * xhat[c][i];
        acc[1][c][i] += dy[i];
      }
    }
    row_sum<true>(sum_g, sum_gx, red, parity);
    sum_g /= static_cast<float>(H);
    sum_gx /= static_cast<float>(H);
    if constexpr (K == LnKind::kEmbed) {
      if (cur.seg != run_seg) {
        if (run_seg >= 0)
#pragma unroll
          for (int c = 0; c < V; ++c) {
            const int j0 = (c * T + t) * 8;
            if (j0 >= H) continue;
            atomic_add8(a.d_token_type + int64_t{run_seg} * H + j0, run[c]);
#pragma unroll
            for (int i = 0; i < 8; ++i) run[c][i] = 0.0f;
          }
        run_seg = cur.seg;
      }
    }
#pragma unroll
    for (int c = 0; c < V; ++c) {
      const int j0 = (c * T + t) * 8;
      if (j0 >= H) continue;
      float dz[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) dz[i] = rstd * (gdy[c][i] - sum_g - xhat[c][i] * sum_gx);
      if constexpr (K == LnKind::kPlain) {
        store8(a.dz + row * H + j0, dz);
      } else if constexpr (K == LnKind::kResidual) {
        float dx[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dx[i] = dz[i] * keep_scale(bits, c * 8 + i, inv_keep);
          acc[2][c][i] += dx[i];  // d_bias from the unrounded dx, as the twin
        }
        store8(a.dz + row * H + j0, dz);
        store8(a.d_x + row * H + j0, dx);
      } else {
        atomic_add8(a.d_word + int64_t{cur.tok} * H + j0, dz);
        atomic_add8(a.d_position + int64_t{cur.pos} * H + j0, dz);
#pragma unroll
        for (int i = 0; i < 8; ++i) run[c][i] += dz[i];
      }
    }
    cur = next;
  }
  if constexpr (K == LnKind::kEmbed) {
    if (run_seg >= 0)
#pragma unroll
      for (int c = 0; c < V; ++c) {
        const int j0 = (c * T + t) * 8;
        if (j0 < H) atomic_add8(a.d_token_type + int64_t{run_seg} * H + j0, run[c]);
      }
  }
  // This block's column sums (zeros for a block without rows): each thread owns its features, no combining needed.
  float* out = a.partial + static_cast<int64_t>(blockIdx.x) * kAcc * H;
#pragma unroll
  for (int q = 0; q < kAcc; ++q)
#pragma unroll
    for (int c = 0; c < V; ++c) {
      const int j0 = (c * T + t) * 8;
      if (j0 >= H) continue;
      *reinterpret_cast<float4*>(out + q * H + j0) =
          make_float4(acc[q][c][0], acc[q][c][1], acc[q][c][2], acc[q][c][3]);
      *reinterpret_cast<float4*>(out + q * H + j0 + 4) =
          make_float4(acc[q][c][4], acc[q][c][5], acc[q][c][6], acc[q][c][7]);
    }
}

// ------------------------------------------------------------------------------------------------ pipelined rows

// The bias + dropout + residual LayerNorm with its row inputs copied global -> shared memory by cp.async, S - 1 rows
// ahead of the row being computed (LnVariant::stages = S), one 16-byte vector (8 features) per thread, T = 32 *
// ceil(H / 256) threads per row (the whole block, as the row-group kernel with V = 1). The register-prefetch kernel
// keeps one row in flight per block, so a block waits out a memory latency per row; here S - 1 rows are in flight
// and the copies need no registers. Each thread copies and later reads only its own vectors (and, in the backward, its
// own copy of the row's mean and rstd), so cp.async.wait_group alone orders them: no barrier beyond the row sums'.
// The same dropout draws and column-partial layout as the row-group kernel with V = 1; the backward's row sums are
// scaled by 1/H (see ln_backward_pipe_kernel).
constexpr int kPipeThreads = 32 * kMaxRowWarps;  // T for H = 1024, the largest H

template <class E>
__device__ __forceinline__ Vec8<E> smem_vec(const uint4& u) {
  const uint4 v = u;  // one 128-bit shared load
  Vec8<E> x;
  memcpy(&x, &v, sizeof x);
  return x;
}

template <class E, int S>
__global__ void __launch_bounds__(kPipeThreads) ln_forward_pipe_kernel(const LnArgs<E> a, int64_t rows_per_block) {
  __shared__ uint4 ring[S][2][kPipeThreads];  // x, residual
  __shared__ float red[2][2][32];
  int parity = 0;
  const int t = threadIdx.x, H = a.H, j0 = t * 8;
  const bool owns = j0 < H;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows;
  if (r0 >= r1) return;  // the whole block
  const uint32_t threshold = dropout_threshold(a.drop.p);
  const bool keyed = threshold != 0;
  const float keep_scale = keyed ? dropout_keep_scale(threshold) : 1.0f;
  auto issue = [&](int64_t row, int slot) {
    if (row < r1 && owns) {
      cp_async16(&ring[slot][0][t], a.x + row * H + j0);
      cp_async16(&ring[slot][1][t], a.residual + row * H + j0);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < S - 1; ++k) issue(r0 + k, k);
  SeqCursor seq;
  if (keyed) seq_cursor_init(a, r0, seq);
  int slot = 0;
  for (int64_t row = r0; row < r1; ++row) {
    issue(row + S - 1, slot == 0 ? S - 1 : slot - 1);  // the slot row - 1 used, already read into registers
    cp_async_wait<S - 1>();                            // this row's copies have landed
    float z[8];
    float sum = 0.0f, unused = 0.0f;
    if (owns) {
      float r[8], b[8], s[8];
      if (keyed) {
        const RowKey key = seq_cursor_key(a, row, seq);
        dropout_scale8(a.drop.stream_key, threshold, keep_scale, key.sample, key.pos, static_cast<uint32_t>(j0), s);
      }
      unpack8(smem_vec<E>(ring[slot][0][t]), z);
      unpack8(smem_vec<E>(ring[slot][1][t]), r);
      load8(a.bias + j0, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        z[i] = keyed ? (z[i] + b[i]) * s[i] + r[i] : (z[i] + b[i]) + r[i];
        sum += z[i];
      }
    }
    row_sum<false>(sum, unused, red, parity);
    const float mean = sum / static_cast<float>(H);
    float sq = 0.0f;
    if (owns)
#pragma unroll
      for (int i = 0; i < 8; ++i) sq += (z[i] - mean) * (z[i] - mean);
    row_sum<false>(sq, unused, red, parity);
    const float rstd = 1.0f / sqrtf(sq / static_cast<float>(H) + a.eps);
    if (owns) {
      float g[8], b[8], o[8];
      load8(a.gamma + j0, g);
      load8(a.beta + j0, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = (z[i] - mean) * rstd * g[i] + b[i];
      store8(a.out + row * H + j0, o);
    }
    if (t == 0) {
      a.mean_out[row] = mean;
      a.rstd_out[row] = rstd;
    }
    slot = slot + 1 == S ? 0 : slot + 1;
  }
}

// Warp per row, pipelined (bias + dropout + residual LayerNorm forward; LnVariant{false, 0, bps, 2}): the warp-per-row
// arithmetic (a lane owns the 8-feature groups j0 = (c*32 + lane)*8, c < VPL), but each block walks a contiguous range
// of rows, warp w taking rows r0 + w, r0 + w + 4, ..., with the next row's x and residual copied into the warp's
// shared-memory ring (cp.async) while this one is computed; gamma, beta and bias are converted to fp32 once per block
// into shared memory; the row -> sequence lookup is a per-warp cursor. No barrier after the parameters' one.
template <class E, int VPL>
__global__ void __launch_bounds__(kWarps * 32) ln_forward_pipe_warp_kernel(const LnArgs<E> a, int64_t rows_per_block) {
  __shared__ uint4 ring[2][kWarps][2][VPL * 32];  // [stage][warp][x, residual][lane vectors]
  __shared__ float4 params[3][VPL * 64];          // gamma, beta, bias as fp32 (two float4 per 8-feature group)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int H = a.H;
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    const E* src[3] = {a.gamma, a.beta, a.bias};
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      float f[8];
      load8(src[q] + v * 8, f);
      params[q][2 * v] = make_float4(f[0], f[1], f[2], f[3]);
      params[q][2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  }
  __syncthreads();
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows;
  const uint32_t threshold = dropout_threshold(a.drop.p);
  const bool keyed = threshold != 0;
  const float keep_scale = keyed ? dropout_keep_scale(threshold) : 1.0f;
  const float inv_h = 1.0f / static_cast<float>(H);
  auto issue = [&](int64_t row, int stage) {
    if (row < r1) {
#pragma unroll
      for (int c = 0; c < VPL; ++c) {
        const int j0 = (c * 32 + lane) * 8;
        if (j0 < H) {
          cp_async16(&ring[stage][warp][0][c * 32 + lane], a.x + row * H + j0);
          cp_async16(&ring[stage][warp][1][c * 32 + lane], a.residual + row * H + j0);
        }
      }
    }
    cp_async_commit();
  };
  SeqCursor seq;
  if (keyed && r0 + warp < r1) seq_cursor_init(a, r0 + warp, seq);
  issue(r0 + warp, 0);
  int stage = 0;
  for (int64_t row = r0 + warp; row < r1; row += kWarps) {
    issue(row + kWarps, stage ^ 1);  // the stage the previous row used, already read into registers
    cp_async_wait<1>();
    RowKey key;
    if (keyed) key = seq_cursor_key(a, row, seq);
    float z[VPL][8];
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < VPL; ++c) {
      const int j0 = (c * 32 + lane) * 8;
      if (j0 >= H) continue;
      float r[8], s[8];
      unpack8(smem_vec<E>(ring[stage][warp][0][c * 32 + lane]), z[c]);
      unpack8(smem_vec<E>(ring[stage][warp][1][c * 32 + lane]), r);
      const float4 b0 = params[2][2 * (c * 32 + lane)], b1 = params[2][2 * (c * 32 + lane) + 1];
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
      if (keyed) {
        dropout_scale8(a.drop.stream_key, threshold, keep_scale, key.sample, key.pos, static_cast<uint32_t>(j0), s);
#pragma unroll
        for (int i = 0; i < 8; ++i) z[c][i] = (z[c][i] + b[i]) * s[i] + r[i];
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) z[c][i] = (z[c][i] + b[i]) + r[i];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += z[c][i];
    }
    const float mean = warp_sum(sum) * inv_h;  // the twin divides by H: the same for H a power of two
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < VPL; ++c)
      if ((c * 32 + lane) * 8 < H)
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += (z[c][i] - mean) * (z[c][i] - mean);
    const float rstd = 1.0f / sqrtf(warp_sum(sq) * inv_h + a.eps);
#pragma unroll
    for (int c = 0; c < VPL; ++c) {
      const int j0 = (c * 32 + lane) * 8;
      if (j0 >= H) continue;
      const int v = c * 32 + lane;
      const float4 g0 = params[0][2 * v], g1 = params[0][2 * v + 1], e0 = params[1][2 * v], e1 = params[1][2 * v + 1];
      const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      const float be[8] = {e0.x, e0.y, e0.z, e0.w, e1.x, e1.y, e1.z, e1.w};
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = (z[c][i] - mean) * rstd * g[i] + be[i];
      store8(a.out + row * H + j0, o);
    }
    if (lane == 0) {
      a.mean_out[row] = mean;
      a.rstd_out[row] = rstd;
    }
    stage ^= 1;
  }
  cp_async_wait<0>();
}

// The backward keeps per-row work to what the arithmetic needs: gamma and bias are converted to fp32 once into the
// thread's own shared-memory slots, pointers are the thread's base plus one row offset, and the row sums are scaled
// by 1/H (the twin divides by H: the same value for H a power of two, within an ulp otherwise).
template <class E, int S>
__global__ void __launch_bounds__(kPipeThreads, 5) ln_backward_pipe_kernel(const LnArgs<E> a, int64_t rows_per_block) {
  __shared__ uint4 ring[S][3][kPipeThreads];  // x, residual, d_out
  __shared__ float stat[S][2][kPipeThreads];  // mean, rstd: each thread's own copy
  __shared__ float4 params[4][kPipeThreads];  // gamma[0:4], gamma[4:8], bias[0:4], bias[4:8] of each thread
  __shared__ float red[2][2][32];
  int parity = 0;
  const int t = threadIdx.x, H = a.H, j0 = t * 8;
  const bool owns = j0 < H;
  const float inv_h = 1.0f / static_cast<float>(H);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows;
  const uint32_t threshold = dropout_threshold(a.drop.p);
  const bool keyed = threshold != 0;
  const float keep_scale = keyed ? dropout_keep_scale(threshold) : 1.0f;
  // Element offsets of the thread's vector in the row whose copies are issued next, and in the row being computed.
  int64_t next_off = r0 * H + j0, row_off = next_off;
  float acc[3][8];  // d_gamma, d_beta, d_bias
#pragma unroll
  for (int q = 0; q < 3; ++q)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[q][i] = 0.0f;
  if (owns) {
    float g[8], b[8];
    load8(a.gamma + j0, g);
    load8(a.bias + j0, b);
    params[0][t] = make_float4(g[0], g[1], g[2], g[3]);
    params[1][t] = make_float4(g[4], g[5], g[6], g[7]);
    params[2][t] = make_float4(b[0], b[1], b[2], b[3]);
    params[3][t] = make_float4(b[4], b[5], b[6], b[7]);
  }
  auto issue = [&](int64_t row, int slot) {  // rows are issued in order: the offset steps one row each time
    if (row < r1 && owns) {
      cp_async16(&ring[slot][0][t], a.x + next_off);
      cp_async16(&ring[slot][1][t], a.residual + next_off);
      cp_async16(&ring[slot][2][t], a.d_out + next_off);
      cp_async4(&stat[slot][0][t], a.mean + row);
      cp_async4(&stat[slot][1][t], a.rstd + row);
    }
    next_off += H;
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < S - 1; ++k) issue(r0 + k, k);
  SeqCursor seq;
  if (keyed && r0 < r1) seq_cursor_init(a, r0, seq);
  int slot = 0;
  for (int64_t row = r0; row < r1; ++row) {
    issue(row + S - 1, slot == 0 ? S - 1 : slot - 1);
    cp_async_wait<S - 1>();
    float gdy[8], xhat[8], s[8];  // dy * gamma, the normalised input and the keep-scales, kept across the row sum
    float sum_g = 0.0f, sum_gx = 0.0f, rstd = 0.0f;
    if (owns) {
      if (keyed) {
        const RowKey key = seq_cursor_key(a, row, seq);
        dropout_scale8(a.drop.stream_key, threshold, keep_scale, key.sample, key.pos, static_cast<uint32_t>(j0), s);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = 1.0f;
      }
      const float mean = stat[slot][0][t];
      rstd = stat[slot][1][t];
      float dy[8], r[8];
      const float4 g0 = params[0][t], g1 = params[1][t], b0 = params[2][t], b1 = params[3][t];
      const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
      unpack8(smem_vec<E>(ring[slot][0][t]), xhat);  // becomes the LN input z, then xhat
      unpack8(smem_vec<E>(ring[slot][1][t]), r);
      unpack8(smem_vec<E>(ring[slot][2][t]), dy);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xhat[i] = ((xhat[i] + b[i]) * s[i] + r[i] - mean) * rstd;
        gdy[i] = dy[i] * g[i];
        sum_g += gdy[i];
        sum_gx += gdy[i] * xhat[i];
        acc[0][i] += dy[i] * xhat[i];
        acc[1][i] += dy[i];
      }
    }
    row_sum<true>(sum_g, sum_gx, red, parity);
    sum_g *= inv_h;
    sum_gx *= inv_h;
    if (owns) {
      float dz[8], dx[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        dz[i] = rstd * (gdy[i] - sum_g - xhat[i] * sum_gx);
        dx[i] = dz[i] * s[i];
        acc[2][i] += dx[i];  // d_bias from the unrounded dx, as the twin
      }
      store8(a.dz + row_off, dz);
      store8(a.d_x + row_off, dx);
    }
    row_off += H;
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  cp_async_wait<0>();  // no copy outlives the block (a block with fewer rows than S - 1 issued only empty groups)
  // This block's column sums (zeros for a block without rows), as the row-group kernel writes them.
  if (!owns) return;
  float* out = a.partial + static_cast<int64_t>(blockIdx.x) * 3 * H;
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    *reinterpret_cast<float4*>(out + q * H + j0) = make_float4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
    *reinterpret_cast<float4*>(out + q * H + j0 + 4) = make_float4(acc[q][4], acc[q][5], acc[q][6], acc[q][7]);
  }
}

// ------------------------------------------------------------------------------------------------ column finish

// out_q[j] += sum over b < blocks of partial[b][q][j]. Block: 32 columns x kFinishSplit row slices; slice s sums the
// partial rows b = s, s + kFinishSplit, ... in increasing order, then the slices are added in slice order: a fixed
// order for a given `blocks`, and kFinishSplit x more loads in flight than one thread per column.
constexpr int kFinishCols = 32, kFinishSplit = 16;
__global__ void __launch_bounds__(kFinishCols * kFinishSplit) column_finish_kernel(const float* __restrict__ partial,
                                                                                int blocks, int H, int nacc,
                                                                                float* out0, float* out1,
                                                                                float* out2) {
  __shared__ float red[kFinishSplit][kFinishCols];
  const int tx = threadIdx.x % kFinishCols, ty = threadIdx.x / kFinishCols;
  const int col = blockIdx.x * kFinishCols + tx;  // over nacc * H
  const int64_t stride = static_cast<int64_t>(nacc) * H;
  float s = 0.0f;
  if (col < nacc * H) {
#pragma unroll 4
    for (int b = ty; b < blocks; b += kFinishSplit) s += partial[b * stride + col];
  }
  red[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || col >= nacc * H) return;
  const int q = col / H, j = col - q * H;
  float* out = q == 0 ? out0 : (q == 1 ? out1 : out2);
  if (out == nullptr) return;
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kFinishSplit; ++w) total += red[w][tx];
  out[j] += total;
}

template <LnKind K, int VPL, class E>
void launch_forward_vpl(const LnArgs<E>& a, cudaStream_t stream) {
  ln_forward_kernel<E, K, VPL><<<ceil_div(a.rows, kWarps), kWarps * 32, 0, stream>>>(a);
  NOPAD_CUDA_CHECK_LAUNCH();
}
template <LnKind K, int VPL, class E>
void launch_backward_vpl(const LnArgs<E>& a, int blocks, cudaStream_t stream) {
  ln_backward_kernel<E, K, VPL><<<blocks, kWarps * 32, 0, stream>>>(a);
  NOPAD_CUDA_CHECK_LAUNCH();
}

void check_hidden(int32_t H) {
  NOPAD_CHECK(H > 0 && H % 8 == 0 && H <= 1024, "CUDA LayerNorm kernels need hidden % 8 == 0 and hidden <= 1024, got ",
              H);
}

template <LnKind K, class E>
void dispatch_forward(const LnArgs<E>& a, cudaStream_t stream) {
  if (a.H <= 256)
    launch_forward_vpl<K, 1>(a, stream);
  else if (a.H <= 512)
    launch_forward_vpl<K, 2>(a, stream);
  else
    launch_forward_vpl<K, 4>(a, stream);
}
template <LnKind K, class E>
void dispatch_backward(const LnArgs<E>& a, int blocks, cudaStream_t stream) {
  if (a.H <= 256)
    launch_backward_vpl<K, 1>(a, blocks, stream);
  else if (a.H <= 512)
    launch_backward_vpl<K, 2>(a, blocks, stream);
  else
    launch_backward_vpl<K, 4>(a, blocks, stream);
}

// --- row-group launch geometry

// Vectors per thread: the variant's choice, or by H. Defaults (an informed guess until GPU timings decide): the
// forward keeps a whole row in one warp up to H = 1024 (no barrier per row; 32 floats of z per lane), the backward
// uses one vector per thread (128 threads per row at H = 1024), where its accumulators (8 features x 3) leave room for
// the prefetched row and many resident warps.
int rg_vectors(const LnVariant& v, int32_t H, bool backward) {
  int vec = v.vectors;
  if (vec == 0) vec = backward ? 1 : (H <= 256 ? 1 : (H <= 512 ? 2 : 4));
  NOPAD_CHECK(vec == 1 || vec == 2 || (vec == 4 && !backward),
              "LayerNorm row-group kernel: vectors per thread must be ",
              backward ? "1 or 2 in the backward" : "1, 2 or 4", ", got ", vec);
  return vec;
}
int rg_threads(int32_t H, int vec) { return 32 * ceil_div(H, 256 * vec); }  // <= 128 for H <= 1024

template <class E, LnKind K, int V>
const void* rg_kernel(bool backward) {
  if constexpr (V == 4)
    return reinterpret_cast<const void*>(&ln_forward_rg_kernel<E, K, V>);  // rg_vectors never gives the backward V = 4
  else
    return backward ? reinterpret_cast<const void*>(&ln_backward_rg_kernel<E, K, V>)
                    : reinterpret_cast<const void*>(&ln_forward_rg_kernel<E, K, V>);
}
template <class E>
const void* rg_kernel_for(LnKind kind, int vec, bool backward) {
#define NOPAD_RG_CASE(KIND)                                 \
  case KIND:                                                \
    return vec == 1   ? rg_kernel<E, KIND, 1>(backward)     \
           : vec == 2 ? rg_kernel<E, KIND, 2>(backward)     \
                      : rg_kernel<E, KIND, 4>(backward);
  switch (kind) {
    NOPAD_RG_CASE(LnKind::kPlain)
    NOPAD_RG_CASE(LnKind::kEmbed)
    NOPAD_RG_CASE(LnKind::kResidual)
  }
#undef NOPAD_RG_CASE
  return nullptr;
}

// Resident blocks per SM of `fn` at `threads` (cudaOccupancy*, a host query, cached in `slot`: once per kernel and
// block size); max_shared: the shared-memory carveout is set to its maximum first (kernels whose rings limit
// residency).
int cached_occupancy(std::atomic<int>& slot, const void* fn, int threads, bool max_shared) {
  int n = slot.load(std::memory_order_relaxed);
  if (n > 0) return n;
  if (max_shared)
    NOPAD_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  NOPAD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, 0));
  n = n > 0 ? n : 1;
  slot.store(n, std::memory_order_relaxed);
  return n;
}
// Most blocks of a grid whose blocks walk row ranges: blocks_per_sm x SMs, capped by residency `occ`; by default as
// many as fit, the backward at most 8 per SM (enough rows in flight, few partials).
int64_t block_cap(const LnVariant& v, int occ, bool backward, int sm_count) {
  const int per_sm = v.blocks_per_sm > 0 ? std::min(v.blocks_per_sm, occ) : (backward ? std::min(occ, 8) : occ);
  return static_cast<int64_t>(per_sm) * (sm_count > 0 ? sm_count : 1);
}
// Blocks of such a grid: at most max_blocks, each ceil(rows / blocks) rows, none without rows (rows > 0).
int row_range_grid(int64_t rows, int64_t max_blocks) {
  const int64_t blocks = std::min<int64_t>(rows, std::max<int64_t>(max_blocks, 1));
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  return static_cast<int>((rows + rows_per_block - 1) / rows_per_block);
}

// Resident blocks per SM of a row-group kernel (the element types' kernels are separate entries, as their register
// counts may differ).
template <class E>
int rg_occupancy(LnKind kind, int vec, bool backward, int threads) {
  static std::atomic<int> cache[3][3][2][5] = {};  // per E: kind, log2 vec, backward, threads / 32
  const int vi = vec == 1 ? 0 : (vec == 2 ? 1 : 2);
  return cached_occupancy(cache[static_cast<int>(kind)][vi][backward ? 1 : 0][threads / 32],
                          rg_kernel_for<E>(kind, vec, backward), threads, false);
}

// Blocks of a row-group grid (block_cap, row_range_grid).
template <class E>
int rg_blocks(LnKind kind, int32_t H, int64_t rows, const LnVariant& v, int sm_count, bool backward) {
  if (rows <= 0) return 1;
  const int vec = rg_vectors(v, H, backward);
  const int occ = rg_occupancy<E>(kind, vec, backward, rg_threads(H, vec));
  return row_range_grid(rows, block_cap(v, occ, backward, sm_count));
}

template <LnKind K, int V, class E>
void launch_rg(const LnArgs<E>& a, int blocks, bool backward, cudaStream_t stream) {
  const int threads = rg_threads(a.H, V);
  const int64_t rows_per_block = (a.rows + blocks - 1) / blocks;
  if constexpr (V != 4) {
    if (backward) {
      ln_backward_rg_kernel<E, K, V><<<blocks, threads, 0, stream>>>(a, rows_per_block);
      NOPAD_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  ln_forward_rg_kernel<E, K, V><<<blocks, threads, 0, stream>>>(a, rows_per_block);
  NOPAD_CUDA_CHECK_LAUNCH();
}
template <LnKind K, class E>
void dispatch_rg(const LnArgs<E>& a, int vec, int blocks, bool backward, cudaStream_t stream) {
  if (vec == 1)
    launch_rg<K, 1>(a, blocks, backward, stream);
  else if (vec == 2)
    launch_rg<K, 2>(a, blocks, backward, stream);
  else
    launch_rg<K, 4>(a, blocks, backward, stream);
}
template <class E>
void launch_row_group(LnKind kind, const LnArgs<E>& a, int vec, int blocks, bool backward, cudaStream_t stream) {
  switch (kind) {
    case LnKind::kPlain: dispatch_rg<LnKind::kPlain>(a, vec, blocks, backward, stream); break;
    case LnKind::kEmbed: dispatch_rg<LnKind::kEmbed>(a, vec, blocks, backward, stream); break;
    case LnKind::kResidual: dispatch_rg<LnKind::kResidual>(a, vec, blocks, backward, stream); break;
  }
}

// --- pipelined launch geometry (kResidual only)

bool use_pipe(LnKind kind, const LnVariant& v) {
  if (!v.row_group || v.stages == 0 || kind != LnKind::kResidual) return false;
  NOPAD_CHECK(v.stages >= 2 && v.stages <= 4, "pipelined LayerNorm kernel: stages must be 2, 3 or 4, got ", v.stages);
  NOPAD_CHECK(v.vectors == 0 || v.vectors == 1, "pipelined LayerNorm kernel: one vector per thread, got ", v.vectors);
  return true;
}
template <class E>
const void* pipe_kernel(int stages, bool backward) {
  switch (stages) {
    case 2: return backward ? reinterpret_cast<const void*>(&ln_backward_pipe_kernel<E, 2>)
                            : reinterpret_cast<const void*>(&ln_forward_pipe_kernel<E, 2>);
    case 3: return backward ? reinterpret_cast<const void*>(&ln_backward_pipe_kernel<E, 3>)
                            : reinterpret_cast<const void*>(&ln_forward_pipe_kernel<E, 3>);
    default: return backward ? reinterpret_cast<const void*>(&ln_backward_pipe_kernel<E, 4>)
                             : reinterpret_cast<const void*>(&ln_forward_pipe_kernel<E, 4>);
  }
}
// Blocks of a pipelined row-group grid (block_cap, row_range_grid; the rings are what limits residency).
template <class E>
int pipe_blocks(int32_t H, int64_t rows, const LnVariant& v, int sm_count, bool backward) {
  if (rows <= 0) return 1;
  static std::atomic<int> cache[3][2][5] = {};  // per E: stages - 2, backward, threads / 32
  const int threads = rg_threads(H, 1);
  const int occ = cached_occupancy(cache[v.stages - 2][backward ? 1 : 0][threads / 32],
                                   pipe_kernel<E>(v.stages, backward), threads, true);
  return row_range_grid(rows, block_cap(v, occ, backward, sm_count));
}
template <class E, int S>
void launch_pipe_s(const LnArgs<E>& a, int blocks, bool backward, cudaStream_t stream) {
  const int threads = rg_threads(a.H, 1);
  const int64_t rows_per_block = (a.rows + blocks - 1) / blocks;
  if (backward)
    ln_backward_pipe_kernel<E, S><<<blocks, threads, 0, stream>>>(a, rows_per_block);
  else
    ln_forward_pipe_kernel<E, S><<<blocks, threads, 0, stream>>>(a, rows_per_block);
  NOPAD_CUDA_CHECK_LAUNCH();
}
// The pipelined warp-per-row forward (kResidual, LnVariant{false, 0, blocks_per_sm, 2}).
bool use_pipe_warp(LnKind kind, const LnVariant& v) {
  if (v.row_group || v.stages == 0 || kind != LnKind::kResidual) return false;
  NOPAD_CHECK(v.stages == 2, "pipelined warp-per-row LayerNorm kernel: 2 stages only, got ", v.stages);
  return true;
}
template <class E, int VPL>
void launch_pipe_warp_vpl(const LnArgs<E>& a, const LnVariant& v, int sm_count, cudaStream_t stream) {
  static std::atomic<int> occupancy{0};  // per E and VPL
  const int occ = cached_occupancy(occupancy, reinterpret_cast<const void*>(&ln_forward_pipe_warp_kernel<E, VPL>),
                                   kWarps * 32, true);
  // At least one row per warp.
  const int64_t cap = std::min<int64_t>(ceil_div(a.rows, kWarps), block_cap(v, occ, false, sm_count));
  const int blocks = row_range_grid(a.rows, cap);
  const int64_t rows_per_block = (a.rows + blocks - 1) / blocks;
  ln_forward_pipe_warp_kernel<E, VPL><<<blocks, kWarps * 32, 0, stream>>>(a, rows_per_block);
  NOPAD_CUDA_CHECK_LAUNCH();
}
template <class E>
void launch_pipe_warp(const LnArgs<E>& a, const LnVariant& v, int sm_count, cudaStream_t stream) {
  if (a.H <= 256)
    launch_pipe_warp_vpl<E, 1>(a, v, sm_count, stream);
  else if (a.H <= 512)
    launch_pipe_warp_vpl<E, 2>(a, v, sm_count, stream);
  else
    launch_pipe_warp_vpl<E, 4>(a, v, sm_count, stream);
}

template <class E>
void launch_pipe(const LnArgs<E>& a, int stages, int blocks, bool backward, cudaStream_t stream) {
  if (stages == 2)
    launch_pipe_s<E, 2>(a, blocks, backward, stream);
  else if (stages == 3)
    launch_pipe_s<E, 3>(a, blocks, backward, stream);
  else
    launch_pipe_s<E, 4>(a, blocks, backward, stream);
}

}  // namespace

template <class E>
void launch_ln_forward(LnKind kind, const LnArgs<E>& a, const LnVariant& v, int sm_count, cudaStream_t stream) {
  check_hidden(a.H);
  if (a.rows <= 0) return;
  if (use_pipe(kind, v)) {
    launch_pipe(a, v.stages, pipe_blocks<E>(a.H, a.rows, v, sm_count, false), false, stream);
    return;
  }
  if (use_pipe_warp(kind, v)) {
    launch_pipe_warp(a, v, sm_count, stream);
    return;
  }
  if (v.row_group) {
    launch_row_group(kind, a, rg_vectors(v, a.H, false), rg_blocks<E>(kind, a.H, a.rows, v, sm_count, false), false,
                     stream);
    return;
  }
  switch (kind) {
    case LnKind::kPlain: dispatch_forward<LnKind::kPlain>(a, stream); break;
    case LnKind::kEmbed: dispatch_forward<LnKind::kEmbed>(a, stream); break;
    case LnKind::kResidual: dispatch_forward<LnKind::kResidual>(a, stream); break;
  }
}

template <class E>
int ln_backward_blocks(LnKind kind, int32_t H, int64_t rows, const LnVariant& v, int sm_count) {
  check_hidden(H);
  if (use_pipe(kind, v)) return pipe_blocks<E>(H, rows, v, sm_count, true);
  if (v.row_group) return rg_blocks<E>(kind, H, rows, v, sm_count, true);
  const int64_t wanted = (rows + kWarps - 1) / kWarps;
  const int64_t cap = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);  // a few rows per warp, small partials
  return static_cast<int>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

template <class E>
void launch_ln_backward(LnKind kind, const LnArgs<E>& a, const LnVariant& v, int blocks, cudaStream_t stream) {
  check_hidden(a.H);
  if (use_pipe(kind, v)) {
    NOPAD_CHECK(blocks >= 1, "LayerNorm backward with ", blocks, " blocks");
    launch_pipe(a, v.stages, blocks, true, stream);
    return;
  }
  if (v.row_group) {
    NOPAD_CHECK(blocks >= 1, "LayerNorm backward with ", blocks, " blocks");
    launch_row_group(kind, a, rg_vectors(v, a.H, true), blocks, true, stream);
    return;
  }
  switch (kind) {
    case LnKind::kPlain: dispatch_backward<LnKind::kPlain>(a, blocks, stream); break;
    case LnKind::kEmbed: dispatch_backward<LnKind::kEmbed>(a, blocks, stream); break;
    case LnKind::kResidual: dispatch_backward<LnKind::kResidual>(a, blocks, stream); break;
  }
}

// The launchers of both element types.
#define NOPAD_LN_INSTANTIATE(E)                                                                                   \
  template void launch_ln_forward<E>(LnKind, const LnArgs<E>&, const LnVariant&, int, cudaStream_t);              \
  template int ln_backward_blocks<E>(LnKind, int32_t, int64_t, const LnVariant&, int);                            \
  template void launch_ln_backward<E>(LnKind, const LnArgs<E>&, const LnVariant&, int, cudaStream_t);
NOPAD_LN_INSTANTIATE(bf)
NOPAD_LN_INSTANTIATE(hf)
#undef NOPAD_LN_INSTANTIATE

void launch_column_finish(const float* partial, int blocks, int H, int nacc, float* out0, float* out1, float* out2,
                          cudaStream_t stream) {
  if (H <= 0 || blocks <= 0) return;
  column_finish_kernel<<<ceil_div(int64_t{nacc} * H, kFinishCols), kFinishCols * kFinishSplit, 0, stream>>>(
      partial, blocks, H, nacc, out0, out1, out2);
  NOPAD_CUDA_CHECK_LAUNCH();
}

}  // namespace nopad::cuda
