// FMHA backward (FlashAttention-2 style):
//   1. fmha_bwd_pre_kernel: D = rowsum(dO * O) / keep_scale and lse * log2(e) per (head, token) into the workspace;
//      zeroes the launch's dq_accum rows.
//   2. main kernel, one CTA per (key tile, head, sequence), looping over the query tiles of 64 (Q, dO, lse and D
//      double-buffered with cp.async), recomputing P, regenerating the dropout mask (one Philox block per 8 keys of a
//      query, bits exchanged over 8 lanes), accumulating dK, dV in registers and adding dQ into fp32 dq_accum:
//      fmha_bwd_kernel (mma.sync, any GPU; tile shapes per variant) or fmha_bwd_wgmma_kernel (head_dim 64 on sm_90a;
//      dQ by float4 atomics, or by one bulk reduction per query row from shared memory). fmha_bwd_wsq_kernel (`ws128q`,
//      head_dim 64 on sm_90a, the default there) is persistent and warp-specialised instead: 128 keys per item on two
//      consumer warpgroups against 128-query tiles from a producer warpgroup, dQ sent by tensor-map reductions. The
//      variants of kBwdVariants are instantiated and chosen per call (fmha.h).
//   3. fmha_bwd_dq_kernel:  dq_accum -> d_qkv's q block (bf16/fp16); with FmhaParams::d_qkv_bias,
//      fmha_bwd_dq_bias_kernel, which also adds the q block's column sums (the main kernels add the v block's; the k
//      bias has no gradient, fmha.h).
// Workspace: dq_accum [T, H] fp32, ws128q's item counters [T + 1] int32 (the region the first pass zeroes, first so
// that its extent depends on T and H alone: fmha_backward_workspace_layout), then (256-byte aligned) D [heads, T] fp32
// and lse2 [heads, T] fp32; T = the query rows (FmhaParams::num_q_tokens when the queries are a subset of the rows).
// Design: docs/fmha.md.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ops/cuda/fmha_common.cuh"
#include "ops/cuda/fmha_wgmma.cuh"
#include "ops/cuda/fmha_wsq_barriers.h"
#include "ops/cuda/tensor_map.h"

namespace nopad::cuda {
namespace fmha_detail {

__host__ __device__ inline size_t lse2_offset(int32_t num_tokens, int32_t num_heads) {  // in floats, from D
  return static_cast<size_t>(num_heads) * static_cast<size_t>(num_tokens);
}
// The work-item counters of the persistent backward (`ws128q`), [num_tokens + 1] ints after dq_accum (at 0): a launch
// uses the slot of its first sequence's start s0 (launches running at one time on one workspace cover different
// sequences, and planned launches hold no empty ones, so their first starts differ); the pre kernel zeroes it.
__host__ __device__ inline size_t item_counter_offset(int32_t num_tokens, int32_t num_heads, int32_t head_dim) {
  return static_cast<size_t>(num_tokens) * static_cast<size_t>(num_heads) * static_cast<size_t>(head_dim) * 4;
}
// The end of the zeroed region (dq_accum and the counters), and D's offset after it.
__host__ __device__ inline size_t zero_region_bytes(int32_t num_tokens, int32_t num_heads, int32_t head_dim) {
  return item_counter_offset(num_tokens, num_heads, head_dim) + (static_cast<size_t>(num_tokens) + 1) * sizeof(int);
}
__host__ __device__ inline size_t d_offset(int32_t num_tokens, int32_t num_heads, int32_t head_dim) {
  return (zero_region_bytes(num_tokens, num_heads, head_dim) + 255) / 256 * 256;
}
// Only launches without query rows (FmhaParams::q_cu_seqlens null) use the counters.
__device__ inline int* item_counter(const FmhaParams& p) {
  int b, s0, L;
  launch_sequence(p, 0, b, s0, L);
  return reinterpret_cast<int*>(static_cast<char*>(p.workspace) +
                                item_counter_offset(p.num_tokens, p.num_heads, p.head_dim)) +
         s0;
}

constexpr int kPreRows = 8;  // rows per CTA of the pre/post kernels (one warp each)

// D[h, t] = sum_d dO[t, h*hd + d] * O[t, h*hd + d] / keep_scale; lse2[h, t] = lse[h, t] * log2(e); dq_accum[t, :] = 0.
// One warp per token row; lanes take 16-byte chunks, the hd/8 lanes of one head reduce with shuffles. D is divided by
// the keep-scale c (an exact multiplication by (256 - threshold) / 256) so that p_and_ds can leave c out of every
// score: the main kernel applies it once to dK, dV and dQ.
template <bool kFp16>
__global__ void __launch_bounds__(32 * kPreRows) fmha_bwd_pre_kernel(const KernelArgs args, float* D, float* dq_acc) {
  const FmhaParams& p = args.p;
  int b, s0, L, qs0, Lq;
  launch_sequence(p, static_cast<int>(blockIdx.y), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && p.q_cu_seqlens == nullptr) *item_counter(p) = 0;
  const int row = static_cast<int>(blockIdx.x) * kPreRows + warp;
  if (row >= Lq) return;  // warp-uniform
  const int hd = p.head_dim, H = p.num_heads * hd, chunks = H / 8, per_head = hd / 8;
  const int32_t Tq = query_tokens(p);
  const int64_t tok = qs0 + row;  // the query's row of ctx, d_ctx, lse and the workspace
  const uint4* o = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.ctx) + tok * H);
  const uint4* d_o = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.d_ctx) + tok * H);
  for (int base = 0; base < chunks; base += 32) {  // uniform trip count: every lane joins the shuffles
    const int c = base + lane;
    float sum = 0.0f;
    if (c < chunks) {
      const uint4 x = o[c], y = d_o[c];
      const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sum += to_f32<kFp16>(static_cast<uint16_t>(xs[i])) * to_f32<kFp16>(static_cast<uint16_t>(ys[i]));
        sum += to_f32<kFp16>(static_cast<uint16_t>(xs[i] >> 16)) * to_f32<kFp16>(static_cast<uint16_t>(ys[i] >> 16));
      }
    }
    for (int off = per_head / 2; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (c < chunks && c % per_head == 0) {
      const int64_t i = int64_t{c / per_head} * Tq + tok;
      D[i] = sum * args.inv_keep_scale;
      D[lse2_offset(Tq, p.num_heads) + i] = p.lse[i] * kLog2e;
    }
  }
  float4* dq = reinterpret_cast<float4*>(dq_acc + tok * H);
  for (int c = lane; c < H / 4; c += 32) dq[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// d_qkv[t, 0:H] = dq_accum[t, :] (the scale is already applied), rounded to 16 bits. With query rows
// (FmhaParams::q_cu_seqlens) dq_accum's row i goes to the d_qkv row of query i's position.
template <bool kFp16>
__global__ void __launch_bounds__(32 * kPreRows) fmha_bwd_dq_kernel(const KernelArgs args, const float* dq_acc) {
  const FmhaParams& p = args.p;
  int b, s0, L, qs0, Lq;
  launch_sequence(p, static_cast<int>(blockIdx.y), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * kPreRows + warp;
  if (row >= Lq) return;
  const int H = p.num_heads * p.head_dim;
  const float4* src = reinterpret_cast<const float4*>(dq_acc + int64_t{qs0 + row} * H);
  const int64_t tok = s0 + query_position(p, qs0, Lq, row);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.d_qkv) + tok * 3 * H);
  for (int c = lane; c < H / 8; c += 32) {
    const float4 a = src[2 * c], bb = src[2 * c + 1];
    dst[c] = make_uint4(pack2<kFp16>(a.x, a.y), pack2<kFp16>(a.z, a.w), pack2<kFp16>(bb.x, bb.y),
                        pack2<kFp16>(bb.z, bb.w));
  }
}

// With the bias gradient (p.d_qkv_bias): the same conversion over kDqBiasRows rows per CTA, column-major: thread i
// owns the 8-column chunk i % (H / 8) and every (256 / (H / 8))-th row from i / (H / 8) on (the threads of one phase
// read consecutive chunks of one row: coalesced), four rows' loads issued before their use; it sums the rounded
// values of its rows per column in registers, the phases' sums meet in shared memory, and one fp32 atomic per column
// and CTA adds them into d_qkv_bias[0, H). No shared-memory atomics. Needs H <= 8 * kDqBiasThreads
// (fmha_backward_bias_supported).
constexpr int kDqBiasRows = 64;
constexpr int kDqBiasThreads = 256;
template <bool kFp16>
__global__ void __launch_bounds__(kDqBiasThreads) fmha_bwd_dq_bias_kernel(const KernelArgs args,
                                                                          const float* __restrict__ dq_acc) {
  const FmhaParams& p = args.p;
  int b, s0, L, qs0, Lq;
  launch_sequence(p, static_cast<int>(blockIdx.y), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int row0 = static_cast<int>(blockIdx.x) * kDqBiasRows;
  if (row0 >= Lq) return;  // CTA-uniform: a tile past this sequence's last query
  __shared__ __align__(16) float red[kDqBiasThreads * 8];  // [phase][H]
  const int tid = static_cast<int>(threadIdx.x);
  const int H = p.num_heads * p.head_dim, chunks = H / 8, phases = kDqBiasThreads / chunks;
  const int chunk = tid % chunks, phase = tid / chunks;
  const int row_end = min(Lq, row0 + kDqBiasRows);
  float sum[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) sum[e] = 0.0f;
  uint16_t* __restrict__ d_qkv = static_cast<uint16_t*>(p.d_qkv);
  if (phase < phases) {
    constexpr int kBatch = 4;  // rows whose loads are in flight together
    for (int r = row0 + phase; r < row_end; r += kBatch * phases) {
      float4 v[kBatch][2];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int row = r + j * phases;
        if (row < row_end) {
          const float4* src = reinterpret_cast<const float4*>(dq_acc + int64_t{qs0 + row} * H) + 2 * chunk;
          v[j][0] = src[0];
          v[j][1] = src[1];
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int row = r + j * phases;
        if (row < row_end) {
          const uint32_t w[4] = {pack2<kFp16>(v[j][0].x, v[j][0].y), pack2<kFp16>(v[j][0].z, v[j][0].w),
                                 pack2<kFp16>(v[j][1].x, v[j][1].y), pack2<kFp16>(v[j][1].z, v[j][1].w)};
          const int64_t tok = s0 + query_position(p, qs0, Lq, row);
          *reinterpret_cast<uint4*>(d_qkv + tok * 3 * H + 8 * chunk) = make_uint4(w[0], w[1], w[2], w[3]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sum[2 * e] += to_f32<kFp16>(static_cast<uint16_t>(w[e]));
            sum[2 * e + 1] += to_f32<kFp16>(static_cast<uint16_t>(w[e] >> 16));
          }
        }
      }
    }
    float4* mine = reinterpret_cast<float4*>(red + phase * H + 8 * chunk);
    mine[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
    mine[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
  }
  __syncthreads();
  for (int c = tid; c < H; c += kDqBiasThreads) {
    float total = 0.0f;
    for (int ph = 0; ph < phases; ++ph) total += red[ph * H + c];
    atomicAdd(p.d_qkv_bias + c, total);
  }
}

// ------------------------------------------------------------------------------------------------ per-warp steps
// What both backward kernels (mma.sync and wgmma) do with one warp's 16 keys x 64 queries of a query tile, in the
// transposed orientation (rows = keys g, g + 8; columns = queries 8 nt + 2t + {0, 1}; g = lane / 4, t = lane % 4).

// lse2 and D of query tile rows [qs, qs + 64) (as the pre kernel wrote them) into the shared tiles (thread tid < 64
// copies row tid) by 4-byte cp.async, in the commit group of the tile's Q/dO copies: a plain load here would hold the
// loading warps for an L2 round trip every tile, and the others at the next barrier. Rows past the sequence end are
// zero, and such queries contribute nothing: their Q and dO rows are zero-filled and D is 0, so their dS and P' dO
// are 0 (and their dQ rows are never stored).
__device__ __forceinline__ void stage_lse_d(float* s_lse, float* s_d, const float* g_lse, const float* g_d, int qs,
                                            int L, int tid) {
  if (tid >= kTile) return;
  const bool ok = qs + tid < L;
  cp_async4(s_lse + tid, g_lse + (ok ? qs + tid : 0), ok);
  cp_async4(s_d + tid, g_d + (ok ? qs + tid : 0), ok);
}

// In place, with the keep-scale c left out (applied once to dK, dV and dQ by the callers): s (S^T) becomes
// P'^T / c = P^T m, dp (dP^T) becomes dS^T / c = P^T m dP^T - P^T D / c, with P^T = exp2(S^T scale log2e - lse2)
// (lse2_tile and Dq as stage_lse_d leaves them: lse2 = lse log2e, Dq = D / c). After the keep-bit test, five
// instructions per element with dropout (exp2 argument, exp2, the keep select, P^T D / c, one FFMA) where the scaled
// form needs six, and the lse scaling moves to the pre kernel. Keys past the end (key_ok) give 0. The one keep mask
// (bit fmha_dropout::bwd_bit(nt, e)) serves both P' (for dV) and dP' (for dS).
template <bool kDrop>
__device__ __forceinline__ void p_and_ds(const KernelArgs& args, float (&s)[kTile / 8][4], float (&dp)[kTile / 8][4],
                                         uint32_t keep, bool key_ok0, bool key_ok1, const float* lse2_tile,
                                         const float* Dq, int t) {
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt) {
    // This thread's two query columns 8 nt + 2t, + 1: one 8-byte shared load each for lse2 and D (the tiles are
    // 8-byte aligned).
    const float2 lse_pair = *reinterpret_cast<const float2*>(lse2_tile + nt * 8 + 2 * t);
    const float2 d_pair = *reinterpret_cast<const float2*>(Dq + nt * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = (e < 2) ? key_ok0 : key_ok1;
      const float lse2 = (e & 1) ? lse_pair.y : lse_pair.x;
      const float d = (e & 1) ? d_pair.y : d_pair.x;
      const float pr = ok ? exp2_ftz(fmaf(s[nt][e], args.scale_log2, -lse2)) : 0.0f;
      const float pm = kDrop ? (((keep >> fmha_dropout::bwd_bit(nt, e)) & 1u) ? pr : 0.0f) : pr;
      s[nt][e] = pm;                              // P' / c (for dV)
      dp[nt][e] = fmaf(pm, dp[nt][e], -pr * d);  // dS / c
    }
  }
}

// dS^T fragment da (k-step kk: queries 16 kk .. +15 of this warp's keys wrow + g, + 8) into the shared dS^T tile
// (rows = keys, columns = queries, swizzled as a 64-column tile) for dQ = dS K.
__device__ __forceinline__ void store_ds_t(uint16_t* sdS, int wrow, int g, int t, int kk, const uint32_t (&da)[4]) {
  *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g, 2 * kk) + 2 * t) = da[0];
  *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g + 8, 2 * kk) + 2 * t) = da[1];
  *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g, 2 * kk + 1) + 2 * t) = da[2];
  *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g + 8, 2 * kk + 1) + 2 * t) = da[3];
}

// One n-tile of dQ accumulators (m16n8 C fragment: rows g, g + 8; columns 2t, 2t + 1), scaled, regrouped so that each
// lane holds 4 consecutive columns of one row: lanes t and t^1 swap half their values (two shfl.xor 1); the even lane
// (odd = false) gets row g, columns 4 (t >> 1) .. + 3 of the n-tile, the odd lane row g + 8. Warp-collective.
__device__ __forceinline__ float4 dq_row_quad(const float (&dq)[4], float scale, bool odd) {
  const float r0 = __shfl_xor_sync(0xffffffffu, odd ? dq[0] : dq[2], 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, odd ? dq[1] : dq[3], 1);
  return odd ? make_float4(r0 * scale, r1 * scale, dq[2] * scale, dq[3] * scale)
             : make_float4(dq[0] * scale, dq[1] * scale, r0 * scale, r1 * scale);
}

// dq_acc[query rows qr0 = q + g and qr1 = qr0 + 8, columns col .. col + 8 kQTiles) += scale * dq (m16n8 C fragments,
// rows past the end skipped; scale = KernelArgs::grad_scale). On sm_90 each lane holds 4 consecutive columns of one row
// (dq_row_quad): one 16-byte atomic instead of four 4-byte ones.
template <int kQTiles>
__device__ __forceinline__ void add_dq(const FmhaParams& p, float* dq_acc, const float (&dq)[kQTiles][4], float scale,
                                       int s0, int qr0, int L, int col, int t) {
  const int H = p.num_heads * p.head_dim, qr1 = qr0 + 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool odd = (t & 1) != 0;
  const int qr = odd ? qr1 : qr0;
  float* dst_row = dq_acc + int64_t{s0 + qr} * H + col + 4 * (t >> 1);
#pragma unroll
  for (int n = 0; n < kQTiles; ++n) {
    const float4 v = dq_row_quad(dq[n], scale, odd);
    if (qr < L) atomicAdd(reinterpret_cast<float4*>(dst_row + n * 8), v);
  }
#else
#pragma unroll
  for (int n = 0; n < kQTiles; ++n) {
    const int c = col + n * 8 + 2 * t;
    if (qr0 < L) {
      float* dst = dq_acc + int64_t{s0 + qr0} * H + c;
      atomicAdd(dst, dq[n][0] * scale);
      atomicAdd(dst + 1, dq[n][1] * scale);
    }
    if (qr1 < L) {
      float* dst = dq_acc + int64_t{s0 + qr1} * H + c;
      atomicAdd(dst, dq[n][2] * scale);
      atomicAdd(dst + 1, dq[n][3] * scale);
    }
  }
#endif
}

// dK * dk_scale and dV * dv_scale (KernelArgs::grad_scale, keep_scale) of keys kr0 = k + g and kr0 + 8 (m16n8 C
// fragments over the head dims) into d_qkv's k and v blocks; keys past the end are not stored. colsum[n] receives
// this thread's share of the v bias gradient: the stored (16-bit) dV values of its rows summed per column, {dV column
// 8n + 2t, dV 8n + 2t + 1} (0 for rows past the end). The k bias has no gradient (fmha.h), so dK is not summed.
template <int HD, bool kFp16>
__device__ __forceinline__ void store_dk_dv(const FmhaParams& p, const float (&dk)[HD / 8][4],
                                            const float (&dv)[HD / 8][4], float dk_scale, float dv_scale, int s0,
                                            int kr0, int L, int head, int t, float (&colsum)[HD / 8][2]) {
  uint16_t* dqkv = static_cast<uint16_t*>(p.d_qkv);
  const int H = p.num_heads * HD, kr1 = kr0 + 8;
  const int64_t ld = 3 * int64_t{H};
  const auto lo = [](uint32_t x) { return to_f32<kFp16>(static_cast<uint16_t>(x)); };
  const auto hi = [](uint32_t x) { return to_f32<kFp16>(static_cast<uint16_t>(x >> 16)); };
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    const int col = head * HD + n * 8 + 2 * t;
    colsum[n][0] = colsum[n][1] = 0.0f;
    if (kr0 < L) {
      uint16_t* row = dqkv + int64_t{s0 + kr0} * ld;
      const uint32_t k2 = pack2<kFp16>(dk[n][0] * dk_scale, dk[n][1] * dk_scale);
      const uint32_t v2 = pack2<kFp16>(dv[n][0] * dv_scale, dv[n][1] * dv_scale);
      *reinterpret_cast<uint32_t*>(row + H + col) = k2;
      *reinterpret_cast<uint32_t*>(row + 2 * H + col) = v2;
      colsum[n][0] = lo(v2);
      colsum[n][1] = hi(v2);
    }
    if (kr1 < L) {
      uint16_t* row = dqkv + int64_t{s0 + kr1} * ld;
      const uint32_t k2 = pack2<kFp16>(dk[n][2] * dk_scale, dk[n][3] * dk_scale);
      const uint32_t v2 = pack2<kFp16>(dv[n][2] * dv_scale, dv[n][3] * dv_scale);
      *reinterpret_cast<uint32_t*>(row + H + col) = k2;
      *reinterpret_cast<uint32_t*>(row + 2 * H + col) = v2;
      colsum[n][0] += lo(v2);
      colsum[n][1] += hi(v2);
    }
  }
}

// One stage of dv_bias_scatter's reduce-scatter: the lane keeps the upper kHalf of v[0, 2 kHalf) if its lane bit kBit
// is set, else the lower, and adds the partner's (lane ^ kBit) copy of that half.
template <int kHalf, int kBit, int kN>
__device__ __forceinline__ void dv_bias_stage(float (&v)[kN], int lane) {
  const bool upper = (lane & kBit) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float keep = upper ? v[kHalf + i] : v[i], send = upper ? v[i] : v[kHalf + i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kBit);
  }
}

// The warp's sums of the v bias gradient: every lane's colsum from store_dk_dv, summed over the 8 rows g of the warp
// by a reduce-scatter over the 8 lanes of each t (lane bits 2..4): at each of 3 stages a lane keeps the half of its
// values that its lane bit selects and adds the partner's copy of that half, so lane (g, t) ends with v[j] =
// flat value i = (HD / 32) g + j (i = 2 n + e of colsum[n][e]: column dv_bias_col), after HD / 8 + HD / 16 + HD / 32
// shuffles. At HD >= 64, v[j] and v[j + 1] (j even) are the adjacent columns c, c + 1.
template <int HD>
__device__ __forceinline__ void dv_bias_scatter(const float (&colsum)[HD / 8][2], int lane, float (&v)[HD / 4]) {
  constexpr int kVals = HD / 4;  // 2 per n-tile
  static_assert(kVals % 8 == 0, "the reduce-scatter needs HD a multiple of 32");
#pragma unroll
  for (int i = 0; i < kVals; ++i) v[i] = colsum[i / 2][i % 2];
  dv_bias_stage<kVals / 2, 16>(v, lane);  // each stage's half a constant: with the half computed from a loop counter,
  dv_bias_stage<kVals / 4, 8>(v, lane);   // nvcc did not unroll the inner loop and kept v in local memory (64 bytes of
  dv_bias_stage<kVals / 8, 4>(v, lane);   // stack in ws128q, ~2,000 ncu stall samples per launch)
}

template <int HD>
__device__ __forceinline__ int dv_bias_col(int j, int lane) {
  const int i = (HD / 32) * (lane >> 2) + j;
  return (i / 2) * 8 + 2 * (lane & 3) + i % 2;
}

// The warp's v bias sums (p.d_qkv_bias set) straight into d_qkv_bias by fp32 reductions in the L2, two columns per
// instruction where HD allows. No shared memory and no barrier: a warp adds its sums as soon as its keys are stored,
// so no other warp (in ws128q, not the other consumer) waits for it. Summing a ws128q consumer's 4 warps in shared
// memory first (4x fewer L2 reductions, one barrier per item) was slower: docs/performance.md.
template <int HD>
__device__ __forceinline__ void add_dv_bias(const FmhaParams& p, const float (&colsum)[HD / 8][2], int head,
                                            int lane) {
  float v[HD / 4];
  dv_bias_scatter<HD>(colsum, lane, v);
  float* vbias = p.d_qkv_bias + 2 * p.num_heads * HD + head * HD;
  if constexpr (HD >= 64) {
#pragma unroll
    for (int j = 0; j < HD / 32; j += 2) red_add2(vbias + dv_bias_col<HD>(j, lane), v[j], v[j + 1]);
  } else {
    atomicAdd(vbias + dv_bias_col<HD>(0, lane), v[0]);
  }
}

// kWarps warps x 16 keys per CTA; the query tiles are 64 wide.
template <int HD, int kWarps>
struct BwdShape {
  static constexpr int kBlockN = 16 * kWarps;   // keys per CTA
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kDqParts = kWarps / 4;   // dQ: warps w and w + 4 (8 warps) split one 16-query group's head dims
  static constexpr int kDqCols = HD / kDqParts;  // head dims of dQ per warp
  static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps");
  // K, V (kBlockN x HD), Q x2, dO x2 (64 x HD), dS^T (kBlockN x 64), all 16-bit; lse x2 and D x2 (fp32).
  static constexpr int kSmemBytes = (2 * kBlockN * HD + 4 * kTile * HD + kBlockN * kTile) * 2 + 4 * kTile * 4;
};

template <int HD, int kWarps, int kMinCtas, bool kFp16, bool kDrop>
__global__ void __launch_bounds__(32 * kWarps, kMinCtas)
    fmha_bwd_kernel(const __grid_constant__ KernelArgs args, const float* D, float* dq_acc) {
  using Sh = BwdShape<HD, kWarps>;
  constexpr int kKSteps = HD / 16;
  constexpr int kDTiles = HD / 8;
  constexpr int kNTiles = kTile / 8;  // n-tiles of S^T over the query tile
  const FmhaParams& p = args.p;

  int b, s0, L, qs0, Lq;  // keys: rows [s0, s0 + L) of qkv; queries: [qs0, qs0 + Lq) of the query matrices
  launch_sequence(p, static_cast<int>(blockIdx.z), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int k0 = static_cast<int>(blockIdx.x) * Sh::kBlockN;
  if (k0 >= L) return;
  const int head = static_cast<int>(blockIdx.y);
  const int H = p.num_heads * HD, T = query_tokens(p);
  const int64_t ld = 3 * int64_t{H};
  const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);
  const uint16_t* gQ = query_source(p) + int64_t{qs0} * ld + head * HD;  // the Q/dO tile last issued
  const uint16_t* gdO = static_cast<const uint16_t*>(p.d_ctx) + int64_t{qs0} * H + head * HD;
  const float* gLse = D + lse2_offset(T, p.num_heads) + int64_t{head} * T + qs0;  // lse * log2(e)
  const float* gD = D + int64_t{head} * T + qs0;

  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sK = smem;                              // [kBlockN][HD]
  uint16_t* sV = sK + Sh::kBlockN * HD;             // [kBlockN][HD]
  uint16_t* sQ = sV + Sh::kBlockN * HD;             // [2][64][HD]
  uint16_t* sdO = sQ + 2 * kTile * HD;              // [2][64][HD]
  uint16_t* sdS = sdO + 2 * kTile * HD;             // [kBlockN keys][64 queries], swizzled as a 64-column tile
  float* sLse = reinterpret_cast<float*>(sdS + Sh::kBlockN * kTile);  // [2][64], lse * log2(e); 0 past the end
  float* sD = sLse + 2 * kTile;                                        // [2][64]

  const int tid = static_cast<int>(threadIdx.x);
  const TileCopy<HD, kTile, Sh::kThreads> q_copy(ld), do_copy(H);
  // Issues the copies of query tile i (its first row at gQ / gdO) into buffer buf.
  const auto load_q_tile = [&](int i, int buf) {
    const int qs = i * kTile;
    q_copy.load(sQ + buf * kTile * HD, gQ, Lq - qs);
    do_copy.load(sdO + buf * kTile * HD, gdO, Lq - qs);
    stage_lse_d(sLse + buf * kTile, sD + buf * kTile, gLse, gD, qs, Lq, tid);
  };
  {
    const TileCopy<HD, Sh::kBlockN, Sh::kThreads> kv_copy(ld);
    const uint16_t* gK = qkv + int64_t{s0 + k0} * ld + H + head * HD;
    kv_copy.load(sK, gK, L - k0);
    kv_copy.load(sV, gK + H, L - k0);
  }
  load_q_tile(0, 0);
  cp_async_commit();

  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16;  // this warp's first key within the K tile
  // A warp whose 16 keys all lie past the end skips its products (warp-uniform) and joins the barriers only.
  const bool keys_live = k0 + wrow < L;
  const bool key_ok0 = k0 + wrow + g < L, key_ok1 = k0 + wrow + g + 8 < L;
  // k-steps (16 keys) of the dQ product that hold keys < L: the dS^T rows of dead warps are never written or read.
  const int dq_ksteps = min(Sh::kBlockN / 16, (L - k0 + 15) / 16);
  const int dq_qgroup = warp & 3;                       // dQ: this warp's 16 queries of the tile
  const int dq_col0 = (warp >> 2) * Sh::kDqCols;        // and its first head dim

  const MaskDraw draw = mask_draw<kDrop>(args, b);

  float dv[kDTiles][4], dk[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.0f;

  // One query tile. kPartial: fewer than 64 valid queries (the sequence's last tile): 16-query groups past the end skip
  // their products (dV, dK and dQ never read their P' or dS). Full tiles carry no such code.
  const auto tile = [&](int qs, int buf, auto partial) {
    constexpr bool kPartial = decltype(partial)::value;
    const int qvalid = Lq - qs;  // > 0; < 64 only when kPartial
    const uint16_t* q = sQ + buf * kTile * HD;
    const uint16_t* d_o = sdO + buf * kTile * HD;
    const float* lse2 = sLse + buf * kTile;
    const float* Dq = sD + buf * kTile;

    if (keys_live) {
      // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x 64 queries.
      float s[kNTiles][4], dp[kNTiles][4];
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t ka[4], va[4];
        const int a_off = swz<HD>(wrow + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4));
        ldmatrix_x4(ka, sK + a_off);
        ldmatrix_x4(va, sV + a_off);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          if (kPartial && np * 16 >= qvalid) continue;  // all 16 queries past the end
          const int b_off = swz<HD>(np * 16 + (lane & 7) + (lane >> 4) * 8, kk * 2 + ((lane >> 3) & 1));
          uint32_t r[4];
          ldmatrix_x4(r, q + b_off);
          mma16816<kFp16>(s[2 * np], ka, r[0], r[1]);
          mma16816<kFp16>(s[2 * np + 1], ka, r[2], r[3]);
          ldmatrix_x4(r, d_o + b_off);
          mma16816<kFp16>(dp[2 * np], va, r[0], r[1]);
          mma16816<kFp16>(dp[2 * np + 1], va, r[2], r[3]);
        }
      }

      // Keep mask of this tile, bit fmha_dropout::bwd_bit(nt, e) for accumulator element e of n-tile nt. Independent
      // of S and dP, so the scheduler interleaves its integer work with the MMAs above.
      uint32_t keep = 0;
      if constexpr (kDrop) {
        const int qc = qs + 8 * g + 2 * t;  // this lane's two query columns qc, qc + 1 draw the blocks
        keep = lane_transpose<2, 2>(
            fmha_dropout::bwd_lane_bits_at(draw, args.threshold, static_cast<uint32_t>(head),
                                           query_position(p, qs0, Lq, qc), query_position(p, qs0, Lq, qc + 1),
                                           static_cast<uint32_t>(k0 + wrow)),
            static_cast<uint32_t>(g));
      }

      p_and_ds<kDrop>(args, s, dp, keep, key_ok0, key_ok1, lse2, Dq, t);

      // dV += P'^T dO, dK += dS^T Q: the accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        if (kPartial && kk * 16 >= qvalid) continue;  // P' and dS are zero there; dQ skips these queries too
        uint32_t pa[4], da[4];
        a_fragment<kFp16>(s, kk, pa);
        a_fragment<kFp16>(dp, kk, da);
#pragma unroll
        for (int d2 = 0; d2 < HD / 16; ++d2) {
          const int off = swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, d2 * 2 + (lane >> 4));
          uint32_t r[4];
          ldmatrix_x4_trans(r, d_o + off);
          mma16816<kFp16>(dv[2 * d2], pa, r[0], r[1]);
          mma16816<kFp16>(dv[2 * d2 + 1], pa, r[2], r[3]);
          ldmatrix_x4_trans(r, q + off);
          mma16816<kFp16>(dk[2 * d2], da, r[0], r[1]);
          mma16816<kFp16>(dk[2 * d2 + 1], da, r[2], r[3]);
        }
        store_ds_t(sdS, wrow, g, t, kk, da);
      }
    }
    __syncthreads();  // all of dS^T written

    // dQ (16 queries x kDqCols head dims per warp) = dS K over the keys < L; A = dS read transposed from dS^T.
    if (kPartial && dq_qgroup * 16 >= qvalid) return;  // these 16 queries do not exist
    constexpr int kQTiles = Sh::kDqCols / 8;
    float dq[kQTiles][4];
#pragma unroll
    for (int n = 0; n < kQTiles; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < Sh::kBlockN / 16; ++kk) {
      if (kk >= dq_ksteps) break;
      uint32_t a[4];
      ldmatrix_x4_trans(a, sdS + swz<64>(kk * 16 + (lane & 7) + (lane >> 4) * 8, dq_qgroup * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int d2 = 0; d2 < Sh::kDqCols / 16; ++d2) {
        uint32_t r[4];
        ldmatrix_x4_trans(
            r, sK + swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dq_col0 / 8 + d2 * 2 + (lane >> 4)));
        mma16816<kFp16>(dq[2 * d2], a, r[0], r[1]);
        mma16816<kFp16>(dq[2 * d2 + 1], a, r[2], r[3]);
      }
    }
    add_dq<kQTiles>(p, dq_acc, dq, args.grad_scale, qs0, qs + dq_qgroup * 16 + g, Lq, head * HD + dq_col0, t);
  };

  const int num_qt = (Lq + kTile - 1) / kTile;
  for (int i = 0; i < num_qt; ++i) {
    const int buf = i & 1, qs = i * kTile;
    cp_async_wait<0>();
    __syncthreads();  // tile i (and its lse/D) visible; every warp done with tile i-1's buffers and with sdS
    if (i + 1 < num_qt) {
      gQ += kTile * ld;  // now tile i + 1's
      gdO += kTile * int64_t{H};
      load_q_tile(i + 1, buf ^ 1);
    }
    cp_async_commit();
    if (qs + kTile <= Lq) {
      tile(qs, buf, std::false_type{});
    } else {
      tile(qs, buf, std::true_type{});
    }
  }

  // dK (scaled) and dV into d_qkv's k and v blocks, rows of this warp's keys that exist (a dead warp stores nothing
  // and adds zeros to the bias gradient).
  float colsum[kDTiles][2];
  store_dk_dv<HD, kFp16>(p, dk, dv, args.grad_scale, args.keep_scale, s0, k0 + wrow + g, L, head, t, colsum);
  if (p.d_qkv_bias != nullptr) add_dv_bias<HD>(p, colsum, head, lane);  // CTA-uniform
}

// ------------------------------------------------------------------------------------------------ Hopper (wgmma)
// head_dim 64 on warpgroup MMAs (sm_90a): one warpgroup x 64 keys per CTA, the loop of fmha_bwd_kernel<64, 4> with
// every product on wgmma. Per query tile: S^T = K Q^T and dP^T = V dO^T with both operands read from shared memory
// (K-major), dV += P'^T dO and dK += dS^T Q with A from registers and dO / Q as MN-major B operands, and dQ = dS K
// with A = dS^T (an MN-major A operand) and B = K (MN-major), both from shared memory. The tensor cores read each Q,
// dO and dS^T tile once per CTA, where mma.sync needs an ldmatrix pass per warp. Per warp the accumulators have the
// mma.sync layout (fmha_wgmma.cuh), so the softmax, dropout, dS and atomics code is fmha_bwd_kernel's. Warps whose
// keys lie past the end compute with the others (a warpgroup MMA is collective): their P is 0 and nothing of theirs is
// stored.
struct BwdWgShape {
  static constexpr int kBlockN = 64;  // keys per CTA
  static constexpr int kThreads = 128;
  // K, V, Q x2, dO x2, dS^T (7 tiles), lse x2 and D x2 (fp32), alignment slack.
  static constexpr int kSmemBytes = 7 * kTileBytes + 4 * kTile * 4 + kSmemAlign;
  // kBulkDq: the scaled fp32 dQ of the last query tile, 64 rows of 64 floats 272 bytes apart (the 16-byte pad puts
  // the float4 stores of a warp into 4 wavefronts; each row is one 256-byte bulk reduction). With it a CTA needs 75 KB:
  // 3 CTAs use all 228 KB of an H100 SM.
  static constexpr int kDqStageLd = 68;
  static constexpr int kDqStageBytes = kTile * kDqStageLd * 4;
};

// This warp's dQ accumulators (queries wrow + g, + 8; m16n8 C fragments over the 64 head dims), scaled, into the dQ
// stage: dq_row_quad gives each lane 4 consecutive columns of one row.
__device__ __forceinline__ void stage_dq(float* sdQ, const float (&dq)[8][4], float scale, int wrow, int g, int t) {
  const bool odd = (t & 1) != 0;
  float* dst = sdQ + (wrow + g + (odd ? 8 : 0)) * BwdWgShape::kDqStageLd + 4 * (t >> 1);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float4 v = dq_row_quad(dq[n], scale, odd);
    *reinterpret_cast<float4*>(dst + n * 8) = v;
  }
}

// kBulkDq: dQ leaves through the stage in shared memory as one bulk reduction per query row (issued by threads 0..63
// after the next barrier), instead of per-thread float4 atomics.
template <int kMinCtas, bool kFp16, bool kDrop, bool kBulkDq>
__global__ void __launch_bounds__(128, kMinCtas)
    fmha_bwd_wgmma_kernel(const __grid_constant__ KernelArgs args, const float* D, float* dq_acc) {
#if NOPAD_FMHA_WGMMA
  constexpr int HD = 64;
  using Sh = BwdWgShape;
  constexpr int kNTiles = kTile / 8;
  constexpr int kDTiles = HD / 8;
  const FmhaParams& p = args.p;

  int b, s0, L, qs0, Lq;  // keys: rows [s0, s0 + L) of qkv; queries: [qs0, qs0 + Lq) of the query matrices
  launch_sequence(p, static_cast<int>(blockIdx.z), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int k0 = static_cast<int>(blockIdx.x) * Sh::kBlockN;
  if (k0 >= L) return;
  const int head = static_cast<int>(blockIdx.y);
  const int H = p.num_heads * HD, T = query_tokens(p);
  const int64_t ld = 3 * int64_t{H};
  const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);
  const uint16_t* gQ = query_source(p) + int64_t{qs0} * ld + head * HD;
  const uint16_t* gdO = static_cast<const uint16_t*>(p.d_ctx) + int64_t{qs0} * H + head * HD;
  const float* gLse = D + lse2_offset(T, p.num_heads) + int64_t{head} * T + qs0;  // lse * log2(e)
  const float* gD = D + int64_t{head} * T + qs0;

  extern __shared__ uint8_t smem_raw[];
  uint16_t* sK = reinterpret_cast<uint16_t*>(align_smem(smem_raw));  // [64][HD]
  uint16_t* sV = sK + Sh::kBlockN * HD;                               // [64][HD]
  uint16_t* sQ = sV + Sh::kBlockN * HD;                               // [2][64][HD]
  uint16_t* sdO = sQ + 2 * kTile * HD;                                // [2][64][HD]
  uint16_t* sdS = sdO + 2 * kTile * HD;                               // [64 keys][64 queries]
  float* sLse = reinterpret_cast<float*>(sdS + Sh::kBlockN * kTile);  // [2][64], lse * log2(e); 0 past the end
  float* sD = sLse + 2 * kTile;                                       // [2][64]
  float* sdQ = sD + 2 * kTile;  // kBulkDq: [64][kDqStageLd] fp32

  const int tid = static_cast<int>(threadIdx.x);
  // kBulkDq: thread tid < 64 sends row tid of the staged tile that starts at query qs_staged.
  const auto send_dq_row = [&](int qs_staged) {
    if (tid < kTile && qs_staged + tid < Lq) {
      bulk_reduce_add_f32(dq_acc + int64_t{qs0 + qs_staged + tid} * H + head * HD, sdQ + tid * Sh::kDqStageLd,
                          HD * sizeof(float));
      bulk_commit();
    }
  };
  const TileCopy<HD, kTile, Sh::kThreads> q_copy(ld), do_copy(H);
  const auto load_q_tile = [&](int i, int buf) {
    const int qs = i * kTile;
    q_copy.load(sQ + buf * kTile * HD, gQ, Lq - qs);
    do_copy.load(sdO + buf * kTile * HD, gdO, Lq - qs);
    stage_lse_d(sLse + buf * kTile, sD + buf * kTile, gLse, gD, qs, Lq, tid);
  };
  {
    const TileCopy<HD, Sh::kBlockN, Sh::kThreads> kv_copy(ld);
    const uint16_t* gK = qkv + int64_t{s0 + k0} * ld + H + head * HD;
    kv_copy.load(sK, gK, L - k0);
    kv_copy.load(sV, gK + H, L - k0);
  }
  load_q_tile(0, 0);
  cp_async_commit();

  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16;  // this warp's first key within the K tile (S^T, dK, dV rows); its 16 queries in dQ
  const bool key_ok0 = k0 + wrow + g < L, key_ok1 = k0 + wrow + g + 8 < L;
  const uint64_t desc_k = wgmma_desc(sK), desc_v = wgmma_desc(sV), desc_ds = wgmma_desc(sdS);

  const MaskDraw draw = mask_draw<kDrop>(args, b);

  float dv[kDTiles][4], dk[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.0f;

  const int num_qt = (Lq + kTile - 1) / kTile;
  for (int i = 0; i < num_qt; ++i) {
    const int buf = i & 1, qs = i * kTile;
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's cp.async writes (and dQ stage stores), visible to the async proxy
    __syncthreads();      // tile i visible; every warp done with tile i-1's buffers and with sdS
    if (i + 1 < num_qt) {
      gQ += kTile * ld;
      gdO += kTile * int64_t{H};
      load_q_tile(i + 1, buf ^ 1);
    }
    cp_async_commit();
    if constexpr (kBulkDq) {
      if (i > 0) send_dq_row(qs - kTile);  // tile i-1's dQ, staged before the barrier above
    }
    const uint64_t desc_q = wgmma_desc(sQ + buf * kTile * HD), desc_do = wgmma_desc(sdO + buf * kTile * HD);
    const float* lse2 = sLse + buf * kTile;
    const float* Dq = sD + buf * kTile;

    // S^T = K Q^T, dP^T = V dO^T (64 keys x 64 queries; this warp's 16 keys in registers).
    float s[kNTiles][4], dp[kNTiles][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wgmma_ss<kFp16, 0, 0>(s, desc_k + kk * kDescStepK, desc_q + kk * kDescStepK, kk > 0);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmma_ss<kFp16, 0, 0>(dp, desc_v + kk * kDescStepK, desc_do + kk * kDescStepK, kk > 0);
    wgmma_commit();
    uint32_t keep = 0;
    if constexpr (kDrop) {
      const int qc = qs + 8 * g + 2 * t;  // this lane's two query columns qc, qc + 1 draw the blocks
      keep = lane_transpose<2, 2>(
          fmha_dropout::bwd_lane_bits_at(draw, args.threshold, static_cast<uint32_t>(head),
                                         query_position(p, qs0, Lq, qc), query_position(p, qs0, Lq, qc + 1),
                                         static_cast<uint32_t>(k0 + wrow)),
          static_cast<uint32_t>(g));
    }
    wgmma_wait<0>();
    fence_regs(s);
    fence_regs(dp);

    p_and_ds<kDrop>(args, s, dp, keep, key_ok0, key_ok1, lse2, Dq, t);
    uint32_t pa[kTile / 16][4], da[kTile / 16][4];
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      a_fragment<kFp16>(s, kk, pa[kk]);
      a_fragment<kFp16>(dp, kk, da[kk]);
      store_ds_t(sdS, wrow, g, t, kk, da[kk]);  // dS^T to shared memory for dQ = dS K
    }
    // dV += P'^T dO, dK += dS^T Q.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) wgmma_rs<kFp16, 1>(dv, pa[kk], desc_do + kk * kDescStepMN);
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) wgmma_rs<kFp16, 1>(dk, da[kk], desc_q + kk * kDescStepMN);
    wgmma_commit();
    fence_proxy_async();  // this thread's dS^T stores, visible to the tensor cores after the barrier
    if constexpr (kBulkDq) {
      if (tid < kTile) bulk_wait_read<0>();  // the dQ stage is free again after the barrier
    }
    __syncthreads();      // all of dS^T written

    // dQ (64 queries x 64 head dims) = dS K; this warp holds queries 16 warp .. +15.
    float dq[kDTiles][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Sh::kBlockN / 16; ++kk)
      wgmma_ss<kFp16, 1, 1>(dq, desc_ds + kk * kDescStepMN, desc_k + kk * kDescStepMN, kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dv);
    fence_regs(dk);
    fence_regs(dq);
    fence_regs(pa);
    fence_regs(da);

    if constexpr (kBulkDq) {
      stage_dq(sdQ, dq, args.grad_scale, wrow, g, t);
    } else {
      add_dq<kDTiles>(p, dq_acc, dq, args.grad_scale, qs0, qs + wrow + g, Lq, head * HD, t);
    }
  }
  if constexpr (kBulkDq) {  // the last tile's dQ (none when the sequence has no queries: FmhaParams::q_cu_seqlens)
    fence_proxy_async();
    __syncthreads();
    if (num_qt > 0) send_dq_row((num_qt - 1) * kTile);
  }

  // dK (scaled) and dV into d_qkv's k and v blocks, rows of keys that exist.
  float colsum[kDTiles][2];
  store_dk_dv<HD, kFp16>(p, dk, dv, args.grad_scale, args.keep_scale, s0, k0 + wrow + g, L, head, t, colsum);
  if (p.d_qkv_bias != nullptr) add_dv_bias<HD>(p, colsum, head, lane);  // CTA-uniform
  if constexpr (kBulkDq) {
    if (tid < kTile) bulk_wait_read<0>();  // the stage stays valid until the copy engine has read it
  }
#else
  __trap();  // never launched: the host selects this kernel only where fmha_wgmma_available()
#endif
}

// ------------------------------------------------------------------------------------------------ warp-specialised
// head_dim 64 on sm_90a, launches without query rows: work items of 128 keys (key block kb of head h of sequence z)
// against query tiles of 128, 384 threads in three warpgroups with fixed roles (docs/fmha.md, "ws128q"). Persistent:
// one CTA per SM takes items from the launch's counter (wsq_item); the next item's K/V and first tiles load while the
// consumers finish the current one.
// * warpgroup 0, producer (56 registers after setmaxnreg): warps 0 and 1 copy rows 0..63 and 64..127 of an item's K
//   and then of every query tile's Q and lse2, warps 2 and 3 the same of V, dO and D, into a kStages ring (cp.async;
//   each lane's copies arrive on the stage's `full` barrier when they land) once both consumers have released the
//   stage (`empty`); K/V are double-buffered by item (`kv_full` / `kv_empty`). Warp 0 takes the items from the
//   counter and publishes them (`item_full`).
// * warpgroups 1 and 2, consumers (224 registers): consumer c owns keys k0 + 64c .. + 63. Per query tile: S^T = K Q^T
//   and dP^T = V dO^T, P' and dS^T one 64-query half at a time, dV += P'^T dO and dK += dS^T Q with K = 128 queries,
//   dS^T into shared memory (two [128 keys][64 queries] halves), and dQ for the tile's queries 64c .. + 63 over all
//   128 keys (A = dS^T half c, B = K), staged in shared memory and sent as one pair of tensor-map reductions. The
//   consumers meet only where one reads what the other wrote: before its dQ product, a consumer waits for the other's
//   dS^T rows of the tile (each signals with bar.arrive and goes on); dS^T is double-buffered by tile parity, so that
//   no consumer waits for the other's dQ product.
// Against wg64 every Q/dO tile copy serves 128 keys, dQ leaves once per 128 keys, the wgmma chains are twice as long,
// and the consumers issue no copies.
struct BwdWsqShape {
  static constexpr int kBlockN = 128;  // keys per item
  static constexpr int kBlockM = 128;  // queries per tile
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  // One consumer's 64 query rows of fp32 dQ: two boxes of 64 rows x 32 columns in the 128-byte-swizzled layout of
  // the tensor map's reductions (stage_dq_swz).
  static constexpr int kDqStageBytes = 64 * 64 * 4;
  // Byte offsets from the 1024-aligned base: per K/V buffer K (128 rows: 2 tiles) and V (2 tiles); per stage Q (2
  // tiles) and dO (2 tiles); dS^T by tile parity (2 halves of 2 tiles each); the dQ stage per consumer; lse2 and D per
  // stage; mbarriers.
  static constexpr int kOffKv = 0;                                       // + 4 kvb tiles; V at + 2 tiles
  static constexpr int kOffQ = 8 * kTileBytes;                           // + 4 s tiles; dO at + 2 tiles
  static constexpr int kOffDs = kOffQ + 4 * kStages * kTileBytes;        // buffer b at + 4 b tiles, half h at + 2 h
  static constexpr int kOffDq = kOffDs + 8 * kTileBytes;                 // + c stages
  static constexpr int kOffLse = kOffDq + 2 * kDqStageBytes;             // [kStages][lse2 128, D 128] fp32
  static constexpr int kOffBar = kOffLse + kStages * 2 * kBlockM * 4;
  // kv_full[2], kv_empty[2], item_full[2], full[kStages], empty[kStages]; then the published item per K/V buffer
  static constexpr int kNumBars = 6 + 2 * kStages;
  // No alignment slack: the kernel declares its dynamic shared memory 1024-byte aligned (and checks it).
  static constexpr int kSmemBytes = kOffBar + kNumBars * 8 + 2 * 4;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
  // setmaxnreg moves registers within the CTA's launch allocation (168 per thread under __launch_bounds__(384, 1)):
  // the budgets must fit it, or the consumers' increase would wait forever.
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 168 * kThreads, "register budget of the CTA");
  static constexpr uint64_t kDescTile = kTileBytes >> 4;  // descriptor advance of one 64-row tile (64 x 128 bytes)
  // The consumers' named barriers (their dQ stages, their dS^T rows by tile parity): fmha_wsq_barriers.h.
};

// The work items of a launch over n sequences are (sequence z, head, key block kb of 128 keys), item =
// (z * heads + head) * key_blocks + kb with key_blocks from max_seqlen; CTAs take them in this order from the launch's
// counter when their producer is ready for the next one: neighbouring CTAs work on neighbouring items (shared Q/dO
// tiles in L2) and no SM idles while items remain. False when the key block lies past the sequence's end.
__device__ __forceinline__ bool wsq_item(const FmhaParams& p, int item, int& b, int& s0, int& L, int& head, int& k0) {
  const int key_blocks = (p.max_seqlen + BwdWsqShape::kBlockN - 1) / BwdWsqShape::kBlockN;
  const int kb = item % key_blocks, zh = item / key_blocks;
  launch_sequence(p, zh / p.num_heads, b, s0, L);
  head = zh % p.num_heads;
  k0 = kb * BwdWsqShape::kBlockN;
  return k0 < L;
}
// How many items a launch over n sequences has (its items counter's range), on the host.
inline int64_t wsq_num_items(const FmhaParams& p, int64_t n) {
  return int64_t{(p.max_seqlen + BwdWsqShape::kBlockN - 1) / BwdWsqShape::kBlockN} * p.num_heads * n;
}

// This warp's dQ accumulators (queries wrow + g, + 8; m16n8 C fragments over the 64 head dims), scaled, into a dQ stage
// of two 64 x 32 fp32 boxes (columns 0..31, 32..63) with the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r & 7)): dq_row_quad gives each lane 4 consecutive columns of one row.
__device__ __forceinline__ void stage_dq_swz(float* sdQ, const float (&dq)[8][4], float scale, int wrow, int g, int t) {
  const bool odd = (t & 1) != 0;
  const int row = wrow + g + (odd ? 8 : 0);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float4 v = dq_row_quad(dq[n], scale, odd);
    const int chunk = 2 * (n & 3) + (t >> 1);  // 16-byte chunk within the box's 128-byte row
    *reinterpret_cast<float4*>(sdQ + (n >> 2) * 64 * 32 + row * 32 + ((chunk ^ (row & 7)) << 2)) = v;
  }
}

template <bool kFp16, bool kDrop>
__global__ void __launch_bounds__(384, 1)
    fmha_bwd_wsq_kernel(const __grid_constant__ KernelArgs args, const float* D,
                        const __grid_constant__ CUtensorMap dq_map, int num_items) {
#if NOPAD_FMHA_WGMMA
  constexpr int HD = 64;
  using Sh = BwdWsqShape;
  constexpr int kStages = Sh::kStages;
  constexpr int kM = Sh::kBlockM;
  const FmhaParams& p = args.p;
  const int H = p.num_heads * HD, T = p.num_tokens;
  const int64_t ld = 3 * int64_t{H};

  extern __shared__ __align__(1024) uint8_t smem_wsq[];
  uint8_t* base = smem_wsq;
  if ((smem_u32(base) & (kSmemAlign - 1)) != 0) __trap();  // the swizzled tiles need it; the launch gives no slack
  const auto tile_at = [&](int off) { return reinterpret_cast<uint16_t*>(base + off); };
  const auto sK = [&](int kvb) { return tile_at(Sh::kOffKv + 4 * kvb * kTileBytes); };
  const auto sV = [&](int kvb) { return tile_at(Sh::kOffKv + (4 * kvb + 2) * kTileBytes); };
  const auto sQ = [&](int s) { return tile_at(Sh::kOffQ + 4 * s * kTileBytes); };
  const auto sdO = [&](int s) { return tile_at(Sh::kOffQ + (4 * s + 2) * kTileBytes); };
  const auto sLse = [&](int s) { return reinterpret_cast<float*>(base + Sh::kOffLse) + s * 2 * kM; };
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + Sh::kOffBar);
  uint64_t* kv_full = bars;
  uint64_t* kv_empty = bars + 2;
  uint64_t* item_full = bars + 4;
  uint64_t* full = bars + 6;
  uint64_t* empty = full + kStages;
  volatile int* sItem = reinterpret_cast<volatile int*>(bars + Sh::kNumBars);

  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  if (tid == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(kv_full + i, 128);  // every producer lane, when its copies have landed
      mbar_init(kv_empty + i, 8);   // one arrival per consumer warp
      mbar_init(item_full + i, 1);
    }
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, 128);
      mbar_init(empty + s, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<Sh::kProducerRegs>();
    // Warp w copies rows 64 (w & 1) .. + 63 of K, Q, lse2 (w < 2) or of V, dO, D (w >= 2). 16-byte copies of a
    // 64-column swizzled tile by one warp: lane = chunk c (lane % 8) of rows lane / 8 + 4k; the swizzle key of row r is
    // r & 7, i.e. (lane / 8) + 4 (k & 1). Rows past the sequence end are zero-filled from the sequence's first row.
    const bool is_q = warp < 2;
    const int half = warp & 1;
    const int row0 = lane >> 3, c = lane & 7;
    const int x_even = (c ^ row0) << 3, x_odd = (c ^ row0 ^ 4) << 3;
    const auto copy_rows = [&](uint16_t* tile, const uint16_t* g, const uint16_t* g_safe, int64_t g_ld, int nvalid) {
      const uint16_t* src = g + row0 * g_ld + c * 8;
#pragma unroll 2
      for (int k = 0; k < 16; ++k) {  // hardly unrolled: the producer has few registers
        const int r = row0 + 4 * k;
        const bool ok = r < nvalid;
        cp_async16(tile + r * HD + ((k & 1) ? x_odd : x_even), ok ? src : g_safe, ok);
        src += 4 * g_ld;
      }
    };
    const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);
    const int64_t g_ld = is_q ? ld : H;
    int gt = 0;  // tiles of this CTA so far
    int* counter = item_counter(p);
    for (int it = 0;; ++it) {  // items of this CTA
      const int kvb = it & 1;
      int item, b, s0, L, head, k0;
      if (warp == 0) {
        // Fetch the next item that has keys, wait until the K/V buffer is free, publish it (-1: no more).
        do {
          item = 0;
          if (lane == 0) item = atomicAdd(counter, 1);
          item = __shfl_sync(0xffffffffu, item, 0);
        } while (item < num_items && !wsq_item(p, item, b, s0, L, head, k0));
        if (item >= num_items) item = -1;
        if (it >= 2) mbar_wait(kv_empty + kvb, ((it >> 1) & 1) ^ 1);
        if (lane == 0) {
          sItem[kvb] = item;
          mbar_arrive(item_full + kvb);
        }
      } else {
        mbar_wait(item_full + kvb, (it >> 1) & 1);
        item = sItem[kvb];
        if (item >= 0) wsq_item(p, item, b, s0, L, head, k0);
      }
      if (item < 0) break;
      {
        const uint16_t* g_kv = qkv + int64_t{s0} * ld + (is_q ? H : 2 * H) + head * HD;
        copy_rows((is_q ? sK(kvb) : sV(kvb)) + half * 64 * HD, g_kv + int64_t{k0 + 64 * half} * ld, g_kv, ld,
                  L - k0 - 64 * half);
      }
      mbar_arrive_cp_async(kv_full + kvb);
      const uint16_t* g_tile = is_q ? qkv + int64_t{s0} * ld + head * HD
                                    : static_cast<const uint16_t*>(p.d_ctx) + int64_t{s0} * H + head * HD;
      // lse * log2(e) (with Q) or D (with dO)
      const float* g_row = D + (is_q ? lse2_offset(T, p.num_heads) : 0) + int64_t{head} * T + s0;
      const int num_qt = (L + kM - 1) / kM;
      for (int i = 0; i < num_qt; ++i, ++gt) {
        const int s = gt % kStages, q0 = i * kM + 64 * half;  // this warp's first query row
        if (gt >= kStages) mbar_wait(empty + s, ((gt / kStages) & 1) ^ 1);
        copy_rows((is_q ? sQ(s) : sdO(s)) + half * 64 * HD, g_tile + int64_t{q0} * g_ld, g_tile, g_ld, L - q0);
        float* st = sLse(s) + (is_q ? 0 : kM) + 64 * half;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = lane + 32 * h;
          const bool ok = q0 + r < L;
          cp_async4(st + r, g_row + (ok ? q0 + r : 0), ok);
        }
        mbar_arrive_cp_async(full + s);
      }
    }
    return;
  }

  // Consumers.
  setmaxnreg_inc<Sh::kConsumerRegs>();
  const int c = wg - 1, ctid = tid & 127;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16;      // this warp's first key within the consumer's 64 (S^T, dK, dV rows); its dQ queries
  const int krow = 64 * c + wrow;  // and within the item's 128
  float* sdQ = reinterpret_cast<float*>(base + Sh::kOffDq + c * Sh::kDqStageBytes);
  const auto release = [&](uint64_t* bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };

  int gt = 0;
  for (int it = 0;; ++it) {
    const int kvb = it & 1;
    mbar_wait(item_full + kvb, (it >> 1) & 1);
    const int item = sItem[kvb];
    if (item < 0) break;
    int b, s0, L, head, k0;
    wsq_item(p, item, b, s0, L, head, k0);
    const int num_qt = (L + kM - 1) / kM;
    // A consumer whose keys lie past the end of a short last block still computes (its P and dS are 0): the other
    // consumer's dQ reads its dS^T rows, and its own dQ rows are needed.
    const bool key_ok0 = k0 + krow + g < L, key_ok1 = k0 + krow + g + 8 < L;
    const uint64_t desc_k = wgmma_desc(sK(kvb));  // all 128 keys (dQ's B)
    // This consumer's keys 64c .. + 63 of K and V.
    const uint64_t desc_kc = desc_k + c * Sh::kDescTile, desc_vc = wgmma_desc(sV(kvb)) + c * Sh::kDescTile;
    const MaskDraw draw = mask_draw<kDrop>(args, b);

    float dv[8][4], dk[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.0f;
    // The dQ of the tile whose queries start at q_tile, once its product is complete, into dq_accum: staged and sent as
    // two tensor-map reductions of 64 rows x 32 columns by one thread (per-thread float4 atomics from registers were
    // 6% slower, docs/performance.md). The staged rows past the sequence end hold exact zeros (their Q and dO rows are
    // zero-filled and their lse2 and D are 0, so dS is 0 there): adding them into the next sequence's rows changes
    // nothing, and rows past the tensor are clipped.
    float dq[8][4];
    const auto finish_dq = [&](int q_tile) {
      fence_regs(dq);
      stage_dq_swz(sdQ, dq, args.grad_scale, wrow, g, t);
      fence_proxy_async();  // the stage, visible to the copy engine
      named_barrier_sync(fmha_wsq::kBarStage + c, 128);
      const int q0 = q_tile + 64 * c;
      if (ctid == 0 && q0 < L) {
        bulk_reduce_tensor_add(&dq_map, sdQ, head * HD, s0 + q0);
        bulk_reduce_tensor_add(&dq_map, sdQ + 64 * 32, head * HD + 32, s0 + q0);
        bulk_commit();
      }
    };

    mbar_wait(kv_full + kvb, (it >> 1) & 1);
    for (int i = 0; i < num_qt; ++i, ++gt) {
      const int s = gt % kStages, qs = i * kM;
      mbar_wait(full + s, (gt / kStages) & 1);
      fence_proxy_async();  // the producer's cp.async writes, visible to this thread's wgmma reads
      const uint64_t desc_q = wgmma_desc(sQ(s)), desc_do = wgmma_desc(sdO(s));
      const float* lse2 = sLse(s);
      const float* Dq = lse2 + kM;
      // dS^T of this tile, by tile parity (half h: queries 64 h .. + 63, all 128 keys): the other consumer read the
      // buffer last in its dQ product two tiles ago, complete before it signalled its previous tile's dS^T rows.
      uint16_t* sdS = tile_at(Sh::kOffDs + 4 * (gt & 1) * kTileBytes);
      const uint64_t desc_ds = wgmma_desc(sdS + c * Sh::kBlockN * 64);  // A of this consumer's dQ: dS^T half c

      // S^T = K Q^T, dP^T = V dO^T, P' and dS^T: this consumer's 64 keys x 128 queries, one half of 64 queries at a
      // time (the accumulators of both halves at once would leave too few registers; the other consumer's products
      // fill the tensor cores meanwhile); then dV += P'^T dO and dK += dS^T Q over the 128 queries.
      uint32_t pa[2][4][4], da[2][4][4];
      const auto issue_sdp = [&](float(&sc)[8][4], float(&dp)[8][4], int h) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          wgmma_ss<kFp16, 0, 0>(sc, desc_kc + kk * kDescStepK, desc_q + h * Sh::kDescTile + kk * kDescStepK,
                                kk > 0);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          wgmma_ss<kFp16, 0, 0>(dp, desc_vc + kk * kDescStepK, desc_do + h * Sh::kDescTile + kk * kDescStepK,
                                kk > 0);
      };
      const auto keep_bits = [&](int h) -> uint32_t {
        if constexpr (kDrop) {
          return lane_transpose<2, 2>(
              fmha_dropout::bwd_lane_bits(draw, args.threshold, static_cast<uint32_t>(head),
                                          static_cast<uint32_t>(qs + 64 * h), static_cast<uint32_t>(k0 + krow),
                                          static_cast<uint32_t>(g), static_cast<uint32_t>(t)),
              static_cast<uint32_t>(g));
        } else {
          return 0u;
        }
      };
      const auto finish_half = [&](float(&sc)[8][4], float(&dp)[8][4], uint32_t keep, int h) {
        p_and_ds<kDrop>(args, sc, dp, keep, key_ok0, key_ok1, lse2 + 64 * h, Dq + 64 * h, t);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          a_fragment<kFp16>(sc, kk, pa[h][kk]);
          a_fragment<kFp16>(dp, kk, da[h][kk]);
        }
      };
      const auto store_ds = [&](int h) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) store_ds_t(sdS + h * Sh::kBlockN * 64, krow, g, t, kk, da[h][kk]);
      };
      const auto issue_dkv = [&](int h) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<kFp16, 1>(dv, pa[h][kk], desc_do + (4 * h + kk) * kDescStepMN);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<kFp16, 1>(dk, da[h][kk], desc_q + (4 * h + kk) * kDescStepMN);
      };
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sc[8][4], dp[8][4];
        wgmma_fence();
        issue_sdp(sc, dp, h);
        wgmma_commit();
        const uint32_t keep = keep_bits(h);
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(dp);
        finish_half(sc, dp, keep, h);
      }
      store_ds(0);
      store_ds(1);
      wgmma_fence();
      issue_dkv(0);
      issue_dkv(1);
      wgmma_commit();
      fence_proxy_async();  // this thread's dS^T stores, visible to the tensor cores
      const int bar_ds = fmha_wsq::ds_done_barrier(gt, 0);  // + consumer (fmha_wsq_barriers.h)
      named_barrier_arrive(bar_ds + c, 256);
      if (ctid == 0) bulk_wait_read<0>();  // the dQ stage's last reductions have read it
      // The other consumer's dS^T rows are written (and, as all of this consumer's threads pass, its dQ stage free).
      named_barrier_sync(bar_ds + (1 - c), 256);

      // dQ (this consumer's 64 queries x 64 head dims) = dS K over the 128 keys; this warp holds queries 16 warp ..
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Sh::kBlockN / 16; ++kk)
        wgmma_ss<kFp16, 1, 1>(dq, desc_ds + kk * kDescStepMN, desc_k + kk * kDescStepMN, kk > 0);
      wgmma_commit();
      wgmma_wait<1>();  // dV, dK done: the stage's Q and dO are no longer read
      fence_regs(dv);
      fence_regs(dk);
      fence_regs(pa[0]);
      fence_regs(pa[1]);
      fence_regs(da[0]);
      fence_regs(da[1]);
      release(empty + s);
      wgmma_wait<0>();
      finish_dq(qs);
    }
    release(kv_empty + kvb);  // the last dQ product, the last reader of this K, has completed

    // dK (scaled) and dV into d_qkv's k and v blocks, rows of keys that exist.
    float colsum[8][2];
    store_dk_dv<HD, kFp16>(p, dk, dv, args.grad_scale, args.keep_scale, s0, k0 + krow + g, L, head, t, colsum);
    if (p.d_qkv_bias != nullptr) add_dv_bias<HD>(p, colsum, head, lane);  // uniform
  }
  if (ctid == 0) bulk_wait<0>();  // the reductions complete before the CTA ends
#else
  __trap();  // never launched: the host selects this kernel only where fmha_wgmma_available()
#endif
}

// One CTA per SM (fewer when there are fewer items), taking items from the counter the pre kernel zeroed.
template <bool kFp16>
void launch_backward_wsq(const KernelArgs& args, const float* D, float* dq_acc, int32_t n, cudaStream_t stream) {
  using Sh = BwdWsqShape;
  const int64_t items = wsq_num_items(args.p, n);
  NOPAD_CHECK(items < (int64_t{1} << 30), "fmha_backward: too many work items (", items, ")");
  const int grid = static_cast<int>(std::min<int64_t>(items, fmha_sm_count()));
  if (grid == 0) return;
  // dq_accum [T, H] fp32 in boxes of 64 rows x 32 columns (128 bytes: the stage's 128-byte swizzle).
  const int64_t T = args.p.num_tokens, H = int64_t{args.p.num_heads} * 64;
  const CUtensorMap dq_map =
      tensor_map_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, dq_acc, static_cast<uint64_t>(T), static_cast<uint64_t>(H),
                    static_cast<uint64_t>(H) * 4, 32, 64, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                    "fmha_backward dq_accum");
  if (args.dropout) {
    constexpr auto kernel = fmha_bwd_wsq_kernel<kFp16, true>;
    ensure_smem<kernel>(Sh::kSmemBytes);
    kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(args, D, dq_map, static_cast<int>(items));
  } else {
    constexpr auto kernel = fmha_bwd_wsq_kernel<kFp16, false>;
    ensure_smem<kernel>(Sh::kSmemBytes);
    kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(args, D, dq_map, static_cast<int>(items));
  }
  NOPAD_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------------------ variants
// CTAs per SM asked for (launch bounds). 4 warps at HD <= 64: 3 CTAs (168 registers, a few spills) or 2 (no cap, no
// spills); 8 warps: 1 (no cap). HD = 128 is never capped (the dK/dV accumulators alone are 128 registers).
struct BwdVariant {
  const char* name;
  int warps, min_ctas;
  bool wgmma;  // the wgmma kernel (head_dim 64 on sm_90a)
};
constexpr BwdVariant kBwdVariants[] = {
    {"n64w4", 4, 3, false},   // 0: 64 keys, 4 warps x 16 keys, 12 warps per SM (the design before variants)
    {"n64w4r", 4, 2, false},  // 1: the same without the register cap: 8 warps per SM, no spills
    {"n128w8", 8, 1, false},  // 2: 128 keys, 8 warps: half the Q/dO tile loads and half the dQ atomics per key
    {"wg64", 4, 3, true},     // 3: wgmma, one warpgroup x 64 keys, 3 CTAs per SM (168 registers)
    {"wg64r", 4, 2, true},    // 4: the same with 2 CTAs per SM and no register cap
    {"wg64b", 4, 3, true},    // 5: wg64 with dQ sent as bulk reductions of whole rows from shared memory
    {"ws128q", 12, 1, true},  // 6: warp-specialised, persistent: 128 keys x 128-query tiles on two consumers
};
constexpr int kNumBwdVariants = static_cast<int>(sizeof(kBwdVariants) / sizeof(kBwdVariants[0]));
constexpr int kDefaultBwdVariant = 0;  // where the wgmma kernels cannot run
constexpr int kWsqVariant = 6;         // ws128q, full attention only: the default at head_dim 64 on sm_90a
// A launch of short sequences with little work defaults to wg64 instead: max_seqlen <= kFewItemsMaxSeqlen and fewer
// than kFewItemsPerSm ws128q items (128-key blocks, counted up to max_seqlen) per SM, as the short length groups of a
// grouped schedule have. ws128q's persistent CTAs then get a few small items each; wg64's CTAs (3 per SM, 64 keys
// each) spread the same work finer. H200, 2026-11-29 (docs/performance.md, "per-launch backward kernels"): groups of
// real batches of <= 254 tokens with 2.5-4.1 items per SM took 0.82-0.92x ws128q's time on wg64, at dropout 0 and
// 0.1, and the stand-in's grouped schedule gained most with its (128, 256] group (~9 items per SM) on wg64; a group
// of <= 376 tokens took 1.03-1.13x, and whole batches of 128- and 256-token sequences (31 items per SM) 1.01-1.09x.
constexpr int kFewItemsBwdVariant = 3;  // wg64
constexpr int32_t kFewItemsMaxSeqlen = 256;
constexpr int64_t kFewItemsPerSm = 16;
// A launch on query rows (FmhaParams::q_cu_seqlens) asking for ws128q runs the one-warpgroup kernel of its dropout.
constexpr int kRowsBwdVariantWg = 3;        // with dropout
constexpr int kRowsBwdVariantWgNoDrop = 5;  // dropout 0

template <int HD, int kWarps, int kMinCtas, bool kFp16>
void launch_backward_main(const KernelArgs& args, const float* D, float* dq_acc, int32_t n, cudaStream_t stream) {
  using Sh = BwdShape<HD, kWarps>;
  constexpr int kMin = HD > 64 ? 1 : kMinCtas;
  const dim3 grid((args.p.max_seqlen + Sh::kBlockN - 1) / Sh::kBlockN, args.p.num_heads, n);
  if (args.dropout) {
    constexpr auto kernel = fmha_bwd_kernel<HD, kWarps, kMin, kFp16, true>;
    ensure_smem<kernel>(Sh::kSmemBytes);
    kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(args, D, dq_acc);
  } else {
    constexpr auto kernel = fmha_bwd_kernel<HD, kWarps, kMin, kFp16, false>;
    ensure_smem<kernel>(Sh::kSmemBytes);
    kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(args, D, dq_acc);
  }
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <int kMinCtas, bool kFp16, bool kBulkDq>
void launch_backward_wgmma(const KernelArgs& args, const float* D, float* dq_acc, int32_t n, cudaStream_t stream) {
  using Sh = BwdWgShape;
  constexpr int kBytes = Sh::kSmemBytes + (kBulkDq ? Sh::kDqStageBytes : 0);
  const dim3 grid((args.p.max_seqlen + Sh::kBlockN - 1) / Sh::kBlockN, args.p.num_heads, n);
  if (args.dropout) {
    constexpr auto kernel = fmha_bwd_wgmma_kernel<kMinCtas, kFp16, true, kBulkDq>;
    ensure_smem<kernel>(kBytes);
    kernel<<<grid, Sh::kThreads, kBytes, stream>>>(args, D, dq_acc);
  } else {
    constexpr auto kernel = fmha_bwd_wgmma_kernel<kMinCtas, kFp16, false, kBulkDq>;
    ensure_smem<kernel>(kBytes);
    kernel<<<grid, Sh::kThreads, kBytes, stream>>>(args, D, dq_acc);
  }
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <int HD, bool kFp16>
void launch_backward(const KernelArgs& args, int variant, int32_t n, cudaStream_t stream) {
  const FmhaParams& p = args.p;
  float* D = reinterpret_cast<float*>(static_cast<char*>(p.workspace) +
                                      d_offset(query_tokens(p), p.num_heads, p.head_dim));
  float* dq_acc = static_cast<float*>(p.workspace);
  // The pre and dQ kernels run over the queries: every row, or query rows (FmhaParams::q_cu_seqlens), whose d_qkv q
  // block is zeroed first in every row (the dQ kernel then writes the queries' rows).
  const int32_t q_rows = query_seqlen(p);
  const dim3 row_grid((q_rows + kPreRows - 1) / kPreRows, n);
  if (p.q_cu_seqlens != nullptr) {
    const size_t row_bytes = static_cast<size_t>(p.num_heads) * p.head_dim * 2;
    NOPAD_CUDA_CHECK(cudaMemset2DAsync(p.d_qkv, 3 * row_bytes, 0, row_bytes, static_cast<size_t>(p.num_tokens), stream));
  }
  if (q_rows > 0 && !p.prepared) {
    fmha_bwd_pre_kernel<kFp16><<<row_grid, 32 * kPreRows, 0, stream>>>(args, D, dq_acc);
    NOPAD_CUDA_CHECK_LAUNCH();
  }
  // At HD = 128 the register cap makes no difference (never capped there), so variant 1 runs variant 0's kernel.
  if (HD > 64 && variant == 1) variant = 0;
  // The wgmma kernel exists for head_dim 64 on sm_90a; elsewhere its variant runs the default mma.sync kernel.
  if (kBwdVariants[variant].wgmma && (HD != 64 || !fmha_wgmma_available())) variant = kDefaultBwdVariant;
  if (variant == kWsqVariant && p.q_cu_seqlens != nullptr)
    variant = args.dropout ? kRowsBwdVariantWg : kRowsBwdVariantWgNoDrop;
  switch (variant) {
    case 0: launch_backward_main<HD, 4, 3, kFp16>(args, D, dq_acc, n, stream); break;
    case 1:
      if constexpr (HD <= 64) launch_backward_main<HD, 4, 2, kFp16>(args, D, dq_acc, n, stream);
      break;
    case 2: launch_backward_main<HD, 8, 1, kFp16>(args, D, dq_acc, n, stream); break;
    case 3:
      if constexpr (HD == 64) launch_backward_wgmma<3, kFp16, false>(args, D, dq_acc, n, stream);
      break;
    case 4:
      if constexpr (HD == 64) launch_backward_wgmma<2, kFp16, false>(args, D, dq_acc, n, stream);
      break;
    case 5:
      if constexpr (HD == 64) launch_backward_wgmma<3, kFp16, true>(args, D, dq_acc, n, stream);
      break;
    case 6:
      if constexpr (HD == 64) launch_backward_wsq<kFp16>(args, D, dq_acc, n, stream);
      break;
    default: fail("fmha_backward: no variant ", variant);
  }
  if (q_rows == 0) return;
  if (p.d_qkv_bias == nullptr) {
    fmha_bwd_dq_kernel<kFp16><<<row_grid, 32 * kPreRows, 0, stream>>>(args, dq_acc);
  } else {
    const dim3 grid((q_rows + kDqBiasRows - 1) / kDqBiasRows, n);
    fmha_bwd_dq_bias_kernel<kFp16><<<grid, kDqBiasThreads, 0, stream>>>(args, dq_acc);
  }
  NOPAD_CUDA_CHECK_LAUNCH();
}
static_assert(kNumBwdVariants == 7, "launch_backward dispatches every variant");

template <int HD>
void launch_backward_hd(const KernelArgs& args, int variant, int32_t n, cudaStream_t stream) {
  if (args.p.fp16) {
    launch_backward<HD, true>(args, variant, n, stream);
  } else {
    launch_backward<HD, false>(args, variant, n, stream);
  }
}

}  // namespace fmha_detail

int fmha_backward_variant_count() { return fmha_detail::kNumBwdVariants; }
const char* fmha_backward_variant_name(int variant) {
  NOPAD_CHECK(variant >= 0 && variant < fmha_detail::kNumBwdVariants, "no backward variant ", variant);
  return fmha_detail::kBwdVariants[variant].name;
}
int fmha_backward_variant(const FmhaParams& p) {
  using namespace fmha_detail;
  static const int env = variant_from_env("NOPAD_FMHA_BWD_VARIANT", kNumBwdVariants);
  // On Hopper at head_dim 64: the warp-specialised ws128q (its launches on query rows run wg64 or wg64b by dropout),
  // or wg64 for a launch of short sequences with few ws128q items per SM.
  int fallback = kDefaultBwdVariant;
  if (p.head_dim == 64 && fmha_wgmma_available()) {
    const int64_t items = wsq_num_items(p, p.seq_index != nullptr ? p.num_launch_seqs : p.num_seqs);
    const bool few = p.max_seqlen <= kFewItemsMaxSeqlen && items < kFewItemsPerSm * fmha_sm_count();
    fallback = few ? kFewItemsBwdVariant : kWsqVariant;
  }
  return choose_variant(p.bwd_variant, env, fallback, kNumBwdVariants, "FmhaParams::bwd_variant");
}

bool fmha_backward_bias_supported(int32_t num_heads, int32_t head_dim) {
  return int64_t{num_heads} * head_dim <= 8 * fmha_detail::kDqBiasThreads;
}

size_t fmha_backward_workspace_bytes(int32_t num_tokens, int32_t num_heads, int32_t head_dim) {
  NOPAD_CHECK(num_tokens >= 0 && num_heads >= 0 && head_dim >= 0, "fmha_backward_workspace_bytes: negative size");
  return fmha_detail::d_offset(num_tokens, num_heads, head_dim) +
         2 * fmha_detail::lse2_offset(num_tokens, num_heads) * sizeof(float);
}

float fmha_backward_d_scale(float dropout_p) {
  return attention_dropout_keep_fraction(attention_dropout_threshold(dropout_p));
}

FmhaWorkspaceLayout fmha_backward_workspace_layout(int32_t num_tokens, int32_t num_heads, int32_t head_dim) {
  FmhaWorkspaceLayout w;
  w.total_bytes = fmha_backward_workspace_bytes(num_tokens, num_heads, head_dim);
  w.zero_bytes = (fmha_detail::zero_region_bytes(num_tokens, num_heads, head_dim) + 15) / 16 * 16;  // <= d_offset
  w.d_offset = fmha_detail::d_offset(num_tokens, num_heads, head_dim);
  w.lse2_offset = w.d_offset + fmha_detail::lse2_offset(num_tokens, num_heads) * sizeof(float);
  return w;
}

void fmha_backward(const FmhaParams& p, cudaStream_t stream) {
  using namespace fmha_detail;
  const int32_t n = validate_common(p, "fmha_backward");
  NOPAD_CHECK(p.d_ctx != nullptr && p.d_qkv != nullptr && p.workspace != nullptr, "fmha_backward: d_ctx, d_qkv and ",
              "workspace must not be null");
  NOPAD_CHECK(aligned16(p.d_ctx) && aligned16(p.d_qkv) && aligned16(p.workspace),
              "fmha_backward: d_ctx, d_qkv and workspace must be 16-byte aligned");
  const size_t need = fmha_backward_workspace_bytes(query_tokens(p), p.num_heads, p.head_dim);
  NOPAD_CHECK(p.workspace_bytes >= need, "fmha_backward: workspace of ", p.workspace_bytes, " bytes is too small, ",
              "need ", need, " (fmha_backward_workspace_bytes)");
  NOPAD_CHECK(p.d_qkv_bias == nullptr || fmha_backward_bias_supported(p.num_heads, p.head_dim), "fmha_backward: ",
              "the bias gradient supports num_heads * head_dim <= ", 8 * fmha_detail::kDqBiasThreads, ", got ",
              int64_t{p.num_heads} * p.head_dim, " (leave d_qkv_bias null and sum the columns of d_qkv separately)");
  NOPAD_CHECK(!p.prepared || p.q_cu_seqlens == nullptr, "fmha_backward: a prepared workspace needs every row a query");
  NOPAD_CHECK(reinterpret_cast<uintptr_t>(p.d_qkv_bias) % 8 == 0, "fmha_backward: d_qkv_bias must be 8-byte aligned ",
              "(its sums are added two columns at a time)");
  const int variant = fmha_backward_variant(p);
  if (n == 0 || p.max_seqlen == 0) return;
  const KernelArgs args = make_args(p);
  switch (p.head_dim) {
    case 32: launch_backward_hd<32>(args, variant, n, stream); break;
    case 64: launch_backward_hd<64>(args, variant, n, stream); break;
    case 128: launch_backward_hd<128>(args, variant, n, stream); break;
    default: fail("fmha_backward: unsupported head_dim ", p.head_dim);
  }
}

}  // namespace nopad::cuda
