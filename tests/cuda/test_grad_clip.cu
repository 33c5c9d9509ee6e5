// The bucket-wise clipping kernels (ops/cuda/grad_clip.h) against their CPU twin (optim/clip.h): random gradients in
// buckets of awkward sizes (1 element, not a multiple of the block, > 1M elements) with thresholds below and above
// each bucket's norm, one bucket holding an inf. The device sum of squares agrees with the CPU's double sum to 1e-5
// relative (fp32 atomics in block order), and the clipped values agree to 1e-5 relative; a bucket at or below its
// threshold and the non-finite bucket are left bit for bit as they were. The sums start poisoned-free: the caller
// zeroes them, as the engine does. Needs a GPU (built as nopad_cuda_tests, not registered with CTest).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "ops/cuda/grad_clip.h"
#include "optim/clip.h"

namespace nopad::cuda {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

TEST(GradClip, KernelsMatchTheCpuTwin) {
  int devices = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) << "no CUDA device";
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.01f);
  struct Bucket {
    size_t n;
    double threshold_frac;  // threshold as a fraction of the bucket's norm (>1: not clipped)
    bool inf;
  };
  const Bucket buckets[] = {{1, 0.5, false},       {1000, 0.1, false},   {4097, 2.0, false},
                            {1 << 20, 0.01, false}, {(1 << 20) + 3, 1.0, false}, {65536, 0.3, true}};
  for (const Bucket& b : buckets) {
    std::vector<float> g(b.n);
    for (float& x : g) x = nd(rng);
    if (b.inf) g[b.n / 2] = INFINITY;
    const double ss_cpu = sum_of_squares(g.data(), g.size());
    const double norm = b.inf ? 1.0 : std::sqrt(ss_cpu);
    // At exactly 1.0 the CPU and GPU sums may land on either side of the threshold: make it a clear "no".
    const double threshold = b.threshold_frac == 1.0 ? norm * 1.0001 : norm * b.threshold_frac;
    std::vector<float> want = g;
    const double f = clip_to_norm(want.data(), want.size(), threshold);

    float *dg = nullptr, *dss = nullptr;
    CK(cudaMalloc(&dg, b.n * sizeof(float)));
    CK(cudaMalloc(&dss, sizeof(float)));
    CK(cudaMemcpy(dg, g.data(), b.n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemset(dss, 0, sizeof(float)));
    launch_sum_of_squares(dg, b.n, dss, sms, nullptr);
    launch_clip_scale(dg, b.n, dss, static_cast<float>(threshold), sms, nullptr);
    CK(cudaDeviceSynchronize());
    float ss_gpu = 0;
    std::vector<float> got(b.n);
    CK(cudaMemcpy(&ss_gpu, dss, sizeof(float), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got.data(), dg, b.n * sizeof(float), cudaMemcpyDeviceToHost));
    CK(cudaFree(dg));
    CK(cudaFree(dss));

    SCOPED_TRACE("bucket of " + std::to_string(b.n) + ", threshold " + std::to_string(b.threshold_frac) + " x norm" +
                 (b.inf ? ", with inf" : ""));
    if (b.inf) {
      EXPECT_TRUE(std::isinf(ss_gpu));
      EXPECT_EQ(0, std::memcmp(got.data(), g.data(), b.n * sizeof(float))) << "a non-finite bucket is left alone";
      continue;
    }
    EXPECT_NEAR(ss_gpu, ss_cpu, 1e-5 * ss_cpu);
    if (f == 1.0) {
      EXPECT_EQ(0, std::memcmp(got.data(), g.data(), b.n * sizeof(float))) << "below the threshold: unchanged";
      continue;
    }
    size_t bad = 0;
    for (size_t i = 0; i < b.n; ++i) bad += std::fabs(got[i] - want[i]) > 1e-5 * std::fabs(want[i]) + 1e-12;
    EXPECT_EQ(bad, 0u) << "clipped values differ from the CPU twin's";
    const double after = std::sqrt(sum_of_squares(got.data(), got.size()));
    EXPECT_NEAR(after, threshold, 1e-5 * threshold);
  }
}

}  // namespace
}  // namespace nopad::cuda
