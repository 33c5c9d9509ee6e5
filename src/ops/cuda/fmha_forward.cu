// FMHA forward (FlashAttention-2 style) on mma.sync tensor cores: one CTA per (query tile of 64, head, sequence),
// 4 warps x 16 query rows, K/V tiles of 64 keys double-buffered in shared memory with cp.async, online softmax in fp32
// registers, dropout from Philox in the kernel. Design: docs/fmha.md.
#include <cmath>

#include "ops/cuda/fmha_common.cuh"

namespace nopad::cuda {
namespace fmha_detail {

template <int HD>
constexpr int fwd_smem_bytes() {
  return (kBlockM * HD + 2 * kBlockN * HD + 2 * kBlockN * HD) * 2;  // Q, K x2, V x2 (16-bit elements)
}

// CTAs per SM to fit the registers for: at head_dim <= 64, 128 registers give 4 CTAs (16 warps) per SM instead of 3;
// at 128 the cap would spill the accumulators.
constexpr int fwd_min_ctas(int hd) { return hd <= 64 ? 4 : 1; }

template <int HD, bool kFp16, bool kDrop>
__global__ void __launch_bounds__(kThreads, fwd_min_ctas(HD)) fmha_fwd_kernel(const KernelArgs args) {
  constexpr int kKSteps = HD / 16;  // k-steps of Q K^T over the head dimension
  constexpr int kDTiles = HD / 8;   // n-tiles of the output over the head dimension
  constexpr int kNTiles = kBlockN / 8;
  const FmhaParams& p = args.p;

  int b, s0, L;
  launch_sequence(p, static_cast<int>(blockIdx.z), b, s0, L);
  const int q0 = static_cast<int>(blockIdx.x) * kBlockM;
  if (q0 >= L) return;  // CTA past its sequence's end (grid.x covers the longest sequence of the launch)
  const int head = static_cast<int>(blockIdx.y);
  const int H = p.num_heads * HD;
  const int64_t ld = 3 * int64_t{H};
  const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);

  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sQ = smem;
  uint16_t* sK = sQ + kBlockM * HD;       // [2][64][HD]
  uint16_t* sV = sK + 2 * kBlockN * HD;   // [2][64][HD]

  const uint16_t* gK = qkv + int64_t{s0} * ld + H + head * HD;
  const uint16_t* gV = gK + H;
  load_tile_async<HD>(sQ, qkv + int64_t{s0 + q0} * ld + head * HD, ld, L - q0);
  load_tile_async<HD>(sK, gK, ld, L);
  load_tile_async<HD>(sV, gV, ld, L);
  cp_async_commit();

  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16;  // this warp's first row within the Q tile

  uint32_t qf[kKSteps][4];
  float acc[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of rows g and g+8, exp2 domain
  float row_sum[2] = {0.0f, 0.0f};            // this thread's partial running sums (quad-reduced at the end)

  // Dropout: lanes t and t^1 cover the same 4 keys (2t, 2t+1 lie in one aligned group of 4); the even lane draws the
  // Philox block of row g, the odd lane that of row g+8, and they swap the halves the other needs (as bits, one
  // shuffle per tile).
  const bool odd = (t & 1) != 0;
  uint32_t s_lo = 0, s_hi = 0;
  uint32_t blk_lo = 0, blk_hi = 0;  // block of (this lane's drop row, key 4 (t/2)); key tile j adds 16 j, n-tile 2 nt
  if constexpr (kDrop) {
    const uint64_t sample = p.sample_ids[b];
    s_lo = static_cast<uint32_t>(sample);
    s_hi = static_cast<uint32_t>(sample >> 32);
    const uint64_t blk = attention_block(head, q0 + wrow + g + (odd ? 8 : 0), (t >> 1) * 4);
    blk_lo = static_cast<uint32_t>(blk);
    blk_hi = static_cast<uint32_t>(blk >> 32);
  }

  const int num_kt = (L + kBlockN - 1) / kBlockN;
  for (int j = 0; j < num_kt; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j visible to all warps; every warp is done with tile j-1's buffer
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk)
        ldmatrix_x4(qf[kk], sQ + swz<HD>(wrow + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4)));
    }
    if (j + 1 < num_kt) {
      const int buf = (j + 1) & 1, k1 = (j + 1) * kBlockN;
      load_tile_async<HD>(sK + buf * kBlockN * HD, gK + int64_t{k1} * ld, ld, L - k1);
      load_tile_async<HD>(sV + buf * kBlockN * HD, gV + int64_t{k1} * ld, ld, L - k1);
    }
    cp_async_commit();
    const uint16_t* k = sK + (j & 1) * kBlockN * HD;
    const uint16_t* v = sV + (j & 1) * kBlockN * HD;

    // Keep mask of this tile, bit 4 nt + e for accumulator element s[nt][e]; independent of S, so the integer work
    // can overlap the tensor-core work below.
    uint32_t keep = 0;
    if constexpr (kDrop) {
      uint32_t own = 0, send = 0;  // bits 4 nt + {0, 1}
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const Philox4x32 blk = dropout_block(args, s_lo, s_hi, blk_lo + static_cast<uint32_t>(16 * j + 2 * nt), blk_hi);
        const uint32_t k0 = blk.v[0] >= args.keep_min, k1 = blk.v[1] >= args.keep_min;
        const uint32_t k2 = blk.v[2] >= args.keep_min, k3 = blk.v[3] >= args.keep_min;
        own |= ((odd ? k2 : k0) | ((odd ? k3 : k1) << 1)) << (4 * nt);
        send |= ((odd ? k0 : k2) | ((odd ? k1 : k3) << 1)) << (4 * nt);
      }
      const uint32_t got = __shfl_xor_sync(0xffffffffu, send, 1);
      keep = odd ? (got | (own << 2)) : (own | (got << 2));
    }

    // S = Q K^T for this warp's 16 rows x 64 keys.
    float s[kNTiles][4];
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t r[4];  // keys np*16 .. +15 (n), head dims kk*16 .. +15 (k)
        ldmatrix_x4(r, k + swz<HD>(np * 16 + (lane & 7) + (lane >> 4) * 8, kk * 2 + ((lane >> 3) & 1)));
        mma16816<kFp16>(s[2 * np], qf[kk], r[0], r[1]);
        mma16816<kFp16>(s[2 * np + 1], qf[kk], r[2], r[3]);
      }
    }

    // Mask keys past the end (last tile only), online softmax on raw scores: scale > 0, so the max commutes with
    // the scaling, which folds into one FFMA per element before exp2.
    const int kbase = j * kBlockN;
    if (kbase + kBlockN > L) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kbase + nt * 8 + 2 * t + (e & 1) >= L) s[nt][e] = -INFINITY;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // mx is finite: every key tile holds at least one key < L.
      const float alpha = exp2f((row_max[r] - mx) * args.scale_log2);  // 0 on the first tile (row_max = -inf)
      row_max[r] = mx;
      const float mx_s = mx * args.scale_log2;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        s[nt][2 * r] = exp2f(fmaf(s[nt][2 * r], args.scale_log2, -mx_s));
        s[nt][2 * r + 1] = exp2f(fmaf(s[nt][2 * r + 1], args.scale_log2, -mx_s));
        sum += s[nt][2 * r] + s[nt][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha + sum;  // the softmax denominator is taken before dropout
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc[dt][2 * r] *= alpha;
        acc[dt][2 * r + 1] *= alpha;
      }
    }

    // Dropped elements are zeroed; the 1/(1-p) of the kept ones is applied once, in the epilogue.
    if constexpr (kDrop) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = ((keep >> (4 * nt + e)) & 1u) ? s[nt][e] : 0.0f;
    }

    // O += P' V: the S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack2<kFp16>(s[2 * kk][0], s[2 * kk][1]), pack2<kFp16>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<kFp16>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<kFp16>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t r[4];  // keys kk*16 .. +15 (k), head dims dp*16 .. +15 (n), transposed
        ldmatrix_x4_trans(r, v + swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4)));
        mma16816<kFp16>(acc[2 * dp], a, r[0], r[1]);
        mma16816<kFp16>(acc[2 * dp + 1], a, r[2], r[3]);
      }
    }
  }

  // Epilogue: O = acc / sum, lse = max + log(sum) in natural log; O staged through this warp's own rows of sQ (only
  // this warp ever read them) for 16-byte coalesced stores.
  const int T = p.num_tokens;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[r] = (kDrop ? args.inv_keep : 1.0f) / sum;
    const int row = q0 + wrow + g + 8 * r;
    if (t == 0 && row < L) p.lse[int64_t{head} * T + s0 + row] = row_max[r] * p.scale + logf(sum);
  }
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
    *reinterpret_cast<uint32_t*>(sQ + swz<HD>(wrow + g, dt) + 2 * t) =
        pack2<kFp16>(acc[dt][0] * inv[0], acc[dt][1] * inv[0]);
    *reinterpret_cast<uint32_t*>(sQ + swz<HD>(wrow + g + 8, dt) + 2 * t) =
        pack2<kFp16>(acc[dt][2] * inv[1], acc[dt][3] * inv[1]);
  }
  __syncwarp();
  uint16_t* ctx = static_cast<uint16_t*>(p.ctx);
  for (int i = lane; i < 16 * kDTiles; i += 32) {
    const int r = i / kDTiles, c = i % kDTiles, row = q0 + wrow + r;
    if (row < L)
      *reinterpret_cast<uint4*>(ctx + int64_t{s0 + row} * H + head * HD + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + swz<HD>(wrow + r, c));
  }
}

template <int HD, bool kFp16, bool kDrop>
void launch_forward_drop(const KernelArgs& args, const dim3 grid, cudaStream_t stream) {
  constexpr int smem = fwd_smem_bytes<HD>();
  ensure_smem<fmha_fwd_kernel<HD, kFp16, kDrop>>(smem);
  fmha_fwd_kernel<HD, kFp16, kDrop><<<grid, kThreads, smem, stream>>>(args);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <int HD, bool kFp16>
void launch_forward(const FmhaParams& p, int32_t num_launch, cudaStream_t stream) {
  const KernelArgs args = make_args(p);
  const dim3 grid((p.max_seqlen + kBlockM - 1) / kBlockM, p.num_heads, num_launch);
  if (args.dropout) {
    launch_forward_drop<HD, kFp16, true>(args, grid, stream);
  } else {
    launch_forward_drop<HD, kFp16, false>(args, grid, stream);
  }
}

template <int HD>
void launch_forward_hd(const FmhaParams& p, int32_t n, cudaStream_t stream) {
  if (p.fp16) {
    launch_forward<HD, true>(p, n, stream);
  } else {
    launch_forward<HD, false>(p, n, stream);
  }
}

}  // namespace fmha_detail

void fmha_forward(const FmhaParams& p, cudaStream_t stream) {
  using namespace fmha_detail;
  const int32_t n = validate_common(p, "fmha_forward");
  if (n == 0 || p.max_seqlen == 0) return;
  switch (p.head_dim) {
    case 32: launch_forward_hd<32>(p, n, stream); break;
    case 64: launch_forward_hd<64>(p, n, stream); break;
    case 128: launch_forward_hd<128>(p, n, stream); break;
    default: fail("fmha_forward: unsupported head_dim ", p.head_dim);
  }
}

}  // namespace nopad::cuda
