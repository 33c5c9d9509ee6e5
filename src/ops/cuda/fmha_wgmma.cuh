// Hopper (sm_90a) building blocks for the FMHA kernels at head_dim 64 and nopad's GEMM: shared-memory matrix
// descriptors of the swizzled tiles of fmha_common.cuh, the m64n64k16 warpgroup MMAs (wgmma) with both operands in
// shared memory (SS) or A in registers (RS) and their fence / commit / wait protocol, bulk (copy-engine) reductions,
// mbarriers, named barriers and register reallocation (setmaxnreg) for warp-specialised kernels.
//
// Contract of the tile layout: a 64 x 64 tile of 16-bit elements with 128-byte rows whose 16-byte chunk index is
// XORed with row & 7 (swz<64>) IS the hardware's 128-byte swizzle layout when the tile starts on a 1024-byte
// boundary; the same bytes serve as a K-major operand (rows = M or N, 64 K-elements per row) and as an MN-major one
// (rows = K, 64 M/N-elements per row). So the cp.async tile copies, the ldmatrix-era epilogues and the wgmma
// descriptors all agree on one layout.
//
// Accumulator layout (m64nNk16, fp32): warp w of the warpgroup holds rows 16w .. 16w+15; with g = lane / 4,
// t = lane % 4, d[nt][0..1] = (row g, columns 8nt + 2t, +1) and d[nt][2..3] = (row g + 8, same columns): per warp,
// exactly the mma.sync m16n8 C fragments of fmha_common.cuh, n-tile by n-tile. The register A fragment of a k16 step
// is likewise mma.sync's A fragment, so the accumulators of n-tiles 2k, 2k+1 packed to 16 bits are k-step k's A.
#pragma once
#include <cstdint>

#include "ops/cuda/fmha_common.cuh"

// wgmma exists only in the architecture-specific sm_90a target; elsewhere the kernels compile to a trap and the host
// never selects them (fmha_wgmma_available()).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NOPAD_FMHA_WGMMA 1
#else
#define NOPAD_FMHA_WGMMA 0
#endif

namespace nopad::cuda::fmha_detail {

// Whether the current device runs the wgmma kernels: compute capability 9.0 (the sm_90a code of this build). Read
// once per device ordinal and cached.
bool fmha_wgmma_available();
// Multiprocessors of the current device (the persistent backward's grid), read with the above once per ordinal.
int fmha_sm_count();

constexpr int kTileBytes = 64 * 64 * 2;  // one 64 x 64 16-bit tile
constexpr int kSmemAlign = 1024;         // the 128-byte swizzle repeats every 8 rows of 128 bytes

// The dynamic shared memory base rounded up to kSmemAlign (launches ask for kSmemAlign bytes of slack).
__device__ __forceinline__ uint8_t* align_smem(uint8_t* p) {
  const uint32_t a = smem_u32(p);
  return p + ((kSmemAlign - (a & (kSmemAlign - 1))) & (kSmemAlign - 1));
}

// Descriptor of a 128-byte-swizzled tile starting at p (1024-byte aligned, or p = aligned base + a k-step offset
// within the first 128-byte row for K-major operands). Stride byte offset: 1024 bytes between groups of 8 rows (K-major:
// 8 M/N rows; MN-major: 8 K rows). Leading byte offset: unused by these layouts (K-major swizzled) or by these
// shapes (MN-major with exactly one 64-element atom along M/N), set to 16 bytes.
__device__ __forceinline__ uint64_t wgmma_desc(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}
// Descriptor advances, in the 16-byte units of the address field: one k16 step of a K-major operand is 32 bytes along
// the row; of an MN-major operand, 16 rows of 128 bytes.
constexpr uint64_t kDescStepK = 32 >> 4;
constexpr uint64_t kDescStepMN = (16 * 128) >> 4;

__device__ __forceinline__ void wgmma_fence() {
#if NOPAD_FMHA_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if NOPAD_FMHA_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if NOPAD_FMHA_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Generic-proxy shared-memory writes (ordinary stores, cp.async) made visible to the async proxy (wgmma operand
// reads): each writing thread fences before the barrier that publishes the data.
__device__ __forceinline__ void fence_proxy_async() {
#if NOPAD_FMHA_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Bulk asynchronous reduction (sm_90): global[dst .. dst + bytes) += shared[src ..) as fp32, executed by the copy
// engine and the L2 in whole sectors; 16-byte aligned addresses, bytes a multiple of 16. The writing threads fence
// (fence_proxy_async) before the barrier that publishes the source; the issuing thread waits with bulk_wait_read
// before the source may be overwritten.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
#if NOPAD_FMHA_WGMMA
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
#else
  (void)dst, (void)src, (void)bytes;
#endif
}
// Bulk asynchronous reduction through a tensor map (sm_90): the box at (x = column, y = row) of the map's global
// tensor += the box in shared memory at src (laid out as the map's swizzle says; 1024-byte aligned for the 128-byte
// swizzle), as fp32 adds in the L2. Boxes reaching past the tensor's bounds are clipped. Fence and waits as for
// bulk_reduce_add_f32.
__device__ __forceinline__ void bulk_reduce_tensor_add(const void* map, const float* src, int x, int y) {
#if NOPAD_FMHA_WGMMA
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(x), "r"(y), "r"(smem_u32(src))
      : "memory");
#else
  (void)map, (void)src, (void)x, (void)y;
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if NOPAD_FMHA_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if NOPAD_FMHA_WGMMA
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}

// ------------------------------------------------------------------------------------------------ mbarriers
// Shared-memory barriers of the warp-specialised kernels (fmha_backward.cu's `ws128q`, gemm_sm90.cu): a phase
// completes when `count`
// arrivals have been made; waiters name the parity of the phase they wait for (phase k has parity k & 1), so a
// barrier may run at most one phase ahead of any waiter (the protocols guarantee it).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if NOPAD_FMHA_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#else
  (void)bar, (void)count;
#endif
}
// Makes the initialisations visible to the other threads (and the async proxy) before the CTA barrier that follows.
__device__ __forceinline__ void mbar_init_fence() {
#if NOPAD_FMHA_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival (release semantics: this thread's earlier writes are visible to whoever sees the phase complete).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if NOPAD_FMHA_WGMMA
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(bar)) : "memory");
#else
  (void)bar;
#endif
}
// One arrival made when all of this thread's earlier cp.async copies have landed (.noinc: counted in `count`).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
#if NOPAD_FMHA_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#else
  (void)bar;
#endif
}
// Blocks until the phase of parity `parity` has completed (acquire semantics); on a fresh barrier, parity 1 (the phase
// "before" the first) counts as completed, which is how producers pass the empty barriers on their first lap.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if NOPAD_FMHA_WGMMA
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
#endif
}
// Barrier `id` (1..15; 0 is __syncthreads) of `threads` threads, whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrival on barrier `id` without waiting: the signalling side of a barrier whose other `threads` - (arriving threads)
// wait in named_barrier_sync.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Register budget of the executing warpgroup (every thread of it executes the same call): producers give registers
// back, consumers take them.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if NOPAD_FMHA_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if NOPAD_FMHA_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Waits until at most N of this thread's bulk groups are incomplete (their writes performed, not only their reads).
template <int N>
__device__ __forceinline__ void bulk_wait() {
#if NOPAD_FMHA_WGMMA
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of registers that an in-flight wgmma owns across the wait (or the
// issue): an empty volatile asm that "modifies" them.
template <int N>
__device__ __forceinline__ void fence_regs(float (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(x[i][e])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(x[i][e])::"memory");
}

#define NOPAD_WG_D                                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define NOPAD_WG_OUT(d)                                                                                              \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),           \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),       \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),       \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),       \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

// d (64 x 64 fp32, the warpgroup's accumulators) = A B (+ d when accumulate): A 64 x 16 and B 16 x 64 from shared
// memory through descriptors; kTransA / kTransB = 1 for MN-major operands, 0 for K-major.
template <bool kFp16, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if NOPAD_FMHA_WGMMA
  if constexpr (kFp16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " NOPAD_WG_D ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : NOPAD_WG_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " NOPAD_WG_D ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : NOPAD_WG_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransA), "n"(kTransB));
  }
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
#endif
}

// d += A B with A (64 x 16) in registers (a: this thread's mma.sync-style A fragment of its warp's 16 rows) and B
// (16 x 64) in shared memory; kTransB as above.
template <bool kFp16, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
#if NOPAD_FMHA_WGMMA
  if constexpr (kFp16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " NOPAD_WG_D
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : NOPAD_WG_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " NOPAD_WG_D
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : NOPAD_WG_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB));
  }
#else
  (void)d, (void)a, (void)desc_b;
#endif
}

#undef NOPAD_WG_D
#undef NOPAD_WG_OUT

}  // namespace nopad::cuda::fmha_detail
