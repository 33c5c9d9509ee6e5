// Device building blocks shared by the FMHA forward and backward kernels (fmha_forward.cu, fmha_backward.cu):
// tensor-core mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), ldmatrix, cp.async with zero fill, the XOR-swizzled
// shared-memory tile layout, the Philox dropout block and the keep-bit lane exchange (fmha_dropout.h), variant
// selection, and the host-side validation both entry points use. Design notes: docs/fmha.md.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"
#include "core/philox.h"
#include "ops/cuda/check.h"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/fmha.h"
#include "ops/cuda/fmha_dropout.h"

namespace nopad::cuda::fmha_detail {

constexpr int kTile = 64;  // keys per K/V tile (forward), queries per Q/dO tile (backward)
constexpr float kLog2e = kFmhaLog2e;
constexpr int kMaxSeqlen = 1 << 20;  // element_attention packs positions in 20 bits

// ------------------------------------------------------------------------------------------------ shared memory
// A tile is rows x HD 16-bit elements, row-major, in 16-byte chunks of 8 elements. The chunk index is XORed with a
// function of the row so that the 8 row addresses of one ldmatrix 8x8 matrix (same logical chunk, 8 consecutive
// rows) and the 16-byte cp.async stores fall in 8 distinct 16-byte bank groups: conflict-free both ways.
template <int HD>
__device__ __forceinline__ int swz(int row, int chunk) {
  static_assert(HD == 32 || HD == 64 || HD == 128, "head_dim 32, 64 or 128");
  if constexpr (HD >= 64) {
    return row * HD + ((chunk ^ (row & 7)) << 3);
  } else {  // 64-byte rows: two rows share a 128-byte line, so the XOR key changes every other row
    return row * HD + ((chunk ^ ((row >> 1) & 3)) << 3);
  }
}

// The cp.async helpers (ops/cuda/cp_async.cuh), also under this namespace for the files that name them so.
using nopad::cuda::cp_async16;
using nopad::cuda::cp_async4;
using nopad::cuda::cp_async_commit;
using nopad::cuda::cp_async_wait;
using nopad::cuda::smem_u32;

// The 16-byte copies of a kRows x HD tile of a row-major global matrix (leading dimension ld elements) into a
// swizzled shared tile, planned once per thread: thread tid copies chunk tid % (HD/8) of rows row0 + k * kStep
// (kStep = kThreads / (HD/8), k < kIters). kStep is a multiple of 8, so the swizzle is the same for all k and the
// shared offset of copy k is smem_off + k * kStep * HD; the global pointer advances by kStep * ld. Each tile load is
// then a compare, a pointer add and a cp.async per copy. kPermuteKeys (64-row K/V tiles of the wgmma forward): row r
// takes source row fmha_dropout::fwd_key_perm(r), and the global pointer advances by kStep / 4 rows per copy.
template <int HD, int kRows, int kThreads, bool kPermuteKeys = false>
struct TileCopy {
  static constexpr int kChunks = HD / 8;
  static constexpr int kStep = kThreads / kChunks;
  static constexpr int kIters = kRows / kStep;
  static_assert(kThreads % kChunks == 0 && kStep % 8 == 0 && kRows % kStep == 0, "whole rounds of 16-byte copies");
  static_assert(!kPermuteKeys || kRows == kTile, "key permutation of whole 64-key tiles");
  // Source rows between a thread's copies: row r = row0 + k kStep takes fwd_key_perm(r) = fwd_key_perm(row0) +
  // k kStep / 4 (kStep is a multiple of 8, so r's bits 0-2 are row0's).
  static constexpr int kSrcStep = kPermuteKeys ? kStep / 4 : kStep;
  int src_row0;    // the source row of this thread's first copy
  int smem_off;    // element offset of its first copy in the swizzled tile
  int64_t g_off;   // element offset of its first copy from the tile's row 0 in global memory
  int64_t g_step;  // kSrcStep * ld
  __device__ __forceinline__ explicit TileCopy(int64_t ld) {
    const int tid = static_cast<int>(threadIdx.x);
    const int row0 = tid / kChunks, c = tid % kChunks;  // first shared row this thread copies, its chunk
    smem_off = swz<HD>(row0, c);
    src_row0 = kPermuteKeys ? fmha_dropout::fwd_key_perm(row0) : row0;
    g_off = src_row0 * ld + c * 8;
    g_step = kSrcStep * ld;
  }
  // Copies rows [0, kRows) of the tile whose row 0 is at g; rows >= nvalid (>= 1) are zero-filled and not read (the
  // source pointer of such a copy is clamped to row 0, which exists). (Zero-filling them with predicated shared
  // stores instead makes ptxas branch around each copy: more instructions.)
  __device__ __forceinline__ void load(uint16_t* tile, const uint16_t* g, int nvalid) const {
    const uint16_t* src = g + g_off;
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const bool ok = src_row0 + k * kSrcStep < nvalid;
      cp_async16(tile + smem_off + k * kStep * HD, ok ? src : g, ok);
      src += g_step;
    }
  }
};

// ------------------------------------------------------------------------------------------------ tensor cores
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// D += A * B, m16n8k16, A row-major 16x16, B column-major 16x8, fp32 accumulators.
// Fragments (g = lane/4, t = lane%4): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
// b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1).
template <bool kFp16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kFp16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> two 16-bit values in one register, lo in the low half (the lower column index), round to nearest.
template <bool kFp16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (kFp16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// The A fragment of k-step kk (16 columns) of a 16 x 64 fp32 accumulator tile c held as m16n8 C fragments: the C
// fragments of n-tiles 2kk and 2kk + 1, packed to 16 bits, are exactly mma.sync's (and wgmma's) A fragment.
template <bool kFp16>
__device__ __forceinline__ void a_fragment(const float (&c)[kTile / 8][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack2<kFp16>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<kFp16>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<kFp16>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<kFp16>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

template <bool kFp16>
__device__ __forceinline__ float to_f32(uint16_t x) {
  if constexpr (kFp16) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
  } else {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
}

// 2^x on the MUFU unit alone (ex2.approx.ftz): the same approximation exp2f uses, minus exp2f's rescaling of results
// below 2^-126 (three more instructions per element), which flush to 0 here; such probabilities are far below what a
// 16-bit P or an fp32 row sum >= 1 can resolve. exp2_ftz(-inf) = +0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------------------------------ launch args
struct KernelArgs {
  FmhaParams p;
  uint64_t stream_key;  // dropout_stream_key(seed, step, op_id)
  float scale_log2;     // scale * log2(e): scores in the exp2 domain
  float keep_scale;     // attention_dropout_keep_scale(threshold): 256 / (256 - threshold) as float; 1 without dropout
  float inv_keep_scale;  // (256 - threshold) / 256, exact; 1 without dropout
  float grad_scale;      // scale * keep_scale: the backward's dK and dQ factor (its dS leaves the keep-scale out)
  uint32_t threshold;   // keep iff the 8-bit draw >= threshold = ceil(p * 256); 0 without dropout
  bool dropout;         // threshold > 0
  // Philox key schedule of stream_key, one pair per round: kernel parameters, so the key XORs read the constant bank
  // instead of spending registers or adds.
  uint32_t key0[kAttentionPhiloxRounds], key1[kAttentionPhiloxRounds];
};

// ------------------------------------------------------------------------------------------------ dropout
// The Philox block core/philox.h's dropout_philox(..., kAttentionPhiloxRounds) computes for block index (b_hi:b_lo) of
// sample (s_hi:s_lo), bit for bit: the rounds of philox4x32() with the key schedule precomputed. The sample half of the
// counter is loop-invariant, so its round-0 product is hoisted out of the tile loops by the compiler.
__device__ __forceinline__ Philox4x32 dropout_block(const KernelArgs& a, uint32_t s_lo, uint32_t s_hi, uint32_t b_lo,
                                                   uint32_t b_hi) {
  uint32_t c0 = b_lo, c1 = b_hi, c2 = s_lo, c3 = s_hi;
#pragma unroll
  for (int r = 0; r < kAttentionPhiloxRounds; ++r) {
    const uint32_t hi0 = __umulhi(philox_detail::kMul0, c0), lo0 = philox_detail::kMul0 * c0;
    const uint32_t hi1 = __umulhi(philox_detail::kMul1, c2), lo1 = philox_detail::kMul1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ a.key0[r], n2 = hi0 ^ c3 ^ a.key1[r];
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// The Philox draws of sequence b's attention masks, called as draw(block_lo, block_hi) by fmha_dropout's lane-bit
// functions: dropout_block with the sample half of the counter (p.sample_ids[b], read only with dropout) bound.
struct MaskDraw {
  const KernelArgs& args;
  uint32_t s_lo, s_hi;
  __device__ __forceinline__ Philox4x32 operator()(uint32_t lo, uint32_t hi) const {
    return dropout_block(args, s_lo, s_hi, lo, hi);
  }
};
// *p += a, p[1] += b as fp32 reductions in the L2 (p 8-byte aligned): one vector reduction on sm_90, two before.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

template <bool kDrop>
__device__ __forceinline__ MaskDraw mask_draw(const KernelArgs& args, int b) {
  uint32_t s_lo = 0, s_hi = 0;
  if constexpr (kDrop) {
    const uint64_t sample = args.p.sample_ids[b];
    s_lo = static_cast<uint32_t>(sample);
    s_hi = static_cast<uint32_t>(sample >> 32);
  }
  return MaskDraw{args, s_lo, s_hi};
}

// Butterfly transpose of kSlotBits-bit slots, within each 16-bit half, over the 16 / kSlotBits lanes that differ in
// lane bits kLaneShift..: i is the lane's index in that group (fmha_dropout.h; the forward uses <4, 0> over a quad,
// the backward <2, 2> over the 8 lanes of one t). One shuffle per stage.
template <int kSlotBits, int kLaneShift>
__device__ __forceinline__ uint32_t lane_transpose(uint32_t x, uint32_t i) {
#pragma unroll
  for (int b = 0; b < fmha_dropout::xchg_stages<kSlotBits>(); ++b) {
    const uint32_t y =
        __shfl_xor_sync(0xffffffffu, fmha_dropout::xchg_send<kSlotBits>(x, i, b), (1 << b) << kLaneShift);
    x = fmha_dropout::xchg_merge<kSlotBits>(x, y, i, b);
  }
  return x;
}

// ------------------------------------------------------------------------------------------------ launch args
// The sequence of CTA z of a launch: [s0, s0 + L).
__device__ __forceinline__ void launch_sequence(const FmhaParams& p, int z, int& b, int& s0, int& L) {
  b = p.seq_index != nullptr ? p.seq_index[z] : z;
  s0 = p.cu_seqlens[b];
  L = p.cu_seqlens[b + 1] - s0;
}
// Its queries: rows [qs0, qs0 + Lq) of the query matrix (qkv itself, or FmhaParams::q_qkv), with their ctx, d_ctx,
// lse and workspace rows at the same indices.
__device__ __forceinline__ void launch_queries(const FmhaParams& p, int b, int s0, int L, int& qs0, int& Lq) {
  if (p.q_cu_seqlens != nullptr) {
    qs0 = p.q_cu_seqlens[b];
    Lq = p.q_cu_seqlens[b + 1] - qs0;
  } else {
    qs0 = s0;
    Lq = L;
  }
}
// Position within the sequence (the dropout key, and where dQ goes) of its query r; r past the last query (whose
// results are never used) reads the last one's.
__device__ __forceinline__ uint32_t query_position(const FmhaParams& p, int qs0, int Lq, int r) {
  return p.q_positions != nullptr ? static_cast<uint32_t>(p.q_positions[qs0 + min(r, Lq - 1)])
                                  : static_cast<uint32_t>(r);
}
// Rows of the query-side matrices (ctx, d_ctx, lse, the backward workspace), and the longest query range.
__host__ __device__ inline int32_t query_tokens(const FmhaParams& p) {
  return p.q_cu_seqlens != nullptr ? p.num_q_tokens : p.num_tokens;
}
__host__ __device__ inline int32_t query_seqlen(const FmhaParams& p) {
  return p.q_cu_seqlens != nullptr ? p.max_q_seqlen : p.max_seqlen;
}
__host__ __device__ inline const uint16_t* query_source(const FmhaParams& p) {
  return static_cast<const uint16_t*>(p.q_cu_seqlens != nullptr ? p.q_qkv : p.qkv);
}

// ------------------------------------------------------------------------------------------------ host side
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Validates what forward and backward share; returns the number of sequences the launch covers.
inline int32_t validate_common(const FmhaParams& p, const char* op) {
  NOPAD_CHECK(p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128, op, ": head_dim ", p.head_dim,
              " is not supported (32, 64 or 128)");
  NOPAD_CHECK(p.num_heads > 0 && p.num_heads <= 65535, op, ": num_heads must be in [1, 65535], got ", p.num_heads);
  NOPAD_CHECK(p.num_tokens >= 0 && p.num_seqs >= 0, op, ": negative num_tokens or num_seqs");
  NOPAD_CHECK(p.max_seqlen >= 0 && p.max_seqlen < kMaxSeqlen, op, ": max_seqlen ", p.max_seqlen,
              " out of range [0, 2^20) (dropout keys pack positions in 20 bits)");
  NOPAD_CHECK(p.scale > 0.0f && std::isfinite(p.scale), op, ": scale must be positive and finite, got ", p.scale);
  NOPAD_CHECK(attention_dropout_p_supported(p.dropout_p), op, ": attention dropout probability must be in ",
              "[0, 1 - 2^-8] (an 8-bit draw must be able to keep an element), got ", p.dropout_p);
  NOPAD_CHECK(p.qkv != nullptr && p.ctx != nullptr && p.lse != nullptr && p.cu_seqlens != nullptr, op,
              ": qkv, ctx, lse and cu_seqlens must not be null");
  NOPAD_CHECK(p.dropout_p == 0.0f || p.sample_ids != nullptr, op, ": dropout needs sample_ids");
  NOPAD_CHECK(aligned16(p.qkv) && aligned16(p.ctx), op, ": qkv and ctx must be 16-byte aligned");
  int32_t n = p.num_seqs;
  if (p.seq_index != nullptr) {
    NOPAD_CHECK(p.num_launch_seqs >= 0 && p.num_launch_seqs <= p.num_seqs, op, ": num_launch_seqs ",
                p.num_launch_seqs, " must be in [0, num_seqs = ", p.num_seqs, "]");
    n = p.num_launch_seqs;
  } else {
    NOPAD_CHECK(p.num_launch_seqs == 0 || p.num_launch_seqs == p.num_seqs, op,
                ": without seq_index, num_launch_seqs must be num_seqs (or 0), got ", p.num_launch_seqs);
  }
  NOPAD_CHECK(n <= 65535, op, ": at most 65535 sequences per launch, got ", n);
  if (p.q_cu_seqlens != nullptr) {
    NOPAD_CHECK(p.seq_index == nullptr, op, ": query rows (q_cu_seqlens) cannot be grouped (seq_index must be null)");
    NOPAD_CHECK(p.q_qkv != nullptr && p.q_positions != nullptr, op, ": q_cu_seqlens needs q_qkv and q_positions");
    NOPAD_CHECK(aligned16(p.q_qkv), op, ": q_qkv must be 16-byte aligned");
    NOPAD_CHECK(p.num_q_tokens >= 0 && p.max_q_seqlen >= 0 && p.max_q_seqlen <= p.max_seqlen, op,
                ": num_q_tokens ", p.num_q_tokens, " and max_q_seqlen ", p.max_q_seqlen,
                " must be >= 0, max_q_seqlen <= max_seqlen ", p.max_seqlen);
  } else {
    NOPAD_CHECK(p.q_qkv == nullptr && p.q_positions == nullptr, op, ": q_qkv / q_positions need q_cu_seqlens");
  }
  return n;
}

inline KernelArgs make_args(const FmhaParams& p) {
  KernelArgs a{};
  a.p = p;
  a.threshold = attention_dropout_threshold(p.dropout_p);
  a.dropout = a.threshold > 0;
  a.stream_key = a.dropout ? dropout_stream_key(p.seed, p.step, p.op_id) : 0;
  a.keep_scale = a.dropout ? attention_dropout_keep_scale(a.threshold) : 1.0f;
  a.inv_keep_scale = attention_dropout_keep_fraction(a.threshold);
  a.grad_scale = p.scale * a.keep_scale;
  a.scale_log2 = p.scale * kLog2e;
  uint32_t k0 = static_cast<uint32_t>(a.stream_key), k1 = static_cast<uint32_t>(a.stream_key >> 32);
  for (int r = 0; r < kAttentionPhiloxRounds; ++r) {  // philox4x32's schedule: bumped between rounds
    if (r > 0) {
      k0 += philox_detail::kWeyl0;
      k1 += philox_detail::kWeyl1;
    }
    a.key0[r] = k0;
    a.key1[r] = k1;
  }
  return a;
}

// The variant a call runs: the params field when >= 0, else the environment variable `env` (read once per process and
// variable) when set, else `fallback`. Out-of-range values are errors that name where they came from.
inline int variant_from_env(const char* env, int count) {
  const char* s = std::getenv(env);
  if (s == nullptr || *s == '\0') return -1;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  NOPAD_CHECK(*end == '\0' && v >= 0 && v < count, "environment variable ", env, "=", s,
              " is not a variant index in [0, ", count, ")");
  return static_cast<int>(v);
}
inline int choose_variant(int field, int env_value, int fallback, int count, const char* what) {
  NOPAD_CHECK(field < count && field >= -1, what, " ", field, " is not a variant index in [0, ", count, ") or -1");
  if (field >= 0) return field;
  return env_value >= 0 ? env_value : fallback;
}

// Raises a kernel's dynamic shared memory limit once per process and kernel instantiation (the template argument is
// the kernel itself). Kernels needing at most 48 KB skip the call. The attribute is per device context; a process
// driving several GPUs from one thread would need it per device (the engine runs one process per GPU).
template <auto Kernel>
inline void ensure_smem(int bytes) {
  if (bytes <= 48 * 1024) return;
  static const cudaError_t once = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  NOPAD_CUDA_CHECK(once);
}

}  // namespace nopad::cuda::fmha_detail
