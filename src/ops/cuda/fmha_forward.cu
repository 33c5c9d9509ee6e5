// FMHA forward (FlashAttention-2 style) on mma.sync tensor cores: one CTA per (query tile, head, sequence), each warp
// owning 16 or 32 query rows (one or two m16 tiles), K/V tiles of 64 keys double-buffered in shared memory with
// cp.async and shared by all warps, online softmax in fp32 registers, dropout from Philox in the kernel (one block per
// 8 mask elements, keep bits exchanged inside each quad). Tile shapes are template parameters; the variants listed in
// kFwdVariants are instantiated and chosen per call (fmha.h). Design: docs/fmha.md.
#include <atomic>
#include <cmath>
#include <type_traits>

#include "ops/cuda/fmha_common.cuh"
#include "ops/cuda/fmha_wgmma.cuh"

namespace nopad::cuda {
namespace fmha_detail {

// ------------------------------------------------------------------------------------------------ per-warp steps
// What both forward kernels (mma.sync and wgmma) do with one warp's 16 query rows of a 64-key tile: the m16n8
// accumulator fragments of fmha_common.cuh, n-tile by n-tile (g = lane / 4 rows g and g + 8, t = lane % 4).

// Online softmax of one key tile: keys >= kvalid to -inf (kPartial), the running max and sum of rows g, g + 8
// updated, s replaced by exp2(s * scale_log2 - max * scale_log2), O rescaled. Raw scores: scale > 0, so the max
// commutes with the scaling, which folds into one FFMA per element before exp2.
// kPermutedKeys: the tile's key rows were loaded permuted (fmha_dropout::fwd_key_perm), column 8 nt + 2 t + h holds
// key 16 t + 2 nt + h of the tile.
template <bool kPartial, int kDTiles, bool kPermutedKeys = false>
__device__ __forceinline__ void softmax_tile(float (&s)[kTile / 8][4], float (&acc)[kDTiles][4], float (&row_max)[2],
                                             float (&row_sum)[2], int kvalid, int t, float scale_log2) {
  constexpr int kNTiles = kTile / 8;
  if constexpr (kPartial) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kPermutedKeys ? fmha_dropout::fwd_permuted_key(nt, t, e) : nt * 8 + 2 * t + (e & 1);
        if (key >= kvalid) s[nt][e] = -INFINITY;
      }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // mx is finite: every key tile holds at least one key < L.
    const float alpha = exp2_ftz((row_max[r] - mx) * scale_log2);  // 0 on the first tile
    row_max[r] = mx;
    const float mx_s = mx * scale_log2;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      s[nt][2 * r] = exp2_ftz(fmaf(s[nt][2 * r], scale_log2, -mx_s));
      s[nt][2 * r + 1] = exp2_ftz(fmaf(s[nt][2 * r + 1], scale_log2, -mx_s));
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha + sum;  // the softmax denominator is taken before dropout
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      acc[dt][2 * r] *= alpha;
      acc[dt][2 * r + 1] *= alpha;
    }
  }
}

// Dropped elements of P to 0 (keep bit fmha_dropout::fwd_bit(nt, e)); the keep-scale of the kept ones is applied once,
// in the epilogue.
__device__ __forceinline__ void drop_tile(float (&s)[kTile / 8][4], uint32_t keep) {
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = ((keep >> fmha_dropout::fwd_bit(nt, e)) & 1u) ? s[nt][e] : 0.0f;
}

// Dropout on the packed P' fragments of the wgmma forward (keys permuted, so the lane's own blocks hold its bits):
// a[kk][2j] / a[kk][2j + 1] are the pair (elements 0-1 / 2-3) of n-tile 2kk + j for row g / g + 8, whose keep draws are
// fields fwd_own_field(2kk + j, 0) and + 1 (two adjacent bytes of one word) of block b0 / b1. Each byte pair is widened
// to two 16-bit halves (PRMT), compared as f16 bit patterns with the threshold in both halves (0..255 are
// non-negative subnormal f16s and order like the integers; set.ge gives 0xFFFF per kept half), and the mask ANDed
// into the packed values.
__device__ __forceinline__ uint32_t keep_halves(uint32_t word, uint32_t selector, uint32_t threshold2) {
  uint32_t halves, mask;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(halves) : "r"(word), "r"(selector));
  asm("set.ge.u32.f16x2 %0, %1, %2;\n" : "=r"(mask) : "r"(halves), "r"(threshold2));
  return mask;
}
__device__ __forceinline__ void drop_fragments(uint32_t (&a)[kTile / 16][4], const Philox4x32& b0, const Philox4x32& b1,
                                               uint32_t threshold2) {
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 2; ++r)  // row g (block b0), then row g + 8 (block b1)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int f = fmha_dropout::fwd_own_field(2 * kk + j, 0);  // word f >> 2, bytes f & 3 and + 1
        // PRMT selector: output bytes 0 and 2 from source bytes f & 3 and (f & 3) + 1, bytes 1 and 3 zero (byte 4).
        const uint32_t sel = 0x4040u | static_cast<uint32_t>(f & 3) | static_cast<uint32_t>((f & 3) + 1) << 8;
        a[kk][2 * j + r] &= keep_halves((r ? b1 : b0).v[f >> 2], sel, threshold2);
      }
}

// Epilogue of one warp's 16 rows, rows mrow .. mrow + 15 of the query tile that starts at query q0 (s0, L: the
// sequence's query rows, launch_queries): lse = max * scale +
// ln(sum) (natural log) by lane t = 0 of each row; O = acc * keep_scale / sum as 16-bit into the same rows of the
// swizzled tile sQ (rows no other warp reads), from where store_rows() writes them with 16-byte stores.
template <int HD, bool kFp16, bool kDrop>
__device__ __forceinline__ void finish_rows(const KernelArgs& args, const float (&acc)[HD / 8][4],
                                            const float (&row_max)[2], const float (&row_sum)[2], uint16_t* sQ,
                                            int mrow, int q0, int s0, int L, int head, int g, int t) {
  const FmhaParams& p = args.p;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    // sum >= 1 (the row max contributes exp2(0)): a reciprocal without the IEEE division's slow-path call.
    inv[r] = (kDrop ? args.keep_scale : 1.0f) * __frcp_rn(sum);
    const int row = q0 + mrow + g + 8 * r;
    if (t == 0 && row < L) p.lse[int64_t{head} * query_tokens(p) + s0 + row] = row_max[r] * p.scale + logf(sum);
  }
  __syncwarp();  // every lane's last read of these rows (ldmatrix of Q) is done before they are overwritten
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    *reinterpret_cast<uint32_t*>(sQ + swz<HD>(mrow + g, dt) + 2 * t) =
        pack2<kFp16>(acc[dt][0] * inv[0], acc[dt][1] * inv[0]);
    *reinterpret_cast<uint32_t*>(sQ + swz<HD>(mrow + g + 8, dt) + 2 * t) =
        pack2<kFp16>(acc[dt][2] * inv[1], acc[dt][3] * inv[1]);
  }
}

// Rows [wrow, wrow + rows) of sQ, staged by finish_rows, to ctx; rows past the sequence end are not stored.
template <int HD>
__device__ __forceinline__ void store_rows(const FmhaParams& p, const uint16_t* sQ, int wrow, int rows, int q0, int s0,
                                           int L, int head, int lane) {
  constexpr int kChunks = HD / 8;
  uint16_t* ctx = static_cast<uint16_t*>(p.ctx);
  const int H = p.num_heads * HD;
  __syncwarp();
  for (int i = lane; i < rows * kChunks; i += 32) {
    const int r = i / kChunks, c = i % kChunks, row = q0 + wrow + r;
    if (row < L)
      *reinterpret_cast<uint4*>(ctx + int64_t{s0 + row} * H + head * HD + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + swz<HD>(wrow + r, c));
  }
}

// kWarps warps x kMT m16 tiles of query rows per warp.
template <int HD, int kWarps, int kMT>
struct FwdShape {
  static constexpr int kWarpRows = 16 * kMT;
  static constexpr int kBlockM = kWarps * kWarpRows;  // query rows per CTA
  static constexpr int kThreads = 32 * kWarps;
  // Q fragments live in registers for the whole CTA when they fit next to 2 x kMT x HD/2 accumulator floats;
  // otherwise (kMT = 2 at HD = 128) they are re-read from shared memory for every key tile.
  static constexpr bool kQInRegs = kMT == 1;
  static constexpr int kSmemBytes = (kBlockM * HD + 4 * kTile * HD) * 2;  // Q, K x2, V x2 (16-bit elements)
};

template <int HD, int kWarps, int kMT, int kMinCtas, bool kFp16, bool kDrop>
__global__ void __launch_bounds__(32 * kWarps, kMinCtas) fmha_fwd_kernel(const __grid_constant__ KernelArgs args) {
  using Sh = FwdShape<HD, kWarps, kMT>;
  constexpr int kKSteps = HD / 16;  // k-steps of Q K^T over the head dimension
  constexpr int kDTiles = HD / 8;   // n-tiles of the output over the head dimension
  constexpr int kNTiles = kTile / 8;
  constexpr int kQF = Sh::kQInRegs ? kMT : 1;
  const FmhaParams& p = args.p;

  int b, s0, L, qs0, Lq;
  launch_sequence(p, static_cast<int>(blockIdx.z), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int q0 = static_cast<int>(blockIdx.x) * Sh::kBlockM;
  if (q0 >= Lq) return;  // CTA past its sequence's last query (grid.x covers the most queries of a sequence)
  const int head = static_cast<int>(blockIdx.y);
  const int H = p.num_heads * HD;
  const int64_t ld = 3 * int64_t{H};
  const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);

  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sQ = smem;
  uint16_t* sK = sQ + Sh::kBlockM * HD;  // [2][64][HD]
  uint16_t* sV = sK + 2 * kTile * HD;    // [2][64][HD]

  const uint16_t* gK = qkv + int64_t{s0} * ld + H + head * HD;  // the K/V tile last issued
  const uint16_t* gV = gK + H;
  {
    const TileCopy<HD, Sh::kBlockM, Sh::kThreads> q_copy(ld);
    q_copy.load(sQ, query_source(p) + int64_t{qs0 + q0} * ld + head * HD, Lq - q0);
  }
  const TileCopy<HD, kTile, Sh::kThreads> kv_copy(ld);
  kv_copy.load(sK, gK, L);
  kv_copy.load(sV, gV, L);
  cp_async_commit();

  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * Sh::kWarpRows;  // this warp's first row within the Q tile
  // A warp whose rows all lie past the end only joins the barriers and the copies (warp-uniform).
  const bool live = q0 + wrow < Lq;

  uint32_t qf[kQF][kKSteps][4];
  float acc[kMT][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;
  float row_max[kMT][2], row_sum[kMT][2];  // running max (raw scores) of rows g, g+8; this thread's partial sums
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  const MaskDraw draw = mask_draw<kDrop>(args, b);
  // The dropout keys of the lane's rows g and g + 8 of each m-tile: their positions in the sequence.
  [[maybe_unused]] uint32_t qpos[kMT][2];
  if constexpr (kDrop) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) qpos[mt][r] = query_position(p, qs0, Lq, q0 + wrow + 16 * mt + g + 8 * r);
  }

  // One key tile. kPartial: the tile holds fewer than 64 valid keys (the sequence's last tile): 16-key groups past the
  // end skip their products and the keys past the end are masked; full tiles carry no such code.
  const auto tile = [&](const uint16_t* k, const uint16_t* v, int kbase, auto partial) {
    constexpr bool kPartial = decltype(partial)::value;
    const int kvalid = L - kbase;  // > 0; < 64 only when kPartial

    // S = Q K^T for this warp's rows x 64 keys.
    float s[kMT][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int i = 0; i < kNTiles; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (Sh::kQInRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) qa[mt][i] = qf[mt][kk][i];
        } else {
          ldmatrix_x4(qa[mt], sQ + swz<HD>(wrow + 16 * mt + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4)));
        }
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        if (kPartial && np * 16 >= kvalid) continue;  // all 16 keys past the end
        uint32_t r[4];  // keys np*16 .. +15 (n), head dims kk*16 .. +15 (k)
        ldmatrix_x4(r, k + swz<HD>(np * 16 + (lane & 7) + (lane >> 4) * 8, kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<kFp16>(s[mt][2 * np], qa[mt], r[0], r[1]);
          mma16816<kFp16>(s[mt][2 * np + 1], qa[mt], r[2], r[3]);
        }
      }
    }

    // Keep mask of this tile for each m-tile, bit fmha_dropout::fwd_bit(nt, e) for accumulator element s[mt][nt][e].
    // Independent of S, so the scheduler interleaves its integer work with the MMAs above. (Written after them: with
    // two m-tiles per warp the other order makes ptxas 13.0 fail register allocation.)
    [[maybe_unused]] uint32_t keep[kMT];  // read only with dropout
    if constexpr (kDrop) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        keep[mt] = lane_transpose<4, 0>(
            fmha_dropout::fwd_lane_bits_at(draw, args.threshold, static_cast<uint32_t>(head), qpos[mt][0],
                                           qpos[mt][1], static_cast<uint32_t>(kbase), static_cast<uint32_t>(t)),
            static_cast<uint32_t>(t));
      }
    }

#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      softmax_tile<kPartial>(s[mt], acc[mt], row_max[mt], row_sum[mt], kvalid, t, args.scale_log2);
      if constexpr (kDrop) drop_tile(s[mt], keep[mt]);
    }

    // O += P' V: the S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      if (kPartial && kk * 16 >= kvalid) continue;  // P' is zero for these keys
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) a_fragment<kFp16>(s[mt], kk, a[mt]);
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t r[4];  // keys kk*16 .. +15 (k), head dims dp*16 .. +15 (n), transposed
        ldmatrix_x4_trans(r, v + swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<kFp16>(acc[mt][2 * dp], a[mt], r[0], r[1]);
          mma16816<kFp16>(acc[mt][2 * dp + 1], a[mt], r[2], r[3]);
        }
      }
    }
  };

  const int num_kt = (L + kTile - 1) / kTile;
  for (int j = 0; j < num_kt; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j visible to all warps; every warp is done with tile j-1's buffer
    if constexpr (Sh::kQInRegs) {
      if (j == 0 && live) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < kKSteps; ++kk)
            ldmatrix_x4(qf[mt][kk],
                        sQ + swz<HD>(wrow + 16 * mt + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4)));
      }
    }
    if (j + 1 < num_kt) {  // one barrier per tile suffices: the buffer overwritten was last read before it
      const int buf = (j + 1) & 1, k1 = (j + 1) * kTile;
      gK += kTile * ld;  // now tile j + 1's
      gV += kTile * ld;
      kv_copy.load(sK + buf * kTile * HD, gK, L - k1);
      kv_copy.load(sV + buf * kTile * HD, gV, L - k1);
    }
    cp_async_commit();
    if (!live) continue;
    const uint16_t* k = sK + (j & 1) * kTile * HD;
    const uint16_t* v = sV + (j & 1) * kTile * HD;
    if ((j + 1) * kTile <= L) {
      tile(k, v, j * kTile, std::false_type{});
    } else {
      tile(k, v, j * kTile, std::true_type{});
    }
  }
  if (!live) return;

  // Epilogue: O and lse per m-tile, staged through this warp's own rows of sQ for 16-byte coalesced stores.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
    finish_rows<HD, kFp16, kDrop>(args, acc[mt], row_max[mt], row_sum[mt], sQ, wrow + 16 * mt, q0, qs0, Lq, head, g,
                                  t);
  store_rows<HD>(p, sQ, wrow, Sh::kWarpRows, q0, qs0, Lq, head, lane);
}

// ------------------------------------------------------------------------------------------------ Hopper (wgmma)
// head_dim 64 on warpgroup MMAs (sm_90a): kWG warpgroups x 64 query rows per CTA. S = Q K^T reads both operands from
// shared memory through descriptors (the tensor cores read each K tile once per warpgroup, where mma.sync needs one
// ldmatrix pass per warp), O += P' V takes P' from registers. Softmax and epilogue are those of fmha_fwd_kernel: per
// warp the accumulators have the same layout (fmha_wgmma.cuh). The K/V tiles are loaded with their rows permuted
// (fmha_dropout::fwd_key_perm), so each lane's S columns hold the keys of its own two Philox blocks and the dropout
// needs no lane exchange: drop_fragments masks the packed P' directly. The Philox draws of a tile are issued between
// the S products and their wait, so their integer work overlaps the tensor cores.
template <int kWG>
struct FwdWgShape {
  static constexpr int kBlockM = 64 * kWG;
  static constexpr int kThreads = 128 * kWG;
  static constexpr int kSmemBytes = (kWG + 4) * kTileBytes + kSmemAlign;  // Q, K x2, V x2, alignment slack
};

template <int kWG, int kMinCtas, bool kFp16, bool kDrop>
__global__ void __launch_bounds__(128 * kWG, kMinCtas) fmha_fwd_wgmma_kernel(const __grid_constant__ KernelArgs args) {
#if NOPAD_FMHA_WGMMA
  constexpr int HD = 64;
  using Sh = FwdWgShape<kWG>;
  constexpr int kNTiles = kTile / 8;
  constexpr int kDTiles = HD / 8;
  const FmhaParams& p = args.p;

  int b, s0, L, qs0, Lq;
  launch_sequence(p, static_cast<int>(blockIdx.z), b, s0, L);
  launch_queries(p, b, s0, L, qs0, Lq);
  const int q0 = static_cast<int>(blockIdx.x) * Sh::kBlockM;
  if (q0 >= Lq) return;
  const int head = static_cast<int>(blockIdx.y);
  const int H = p.num_heads * HD;
  const int64_t ld = 3 * int64_t{H};
  const uint16_t* qkv = static_cast<const uint16_t*>(p.qkv);

  extern __shared__ uint8_t smem_raw[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(align_smem(smem_raw));
  uint16_t* sK = sQ + Sh::kBlockM * HD;  // [2][64][HD]
  uint16_t* sV = sK + 2 * kTile * HD;    // [2][64][HD]

  const uint16_t* gK = qkv + int64_t{s0} * ld + H + head * HD;
  const uint16_t* gV = gK + H;
  {
    const TileCopy<HD, Sh::kBlockM, Sh::kThreads> q_copy(ld);
    q_copy.load(sQ, query_source(p) + int64_t{qs0 + q0} * ld + head * HD, Lq - q0);
  }
  // K and V rows permuted within each tile (fmha_dropout::fwd_key_perm): each lane's S columns then hold the keys of
  // its own Philox blocks, so the dropout needs no lane exchange. Softmax and P' V do not depend on the key order.
  const TileCopy<HD, kTile, Sh::kThreads, true> kv_copy(ld);
  kv_copy.load(sK, gK, L);
  kv_copy.load(sV, gV, L);
  cp_async_commit();

  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16;  // this warp's first row within the Q tile (warpgroup warp / 4 owns 64 of them)
  const uint64_t desc_q = wgmma_desc(sQ + (warp >> 2) * 64 * HD);

  float acc[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  const MaskDraw draw = mask_draw<kDrop>(args, b);
  [[maybe_unused]] uint32_t qpos[2];  // dropout keys of the lane's rows g and g + 8
  [[maybe_unused]] uint32_t threshold2 = 0;  // the threshold in both 16-bit halves (drop_fragments)
  if constexpr (kDrop) {
    qpos[0] = query_position(p, qs0, Lq, q0 + wrow + g);
    qpos[1] = query_position(p, qs0, Lq, q0 + wrow + g + 8);
    threshold2 = args.threshold * 0x00010001u;
  }

  const auto tile = [&](const uint16_t* k, const uint16_t* v, int kbase, auto partial) {
    constexpr bool kPartial = decltype(partial)::value;
    const int kvalid = L - kbase;

    float s[kNTiles][4];
    const uint64_t desc_k = wgmma_desc(k);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wgmma_ss<kFp16, 0, 0>(s, desc_q + kk * kDescStepK, desc_k + kk * kDescStepK, kk > 0);
    wgmma_commit();
    // The lane's two Philox blocks (rows g and g + 8, keys kbase + 16 t ..), drawn while the products run.
    [[maybe_unused]] Philox4x32 b0, b1;
    if constexpr (kDrop) {
      const uint32_t h = static_cast<uint32_t>(head), kt = static_cast<uint32_t>(kbase), lt = static_cast<uint32_t>(t);
      b0 = fmha_dropout::fwd_lane_block(draw, h, qpos[0], kt, lt);
      b1 = fmha_dropout::fwd_lane_block(draw, h, qpos[1], kt, lt);
    }
    wgmma_wait<0>();
    fence_regs(s);

    softmax_tile<kPartial, kDTiles, true>(s, acc, row_max, row_sum, kvalid, t, args.scale_log2);

    // O += P' V: A = P' (the S accumulators of n-tiles 2kk, 2kk+1), B = the V tile as an MN-major operand.
    uint32_t a[kTile / 16][4];
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) a_fragment<kFp16>(s, kk, a[kk]);
    if constexpr (kDrop) drop_fragments(a, b0, b1, threshold2);
    const uint64_t desc_v = wgmma_desc(v);
    wgmma_fence();  // acc was rescaled by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) wgmma_rs<kFp16, 1>(acc, a[kk], desc_v + kk * kDescStepMN);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    fence_regs(a);
  };

  const int num_kt = (L + kTile - 1) / kTile;
  for (int j = 0; j < num_kt; ++j) {
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's cp.async writes, visible to the tensor cores' reads after the barrier
    __syncthreads();
    if (j + 1 < num_kt) {
      const int buf = (j + 1) & 1, k1 = (j + 1) * kTile;
      gK += kTile * ld;
      gV += kTile * ld;
      kv_copy.load(sK + buf * kTile * HD, gK, L - k1);
      kv_copy.load(sV + buf * kTile * HD, gV, L - k1);
    }
    cp_async_commit();
    const uint16_t* k = sK + (j & 1) * kTile * HD;
    const uint16_t* v = sV + (j & 1) * kTile * HD;
    if ((j + 1) * kTile <= L) {
      tile(k, v, j * kTile, std::false_type{});
    } else {
      tile(k, v, j * kTile, std::true_type{});
    }
  }

  // Epilogue as in fmha_fwd_kernel (one m-tile per warp).
  finish_rows<HD, kFp16, kDrop>(args, acc, row_max, row_sum, sQ, wrow, q0, qs0, Lq, head, g, t);
  store_rows<HD>(p, sQ, wrow, 16, q0, qs0, Lq, head, lane);
#else
  __trap();  // never launched: the host selects these kernels only where fmha_wgmma_available()
#endif
}

// ------------------------------------------------------------------------------------------------ variants
// CTAs per SM each variant asks registers for (launch bounds): 16 rows per warp at HD <= 64 fits 128 registers, so
// 4 CTAs of 4 warps (16 warps per SM) instead of 3; two m-tiles per warp need 230-255 registers (2 CTAs of 4 warps, or
// 4 of 2 warps); HD = 128 is left unconstrained (a cap would spill the accumulators).
struct FwdVariant {
  const char* name;
  int warps, m_tiles;
  int warpgroups;  // > 0: the wgmma kernel with this many warpgroups (head_dim 64 on sm_90a)
};
constexpr FwdVariant kFwdVariants[] = {
    {"m64w4", 4, 1, 0},   // 0: 64 query rows, 4 warps x 16 rows (the design before variants)
    {"m128w4", 4, 2, 0},  // 1: 128 query rows, 4 warps x 32 rows: each K/V fragment read from shared memory feeds 2 MMAs
    {"m64w2", 2, 2, 0},   // 2: 64 query rows, 2 warps x 32 rows: same reuse with the 64-row tile granularity
    {"m128w8", 8, 1, 0},  // 3: 128 query rows, 8 warps x 16 rows: half the K/V tile loads per query row
    {"wg64", 4, 1, 1},    // 4: wgmma, one warpgroup x 64 query rows
    {"wg128", 8, 1, 2},   // 5: wgmma, two warpgroups x 64 rows sharing the K/V tiles
};
constexpr int kNumFwdVariants = static_cast<int>(sizeof(kFwdVariants) / sizeof(kFwdVariants[0]));
constexpr int kDefaultFwdVariant = 0;     // where the wgmma kernels cannot run
constexpr int kDefaultFwdVariantWg = 4;   // head_dim 64 on sm_90a

constexpr int fwd_min_ctas(int hd, int warps, int m_tiles) {
  if (hd > 64) return 1;
  if (m_tiles == 1) return warps == 4 ? 4 : 2;  // 128 registers: 16 warps per SM
  return warps == 4 ? 2 : 4;                    // no cap (255): 8 warps per SM
}

template <int HD, int kWarps, int kMT, bool kFp16, bool kDrop>
void launch_forward_kernel(const KernelArgs& args, int32_t num_launch, cudaStream_t stream) {
  using Sh = FwdShape<HD, kWarps, kMT>;
  constexpr auto kernel = fmha_fwd_kernel<HD, kWarps, kMT, fwd_min_ctas(HD, kWarps, kMT), kFp16, kDrop>;
  ensure_smem<kernel>(Sh::kSmemBytes);
  const dim3 grid((query_seqlen(args.p) + Sh::kBlockM - 1) / Sh::kBlockM, args.p.num_heads, num_launch);
  kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(args);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <int HD, int kWarps, int kMT>
void launch_forward_shape(const KernelArgs& args, int32_t n, cudaStream_t stream) {
  const bool fp16 = args.p.fp16;
  if (args.dropout) {
    fp16 ? launch_forward_kernel<HD, kWarps, kMT, true, true>(args, n, stream)
         : launch_forward_kernel<HD, kWarps, kMT, false, true>(args, n, stream);
  } else {
    fp16 ? launch_forward_kernel<HD, kWarps, kMT, true, false>(args, n, stream)
         : launch_forward_kernel<HD, kWarps, kMT, false, false>(args, n, stream);
  }
}

// Two m-tiles per warp at HD = 128 would need 2 x 64 accumulator floats plus 64 for S (ptxas spills or fails), so those
// variants run the default's kernel there (not instantiated).
template <int kWG, bool kFp16, bool kDrop>
void launch_forward_wgmma_kernel(const KernelArgs& args, int32_t num_launch, cudaStream_t stream) {
  using Sh = FwdWgShape<kWG>;
  constexpr auto kernel = fmha_fwd_wgmma_kernel<kWG, kWG == 1 ? 4 : 2, kFp16, kDrop>;
  ensure_smem<kernel>(Sh::kSmemBytes);
  const dim3 grid((query_seqlen(args.p) + Sh::kBlockM - 1) / Sh::kBlockM, args.p.num_heads, num_launch);
  kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(args);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <int kWG>
void launch_forward_wgmma(const KernelArgs& args, int32_t n, cudaStream_t stream) {
  const bool fp16 = args.p.fp16;
  if (args.dropout) {
    fp16 ? launch_forward_wgmma_kernel<kWG, true, true>(args, n, stream)
         : launch_forward_wgmma_kernel<kWG, false, true>(args, n, stream);
  } else {
    fp16 ? launch_forward_wgmma_kernel<kWG, true, false>(args, n, stream)
         : launch_forward_wgmma_kernel<kWG, false, false>(args, n, stream);
  }
}

template <int HD>
void launch_forward_hd(const KernelArgs& args, int variant, int32_t n, cudaStream_t stream) {
  if (HD > 64 && kFwdVariants[variant].m_tiles > 1) variant = kDefaultFwdVariant;
  // The wgmma kernels exist for head_dim 64 on sm_90a; elsewhere their variants run the default mma.sync kernel.
  if (kFwdVariants[variant].warpgroups > 0 && (HD != 64 || !fmha_wgmma_available())) variant = kDefaultFwdVariant;
  switch (variant) {
    case 0: launch_forward_shape<HD, 4, 1>(args, n, stream); break;
    case 1:
      if constexpr (HD <= 64) launch_forward_shape<HD, 4, 2>(args, n, stream);
      break;
    case 2:
      if constexpr (HD <= 64) launch_forward_shape<HD, 2, 2>(args, n, stream);
      break;
    case 3: launch_forward_shape<HD, 8, 1>(args, n, stream); break;
    case 4:
      if constexpr (HD == 64) launch_forward_wgmma<1>(args, n, stream);
      break;
    case 5:
      if constexpr (HD == 64) launch_forward_wgmma<2>(args, n, stream);
      break;
    default: fail("fmha_forward: no variant ", variant);
  }
}
static_assert(kNumFwdVariants == 6, "launch_forward_hd dispatches every variant");

namespace {
// What the launches need to know of the current device, read once per device ordinal: whether it is compute
// capability 9.0 and its multiprocessors. ok is false where the runtime cannot say (nothing is cached then).
struct DeviceFacts {
  bool ok = false, sm90 = false;
  int sms = 0;
};
DeviceFacts current_device_facts() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0: not read yet; else 1 | sm90 << 1 | sms << 2
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return {};
  int c = cached[dev].load(std::memory_order_relaxed);
  if (c == 0) {
    int major = 0, minor = 0, sms = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return {};
    c = 1 | (major == 9 && minor == 0 ? 2 : 0) | (sms << 2);
    cached[dev].store(c, std::memory_order_relaxed);
  }
  return {true, (c & 2) != 0, c >> 2};
}
}  // namespace

bool fmha_wgmma_available() {
#ifdef NOPAD_CUDA_SM90A
  return current_device_facts().sm90;
#else
  return false;  // this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90a)
#endif
}

int fmha_sm_count() {
  const DeviceFacts f = current_device_facts();
  NOPAD_CHECK(f.ok, "fmha: the CUDA runtime reports no current device or its multiprocessor count");
  return f.sms;
}

}  // namespace fmha_detail

int fmha_forward_variant_count() { return fmha_detail::kNumFwdVariants; }
const char* fmha_forward_variant_name(int variant) {
  NOPAD_CHECK(variant >= 0 && variant < fmha_detail::kNumFwdVariants, "no forward variant ", variant);
  return fmha_detail::kFwdVariants[variant].name;
}
int fmha_forward_variant(const FmhaParams& p) {
  using namespace fmha_detail;
  static const int env = variant_from_env("NOPAD_FMHA_FWD_VARIANT", kNumFwdVariants);
  const int fallback = p.head_dim == 64 && fmha_wgmma_available() ? kDefaultFwdVariantWg : kDefaultFwdVariant;
  return choose_variant(p.fwd_variant, env, fallback, kNumFwdVariants, "FmhaParams::fwd_variant");
}

void fmha_forward(const FmhaParams& p, cudaStream_t stream) {
  using namespace fmha_detail;
  const int32_t n = validate_common(p, "fmha_forward");
  const int variant = fmha_forward_variant(p);
  if (n == 0 || p.max_seqlen == 0 || query_seqlen(p) == 0) return;
  const KernelArgs args = make_args(p);
  switch (p.head_dim) {
    case 32: launch_forward_hd<32>(args, variant, n, stream); break;
    case 64: launch_forward_hd<64>(args, variant, n, stream); break;
    case 128: launch_forward_hd<128>(args, variant, n, stream); break;
    default: fail("fmha_forward: unsupported head_dim ", p.head_dim);
  }
}

}  // namespace nopad::cuda
