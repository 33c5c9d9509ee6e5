// Global -> shared memory copies by cp.async (sm_80+), shared by the FMHA tiles and the pipelined LayerNorm rows:
// a copy is issued by one thread, grouped by cp_async_commit, and visible to that thread after cp_async_wait<N>
// (to other threads only after a barrier as well).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace nopad::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; when !valid the 16 bytes are zero-filled and src is not read (src-size 0).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid = true) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}
// 4-byte global -> shared copy (cp.async.ca: the only size below 16 that cp.async takes); zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid = true) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}
// Closes the group of copies this thread issued since its last commit (an empty group is allowed).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace nopad::cuda
