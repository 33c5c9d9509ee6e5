// nopad's Hopper GEMM with GELU / scale epilogues (contract and requirements: gemm_sm90.h).
//
// Structure: persistent, one CTA per SM, 128 x 256 output tiles walked in row-major tile order with a stride of the
// grid (consecutive CTAs share A's 128-row block in the L2; B, a weight of <= 8 MB, stays in the L2 throughout).
// 384 threads. Warp 0 is the producer (one thread issues the TMA loads of A [128 x 64] and B [256 x 64] k-blocks into
// a kStages-deep ring of 128-byte-swizzled stages, full/empty mbarriers). Warpgroups 1 and 2 are the consumers: each
// owns 64 rows of the tile and issues m64n256k16 wgmma from shared memory (four per k-block) with one k-block in
// flight, then rounds its accumulators (+ bias) to 16 bits into its staging boxes (shared memory, the TMA store's
// swizzled layout).
// - kBias: the consumers store the staging themselves (TMA) and move on; warps 1-3 are idle and the producer
//   warpgroup gives its registers to the consumers (setmaxnreg).
// - kGelu: warps 1-3 are the epilogue warps. Per tile they wait for both halves to be staged ("staged" mbarriers),
//   then box by box (64 rows x 64 columns) compute y = gelu(pre) in place and store gelu'(pre) straight to global
//   memory from registers, TMA-store each box of y when complete, and release the staging ("freed", which
//   also carries the next tile's bias) while the consumers run the next tile's main loop. The consumers take the
//   last gemm_sm90_consumer_columns() box columns of their own half themselves, one 16-row unit per k-block of the
//   next main loop, so that the two shares fit beside the products. With bf16, y and gelu' of half the elements
//   (the first two 2-element words of each 8-column chunk) come from a 16 KB table copied into shared memory at the
//   start (ops/gelu_table.h; the arithmetic GELU for the rare elements outside its range), the other half from a
//   two-MUFU arithmetic form (gemm_sm90_gelu_arith_words()): the table alone keeps the shared-memory pipe, which the
//   products' operands need, too busy (its random lookups conflict ~5-way), the arithmetic alone the epilogue warps.
// - kScale / kRowDot: no epilogue warps (the producer warpgroup gives its registers away; with kRowDot its warps 1-3
//   do the launch's side jobs, GemmSideJobs, and exit). Each consumer warpgroup TMA-loads
//   its half of the tile's aux into its staging half-way through the main loop (its thread 0 first waits for the
//   previous tile's stores to have read the staging: late enough that this rarely holds the warpgroup), multiplies
//   in place at staging time, and stores by TMA. Column sums: a thread's columns over its two rows, summed over the
//   warp by a halving shuffle butterfly, the 4 warps' sums combined in a fixed order through shared memory.
//   kRowDot stores round(acc) instead (written over the aux) and sums its products with the aux per row and 64-column
//   box: a thread's 16 columns of a box, then over the 4 lanes of its row (two shuffles).
// Between k-blocks the consumers first release the previous k-block's stage (wgmma wait, `empty` arrival), then do
// their epilogue share of that k-block (a GELU unit, the aux load), so the producer refills the stage meanwhile.
// Measured design history: docs/performance.md ("nopad's own GEMM with the GELU epilogue", "the saved GELU
// derivative").
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/fmha_wgmma.cuh"
#include "ops/cuda/gemm_sm90.h"
#include "ops/cuda/kernels.cuh"
#include "ops/cuda/tensor_map.h"
#include "ops/gelu_table.h"

namespace nopad::cuda {
namespace gemm90 {

using fmha_detail::align_smem;
using fmha_detail::bulk_commit;
using fmha_detail::bulk_wait;
using fmha_detail::bulk_wait_read;
using fmha_detail::fence_proxy_async;
using fmha_detail::mbar_arrive;
using fmha_detail::mbar_init;
using fmha_detail::mbar_wait;
using fmha_detail::named_barrier_sync;
using fmha_detail::setmaxnreg_dec;
using fmha_detail::setmaxnreg_inc;
using fmha_detail::smem_u32;
using fmha_detail::wgmma_commit;
using fmha_detail::wgmma_desc;
using fmha_detail::wgmma_fence;
using fmha_detail::wgmma_wait;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3;
// Warpgroup 0: the producer warp (and for kGelu three epilogue warps); warpgroups 1 and 2: consumers.
constexpr int kThreads = 384;
[[maybe_unused]] constexpr int kEpiThreads = 96;  // warps 1-3
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
// Epilogue staging, per consumer warpgroup: its 64 rows x 256 columns of one 16-bit output as four 64 x 64 boxes in
// the 128-byte-swizzled layout the TMA store reads. kScale: the tile's aux half arrives there by TMA during the main
// loop and the product overwrites it in place.
constexpr int kBoxBytes = 64 * 64 * 2, kStageOutBytes = 4 * kBoxBytes;
constexpr int kRedBytes = 2 * 4 * kBN * 4;  // kScale: per consumer warpgroup, its 4 warps' column sums
// kGelu (bf16): the GELU table (ops/gelu_table.h) in the same region, which kScale alone uses for its sums.
constexpr int kTabBytes = ops::kGeluTableBytes;
constexpr int kRegionBytes = kRedBytes > kTabBytes ? kRedBytes : kTabBytes;
constexpr int kBiasBytes = 2 * kBN * 2;     // kGelu: the bias of a CTA's next two tiles, by tile parity
constexpr int kBarBytes = (2 * kStages + 6) * 8 + 8;  // the mbarriers, then kRowDot's tile counter (side jobs)
// kGelu: the consumers compute y and gelu' of the last gemm_sm90_consumer_columns() box columns of their own half
// (units of 16 rows, one per k-block of the next tile's main loop), the epilogue warps those of the others, so that
// their shares of the GELU's issue time fit beside the products.
constexpr int kSmemBytes =
    fmha_detail::kSmemAlign + kStages * kStageBytes + 2 * kStageOutBytes + kRegionBytes + kBiasBytes + kBarBytes;
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
// kBias / kScale: the producer warpgroup gives registers to the consumers (setmaxnreg, 128 x 40 + 256 x 232 <=
// 65,536); with kGelu's epilogue warps in warpgroup 0 every thread keeps the launch's 168.
[[maybe_unused]] constexpr int kProducerRegs = 40, kConsumerRegs = 232;

// ------------------------------------------------------------------------------------------------ sm_90 primitives
#if NOPAD_FMHA_WGMMA
#define NOPAD_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define NOPAD_SM90_ASM(...) (void)0
#endif

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  NOPAD_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
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
__device__ __forceinline__ float fast_exp(float x) { return fmha_detail::exp2_ftz(x * 1.4426950408889634f); }
// Phi(x) and the normal density pdf = phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
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
  pdf = fast_exp(-z2) * 0.39894228040143267794f;
  return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}
// y = gelu(x) and grad = gelu'(x) = Phi(x) + x phi(x) (the tanh form: kernels.cuh's gelu_and_grad_fn).
template <bool kTanh>
__device__ __forceinline__ float gelu_and_grad(float x, float& grad) {
  if constexpr (kTanh) {
    return gelu_and_grad_fn<true>(x, grad);
  } else {
    float pdf;
    const float cdf = normal_cdf(x, pdf);
    grad = fmaf(x, pdf, cdf);
    return x * cdf;
  }
}
// The erf GELU of the split epilogue's arithmetic words (gemm_sm90_gelu_arith_words()): Phi(-|x|) = exp(-x^2 / 2)
// u R(u), u = 1 / (1 + 0.26 |x|), R of degree 6 fitted for relative error (2.6e-7 in double, ~6e-7 evaluated in fp32,
// for |x| <= 9; beyond, Phi(-|x|) < 1e-19 and the absolute error is what counts), the exp shared with phi(x): ~19
// instructions with two MUFU ops instead of normal_cdf's ~27 with three. Its bf16 results may differ from the
// correctly rounded ones by one step where the exact value lies within ~1e-6 of a rounding boundary.
__device__ __forceinline__ float gelu_and_grad_split(float x, float& grad) {
  const float e = fmha_detail::exp2_ftz(x * x * -0.72134752044448170368f);  // exp(-x^2 / 2)
  const float u = fast_rcp(fmaf(0.26f, fabsf(x), 1.0f));
  float r = -7.566994937e-02f;
  r = fmaf(r, u, 2.393602107e-01f);
  r = fmaf(r, u, -1.225119073e-01f);
  r = fmaf(r, u, 1.792051443e-01f);
  r = fmaf(r, u, 6.781883204e-02f);
  r = fmaf(r, u, 1.083864759e-01f);
  r = fmaf(r, u, 1.034110636e-01f);
  const float q = e * (u * r);  // Phi(-|x|)
  const float cdf = x < 0.0f ? q : 1.0f - q;
  grad = fmaf(x * 0.39894228040143267794f, e, cdf);
  return x * cdf;
}
// y and gelu' of both 16-bit halves of x. kSplit: the erf GELU by gelu_and_grad_split (the split epilogue's
// arithmetic words); otherwise, and for the tanh GELU always, by gelu_and_grad.
template <bool kFp16, bool kTanh, bool kSplit>
__device__ __forceinline__ void gelu_word(uint32_t x, uint32_t& y, uint32_t& g) {
  const float2 f = unpack2<kFp16>(x);
  float ga, gb, ya, yb;
  if constexpr (kSplit && !kTanh) {
    ya = gelu_and_grad_split(f.x, ga);
    yb = gelu_and_grad_split(f.y, gb);
  } else {
    ya = gelu_and_grad<kTanh>(f.x, ga);
    yb = gelu_and_grad<kTanh>(f.y, gb);
  }
  y = fmha_detail::pack2<kFp16>(ya, yb);
  g = fmha_detail::pack2<kFp16>(ga, gb);
}
// kGelu's unit work on one 16-byte chunk (8 columns of a row) of staged pre-activations: y in place, gelu' returned.
template <bool kFp16, bool kTanh>
__device__ __forceinline__ uint4 gelu_chunk(uint4& v) {
  uint4 gv;
  uint32_t* w = &v.x;
  uint32_t* gw = &gv.x;
#pragma unroll
  for (int e = 0; e < 4; ++e) gelu_word<kFp16, kTanh, false>(w[e], w[e], gw[e]);
  return gv;
}

// kGelu, bf16, from the table in shared memory (ops/gelu_table.h): tab = the shared address of entry 0 minus
// 8 kGeluTableAbsLo, so that the entry of bf16 bits h sits at tab + (a << 3 | s << 2). The range test works on both
// halves of a word at once: with a = the half's magnitude bits (<= 0x7fff), a + 0x8000 - bound has bit 15 set exactly
// when a >= bound, and no carry reaches the other half. Every element is looked up (an element outside the range reads
// a valid entry instead and is replaced afterwards), so the loads of all of a thread's chunks are in flight together;
// a chunk with an element outside the range anywhere in the warp (rare: the vote is warp-uniform, so is the branch)
// then takes the arithmetic GELU for those elements.
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));  // the table is read-only after the first barrier
  return v;
}
[[maybe_unused]] constexpr uint32_t kGeLo = (0x8000u - ops::kGeluTableAbsLo) * 0x10001u;  // bit 15 / 31: half >= lo
[[maybe_unused]] constexpr uint32_t kGeHi = (0x8000u - ops::kGeluTableAbsHi) * 0x10001u;  // bit 15 / 31: half >= hi
// Bits 15 and 31: which halves of x (two bf16) have a table entry.
__device__ __forceinline__ uint32_t table_halves(uint32_t x) {
  const uint32_t a = x & 0x7fff7fffu;
  return (a + kGeLo) & ~(a + kGeHi) & 0x80008000u;
}
// y and gelu' of the two bf16 in x from the table (the halves `in` marks; the others read entry 0, a valid address,
// and are replaced by merge_arith_word). in = 0x80008000 when both halves are known to have entries.
__device__ __forceinline__ void lookup_word(uint32_t tab, uint32_t x, uint32_t in, uint32_t& y, uint32_t& g) {
  constexpr uint32_t kEntry0 = 8 * ops::kGeluTableAbsLo;
  const uint32_t e0 = lds32(tab + ((in & 0x8000u) ? (((x << 3) & 0x3fff8u) | ((x >> 13) & 4u)) : kEntry0));
  const uint32_t e1 = lds32(tab + ((in & 0x80000000u) ? (((x >> 13) & 0x3fff8u) | ((x >> 29) & 4u)) : kEntry0));
  y = __byte_perm(e0, e1, 0x5410);  // y of both columns
  g = __byte_perm(e0, e1, 0x7632);  // gelu'
}
// The halves of x without a table entry: the arithmetic GELU, merged into y and g.
template <bool kTanh>
__device__ __forceinline__ void merge_arith_word(uint32_t x, uint32_t& y, uint32_t& g) {
  const uint32_t keep = (table_halves(x) >> 15) * 0xffffu;  // 0xffff per half with an entry
  uint32_t ay, ag;
  gelu_word<false, kTanh, false>(x, ay, ag);
  y = (y & keep) | (ay & ~keep);
  g = (g & keep) | (ag & ~keep);
}
// kN >= 2 chunks (8 bf16 each) of pre-activations -> y in place, gelu' into g: every table word looked up first, so
// all of a thread's loads are in flight together, then the chunks with an element outside the range anywhere in the
// warp fixed up. Words e >= 4 - aw of each chunk (aw = gemm_sm90_gelu_arith_words(), warp-uniform) take the
// arithmetic form instead, which relieves the shared-memory pipe the products' operands need. Chunks i >= n_valid
// (n_valid warp-uniform, >= kN - 1) are left alone.
template <bool kTanh, int kN>
__device__ __forceinline__ void gelu_chunks_table_batch(uint4 (&v)[kN], uint4 (&g)[kN], int n_valid, uint32_t tab,
                                                        int aw) {
  uint4 y[kN];
  bool outside[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (i + 1 < kN || i < n_valid) {
      uint32_t missing = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t x = (&v[i].x)[e];
        if (e < 4 - aw) {
          const uint32_t in = table_halves(x);
          missing |= in ^ 0x80008000u;
          lookup_word(tab, x, in, (&y[i].x)[e], (&g[i].x)[e]);
        }
      }
      outside[i] = missing != 0;
    }
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (i + 1 < kN || i < n_valid) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (e >= 4 - aw) gelu_word<false, kTanh, true>((&v[i].x)[e], (&y[i].x)[e], (&g[i].x)[e]);
      if (__any_sync(0xffffffffu, outside[i])) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < 4 - aw) merge_arith_word<kTanh>((&v[i].x)[e], (&y[i].x)[e], (&g[i].x)[e]);
      }
      v[i] = y[i];
    }
  }
}
// kN chunks of pre-activations -> y in place, gelu' into g, from the table (words e >= 4 - aw arithmetic). One chunk
// (the consumers' units, between two k-blocks, beside 128 accumulator registers): the lean form when the whole warp
// is in range, else looked-up and arithmetic halves merged word by word (this shape keeps the consumers free of
// spills).
template <bool kTanh, int kN>
__device__ __forceinline__ void gelu_chunks_table(uint4 (&v)[kN], uint4 (&g)[kN], int n_valid, uint32_t tab, int aw) {
  if constexpr (kN == 1) {
    uint32_t* w = &v[0].x;
    uint32_t* gw = &g[0].x;
    uint32_t missing = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < 4 - aw) missing |= table_halves(w[e]) ^ 0x80008000u;
    if (!__any_sync(0xffffffffu, missing != 0)) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e < 4 - aw) {
          lookup_word(tab, w[e], 0x80008000u, w[e], gw[e]);
        } else {
          gelu_word<false, kTanh, true>(w[e], w[e], gw[e]);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t x = w[e];
        if (e < 4 - aw) {
          lookup_word(tab, x, table_halves(x), w[e], gw[e]);
          merge_arith_word<kTanh>(x, w[e], gw[e]);
        } else {
          gelu_word<false, kTanh, true>(x, w[e], gw[e]);
        }
      }
    }
    (void)n_valid;
  } else {
    gelu_chunks_table_batch<kTanh, kN>(v, g, n_valid, tab, aw);
  }
}
// kN chunks of kGelu's unit work: from the table where the launch has one (bf16), else arithmetic.
template <bool kFp16, bool kTanh, int kN>
__device__ __forceinline__ void gelu_unit_chunks(uint4 (&v)[kN], uint4 (&g)[kN], int n_valid, bool table, uint32_t tab,
                                                 int probe, int aw) {
  if (probe != 0) {  // gemm_sm90_gelu_probe(): the data movement alone, y = gelu' = pre
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (i + 1 < kN || i < n_valid) g[i] = v[i];
    return;
  }
  if constexpr (!kFp16) {
    if (table) {
      gelu_chunks_table<kTanh, kN>(v, g, n_valid, tab, aw);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (i + 1 < kN || i < n_valid) g[i] = gelu_chunk<kFp16, kTanh>(v[i]);
}

struct Args {
  int32_t m, n, k;
  int32_t tiles_n, tiles;
  const uint16_t* bias;  // [n] or null
  uint16_t* act_grad;    // kGelu: [m, n], gelu'(pre), stored from registers
  float* partial;        // kScale: [ceil(m / 64), n] or null
  const uint32_t* gelu_table;  // kGelu, bf16: the table in global memory (copied to shared memory), or null
  int32_t consumer_bc;   // kGelu: box columns of each tile whose GELU the consumers compute (0 to 4)
  int32_t probe;         // kGelu: gemm_sm90_gelu_probe() (a measurement, not an activation)
  int32_t arith_words;   // kGelu with the table: words of each 8-column chunk computed arithmetically (0 to 4)
  int32_t early_release;  // 1: a k-block's stage is released before the epilogue work of the next k-block's slot
  int32_t aux_kb;         // kScale / kRowDot: the k-block of the main loop during which a consumer issues its aux load
  float* rowdot;           // kRowDot: [n / 64, rowdot_ld]
  int64_t rowdot_ld;
  float rowdot_scale;
  // Side jobs (GemmSideJobs) of warps 1-3 (kRowDot): zero_vec 16-byte zeros at zero_ptr; mul_dst = mul_src * mul_by
  // over mul_count floats.
  uint4* zero_ptr;
  int64_t zero_vec;
  const float* mul_src;
  float* mul_dst;
  int64_t mul_count;
  float mul_by;
};

// GemmSideJobs on the 96 threads t of a CTA's warps 1-3: element i of each job on CTA i / 96 % grid, so that a warp's
// stores are consecutive. The zeroing is paced by the main loop: the CTA's share in one slice per tile, each once the
// producer has issued that tile's loads (tiles_issued), so that its DRAM writes spread over the kernel instead of
// competing with the first tiles' operand loads all at once.
__device__ __forceinline__ void side_jobs(const Args& a, int t, volatile int* tiles_issued) {
  const int64_t stride = int64_t{gridDim.x} * 96;
  const int64_t i0 = int64_t{blockIdx.x} * 96 + t;
  for (int64_t i = i0; i < a.mul_count; i += stride) a.mul_dst[i] = a.mul_src[i] * a.mul_by;
  const int my_tiles = (a.tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                       static_cast<int>(gridDim.x);
  const int64_t mine = i0 < a.zero_vec ? (a.zero_vec - i0 + stride - 1) / stride : 0;  // this thread's vectors
  for (int slice = 0; slice < my_tiles; ++slice) {
    const int64_t begin = mine * slice / my_tiles, end = mine * (slice + 1) / my_tiles;
    if (begin == end) continue;
    while (*tiles_issued <= slice) __nanosleep(256);
    for (int64_t j = begin; j < end; ++j) a.zero_ptr[i0 + j * stride] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The 16-bit accumulator tile of one consumer warpgroup (64 rows x 256 columns, + bias) into its staging boxes:
// this thread's 4-byte pairs at (row warp 16 + g, column 2 tq) and row + 8 of box nt / 8, chunk nt % 8. The bias
// pair of columns 8 nt + 2 tq is bias2[bias_step * nt] (registers: step 1; the tile's bias in shared memory: 4).
template <bool kFp16, bool kBiasAdd>
__device__ __forceinline__ void stage_tile(uint8_t* stage_out, const float (&acc)[32][4], const uint32_t* bias2,
                                           int bias_step, int warp, int g, int tq) {
  const int rr0 = warp * 16 + g;  // rr0 & 7 == g
#pragma unroll
  for (int nt = 0; nt < 32; ++nt) {
    const int off0 = (nt / 8) * kBoxBytes + rr0 * 128 + (((nt % 8) ^ g) * 16) + 4 * tq, off1 = off0 + 8 * 128;
    uint32_t p0, p1;
    if constexpr (kBiasAdd) {
      const float2 b = unpack2<kFp16>(bias2[bias_step * nt]);
      p0 = fmha_detail::pack2<kFp16>(acc[nt][0] + b.x, acc[nt][1] + b.y);
      p1 = fmha_detail::pack2<kFp16>(acc[nt][2] + b.x, acc[nt][3] + b.y);
    } else {
      p0 = fmha_detail::pack2<kFp16>(acc[nt][0], acc[nt][1]);
      p1 = fmha_detail::pack2<kFp16>(acc[nt][2], acc[nt][3]);
    }
    *reinterpret_cast<uint32_t*>(stage_out + off0) = p0;
    *reinterpret_cast<uint32_t*>(stage_out + off1) = p1;
  }
}

// This thread's two 4-byte pairs of fragment nt in a consumer warpgroup's staging (stage_tile's layout): rows
// rr0 = warp 16 + g and rr0 + 8, columns 8 nt + 2 tq, + 1.
__device__ __forceinline__ void staged_pairs(uint8_t* stage_out, int nt, int rr0, int g, int tq, uint32_t*& q0,
                                             uint32_t*& q1) {
  const int off0 = (nt / 8) * kBoxBytes + rr0 * 128 + (((nt % 8) ^ g) * 16) + 4 * tq, off1 = off0 + 8 * 128;
  q0 = reinterpret_cast<uint32_t*>(stage_out + off0);
  q1 = reinterpret_cast<uint32_t*>(stage_out + off1);
}

// kScale's staging: g = round(acc) times the aux pair that the TMA put at the same place of the staging, written
// back rounded; this thread's column sums of the unrounded products over its two rows left in acc[nt][0] (column
// 8 nt + 2 tq) and acc[nt][1] (the next column).
template <bool kFp16>
__device__ __forceinline__ void stage_scale(uint8_t* stage_out, float (&acc)[32][4], int warp, int g, int tq) {
  const int rr0 = warp * 16 + g;
#pragma unroll
  for (int nt = 0; nt < 32; ++nt) {
    uint32_t *q0, *q1;
    staged_pairs(stage_out, nt, rr0, g, tq, q0, q1);
    const float2 x0 = unpack2<kFp16>(*q0), x1 = unpack2<kFp16>(*q1);
    const float2 g0 = unpack2<kFp16>(fmha_detail::pack2<kFp16>(acc[nt][0], acc[nt][1]));
    const float2 g1 = unpack2<kFp16>(fmha_detail::pack2<kFp16>(acc[nt][2], acc[nt][3]));
    const float a0 = g0.x * x0.x, b0 = g0.y * x0.y, a1 = g1.x * x1.x, b1 = g1.y * x1.y;
    *q0 = fmha_detail::pack2<kFp16>(a0, b0);
    *q1 = fmha_detail::pack2<kFp16>(a1, b1);
    acc[nt][0] = a0 + a1;
    acc[nt][1] = b0 + b1;
  }
}

// kRowDot's staging: g = round(acc) written over the aux pair that the TMA put at the same place (read first);
// dot[b][j] accumulates g * aux over this thread's columns of box b (columns 64 b .. 64 b + 63) in row g + 8 j, nt
// ascending, from the rounded g (what the stored output holds).
template <bool kFp16>
__device__ __forceinline__ void stage_rowdot(uint8_t* stage_out, const float (&acc)[32][4], float (&dot)[4][2],
                                             int warp, int g, int tq) {
  const int rr0 = warp * 16 + g;
#pragma unroll
  for (int b = 0; b < 4; ++b) dot[b][0] = dot[b][1] = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 32; ++nt) {
    uint32_t *q0, *q1;
    staged_pairs(stage_out, nt, rr0, g, tq, q0, q1);
    const float2 x0 = unpack2<kFp16>(*q0), x1 = unpack2<kFp16>(*q1);
    const uint32_t p0 = fmha_detail::pack2<kFp16>(acc[nt][0], acc[nt][1]);
    const uint32_t p1 = fmha_detail::pack2<kFp16>(acc[nt][2], acc[nt][3]);
    const float2 g0 = unpack2<kFp16>(p0), g1 = unpack2<kFp16>(p1);
    dot[nt / 8][0] = fmaf(g0.y, x0.y, fmaf(g0.x, x0.x, dot[nt / 8][0]));
    dot[nt / 8][1] = fmaf(g1.y, x1.y, fmaf(g1.x, x1.x, dot[nt / 8][1]));
    *q0 = p0;
    *q1 = p1;
  }
}

// One halving step of warp_column_sums: entries 0 .. kHalf - 1 of w afterwards hold this lane's half (the upper
// one where lane & kMask) summed with the partner lane's same half.
template <int kHalf, int kMask>
__device__ __forceinline__ void butterfly_step(float (&w)[64], int lane, int& base) {
  const bool upper = (lane & kMask) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? w[i] : w[i + kHalf];
    const float recv = __shfl_xor_sync(0xffffffffu, send, kMask);
    w[i] = (upper ? w[i + kHalf] : w[i]) + recv;
  }
  if (upper) base += kHalf;
}
// The column sums of a consumer warp's 16 rows: entry 2 nt + j (column 8 nt + 2 tq + j, in acc[nt][j]) summed over
// the 8 lanes of equal tq by a halving butterfly (56 shuffles instead of 192): lane (g, tq) ends with the sums of
// entries base .. base + 7 in v, base = 8 bitrev3(g) (fragments base / 2 .. + 3). Returns base.
__device__ __forceinline__ int warp_column_sums(const float (&acc)[32][4], float (&v)[8], int lane) {
  float w[64];
#pragma unroll
  for (int nt = 0; nt < 32; ++nt) {
    w[2 * nt] = acc[nt][0];
    w[2 * nt + 1] = acc[nt][1];
  }
  int base = 0;
  butterfly_step<32, 16>(w, lane, base);
  butterfly_step<16, 8>(w, lane, base);
  butterfly_step<8, 4>(w, lane, base);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = w[i];
  return base;
}

template <int kEpi, bool kFp16, bool kTanh>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_out0, const __grid_constant__ CUtensorMap map_out1,
                     Args args) {
#if NOPAD_FMHA_WGMMA
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem(smem_raw);
  uint8_t* staging = smem + kStages * kStageBytes;  // [2 consumers][kStageOutBytes]
  float* red = reinterpret_cast<float*>(staging + 2 * kStageOutBytes);  // kScale: [2 consumers][4 warps][kBN]
  uint16_t* bias_tile = reinterpret_cast<uint16_t*>(staging + 2 * kStageOutBytes + kRegionBytes);  // [2][kBN]
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + 2 * kStageOutBytes + kRegionBytes + kBiasBytes);
  uint64_t* empty = full + kStages;
  uint64_t* staged = empty + kStages;  // [2]: consumer warpgroup cw's staging holds the tile (128 arrivals)
  uint64_t* freed = staged + 2;  // [2]: phase i: the consumers may stage the CTA's i-th tile (1 arrival)
  uint64_t* aux_full = freed + 2;  // [2]: kScale: phase i: consumer cw's staging holds the i-th tile's aux half
  // kRowDot: the tiles whose loads the producer has issued, which paces the side jobs (volatile shared accesses).
  volatile int* tiles_issued = reinterpret_cast<volatile int*>(aux_full + 2);
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int cb = args.consumer_bc;  // kGelu: box columns 4 - cb .. 3 are the consumers'
  // kGelu, bf16: the GELU table into shared memory (16 KB from the L2, once per CTA), read by the epilogue warps and
  // the consumers' units after the barrier below.
  [[maybe_unused]] const bool table = kEpi == 1 && !kFp16 && args.gelu_table != nullptr;
  [[maybe_unused]] const int probe = kEpi == 1 ? args.probe : 0;
  [[maybe_unused]] uint32_t tab = 0;
  if constexpr (kEpi == 1 && !kFp16) {
    if (table) {
      uint4* dst = reinterpret_cast<uint4*>(red);
      const uint4* src = reinterpret_cast<const uint4*>(args.gelu_table);
      for (int i = threadIdx.x; i < kTabBytes / 16; i += kThreads) dst[i] = __ldg(src + i);
      tab = smem_u32(red) - 8 * ops::kGeluTableAbsLo;  // wraps; every entry's offset brings it back in range
    }
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // one arrival per consumer warp
    }
    *tiles_issued = 0;
    for (int i = 0; i < 2; ++i) {
      mbar_init(&staged[i], 128);
      mbar_init(&freed[i], 1);
      mbar_init(&aux_full[i], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 0 && (kEpi != 1 || tid < 32)) {  // ------------------------------------ producer
    if constexpr (kEpi != 1) setmaxnreg_dec<kProducerRegs>();
    if constexpr (kEpi == 3) {
      if (tid >= 32) {
        side_jobs(args, tid - 32, tiles_issued);
        return;
      }
    }
    if (tid != 0) return;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
    const int nk = args.k / kBK;
    uint32_t s = 0, ph = 0;  // ring slot and its lap's parity
    int issued = 0;
    for (int t = blockIdx.x; t < args.tiles; t += gridDim.x) {
      const int m0 = (t / args.tiles_n) * kBM, n0 = (t % args.tiles_n) * kBN;
      for (int kb = 0; kb < nk; ++kb, s = s + 1 == kStages ? 0 : s + 1, ph ^= s == 0) {
        mbar_wait(&empty[s], ph ^ 1);
        mbar_arrive_expect_tx(&full[s], kStageBytes);
        uint8_t* st = smem + s * kStageBytes;
        tma_load_2d(st, &map_a, kb * kBK, m0, &full[s]);
        tma_load_2d(st + kABytes, &map_b, kb * kBK, n0, &full[s]);
      }
      if constexpr (kEpi == 3) *tiles_issued = ++issued;
    }
    return;
  }

  if constexpr (kEpi == 1) {
    if (wg == 0) {  // ---------------------------------------------------------- epilogue warps 1..3
      const int et = tid - 32;  // epilogue thread 0..95
      // 2 (4 - cb) boxes per tile, box q = 2 bc + h: rows 64 h .. + 63 of the tile, box column bc (64 columns).
      // Thread et takes the 16-byte chunk et % 8 of rows et / 8 + 12 i, i < 6 (warp 1: 6 rows, warps 2 and 3: 5), all
      // at once (their table loads in flight together); the box is stored when the three warps are done with it.
      // Phase i of freed[cw] completes when the consumers may stage the CTA's i-th tile: the staging is free and
      // that tile's bias is in bias_tile[i % 2].
      auto release = [&](int ti, uint32_t parity) {
        if (et < kBN / 8 && ti < args.tiles) {
          const int bn0 = (ti % args.tiles_n) * kBN;
          *reinterpret_cast<uint4*>(bias_tile + parity * kBN + 8 * et) =
              args.bias ? __ldg(reinterpret_cast<const uint4*>(args.bias + bn0 + 8 * et)) : make_uint4(0, 0, 0, 0);
        }
        named_barrier_sync(4, kEpiThreads);
        if (et == 0) {
          mbar_arrive(&freed[0]);
          mbar_arrive(&freed[1]);
        }
      };
      release(blockIdx.x, 0);
      uint32_t tile_parity = 0;
      const int boxes = 2 * (4 - cb);
      constexpr int kRows = 6;
      const int n_valid = et / 8 + 12 * (kRows - 1) < 64 ? kRows : kRows - 1;  // warp-uniform
      for (int t = blockIdx.x; t < args.tiles; t += gridDim.x, tile_parity ^= 1) {
        const int m0 = (t / args.tiles_n) * kBM, n0 = (t % args.tiles_n) * kBN;
        mbar_wait(&staged[0], tile_parity);
        mbar_wait(&staged[1], tile_parity);
        for (int q = 0; q < boxes; ++q) {
          const int bc = q / 2, h = q % 2;
          uint8_t* box = staging + h * kStageOutBytes + bc * kBoxBytes;
          uint4 v[kRows], gv[kRows];
          uint4* ptr[kRows];
#pragma unroll
          for (int i = 0; i < kRows; ++i) {
            const int rr = et / 8 + 12 * i;  // row in the half
            ptr[i] = reinterpret_cast<uint4*>(box + rr * 128 + (((et % 8) ^ (rr & 7)) * 16));
            if (i + 1 < kRows || i < n_valid) v[i] = *ptr[i];
          }
          gelu_unit_chunks<kFp16, kTanh, kRows>(v, gv, n_valid, table, tab, probe, args.arith_words);
#pragma unroll
          for (int i = 0; i < kRows; ++i) {
            if (i + 1 < kRows || i < n_valid) {
              *ptr[i] = v[i];
              const int row = m0 + 64 * h + et / 8 + 12 * i;
              if (row < args.m && probe != 2)
                *reinterpret_cast<uint4*>(args.act_grad + static_cast<int64_t>(row) * args.n + n0 + 64 * bc +
                                          8 * (et % 8)) = gv[i];
            }
          }
          fence_proxy_async();  // the generic-proxy writes of the box, visible to the TMA's reads
          named_barrier_sync(4, kEpiThreads);
          if (et == 0) {
            if (m0 + 64 * h < args.m) tma_store_2d(&map_out1, box, n0 + 64 * bc, m0 + 64 * h);
            bulk_commit();
          }
        }
        if (et == 0) bulk_wait_read<0>();  // the stores have read the staging
        release(t + static_cast<int>(gridDim.x), tile_parity ^ 1);
      }
      if (et == 0) bulk_wait<0>();  // the last stores have completed before the CTA's shared memory goes
      return;
    }
  }

  // ------------------------------------------------------------------------------------ consumers
  if constexpr (kEpi != 1) setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;  // consumer warpgroup: rows 64 cw .. 64 cw + 63 of the tile
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  uint8_t* stage_out = staging + cw * kStageOutBytes;  // this warpgroup's 64 rows x 256 columns: 4 boxes
  const int bar_wg = 2 + cw;                            // named barrier of this warpgroup's 128 threads
  // kBias / kRowDot: the warpgroup's staged half of tile (m0, n0), its 4 boxes, to out0 as one bulk group. kScale keeps
  // its own copy: through this lambda ptxas moved a few of its instructions out of the uniform datapath.
  [[maybe_unused]] const auto store_staged = [&](int m0, int n0) {
    if (tid != 0) return;
    if (m0 + 64 * cw < args.m) {
#pragma unroll
      for (int box = 0; box < 4; ++box)
        tma_store_2d(&map_out0, stage_out + box * kBoxBytes, n0 + 64 * box, m0 + 64 * cw);
    }
    bulk_commit();
  };
  const int nk = args.k / kBK;
  uint32_t s = 0, ph = 0;  // ring slot and its lap's parity
  uint32_t tile_parity = 0;
  // kGelu: this warpgroup's share of the previous tile's GELU (box columns 4 - cb .. 3 of its half): unit u = rows
  // 16 (u % 4) .. + 15 of box column 4 - cb + u / 4; thread tid takes row 16 (u % 4) + tid / 8, 16-byte chunk
  // tid % 8. A box (y) is stored after its unit u % 4 == 3.
  [[maybe_unused]] bool pending = false;
  [[maybe_unused]] int pm0 = 0, pn0 = 0;
  [[maybe_unused]] uint32_t pending_parity = 0;
  [[maybe_unused]] auto consumer_unit = [&](int u) {
    // Every thread of the warpgroup has staged the tile (its rows were written by other threads).
    if (u == 0) mbar_wait(&staged[cw], pending_parity);
    const int bc = 4 - cb + u / 4, rr = 16 * (u % 4) + tid / 8;
    uint8_t* box = stage_out + bc * kBoxBytes;
    uint4* p = reinterpret_cast<uint4*>(box + rr * 128 + (((tid % 8) ^ (rr & 7)) * 16));
    uint4 v[1] = {*p}, gv[1];
    gelu_unit_chunks<kFp16, kTanh, 1>(v, gv, 1, table, tab, probe, args.arith_words);
    *p = v[0];
    const int row = pm0 + 64 * cw + rr;
    if (row < args.m && probe != 2)
      *reinterpret_cast<uint4*>(args.act_grad + static_cast<int64_t>(row) * args.n + pn0 + 64 * bc + 8 * (tid % 8)) =
          gv[0];
    if (u % 4 == 3) {
      fence_proxy_async();  // the generic-proxy writes of the box, visible to the TMA's reads
      named_barrier_sync(bar_wg, 128);
      if (tid == 0) {
        if (pm0 + 64 * cw < args.m) tma_store_2d(&map_out1, box, pn0 + 64 * bc, pm0 + 64 * cw);
        bulk_commit();
      }
    }
  };
  // kScale: this warpgroup's aux half of tile t into its staging, once the previous tile's stores have read it.
  [[maybe_unused]] auto load_aux = [&](int t) {
    const int am0 = (t / args.tiles_n) * kBM + 64 * cw, an0 = (t % args.tiles_n) * kBN;
    bulk_wait_read<0>();
    mbar_arrive_expect_tx(&aux_full[cw], kStageOutBytes);
#pragma unroll
    for (int box = 0; box < 4; ++box) tma_load_2d(stage_out + box * kBoxBytes, &map_out1, an0 + 64 * box, am0, &aux_full[cw]);
  };
  for (int t = blockIdx.x; t < args.tiles; t += gridDim.x, tile_parity ^= 1) {
    const int m0 = (t / args.tiles_n) * kBM, n0 = (t % args.tiles_n) * kBN;
    uint32_t bias2[kEpi == 0 ? 32 : 1];  // kBias: this thread's bias pairs, loaded now, used after the main loop
    if constexpr (kEpi == 0) {
#pragma unroll
      for (int nt = 0; nt < 32; ++nt)
        bias2[nt] = args.bias ? __ldg(reinterpret_cast<const unsigned int*>(args.bias + n0 + 8 * nt + 2 * tq)) : 0u;
    }
    float acc[32][4];
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    uint32_t prev_s = 0;
    for (int kb = 0; kb < nk; ++kb) {  // wait for the stage, issue its products, retire the previous stage
      mbar_wait(&full[s], ph);
      const uint8_t* st = smem + s * kStageBytes;
      const uint64_t da = wgmma_desc(st + cw * 64 * 128), db = wgmma_desc(st + kABytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_256<kFp16>(acc, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
      wgmma_commit();
      // The previous k-block's products are done: its stage may be refilled. With early_release before this
      // k-block's share of the epilogue work (a GELU unit, the aux load that may wait for the last tile's stores),
      // so that the producer refills the slot while that work runs; otherwise after it.
      const auto release_prev = [&] {
        wgmma_wait<1>();
        if (lane == 0) mbar_arrive(&empty[prev_s]);
      };
      if (kb > 0 && args.early_release) release_prev();
      if constexpr (kEpi == 1) {
        if (pending && kb >= 1 && kb <= 4 * cb) consumer_unit(kb - 1);
      }
      if constexpr (kEpi >= 2) {
        if (tid == 0 && kb == min(args.aux_kb, nk - 1)) load_aux(t);
      }
      if (kb > 0 && !args.early_release) release_prev();
      prev_s = s;
      s = s + 1 == kStages ? 0 : s + 1;
      ph ^= s == 0;
    }
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(&empty[prev_s]);
    if constexpr (kEpi == 1) {
      if (pending) {
        for (int u = min(nk - 1, 4 * cb); u < 4 * cb; ++u) consumer_unit(u);  // the units the main loop left
        if (tid == 0) bulk_wait_read<0>();                                        // y's stores have read the staging
        named_barrier_sync(bar_wg, 128);
      }
    }

    if constexpr (kEpi == 0) {  // out0 = round(acc + bias), stored from the staging by this warpgroup
      if (tid == 0) bulk_wait_read<0>();  // the previous stores have read the staging
      named_barrier_sync(bar_wg, 128);
      stage_tile<kFp16, true>(stage_out, acc, bias2, 1, warp, g, tq);
      fence_proxy_async();
      named_barrier_sync(bar_wg, 128);
      store_staged(m0, n0);
    } else if constexpr (kEpi == 2) {  // out0 = round(round(acc) * aux) in place of the aux, and the column sums
      mbar_wait(&aux_full[cw], tile_parity);
      stage_scale<kFp16>(stage_out, acc, warp, g, tq);
      fence_proxy_async();
      float* red_wg = red + cw * 4 * kBN;
      if (args.partial) {
        float v[8];
        const int base = warp_column_sums(acc, v, lane);  // entries base .. base + 7: fragments base / 2 ..
#pragma unroll
        for (int i = 0; i < 8; ++i) red_wg[warp * kBN + 8 * ((base + i) / 2) + 2 * tq + (i % 2)] = v[i];
      }
      named_barrier_sync(bar_wg, 128);
      const bool rows_here = m0 + 64 * cw < args.m;
      if (tid == 0) {
        if (rows_here) {
#pragma unroll
          for (int box = 0; box < 4; ++box)
            tma_store_2d(&map_out0, stage_out + box * kBoxBytes, n0 + 64 * box, m0 + 64 * cw);
        }
        bulk_commit();
      }
      if (args.partial && rows_here) {  // the half's column sums, its 4 warps in order
        float* out = args.partial + static_cast<int64_t>(m0 / 64 + cw) * args.n + n0;
#pragma unroll
        for (int c = tid; c < kBN; c += 128)
          out[c] = ((red_wg[c] + red_wg[kBN + c]) + red_wg[2 * kBN + c]) + red_wg[3 * kBN + c];
      }
      named_barrier_sync(bar_wg, 128);  // red_wg is read before the next tile writes it
    } else if constexpr (kEpi == 3) {  // out0 = round(acc) in place of the aux, and the per-box row dots with it
      mbar_wait(&aux_full[cw], tile_parity);
      float dot[4][2];
      stage_rowdot<kFp16>(stage_out, acc, dot, warp, g, tq);
      fence_proxy_async();
      named_barrier_sync(bar_wg, 128);
      store_staged(m0, n0);
#pragma unroll
      for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          dot[b][j] += __shfl_xor_sync(0xffffffffu, dot[b][j], 1);
          dot[b][j] += __shfl_xor_sync(0xffffffffu, dot[b][j], 2);
        }
      if (tq == 0) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int row = m0 + 64 * cw + 16 * warp + g + 8 * j;
          if (row < args.m) {
#pragma unroll
            for (int b = 0; b < 4; ++b)
              args.rowdot[static_cast<int64_t>(n0 / 64 + b) * args.rowdot_ld + row] = dot[b][j] * args.rowdot_scale;
          }
        }
      }
    } else {  // kGelu: the staged tile goes to the epilogue warps, once they are done with the previous one
      mbar_wait(&freed[cw], tile_parity);
      stage_tile<kFp16, true>(stage_out, acc, reinterpret_cast<const uint32_t*>(bias_tile + tile_parity * kBN) + tq,
                              4, warp, g, tq);
      fence_proxy_async();
      mbar_arrive(&staged[cw]);
      pending = true;
      pm0 = m0;
      pn0 = n0;
      pending_parity = tile_parity;
    }
  }
  if constexpr (kEpi == 1) {
    if (pending) {  // the last tile's share, with nothing left to hide behind
      for (int u = 0; u < 4 * cb; ++u) consumer_unit(u);
    }
  }
  if (tid == 0) bulk_wait<0>();  // the last stores have completed before the CTA's shared memory goes
#else
  (void)map_a, (void)map_b, (void)map_out0, (void)map_out1, (void)args;
  __trap();  // never launched: the host selects this kernel only where gemm_sm90_available()
#endif
}

// The tensor map of a row-major [rows, cols] 16-bit matrix read in boxes of box_rows x 64 columns (128 bytes: the
// 128-byte swizzle of the wgmma operand layout).
CUtensorMap tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows, bool fp16) {
  return tensor_map_2d(fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base,
                       static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), static_cast<uint64_t>(cols) * 2, kBK,
                       static_cast<uint32_t>(box_rows), CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       "gemm_sm90 operand");
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

// The shape, the tile count and the settings every epilogue reads, after checking the problem is supported.
Args base_args(int64_t m, int32_t n, int32_t k, const void* a, const void* b, const void* out0, const void* out1,
               const void* aux, const void* bias) {
  NOPAD_CHECK(gemm_sm90_supported(m, n, k, a, b, out0, out1, aux, bias), "gemm_sm90: unsupported product m=", m,
              " n=", n, " k=", k,
              " (needs the sm_90a build on a 9.0 device, n % 256 == 0, k % 64 == 0, 16-byte alignment)");
  Args args{};
  args.m = static_cast<int32_t>(m);
  args.n = n;
  args.k = k;
  args.tiles_n = n / kBN;
  const int64_t tiles = (m + kBM - 1) / kBM * args.tiles_n;
  NOPAD_CHECK(tiles < (int64_t{1} << 31), "gemm_sm90: too many tiles (", tiles, ")");
  args.tiles = static_cast<int32_t>(tiles);
  args.early_release = gemm_sm90_early_release() ? 1 : 0;
  return args;
}

// kScale / kRowDot's aux load k-block: the switches (gemm_sm90.h), else the epilogue's default (kScale three quarters
// of the way through the main loop, kRowDot half-way).
int aux_kblock(bool scale, int32_t k) {
  if (scale && gemm_sm90_scale_aux_kblock() >= 0) return gemm_sm90_scale_aux_kblock();
  if (gemm_sm90_aux_kblock() >= 0) return gemm_sm90_aux_kblock();
  const int nk = k / kBK;
  return scale ? 3 * nk / 4 : nk / 2;
}

void set_side_jobs(Args& args, const GemmSideJobs& jobs) {
  NOPAD_CHECK(reinterpret_cast<uintptr_t>(jobs.zero) % 16 == 0 && jobs.zero_bytes % 16 == 0 &&
                  (jobs.zero != nullptr || jobs.zero_bytes == 0) && jobs.mul_count >= 0 &&
                  (jobs.mul_count == 0 || (jobs.mul_src != nullptr && jobs.mul_dst != nullptr)),
              "gemm_sm90: side jobs need a 16-byte aligned zero range of whole 16-byte vectors and mul pointers");
  args.zero_ptr = static_cast<uint4*>(jobs.zero);
  args.zero_vec = static_cast<int64_t>(jobs.zero_bytes / 16);
  args.mul_src = jobs.mul_src;
  args.mul_dst = jobs.mul_dst;
  args.mul_count = jobs.mul_count;
  args.mul_by = jobs.mul_by;
}

// The bf16 GELU tables ([0] erf, [1] tanh), filled once per device by gemm_sm90_prepare.
__device__ uint32_t g_gelu_tables[2][ops::kGeluTableEntries];

constexpr int kMaxDevices = 64;
struct DeviceTables {
  std::once_flag once;
  const uint32_t* tables = nullptr;  // device address of g_gelu_tables on that device
};
std::array<DeviceTables, kMaxDevices>& device_tables() {
  static std::array<DeviceTables, kMaxDevices> d;
  return d;
}

// The current device's copy of the tables, uploaded the first time (a synchronous copy: gemm_sm90_prepare does it at
// setup so that no training step pays it).
const uint32_t* gelu_tables() {
  int device = 0;
  NOPAD_CUDA_CHECK(cudaGetDevice(&device));
  NOPAD_CHECK(device >= 0 && device < kMaxDevices, "gemm_sm90: device index ", device, " beyond ", kMaxDevices);
  DeviceTables& d = device_tables()[device];
  std::call_once(d.once, [&] {
    for (int tanh = 0; tanh < 2; ++tanh) {
      const std::vector<uint32_t> t = ops::gelu_table_bf16(tanh != 0);
      NOPAD_CUDA_CHECK(cudaMemcpyToSymbol(g_gelu_tables, t.data(), ops::kGeluTableBytes,
                                          static_cast<size_t>(tanh) * ops::kGeluTableBytes, cudaMemcpyHostToDevice));
    }
    void* p = nullptr;
    NOPAD_CUDA_CHECK(cudaGetSymbolAddress(&p, g_gelu_tables));
    d.tables = static_cast<const uint32_t*>(p);
  });
  return d.tables;
}

}  // namespace gemm90

void gemm_sm90_prepare() {
  if (gemm_sm90_available()) (void)gemm90::gelu_tables();
}

bool& gemm_sm90_gelu_table() {
  static bool on = [] {
    const char* e = std::getenv("NOPAD_GELU_TABLE");
    return e == nullptr || std::string_view(e) != "0";
  }();
  return on;
}

int& gemm_sm90_gelu_arith_words() {
  static int words = [] {
    const char* e = std::getenv("NOPAD_GELU_ARITH_WORDS");
    if (e == nullptr) return 2;  // half the elements each way: -2% of a BERT-large step (docs/performance.md)
    const std::string_view v(e);
    NOPAD_CHECK(v.size() == 1 && v[0] >= '0' && v[0] <= '4', "NOPAD_GELU_ARITH_WORDS must be 0 to 4 (of each 8-column ",
                "chunk's four words, how many the GELU epilogue computes arithmetically beside the table), got '", v,
                "'; unset it for the default");
    return v[0] - '0';
  }();
  return words;
}

int& gemm_sm90_gelu_probe() {
  static int probe = 0;
  return probe;
}

bool gemm_sm90_available() {
#ifdef NOPAD_CUDA_SM90A
  return fmha_detail::fmha_wgmma_available();  // the same condition: sm_90a code and a 9.0 device
#else
  return false;
#endif
}

bool gemm_sm90_supported(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* out0,
                         const void* out1, const void* aux, const void* bias) {
  auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return m >= 1 && m < (int64_t{1} << 31) && n >= gemm90::kBN && n % gemm90::kBN == 0 && n < (1 << 24) &&
         k >= gemm90::kBK && k % gemm90::kBK == 0 && k < (1 << 24) && al(a) && al(b) && al(out0) && al(out1) &&
         al(aux) && al(bias) && gemm_sm90_available();
}

int gemm_sm90_row_chunks(int64_t m) { return static_cast<int>((m + 63) / 64); }

int& gemm_sm90_aux_kblock() {
  static int kb = [] {
    const char* e = std::getenv("NOPAD_GEMM_AUX_KB");
    return e != nullptr ? std::atoi(e) : -1;
  }();
  return kb;
}

int& gemm_sm90_scale_aux_kblock() {
  static int kb = [] {
    const char* e = std::getenv("NOPAD_GEMM_SCALE_AUX_KB");
    return e != nullptr ? std::atoi(e) : -1;
  }();
  return kb;
}

bool& gemm_sm90_early_release() {
  static bool early = [] {
    const char* e = std::getenv("NOPAD_GEMM_EARLY_RELEASE");
    return e == nullptr || std::string_view(e) != "0";
  }();
  return early;
}

int& gemm_sm90_consumer_columns() {
  static int columns = [] {
    const char* e = std::getenv("NOPAD_GEMM_CONSUMER_COLUMNS");
    if (e == nullptr) return -1;  // by the GELU's form: launch_gemm_sm90
    const std::string_view v(e);
    NOPAD_CHECK(v.size() == 1 && v[0] >= '0' && v[0] <= '4', "NOPAD_GEMM_CONSUMER_COLUMNS must be 0 to 4 (box columns ",
                "of the GELU epilogue the consumer warpgroups take), got '", v, "'; unset it for the default");
    return v[0] - '0';
  }();
  return columns;
}

template <class T>
void launch_gemm_sm90(GemmEpilogue epi, const T* a, const T* b, int64_t m, int32_t n, int32_t k, const T* bias,
                      T* out0, T* out1, const T* aux, float* partial, bool tanh, int sm_count,
                      cudaStream_t stream) {
  NOPAD_CHECK(out0 != nullptr && (epi != GemmEpilogue::kGelu || out1 != nullptr) &&
                  (epi != GemmEpilogue::kScale || aux != nullptr),
              "gemm_sm90: missing output or scale");
  constexpr bool kFp16 = std::is_same_v<T, hf>;
  gemm90::Args args = gemm90::base_args(m, n, k, a, b, out0, out1, aux, bias);
  args.bias = reinterpret_cast<const uint16_t*>(bias);
  args.act_grad = epi == GemmEpilogue::kGelu ? reinterpret_cast<uint16_t*>(out0) : nullptr;
  args.partial = partial;
  args.gelu_table = epi == GemmEpilogue::kGelu && !kFp16 && gemm_sm90_gelu_table() ? gemm90::gelu_tables() + (tanh ? ops::kGeluTableEntries : 0)
                                                                                  : nullptr;
  // The consumers' share: 2 box columns with the table (the epilogue warps alone, even at a few instructions per
  // element, hold the consumers at `freed`), 1 with the arithmetic GELU (docs/performance.md, 2026-11-25 midday).
  args.consumer_bc = gemm_sm90_consumer_columns() >= 0 ? gemm_sm90_consumer_columns() : args.gelu_table ? 2 : 1;
  args.probe = gemm_sm90_gelu_probe();
  args.arith_words = args.gelu_table ? gemm_sm90_gelu_arith_words() : 0;
  args.aux_kb = gemm90::aux_kblock(epi == GemmEpilogue::kScale, k);
  NOPAD_CHECK(args.arith_words >= 0 && args.arith_words <= 4, "gemm_sm90: 0 to 4 arithmetic words per chunk, not ",
              args.arith_words);
  NOPAD_CHECK(args.consumer_bc >= 0 && args.consumer_bc <= 4, "gemm_sm90: the consumers take 0 to 4 box columns, not ",
              args.consumer_bc);
  const CUtensorMap ma = gemm90::tensor_map(a, m, k, gemm90::kBM, kFp16);
  const CUtensorMap mb = gemm90::tensor_map(b, n, k, gemm90::kBN, kFp16);
  // kBias / kScale store out0 through the first output map; kGelu stores out0 (gelu') from registers and y (out1)
  // through the second; kScale reads aux through the second (64 x 64 boxes into the staging).
  const CUtensorMap mo0 = gemm90::tensor_map(out0, m, n, 64, kFp16);
  const CUtensorMap mo1 = epi == GemmEpilogue::kScale ? gemm90::tensor_map(aux, m, n, 64, kFp16)
                          : out1                      ? gemm90::tensor_map(out1, m, n, 64, kFp16)
                                                      : mo0;
  switch (epi) {
    case GemmEpilogue::kBias: gemm90::launch<0, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream); break;
    case GemmEpilogue::kGelu:
      if (tanh)
        gemm90::launch<1, kFp16, true>(ma, mb, mo0, mo1, args, sm_count, stream);
      else
        gemm90::launch<1, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream);
      break;
    case GemmEpilogue::kScale: gemm90::launch<2, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream); break;
  }
}

template <class T>
void launch_gemm_sm90_rowdot(const T* a, const T* b, int64_t m, int32_t n, int32_t k, T* out0, const T* aux,
                             float* rowdot, int64_t rowdot_ld, float rowdot_scale, const GemmSideJobs& jobs,
                             int sm_count, cudaStream_t stream) {
  NOPAD_CHECK(out0 != nullptr && aux != nullptr && rowdot != nullptr && rowdot_ld >= m,
              "gemm_sm90 kRowDot: needs out0, aux and rowdot with rowdot_ld >= m");
  constexpr bool kFp16 = std::is_same_v<T, hf>;
  gemm90::Args args = gemm90::base_args(m, n, k, a, b, out0, nullptr, aux, nullptr);
  args.rowdot = rowdot;
  args.rowdot_ld = rowdot_ld;
  args.rowdot_scale = rowdot_scale;
  args.aux_kb = gemm90::aux_kblock(false, k);
  gemm90::set_side_jobs(args, jobs);
  const CUtensorMap ma = gemm90::tensor_map(a, m, k, gemm90::kBM, kFp16);
  const CUtensorMap mb = gemm90::tensor_map(b, n, k, gemm90::kBN, kFp16);
  const CUtensorMap mo0 = gemm90::tensor_map(out0, m, n, 64, kFp16);
  const CUtensorMap mo1 = gemm90::tensor_map(aux, m, n, 64, kFp16);
  gemm90::launch<3, kFp16, false>(ma, mb, mo0, mo1, args, sm_count, stream);
}

template <class T>
void launch_transpose16(const T* in, int32_t rows, int32_t cols, T* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(ceil_div(rows, 32)));
  NOPAD_CHECK(grid.y <= 65535, "transpose: ", rows, " rows is too many");
  gemm90::transpose16_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(in, rows, cols, out);
  NOPAD_CUDA_CHECK_LAUNCH();
}

#define NOPAD_GEMM90_INSTANTIATE(T)                                                                              \
  template void launch_gemm_sm90<T>(GemmEpilogue, const T*, const T*, int64_t, int32_t, int32_t, const T*, T*, T*, \
                                    const T*, float*, bool, int, cudaStream_t);                                    \
  template void launch_transpose16<T>(const T*, int32_t, int32_t, T*, cudaStream_t);                           \
  template void launch_gemm_sm90_rowdot<T>(const T*, const T*, int64_t, int32_t, int32_t, T*, const T*, float*,   \
                                           int64_t, float, const GemmSideJobs&, int, cudaStream_t);
NOPAD_GEMM90_INSTANTIATE(bf)
NOPAD_GEMM90_INSTANTIATE(hf)
#undef NOPAD_GEMM90_INSTANTIATE

}  // namespace nopad::cuda
