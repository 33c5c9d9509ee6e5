// Bucket-wise gradient clipping: see clip.h.
#include "optim/clip.h"

#include <cmath>

namespace nopad {

double sum_of_squares(const float* g, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  return s;
}

double clip_factor(double sum_sq, double threshold) {
  if (!(threshold > 0) || !std::isfinite(sum_sq) || !(sum_sq > threshold * threshold)) return 1.0;
  return threshold / std::sqrt(sum_sq);
}

double clip_to_norm(float* g, size_t n, double threshold) {
  const double f = clip_factor(sum_of_squares(g, n), threshold);
  if (f != 1.0) {
    const auto ff = static_cast<float>(f);
    for (size_t i = 0; i < n; ++i) g[i] *= ff;
  }
  return f;
}

}  // namespace nopad
