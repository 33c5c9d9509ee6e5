// LtGemm autotuning by size class (ops/cuda/dense.h): a training run's token count changes every step, so the
// algorithm is timed once per size class, not once per exact shape. Checks that (a) two row counts of one class tune
// once and the second takes the class's algorithm, (b) a row count of another class tunes again, (c) every product is
// right (bf16 operands, fp32 reference on the host, output poisoned before each product), (d) with tuning off (the
// default) nothing is timed. Needs a GPU (nopad_cuda_tests).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cuda/dense.h"

namespace nopad::cuda {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

// y[rows, n] = x[rows, k] W[n, k]^T (the forward dense product of dense.h's mapping), checked against the host.
void forward_product(LtGemm& gemm, int64_t rows, int64_t k, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> x(rows * k), w(n * k);
  std::vector<float> xf(x.size()), wf(w.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = to_bf16(nd(rng)).bits;
    xf[i] = to_float(bf16{x[i]});
  }
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = to_bf16(nd(rng) * 0.05f).bits;
    wf[i] = to_float(bf16{w[i]});
  }
  void *dx = nullptr, *dw = nullptr, *dy = nullptr;
  CK(cudaMalloc(&dx, x.size() * 2));
  CK(cudaMalloc(&dw, w.size() * 2));
  CK(cudaMalloc(&dy, rows * n * 2));
  CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(dy, 0xFF, rows * n * 2));  // NaN: unwritten elements show
  GemmProblem p;
  p.trans_a = true;
  p.m = n;
  p.n = rows;
  p.k = k;
  p.a = dw;
  p.lda = k;
  p.b = dx;
  p.ldb = k;
  p.d = dy;
  p.ldd = n;
  gemm.run(p, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> y(rows * n);
  CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int64_t r = 0; r < rows; r += 7) {  // every 7th row: enough to catch a wrong algorithm, cheap on the host
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int64_t q = 0; q < k; ++q) ref += static_cast<double>(xf[r * k + q]) * wf[j * k + q];
      const double got = to_float(bf16{y[r * n + j]});
      ASSERT_TRUE(std::isfinite(got)) << "rows " << rows << ": y[" << r << ", " << j << "] not written";
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
  }
  EXPECT_LT(std::sqrt(num / den), 1e-2) << "rows " << rows << " (one bf16 rounding of an fp32 product: ~1e-3)";
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
}

TEST(GemmTuning, OncePerSizeClass) {
  int count = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&count) == cudaSuccess && count > 0) << "no CUDA device";
  for (const int on : {1, 0}) {
    SCOPED_TRACE(on ? "autotuning on" : "autotuning off");
    LtGemm gemm(on);
    // 5000 and 5100 rows share the class 5120 (4096 / 8 = 512-row steps); 9000 is in 9216 (1024-row steps).
    forward_product(gemm, 5000, 1024, 768, 1);
    forward_product(gemm, 5100, 1024, 768, 2);
    const LtGemm::TuningStats after_two = gemm.tuning_stats();
    forward_product(gemm, 9000, 1024, 768, 3);
    const LtGemm::TuningStats after_three = gemm.tuning_stats();
    std::printf("  gemm tuning %s: %d classes tuned, %d shapes reused a class's algorithm, %d changed from the "
                "heuristic's first; first %.3f ms vs chosen %.3f ms\n",
                on ? "on" : "off", after_three.shapes, after_three.reused, after_three.changed, after_three.first_ms,
                after_three.chosen_ms);
    if (!on) {
      EXPECT_EQ(after_three.shapes, 0);
      EXPECT_EQ(after_three.reused, 0);
      continue;
    }
    EXPECT_EQ(after_two.shapes, 1) << "5000 and 5100 rows are one class: tuned once";
    EXPECT_EQ(after_two.reused, 1) << "5100 rows take the algorithm tuned at 5000 (cublasLtMatmulAlgoCheck accepts it)";
    EXPECT_EQ(after_three.shapes, 2) << "9000 rows are another class";
    EXPECT_EQ(after_three.reused, 1);
  }
}

}  // namespace
}  // namespace nopad::cuda
