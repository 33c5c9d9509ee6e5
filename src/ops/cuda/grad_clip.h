// Bucket-wise gradient clipping on the GPU (dist.clip = bucket): the CUDA twins of optim/clip.h. Two launches per
// bucket on the caller's stream, nothing read back: the bucket's sum of squares accumulated into a device float (which
// the caller zeroes first), then the bucket scaled by clip_factor(sum, threshold) computed on the device. fp32 sums in
// a launch-dependent order (atomics across blocks), so the factor agrees with the CPU twin's double sum to ~1e-6
// relative, not bitwise. Statuses checked; throws nopad::Error.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace nopad::cuda {

// *sum_sq += sum of g[i]^2 over [0, n).
void launch_sum_of_squares(const float* g, size_t n, float* sum_sq, int sm_count, cudaStream_t stream);
// g[0, n) *= clip_factor(*sum_sq, threshold): unchanged when *sum_sq <= threshold^2, non-finite, or threshold <= 0.
void launch_clip_scale(float* g, size_t n, const float* sum_sq, float threshold, int sm_count, cudaStream_t stream);

}  // namespace nopad::cuda
