// nopad's Hopper GEMM with GELU / dGELU epilogues (contract and requirements: gemm_sm90.h).
//
// Structure: persistent, one CTA per SM, 128 x 256 output tiles walked in row-major tile order with a stride of the
// grid (consecutive CTAs share A's 128-row block in the L2; B, a weight of <= 8 MB, stays in the L2 throughout).
// 384 threads: warpgroup 0 is the producer (one thread issues the TMA loads of A [128 x 64] and B [256 x 64] k-blocks
// into a kStages-deep ring of 128-byte-swizzled stages, full/empty mbarriers; it gives its registers back with
// setmaxnreg), warpgroups 1 and 2 are the consumers: each owns 64 rows of the tile and issues m64n256k16 wgmma from
// shared memory (four per k-block) with one k-block in flight. After its main loop a consumer rounds its accumulators
// (+ bias) to 16 bits into its staging boxes (shared memory, the TMA store's swizzled layout; kBias and kGelu store
// them at once as out0) and moves on; the rest of the epilogue (kGelu: y = gelu(pre) in place; kDGelu: dpre =
// g * gelu'(aux) in place, with the column sums) is done in 16 units between the next tile's k-blocks, while its
// products run, each 64 x 64 box TMA-stored when complete (see the consumer code). Column sums (kDGelu): per unit a
// thread's 8 columns over its rows, reduced over the warp by shuffles, the 8 warps' sums combined in a fixed order
// through shared memory. Measured design history: docs/performance.md ("nopad's own GEMM with the GELU epilogue").
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/fmha_wgmma.cuh"
#include "ops/cuda/gemm_sm90.h"
#include "ops/cuda/kernels.cuh"

namespace nopad::cuda {
namespace gemm90 {

using fmha_detail::align_smem;
using fmha_detail::bulk_commit;
using fmha_detail::bulk_wait_read;
using fmha_detail::fence_proxy_async;
using fmha_detail::smem_u32;
using fmha_detail::wgmma_commit;
using fmha_detail::wgmma_desc;
using fmha_detail::wgmma_fence;
using fmha_detail::wgmma_wait;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
// Epilogue staging, per consumer warpgroup: its 64 rows x 256 columns of one 16-bit output as four 64 x 64 boxes in
// the 128-byte-swizzled layout the TMA store reads.
constexpr int kBoxBytes = 64 * 64 * 2, kStageOutBytes = 4 * kBoxBytes;
constexpr int kRedBytes = 8 * kBN * 4;  // kDGelu: the 8 consumer warps' column sums of a tile
constexpr int kBarBytes = 2 * kStages * 8;
constexpr int kSmemBytes =
    fmha_detail::kSmemAlign + kStages * kStageBytes + 2 * kStageOutBytes + kRedBytes + kBarBytes;
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
[[maybe_unused]] constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128 x 40 + 256 x 232 <= 65,536

// ------------------------------------------------------------------------------------------------ sm_90 primitives
#if NOPAD_FMHA_WGMMA
#define NOPAD_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define NOPAD_SM90_ASM(...) (void)0
#endif

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  NOPAD_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  NOPAD_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  NOPAD_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
// Blocks until the phase of parity `parity` has completed; on a fresh barrier, parity 1 (the phase "before" the
// first) counts as completed, which is how the producer passes the empty barriers on its first lap.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  NOPAD_SM90_ASM(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// 2D tensor-map load of one box into shared memory, completing `bytes` on the barrier (out-of-bounds rows: zeros).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  NOPAD_SM90_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}
// 2D tensor-map store of one box from shared memory (rows past the tensor are not written), as a bulk group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int x, int y) {
  NOPAD_SM90_ASM("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(x), "r"(y), "r"(smem_u32(src))
                 : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  NOPAD_SM90_ASM("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  NOPAD_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  NOPAD_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// d (64 x 256 fp32 per warpgroup; d[nt] = the m64n8 accumulator fragment of columns 8nt..8nt+7, fmha_wgmma.cuh's
// layout) (+)= A (64 x 16) B (16 x 256)^T, both K-major in shared memory.
#include "ops/cuda/gemm_sm90_wgmma.inc"

template <bool kFp16>
__device__ __forceinline__ void wgmma_256(float (&d)[32][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if NOPAD_FMHA_WGMMA
  if constexpr (kFp16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " NOPAD_WG256_D ", %128, %129, p, 1, 1, 0, 0;\n}\n"
        : NOPAD_WG256_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " NOPAD_WG256_D ", %128, %129, p, 1, 1, 0, 0;\n}\n"
        : NOPAD_WG256_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  }
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
#endif
}

// Two 16-bit values packed in a register (fmha_detail::pack2's layout: lo = the lower column) as floats.
template <bool kFp16>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (kFp16) {
    __half2_raw r;
    r.x = static_cast<unsigned short>(v & 0xffffu);
    r.y = static_cast<unsigned short>(v >> 16);
    return __half22float2(__half2(r));
  } else {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  }
}

// The erf GELU of the epilogue units, with fewer instructions than erff (~20 with two MUFU ops instead of ~31):
// Phi(x) = 0.5 erfc(-x / sqrt 2), erfc from the 10-term Chebyshev fit t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), whose
// fractional error is below 1.2e-7 over all z >= 0, so Phi keeps its relative accuracy in the negative tail too
// (where 1 + erff(x / sqrt 2) cancels). Checked on the host over every bf16 input in [-12, 12]: gelu rounded to bf16
// equals the double-precision value's rounding for all of them (the erff form differs on 173, all in the tail).
__device__ __forceinline__ float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float fast_exp(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}
// Phi(x) and, through pdf, the normal density phi(x) = exp(-x^2 / 2) / sqrt(2 pi) (kGrad only).
template <bool kGrad>
__device__ __forceinline__ float normal_cdf(float x, float& pdf) {
  const float z = fabsf(x) * 0.70710678118654752f;
  const float t = fast_rcp(fmaf(0.5f, z, 1.0f));
  float p = 0.17087277f;
  p = fmaf(p, t, -0.82215223f);
  p = fmaf(p, t, 1.48851587f);
  p = fmaf(p, t, -1.13520398f);
  p = fmaf(p, t, 0.27886807f);
  p = fmaf(p, t, -0.18628806f);
  p = fmaf(p, t, 0.09678418f);
  p = fmaf(p, t, 0.37409196f);
  p = fmaf(p, t, 1.00002368f);
  p = fmaf(p, t, -1.26551223f);
  const float z2 = z * z;
  const float half_erfc = 0.5f * t * fast_exp(p - z2);
  if constexpr (kGrad) pdf = fast_exp(-z2) * 0.39894228040143267794f;
  return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}
template <bool kTanh>
__device__ __forceinline__ float gelu_unit(float x) {
  if constexpr (kTanh) {
    return gelu_tanh(x);
  } else {
    float unused;
    return x * normal_cdf<false>(x, unused);
  }
}
template <bool kTanh>
__device__ __forceinline__ float gelu_grad_unit(float x) {
  if constexpr (kTanh) {
    return gelu_tanh_grad(x);
  } else {
    float pdf;
    const float cdf = normal_cdf<true>(x, pdf);
    return fmaf(x, pdf, cdf);
  }
}

struct Args {
  int32_t m, n, k;
  int32_t tiles_n, tiles;
  const uint16_t* bias;  // [n] or null
  const uint16_t* aux;   // kDGelu: [m, n] (the outputs are written through their tensor maps)
  float* partial;        // kDGelu: [ceil(m / 128), n] or null
};

template <int kEpi, bool kFp16, bool kTanh>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_out0, const __grid_constant__ CUtensorMap map_out1,
                     Args args) {
#if NOPAD_FMHA_WGMMA
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem(smem_raw);
  uint8_t* staging = smem + kStages * kStageBytes;  // [2 consumers][kStageOutBytes]
  float* red = reinterpret_cast<float*>(staging + 2 * kStageOutBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + 2 * kStageOutBytes + kRedBytes);
  uint64_t* empty = full + kStages;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kProducerRegs>();
    if (tid != 0) return;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
    const int nk = args.k / kBK;
    uint32_t s = 0, ph = 0;  // ring slot and its lap's parity
    for (int t = blockIdx.x; t < args.tiles; t += gridDim.x) {
      const int m0 = (t / args.tiles_n) * kBM, n0 = (t % args.tiles_n) * kBN;
      for (int kb = 0; kb < nk; ++kb, s = s + 1 == kStages ? 0 : s + 1, ph ^= s == 0) {
        mbar_wait(&empty[s], ph ^ 1);
        mbar_arrive_expect_tx(&full[s], kStageBytes);
        uint8_t* st = smem + s * kStageBytes;
        tma_load_2d(st, &map_a, kb * kBK, m0, &full[s]);
        tma_load_2d(st + kABytes, &map_b, kb * kBK, n0, &full[s]);
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;  // consumer warpgroup: rows 64 cw .. 64 cw + 63 of the tile
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  [[maybe_unused]] const int wi = cw * 4 + warp;  // consumer warp 0..7
  uint8_t* stage_out = staging + cw * kStageOutBytes;  // this warpgroup's 64 rows x 256 columns: 4 boxes
  const int bar_wg = 2 + cw;                            // named barrier of this warpgroup's 128 threads
  // Deferred epilogue work on the staged previous tile, done between the next tile's k-blocks while its products
  // run on the tensor cores: kGelu y = gelu(pre) in place of pre (already stored), kDGelu dpre = g * gelu'(aux) in
  // place of g (+ column sums). 16 units of 16 rows x 64 columns: unit u is box u / 4, rows 16 (u % 4) .. + 15 of the
  // warpgroup's 64; thread tid takes row 16 (u % 4) + tid / 8, 16-byte chunk tid % 8. A box is stored (and its
  // column sums reduced) when its fourth unit is done. upk units per k-block (at most 4); any left after the main
  // loop (k < 1024) are done then.
  const int nk = args.k / kBK;
  const int upk = nk >= 16 ? 1 : min(4, (16 + nk - 1) / nk);
  bool pending = false;
  int pm0 = 0, pn0 = 0, pmblk = 0;  // the staged tile
  [[maybe_unused]] float csum[8] = {};
  auto unit_row = [&](int u) { return pm0 + 64 * cw + 16 * (u % 4) + tid / 8; };
  auto load_aux = [&](int u) {
    uint4 x = make_uint4(0, 0, 0, 0);
    if constexpr (kEpi == 2) {
      const int r = unit_row(u);
      if (r < args.m)
        x = __ldg(reinterpret_cast<const uint4*>(args.aux + static_cast<int64_t>(r) * args.n + pn0 + 64 * (u / 4) +
                                                 8 * (tid % 8)));
    }
    return x;
  };
  auto do_unit = [&](int u, uint4 x) {
    const int rr = 16 * (u % 4) + tid / 8;
    uint4* p = reinterpret_cast<uint4*>(stage_out + (u / 4) * kBoxBytes + rr * 128 + (((tid % 8) ^ (rr & 7)) * 16));
    uint4 v = *p;
    uint32_t* w = &v.x;
    if constexpr (kEpi == 1) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<kFp16>(w[e]);
        w[e] = fmha_detail::pack2<kFp16>(gelu_unit<kTanh>(f.x), gelu_unit<kTanh>(f.y));
      }
    } else if constexpr (kEpi == 2) {
      const uint32_t* xa = &x.x;
      const bool ok = unit_row(u) < args.m;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 gf = unpack2<kFp16>(w[e]), xf = unpack2<kFp16>(xa[e]);
        float a = gf.x * gelu_grad_unit<kTanh>(xf.x), b = gf.y * gelu_grad_unit<kTanh>(xf.y);
        if (!ok) a = b = 0.0f;
        csum[2 * e] += a;
        csum[2 * e + 1] += b;
        w[e] = fmha_detail::pack2<kFp16>(a, b);
      }
    }
    *p = v;
    if (u % 4 == 3) {  // box u / 4 complete
      const int box = u / 4;
      if constexpr (kEpi == 2) {
        if (args.partial) {  // the warp's 16 rows of the box: lanes with equal tid % 8 hold the same columns
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            csum[e] += __shfl_xor_sync(0xffffffffu, csum[e], 8);
            csum[e] += __shfl_xor_sync(0xffffffffu, csum[e], 16);
          }
          if (lane < 8) {
#pragma unroll
            for (int e = 0; e < 8; ++e) red[wi * kBN + 64 * box + 8 * lane + e] = csum[e];
          }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) csum[e] = 0.0f;
      }
      fence_proxy_async();  // the generic-proxy writes of the box, visible to the TMA's reads
      named_barrier_sync(bar_wg, 128);
      if (tid == 0) {
        if (pm0 + 64 * cw < args.m) tma_store_2d(kEpi == 1 ? &map_out1 : &map_out0, stage_out + box * kBoxBytes,
                                                 pn0 + 64 * box, pm0 + 64 * cw);
        bulk_commit();
      }
      if constexpr (kEpi == 2) {
        if (box == 3 && args.partial) {  // the staged tile's 128-row column sums: the 8 warps in order
          named_barrier_sync(1, 256);
          const int col = cw * 128 + tid;
          float s = 0.0f;
#pragma unroll
          for (int w8 = 0; w8 < 8; ++w8) s += red[w8 * kBN + col];
          args.partial[static_cast<int64_t>(pmblk) * args.n + pn0 + col] = s;
          named_barrier_sync(1, 256);  // red is rewritten by the next tile's boxes
        }
      }
    }
  };

  uint32_t s = 0, ph = 0;  // ring slot and its lap's parity
  for (int t = blockIdx.x; t < args.tiles; t += gridDim.x) {
    const int m_blk = t / args.tiles_n;
    const int m0 = m_blk * kBM, n0 = (t % args.tiles_n) * kBN;

    uint32_t bias2[kEpi != 2 ? 32 : 1];  // this thread's bias pairs, loaded now, used after the main loop
    if constexpr (kEpi != 2) {
#pragma unroll
      for (int nt = 0; nt < 32; ++nt)
        bias2[nt] = args.bias ? __ldg(reinterpret_cast<const unsigned int*>(args.bias + n0 + 8 * nt + 2 * tq)) : 0u;
    }
    // kDGelu: the pre-activation chunks of the units of two consecutive k-blocks; the loop below handles k-blocks in
    // pairs so the two sets swap roles without register copies (a copy would wait for the loads it meant to hide).
    uint4 set_a[4], set_b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) set_a[i] = set_b[i] = make_uint4(0, 0, 0, 0);
    if (pending) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (i < upk) set_a[i] = load_aux(i);
    }

    float acc[32][4];
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    uint32_t prev_s = 0;
    // One k-block: wait for its stage, issue its products, do its share of the deferred units (their chunks in
    // `cur`, the next k-block's loaded into `nxt`), then retire the previous k-block's stage.
    auto kblock = [&](int kb, uint4 (&cur)[4], uint4 (&nxt)[4]) {
      mbar_wait(&full[s], ph);
      const uint8_t* st = smem + s * kStageBytes;
      const uint64_t da = wgmma_desc(st + cw * 64 * 128), db = wgmma_desc(st + kABytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_256<kFp16>(acc, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
      wgmma_commit();
      if (pending) {
        const int u0 = kb * upk;
        if (kb == 0) {  // the staging is complete (and, for kGelu, pre's stores have read it)
          if (tid == 0) bulk_wait_read<0>();
          named_barrier_sync(bar_wg, 128);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (i < upk && u0 + upk + i < 16) nxt[i] = load_aux(u0 + upk + i);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (i < upk && u0 + i < 16) do_unit(u0 + i, cur[i]);
      }
      if (kb > 0) {
        wgmma_wait<1>();  // the previous k-block's products are done: its stage may be refilled
        if (lane == 0) mbar_arrive(&empty[prev_s]);
      }
      prev_s = s;
      s = s + 1 == kStages ? 0 : s + 1;
      ph ^= s == 0;
    };
    int kb = 0;
    for (; kb + 1 < nk; kb += 2) {
      kblock(kb, set_a, set_b);
      kblock(kb + 1, set_b, set_a);
    }
    if (kb < nk) kblock(kb, set_a, set_b);
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(&empty[prev_s]);
    if (pending) {
      for (int u = nk * upk; u < 16; ++u) do_unit(u, load_aux(u));  // k < 1024: units the main loop left
    }

    // ---------------------------------------------------------------------------------- this tile's staging
    // pre = round(acc + bias) (kBias, kGelu: stored at once) or g = round(acc) (kDGelu), in the swizzled boxes:
    // this thread's 4-byte pairs at (row warp 16 + g, column 2 tq) and row + 8 of box nt / 8, chunk nt % 8.
    if (tid == 0) bulk_wait_read<0>();  // the previous stores have read the staging
    named_barrier_sync(bar_wg, 128);
    const int rr0 = warp * 16 + g;  // rr0 & 7 == g
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) {
      const int off0 = (nt / 8) * kBoxBytes + rr0 * 128 + (((nt % 8) ^ g) * 16) + 4 * tq, off1 = off0 + 8 * 128;
      uint32_t p0, p1;
      if constexpr (kEpi != 2) {
        const float2 b = unpack2<kFp16>(bias2[nt]);
        p0 = fmha_detail::pack2<kFp16>(acc[nt][0] + b.x, acc[nt][1] + b.y);
        p1 = fmha_detail::pack2<kFp16>(acc[nt][2] + b.x, acc[nt][3] + b.y);
      } else {
        p0 = fmha_detail::pack2<kFp16>(acc[nt][0], acc[nt][1]);
        p1 = fmha_detail::pack2<kFp16>(acc[nt][2], acc[nt][3]);
      }
      *reinterpret_cast<uint32_t*>(stage_out + off0) = p0;
      *reinterpret_cast<uint32_t*>(stage_out + off1) = p1;
    }
    if constexpr (kEpi != 2) {
      fence_proxy_async();
      named_barrier_sync(bar_wg, 128);
      if (tid == 0) {
        if (m0 + 64 * cw < args.m) {
#pragma unroll
          for (int box = 0; box < 4; ++box)
            tma_store_2d(&map_out0, stage_out + box * kBoxBytes, n0 + 64 * box, m0 + 64 * cw);
        }
        bulk_commit();
      }
    }
    pending = kEpi != 0;
    pm0 = m0;
    pn0 = n0;
    pmblk = m_blk;
  }
  if (pending) {  // the last tile's deferred work, with nothing left to hide behind
    if (tid == 0) bulk_wait_read<0>();
    named_barrier_sync(bar_wg, 128);
    for (int u = 0; u < 16; ++u) do_unit(u, load_aux(u));
  }
  if (tid == 0) bulk_wait<0>();  // the last stores have completed before the CTA's shared memory goes
#else
  (void)map_a, (void)map_b, (void)map_out0, (void)map_out1, (void)args;
  __trap();  // never launched: the host selects this kernel only where gemm_sm90_available()
#endif
}

// The tensor map of a row-major [rows, cols] 16-bit matrix read in boxes of box_rows x 64 columns (128 bytes: the
// 128-byte swizzle of the wgmma operand layout). cuTensorMapEncodeTiled is a driver function reached through the
// runtime's entry-point query, once per process; encoding is host-only and allocates nothing.
CUtensorMap tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows, bool fp16) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    NOPAD_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    NOPAD_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "gemm_sm90: the driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                            const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  NOPAD_CHECK(r == CUDA_SUCCESS, "gemm_sm90: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ") for [",
              rows, ", ", cols, "]");
  return map;
}

template <int kEpi, bool kFp16, bool kTanh>
void launch(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mo0, const CUtensorMap& mo1,
            const Args& args, int sm_count, cudaStream_t stream) {
  constexpr auto kernel = gemm_sm90_kernel<kEpi, kFp16, kTanh>;
  static const cudaError_t once = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  NOPAD_CUDA_CHECK(once);
  const int grid = std::min(args.tiles, std::max(sm_count, 1));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(ma, mb, mo0, mo1, args);
  NOPAD_CUDA_CHECK_LAUNCH();
}

// 32 x 32 tiles through shared memory (one padding column: conflict-free both ways), 32 x 8 threads.
template <class T>
__global__ void transpose16_kernel(const T* __restrict__ in, int32_t rows, int32_t cols, T* __restrict__ out) {
  __shared__ T tile[32][33];
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[static_cast<int64_t>(r) * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[static_cast<int64_t>(c) * rows + r] = tile[threadIdx.x][i];
  }
}

}  // namespace gemm90

bool gemm_sm90_available() {
#ifdef NOPAD_CUDA_SM90A
  return fmha_detail::fmha_wgmma_available();  // the same condition: sm_90a code and a 9.0 device
#else
  return false;
#endif
}

bool gemm_sm90_supported(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* out0,
                         const void* out1, const void* aux) {
  auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return m >= 1 && m < (int64_t{1} << 31) && n >= gemm90::kBN && n % gemm90::kBN == 0 && n < (1 << 24) &&
         k >= gemm90::kBK && k % gemm90::kBK == 0 && k < (1 << 24) && al(a) && al(b) && al(out0) && al(out1) &&
         al(aux) && gemm_sm90_available();
}

int gemm_sm90_row_chunks(int64_t m) { return static_cast<int>((m + gemm90::kBM - 1) / gemm90::kBM); }

template <class T>
void launch_gemm_sm90(GemmEpilogue epi, const T* a, const T* b, int64_t m, int32_t n, int32_t k, const T* bias,
                      T* out0, T* out1, const T* aux, float* partial, bool tanh, int sm_count,
                      cudaStream_t stream) {
  NOPAD_CHECK(gemm_sm90_supported(m, n, k, a, b, out0, out1, aux), "gemm_sm90: unsupported product m=", m, " n=", n,
              " k=", k, " (needs the sm_90a build on a 9.0 device, n % 256 == 0, k % 64 == 0, 16-byte alignment)");
  NOPAD_CHECK(out0 != nullptr && (epi != GemmEpilogue::kGelu || out1 != nullptr) &&
                  (epi != GemmEpilogue::kDGelu || aux != nullptr),
              "gemm_sm90: missing output or pre-activation");
  constexpr bool kFp16 = std::is_same_v<T, hf>;
  gemm90::Args args{};
  args.m = static_cast<int32_t>(m);
  args.n = n;
  args.k = k;
  args.tiles_n = n / gemm90::kBN;
  const int64_t tiles = int64_t{gemm_sm90_row_chunks(m)} * args.tiles_n;
  NOPAD_CHECK(tiles < (int64_t{1} << 31), "gemm_sm90: too many tiles (", tiles, ")");
  args.tiles = static_cast<int32_t>(tiles);
  args.bias = reinterpret_cast<const uint16_t*>(bias);
  args.aux = reinterpret_cast<const uint16_t*>(aux);
  args.partial = partial;
  const CUtensorMap ma = gemm90::tensor_map(a, m, k, gemm90::kBM, kFp16);
  const CUtensorMap mb = gemm90::tensor_map(b, n, k, gemm90::kBN, kFp16);
  const CUtensorMap mo0 = gemm90::tensor_map(out0, m, n, 64, kFp16);
  const CUtensorMap mo1 = out1 ? gemm90::tensor_map(out1, m, n, 64, kFp16) : mo0;
  switch (epi) {
    case GemmEpilogue::kBias: gemm90::launch<0, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream); break;
    case GemmEpilogue::kGelu:
      if (tanh)
        gemm90::launch<1, kFp16, true>(ma, mb, mo0, mo1, args, sm_count, stream);
      else
        gemm90::launch<1, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream);
      break;
    case GemmEpilogue::kDGelu:
      if (tanh)
        gemm90::launch<2, kFp16, true>(ma, mb, mo0, mo1, args, sm_count, stream);
      else
        gemm90::launch<2, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream);
      break;
  }
}

template <class T>
void launch_transpose16(const T* in, int32_t rows, int32_t cols, T* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(ceil_div(rows, 32)));
  NOPAD_CHECK(grid.y <= 65535, "transpose: ", rows, " rows is too many");
  gemm90::transpose16_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(in, rows, cols, out);
  NOPAD_CUDA_CHECK_LAUNCH();
}

#define NOPAD_GEMM90_INSTANTIATE(T)                                                                                 \
  template void launch_gemm_sm90<T>(GemmEpilogue, const T*, const T*, int64_t, int32_t, int32_t, const T*, T*, T*, \
                                    const T*, float*, bool, int, cudaStream_t);                                          \
  template void launch_transpose16<T>(const T*, int32_t, int32_t, T*, cudaStream_t);
NOPAD_GEMM90_INSTANTIATE(bf)
NOPAD_GEMM90_INSTANTIATE(hf)
#undef NOPAD_GEMM90_INSTANTIATE

}  // namespace nopad::cuda
