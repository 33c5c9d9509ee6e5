// Bucket-wise gradient clipping kernels: see grad_clip.h (CPU twin: optim/clip.h).
#include "ops/cuda/grad_clip.h"

#include <algorithm>

#include "ops/cuda/check.h"

namespace nopad::cuda {
namespace {

constexpr int kThreads = 256;

int grid_for(size_t n, int sm_count) {
  const size_t want = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, static_cast<size_t>(4 * std::max(1, sm_count)))));
}

__global__ void __launch_bounds__(kThreads) sum_of_squares_kernel(const float* __restrict__ g, size_t n,
                                                                   float* __restrict__ out) {
  float acc = 0.0f;
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads)
    acc = fmaf(g[i], g[i], acc);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float warp_sums[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    float s = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) atomicAdd(out, s);
  }
}

__global__ void __launch_bounds__(kThreads) clip_scale_kernel(float* __restrict__ g, size_t n,
                                                               const float* __restrict__ sum_sq, float threshold) {
  const float ss = *sum_sq;
  // The CPU twin's rule: clip only a finite sum above threshold^2 (a non-finite bucket is the optimizer's to see).
  if (!(threshold > 0.0f) || !isfinite(ss) || !(ss > threshold * threshold)) return;
  const float f = threshold / sqrtf(ss);
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads) g[i] *= f;
}

}  // namespace

void launch_sum_of_squares(const float* g, size_t n, float* sum_sq, int sm_count, cudaStream_t stream) {
  if (n == 0) return;
  sum_of_squares_kernel<<<grid_for(n, sm_count), kThreads, 0, stream>>>(g, n, sum_sq);
  NOPAD_CUDA_CHECK_LAUNCH();
}

void launch_clip_scale(float* g, size_t n, const float* sum_sq, float threshold, int sm_count, cudaStream_t stream) {
  if (n == 0) return;
  clip_scale_kernel<<<grid_for(n, sm_count), kThreads, 0, stream>>>(g, n, sum_sq, threshold);
  NOPAD_CUDA_CHECK_LAUNCH();
}

}  // namespace nopad::cuda
