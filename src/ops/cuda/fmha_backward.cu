// FMHA backward (FlashAttention-2 style) on mma.sync tensor cores:
//   1. fmha_bwd_pre_kernel:   D = rowsum(dO * O) per (head, token) into the workspace; zeroes this launch's dq_accum rows.
//   2. fmha_bwd_kernel:       one CTA per (key tile of 64, head, sequence); 4 warps x 16 keys; loops over the query
//                             tiles (Q, dO, lse, D double-buffered with cp.async), recomputes P, regenerates the dropout
//                             mask, accumulates dK, dV in registers and adds dQ into fp32 dq_accum with atomicAdd.
//   3. fmha_bwd_dq_kernel:    dq_accum -> d_qkv's q block (bf16/fp16).
// Workspace: D [heads, T] fp32, then (256-byte aligned) dq_accum [T, H] fp32. Design: docs/fmha.md.
#include <cmath>

#include "ops/cuda/fmha_common.cuh"

namespace nopad::cuda {
namespace fmha_detail {

inline size_t dq_accum_offset(int32_t num_tokens, int32_t num_heads) {
  const size_t d_bytes = static_cast<size_t>(num_heads) * static_cast<size_t>(num_tokens) * sizeof(float);
  return (d_bytes + 255) / 256 * 256;
}

constexpr int kPreRows = 8;  // rows per CTA of the pre/post kernels (one warp each)

// D[h, t] = sum_d dO[t, h*hd + d] * O[t, h*hd + d]; dq_accum[t, :] = 0. One warp per token row; lanes take 16-byte
// chunks, the hd/8 lanes of one head reduce with shuffles.
template <bool kFp16>
__global__ void __launch_bounds__(32 * kPreRows) fmha_bwd_pre_kernel(const KernelArgs args, float* D, float* dq_acc) {
  const FmhaParams& p = args.p;
  int b, s0, L;
  launch_sequence(p, static_cast<int>(blockIdx.y), b, s0, L);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * kPreRows + warp;
  if (row >= L) return;  // warp-uniform
  const int hd = p.head_dim, H = p.num_heads * hd, chunks = H / 8, per_head = hd / 8;
  const int64_t tok = s0 + row;
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
    if (c < chunks && c % per_head == 0) D[int64_t{c / per_head} * p.num_tokens + tok] = sum;
  }
  float4* dq = reinterpret_cast<float4*>(dq_acc + tok * H);
  for (int c = lane; c < H / 4; c += 32) dq[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// d_qkv[t, 0:H] = dq_accum[t, :] (the scale is already applied), rounded to 16 bits.
template <bool kFp16>
__global__ void __launch_bounds__(32 * kPreRows) fmha_bwd_dq_kernel(const KernelArgs args, const float* dq_acc) {
  const FmhaParams& p = args.p;
  int b, s0, L;
  launch_sequence(p, static_cast<int>(blockIdx.y), b, s0, L);
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * kPreRows + warp;
  if (row >= L) return;
  const int H = p.num_heads * p.head_dim;
  const int64_t tok = s0 + row;
  const float4* src = reinterpret_cast<const float4*>(dq_acc + tok * H);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.d_qkv) + tok * 3 * H);
  for (int c = lane; c < H / 8; c += 32) {
    const float4 a = src[2 * c], bb = src[2 * c + 1];
    dst[c] = make_uint4(pack2<kFp16>(a.x, a.y), pack2<kFp16>(a.z, a.w), pack2<kFp16>(bb.x, bb.y),
                        pack2<kFp16>(bb.z, bb.w));
  }
}

template <int HD>
constexpr int bwd_smem_bytes() {
  // K, V, Q x2, dO x2 (16-bit), dS^T 64x64 (16-bit), lse x2 and D x2 (fp32).
  return (2 * kBlockN * HD + 4 * kBlockM * HD + kBlockN * kBlockM) * 2 + 4 * kBlockM * 4;
}

// CTAs per SM to fit the registers for: at head_dim <= 64, 168 registers give 3 CTAs (12 warps) per SM instead of 2;
// at 128 the cap would spill the dK/dV accumulators.
constexpr int bwd_min_ctas(int hd) { return hd <= 64 ? 3 : 1; }

template <int HD, bool kFp16, bool kDrop>
__global__ void __launch_bounds__(kThreads, bwd_min_ctas(HD))
    fmha_bwd_kernel(const KernelArgs args, const float* D, float* dq_acc) {
  constexpr int kKSteps = HD / 16;
  constexpr int kDTiles = HD / 8;
  constexpr int kNTiles = kBlockM / 8;  // n-tiles of S^T over the query tile
  const FmhaParams& p = args.p;

  int b, s0, L;
  launch_sequence(p, static_cast<int>(blockIdx.z), b, s0, L);
  const int k0 = static_cast<int>(blockIdx.x) * kBlockN;
  if (k0 >= L) return;
  const int head = static_cast<int>(blockIdx.y);
  const int H = p.num_heads * HD, T = p.num_tokens;
  const int64_t ld = 3 * int64_t{H};
  const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);
  const uint16_t* gQ = qkv + int64_t{s0} * ld + head * HD;
  const uint16_t* gdO = static_cast<const uint16_t*>(p.d_ctx) + int64_t{s0} * H + head * HD;
  const float* gLse = p.lse + int64_t{head} * T + s0;
  const float* gD = D + int64_t{head} * T + s0;

  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sK = smem;                     // [64][HD]
  uint16_t* sV = sK + kBlockN * HD;        // [64][HD]
  uint16_t* sQ = sV + kBlockN * HD;        // [2][64][HD]
  uint16_t* sdO = sQ + 2 * kBlockM * HD;   // [2][64][HD]
  uint16_t* sdS = sdO + 2 * kBlockM * HD;  // [64 keys][64 queries], swizzled as a 64-column tile
  float* sLse = reinterpret_cast<float*>(sdS + kBlockN * kBlockM);  // [2][64], log2 domain; +inf past the end
  float* sD = sLse + 2 * kBlockM;                                     // [2][64]

  const int tid = static_cast<int>(threadIdx.x);
  auto load_q_tile = [&](int i, int buf) {
    const int qs = i * kBlockM;
    load_tile_async<HD>(sQ + buf * kBlockM * HD, gQ + int64_t{qs} * ld, ld, L - qs);
    load_tile_async<HD>(sdO + buf * kBlockM * HD, gdO + int64_t{qs} * H, H, L - qs);
    if (tid < kBlockM) {  // plain loads; published by the __syncthreads at the top of the iteration that uses them
      const bool ok = qs + tid < L;
      sLse[buf * kBlockM + tid] = ok ? gLse[qs + tid] * kLog2e : INFINITY;
      sD[buf * kBlockM + tid] = ok ? gD[qs + tid] : 0.0f;
    }
  };
  load_tile_async<HD>(sK, qkv + int64_t{s0 + k0} * ld + H + head * HD, ld, L - k0);
  load_tile_async<HD>(sV, qkv + int64_t{s0 + k0} * ld + 2 * H + head * HD, ld, L - k0);
  load_q_tile(0, 0);
  cp_async_commit();

  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16;  // this warp's first key within the K tile
  const bool key_ok0 = k0 + wrow + g < L, key_ok1 = k0 + wrow + g + 8 < L;
  // Dropout in the transposed layout: for a query column, one Philox block covers keys 4a..4a+3, i.e. rows g = 4a+r
  // of lanes r = 0..3 (lane bits 2-3). Lane r draws block r of {(q 2t, keys g0..), (q 2t+1, keys g0..),
  // (q 2t, keys g0+8..), (q 2t+1, keys g0+8..)} with g0 = 4a: one Philox call per lane per n-tile. The keep bits of
  // a whole tile (a nibble per n-tile) are then transposed over those 4 lanes with 3 shuffles.
  const int quad_r = g & 3;
  uint32_t s_lo = 0, s_hi = 0, key_q = 0, head_hi = 0;
  if constexpr (kDrop) {
    const uint64_t sample = p.sample_ids[b];
    s_lo = static_cast<uint32_t>(sample);
    s_hi = static_cast<uint32_t>(sample >> 32);
    const int drop_key4 = k0 + wrow + (g & ~3) + ((quad_r >> 1) ? 8 : 0);
    key_q = static_cast<uint32_t>(drop_key4) >> 2;          // low word: (query << 18) | key / 4
    head_hi = static_cast<uint32_t>(head) << 6;             // high word: (head << 6) | (query >> 14)
  }

  float dv[kDTiles][4], dk[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.0f;

  const int num_qt = (L + kBlockM - 1) / kBlockM;
  for (int i = 0; i < num_qt; ++i) {
    const int buf = i & 1, qs = i * kBlockM;
    cp_async_wait<0>();
    __syncthreads();  // tile i (and its lse/D) visible; every warp done with tile i-1's buffers and with sdS
    if (i + 1 < num_qt) load_q_tile(i + 1, buf ^ 1);
    cp_async_commit();
    const uint16_t* q = sQ + buf * kBlockM * HD;
    const uint16_t* d_o = sdO + buf * kBlockM * HD;
    const float* lse2 = sLse + buf * kBlockM;
    const float* Dq = sD + buf * kBlockM;

    // Keep mask of this tile, bit 4 nt + e for accumulator element e of n-tile nt; independent of S and dP, so the
    // integer work can overlap the tensor-core work below.
    uint32_t keep = 0;
    if constexpr (kDrop) {
      uint32_t mine = 0;  // nibble nt: bit k = keep of element k of this lane's block
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const uint32_t qpos = static_cast<uint32_t>(qs + nt * 8 + 2 * t + (quad_r & 1));
        const Philox4x32 blk = dropout_block(args, s_lo, s_hi, (qpos << 18) | key_q, head_hi | (qpos >> 14));
        const uint32_t bits = static_cast<uint32_t>(blk.v[0] >= args.keep_min) |
                              (static_cast<uint32_t>(blk.v[1] >= args.keep_min) << 1) |
                              (static_cast<uint32_t>(blk.v[2] >= args.keep_min) << 2) |
                              (static_cast<uint32_t>(blk.v[3] >= args.keep_min) << 3);
        mine |= bits << (4 * nt);
      }
      // Lane quad_r ^ x holds block (element) quad_r ^ x; this lane needs bit quad_r of each of its nibbles.
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const uint32_t w = x == 0 ? mine : __shfl_xor_sync(0xffffffffu, mine, 4 * x);
        keep |= ((w >> quad_r) & 0x11111111u) << (quad_r ^ x);
      }
    }

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

    // P^T = exp(S^T * scale - lse) (0 for keys or queries past the end), dropout, dS^T = P^T (dP'^T - D).
    // The mask is drawn once per tile and serves both P' (dV) and dP' (dS).
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);
        const bool ok = (e < 2) ? key_ok0 : key_ok1;
        const float pr = ok ? exp2f(fmaf(s[nt][e], args.scale_log2, -lse2[qc])) : 0.0f;
        const float kf = kDrop ? (((keep >> (4 * nt + e)) & 1u) ? args.inv_keep : 0.0f) : 1.0f;
        s[nt][e] = pr * kf;                         // P' (for dV)
        dp[nt][e] = pr * (dp[nt][e] * kf - Dq[qc]);  // dS (unscaled)
      }
    }

    // dV += P'^T dO, dK += dS^T Q: the accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint32_t pa[4] = {pack2<kFp16>(s[2 * kk][0], s[2 * kk][1]), pack2<kFp16>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<kFp16>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<kFp16>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const uint32_t da[4] = {pack2<kFp16>(dp[2 * kk][0], dp[2 * kk][1]),
                              pack2<kFp16>(dp[2 * kk][2], dp[2 * kk][3]),
                              pack2<kFp16>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                              pack2<kFp16>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
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
      // dS^T to shared memory (rows = keys, columns = queries) for dQ = dS K.
      *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g, 2 * kk) + 2 * t) = da[0];
      *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g + 8, 2 * kk) + 2 * t) = da[1];
      *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g, 2 * kk + 1) + 2 * t) = da[2];
      *reinterpret_cast<uint32_t*>(sdS + swz<64>(wrow + g + 8, 2 * kk + 1) + 2 * t) = da[3];
    }
    __syncthreads();  // all of dS^T written

    // dQ (this warp's 16 queries x HD) = dS K over the tile's 64 keys; A = dS read transposed from dS^T.
    float dq[kDTiles][4];
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, sdS + swz<64>(kk * 16 + (lane & 7) + (lane >> 4) * 8, warp * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int d2 = 0; d2 < HD / 16; ++d2) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, sK + swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, d2 * 2 + (lane >> 4)));
        mma16816<kFp16>(dq[2 * d2], a, r[0], r[1]);
        mma16816<kFp16>(dq[2 * d2 + 1], a, r[2], r[3]);
      }
    }
    const int qr0 = qs + wrow + g, qr1 = qr0 + 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Lanes t, t^1 swap half their values so that each holds 4 consecutive columns of one row: the even lane row g,
    // the odd lane row g+8; one 16-byte atomic instead of four 4-byte ones.
    const bool odd = (t & 1) != 0;
    const int qr = odd ? qr1 : qr0;
    float* dst_row = dq_acc + int64_t{s0 + qr} * H + head * HD + 4 * (t >> 1);
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      const float r0 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][0] : dq[n][2], 1);
      const float r1 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][1] : dq[n][3], 1);
      const float4 v = odd ? make_float4(r0 * p.scale, r1 * p.scale, dq[n][2] * p.scale, dq[n][3] * p.scale)
                           : make_float4(dq[n][0] * p.scale, dq[n][1] * p.scale, r0 * p.scale, r1 * p.scale);
      if (qr < L) atomicAdd(reinterpret_cast<float4*>(dst_row + n * 8), v);
    }
#else
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      const int col = head * HD + n * 8 + 2 * t;
      if (qr0 < L) {
        float* dst = dq_acc + int64_t{s0 + qr0} * H + col;
        atomicAdd(dst, dq[n][0] * p.scale);
        atomicAdd(dst + 1, dq[n][1] * p.scale);
      }
      if (qr1 < L) {
        float* dst = dq_acc + int64_t{s0 + qr1} * H + col;
        atomicAdd(dst, dq[n][2] * p.scale);
        atomicAdd(dst + 1, dq[n][3] * p.scale);
      }
    }
#endif
  }

  // dK (scaled) and dV into d_qkv's k and v blocks, rows of this warp's keys that exist.
  uint16_t* dqkv = static_cast<uint16_t*>(p.d_qkv);
  const int kr0 = k0 + wrow + g, kr1 = kr0 + 8;
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) {
    const int col = head * HD + n * 8 + 2 * t;
    if (kr0 < L) {
      uint16_t* row = dqkv + int64_t{s0 + kr0} * ld;
      *reinterpret_cast<uint32_t*>(row + H + col) = pack2<kFp16>(dk[n][0] * p.scale, dk[n][1] * p.scale);
      *reinterpret_cast<uint32_t*>(row + 2 * H + col) = pack2<kFp16>(dv[n][0], dv[n][1]);
    }
    if (kr1 < L) {
      uint16_t* row = dqkv + int64_t{s0 + kr1} * ld;
      *reinterpret_cast<uint32_t*>(row + H + col) = pack2<kFp16>(dk[n][2] * p.scale, dk[n][3] * p.scale);
      *reinterpret_cast<uint32_t*>(row + 2 * H + col) = pack2<kFp16>(dv[n][2], dv[n][3]);
    }
  }
}

template <int HD, bool kFp16>
void launch_backward(const FmhaParams& p, int32_t n, cudaStream_t stream) {
  const KernelArgs args = make_args(p);
  float* D = static_cast<float*>(p.workspace);
  float* dq_acc = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + dq_accum_offset(p.num_tokens, p.num_heads));
  const dim3 row_grid((p.max_seqlen + kPreRows - 1) / kPreRows, n);
  fmha_bwd_pre_kernel<kFp16><<<row_grid, 32 * kPreRows, 0, stream>>>(args, D, dq_acc);
  NOPAD_CUDA_CHECK_LAUNCH();
  constexpr int smem = bwd_smem_bytes<HD>();
  const dim3 grid((p.max_seqlen + kBlockN - 1) / kBlockN, p.num_heads, n);
  if (args.dropout) {
    ensure_smem<fmha_bwd_kernel<HD, kFp16, true>>(smem);
    fmha_bwd_kernel<HD, kFp16, true><<<grid, kThreads, smem, stream>>>(args, D, dq_acc);
  } else {
    ensure_smem<fmha_bwd_kernel<HD, kFp16, false>>(smem);
    fmha_bwd_kernel<HD, kFp16, false><<<grid, kThreads, smem, stream>>>(args, D, dq_acc);
  }
  NOPAD_CUDA_CHECK_LAUNCH();
  fmha_bwd_dq_kernel<kFp16><<<row_grid, 32 * kPreRows, 0, stream>>>(args, dq_acc);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <int HD>
void launch_backward_hd(const FmhaParams& p, int32_t n, cudaStream_t stream) {
  if (p.fp16) {
    launch_backward<HD, true>(p, n, stream);
  } else {
    launch_backward<HD, false>(p, n, stream);
  }
}

}  // namespace fmha_detail

size_t fmha_backward_workspace_bytes(int32_t num_tokens, int32_t num_heads, int32_t head_dim) {
  NOPAD_CHECK(num_tokens >= 0 && num_heads >= 0 && head_dim >= 0, "fmha_backward_workspace_bytes: negative size");
  return fmha_detail::dq_accum_offset(num_tokens, num_heads) +
         static_cast<size_t>(num_tokens) * static_cast<size_t>(num_heads) * static_cast<size_t>(head_dim) *
             sizeof(float);
}

void fmha_backward(const FmhaParams& p, cudaStream_t stream) {
  using namespace fmha_detail;
  const int32_t n = validate_common(p, "fmha_backward");
  NOPAD_CHECK(p.d_ctx != nullptr && p.d_qkv != nullptr && p.workspace != nullptr, "fmha_backward: d_ctx, d_qkv and ",
              "workspace must not be null");
  NOPAD_CHECK(aligned16(p.d_ctx) && aligned16(p.d_qkv) && aligned16(p.workspace),
              "fmha_backward: d_ctx, d_qkv and workspace must be 16-byte aligned");
  const size_t need = fmha_backward_workspace_bytes(p.num_tokens, p.num_heads, p.head_dim);
  NOPAD_CHECK(p.workspace_bytes >= need, "fmha_backward: workspace of ", p.workspace_bytes, " bytes is too small, ",
              "need ", need, " (fmha_backward_workspace_bytes)");
  if (n == 0 || p.max_seqlen == 0) return;
  switch (p.head_dim) {
    case 32: launch_backward_hd<32>(p, n, stream); break;
    case 64: launch_backward_hd<64>(p, n, stream); break;
    case 128: launch_backward_hd<128>(p, n, stream); break;
    default: fail("fmha_backward: unsupported head_dim ", p.head_dim);
  }
}

}  // namespace nopad::cuda
