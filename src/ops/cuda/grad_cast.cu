// fp32 <-> bf16 conversions of the bf16 gradient reduction: see grad_cast.h (CPU twin: round_to_bf16 in core/dtype.h).
#include "ops/cuda/grad_cast.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "ops/cuda/check.h"

namespace nopad::cuda {
namespace {

constexpr int kThreads = 256;

int grid_for(size_t n, int sm_count) {
  const size_t want = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, static_cast<size_t>(8 * std::max(1, sm_count)))));
}

__global__ void __launch_bounds__(kThreads) fp32_to_bf16_kernel(const float* __restrict__ in,
                                                                 __nv_bfloat16* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void __launch_bounds__(kThreads) bf16_to_fp32_kernel(const __nv_bfloat16* __restrict__ in,
                                                                 float* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads)
    out[i] = __bfloat162float(in[i]);
}

}  // namespace

void launch_fp32_to_bf16(const float* in, bf16* out, size_t n, int sm_count, cudaStream_t stream) {
  if (n == 0) return;
  fp32_to_bf16_kernel<<<grid_for(n, sm_count), kThreads, 0, stream>>>(in, reinterpret_cast<__nv_bfloat16*>(out), n);
  NOPAD_CUDA_CHECK_LAUNCH();
}

void launch_bf16_to_fp32(const bf16* in, float* out, size_t n, int sm_count, cudaStream_t stream) {
  if (n == 0) return;
  bf16_to_fp32_kernel<<<grid_for(n, sm_count), kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(in), out,
                                                                       n);
  NOPAD_CUDA_CHECK_LAUNCH();
}

}  // namespace nopad::cuda
