// Bucket-wise gradient clipping (dist.clip = bucket, docs/distributed.md): each gradient bucket is scaled so that its
// norm is at most a threshold, on each rank before the bucket's all-reduce, so clipping need not wait for the whole
// backward pass (the global-norm clip of LAMB needs every gradient). This is the definition the CUDA kernels
// (ops/cuda/grad_clip.h) are tested against.
//
// clip_factor(ss, t) = t / sqrt(ss) when ss > t^2 and ss is finite, else 1: a non-finite bucket is left as it is, so
// the optimizer still sees the overflow and skips the step; t <= 0 never clips.
#pragma once
#include <cstddef>

namespace nopad {

// Sum of squares in double, in index order (deterministic).
double sum_of_squares(const float* g, size_t n);
double clip_factor(double sum_sq, double threshold);
// Scales g[0, n) by clip_factor(sum_of_squares(g), threshold); returns the factor.
double clip_to_norm(float* g, size_t n, double threshold);

}  // namespace nopad
