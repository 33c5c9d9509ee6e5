// The bf16 gradient reduction (dist.reduce = bf16) on one GPU: the conversion kernels (ops/cuda/grad_cast.h) against
// their CPU twin round_to_bf16 (core/dtype.h) on values that exercise the rounding (ties to even, subnormals, values
// that round up to a power of two, the largest finite bf16 and beyond, inf, NaN), in an awkward count; and the whole
// bucket path of a one-rank NCCL communicator (fp32 -> bf16 staging -> ncclBfloat16 all-reduce -> fp32), whose sum of
// one rank must be exactly the rounding. Outputs are poisoned first. Needs a GPU (nopad_cuda_tests).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "dist/comm.h"
#include "ops/cuda/grad_cast.h"
#include "ops/cuda/nccl_comm.h"

namespace nopad::cuda {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

std::vector<float> tricky_values(size_t n) {
  std::vector<float> v(n);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1e-3f);
  for (float& x : v) x = nd(rng);
  const float specials[] = {1.0f + 1.0f / 256,          // a tie between two bf16 values: rounds to even (down)
                            1.0f + 3.0f / 256,          // a tie that rounds up
                            1.9999999f,                 // rounds up to 2
                            1e-40f,                     // fp32 subnormal
                            -0.0f,
                            3.3895314e38f,              // the largest finite bf16
                            3.4028235e38f,              // rounds to inf in bf16
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (size_t i = 0; i < std::size(specials) && i < n; ++i) v[i * 97 % n] = specials[i];
  return v;
}

void expect_same_bits_or_both_nan(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      bad += !std::isnan(got[i]);
      continue;
    }
    bad += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
    if (bad == 1 && std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      ADD_FAILURE() << "first difference at " << i << ": got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0u);
}

TEST(GradCast, KernelsMatchTheCpuTwin) {
  int devices = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) << "no CUDA device";
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (const size_t n : {size_t{1}, size_t{4099}, size_t{(1 << 22) + 5}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const std::vector<float> in = tricky_values(n);
    std::vector<float> want = in;
    round_to_bf16(want.data(), want.size());
    float *d_in = nullptr, *d_out = nullptr;
    bf16* d16 = nullptr;
    CK(cudaMalloc(&d_in, n * sizeof(float)));
    CK(cudaMalloc(&d_out, n * sizeof(float)));
    CK(cudaMalloc(&d16, n * sizeof(bf16)));
    CK(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemset(d_out, 0xFF, n * sizeof(float)));  // poison: NaN everywhere
    CK(cudaMemset(d16, 0xFF, n * sizeof(bf16)));
    launch_fp32_to_bf16(d_in, d16, n, sms, nullptr);
    launch_bf16_to_fp32(d16, d_out, n, sms, nullptr);
    CK(cudaDeviceSynchronize());
    std::vector<float> got(n);
    CK(cudaMemcpy(got.data(), d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
    CK(cudaFree(d_in));
    CK(cudaFree(d_out));
    CK(cudaFree(d16));
    expect_same_bits_or_both_nan(got, want);
  }
  // The twin itself on the ties: 1 + 1/256 lies halfway between 1 and 1 + 1/128 and goes to the even one (1).
  float x[2] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256};
  round_to_bf16(x, 2);
  EXPECT_EQ(x[0], 1.0f);
  EXPECT_EQ(x[1], 1.0f + 4.0f / 256);
}

TEST(GradCast, OneRankBf16AllReduceIsTheRounding) {
  ASSERT_TRUE(nccl_built()) << "this build has no NCCL: data-parallel GPU training needs it (set NCCL_ROOT)";
  int devices = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) << "no CUDA device";
  CK(cudaSetDevice(0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto host = dist::make_single_communicator();
  std::unique_ptr<NcclComm> nccl = make_nccl_comm(*host);
  const size_t n = 1000003;
  const std::vector<float> in = tricky_values(n);
  std::vector<float> want = in;
  round_to_bf16(want.data(), want.size());
  float* d = nullptr;
  bf16* d16 = nullptr;
  CK(cudaMalloc(&d, n * sizeof(float)));
  CK(cudaMalloc(&d16, n * sizeof(bf16)));
  CK(cudaMemcpy(d, in.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemset(d16, 0xFF, n * sizeof(bf16)));
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  launch_fp32_to_bf16(d, d16, n, sms, s);
  CK(cudaMemsetAsync(d, 0xFF, n * sizeof(float), s));  // poison the destination
  nccl->all_reduce_sum_bf16(d16, n, s);
  launch_bf16_to_fp32(d16, d, n, sms, s);
  CK(cudaStreamSynchronize(s));
  std::vector<float> got(n);
  CK(cudaMemcpy(got.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  CK(cudaStreamDestroy(s));
  CK(cudaFree(d));
  CK(cudaFree(d16));
  nccl.reset();
  expect_same_bits_or_both_nan(got, want);
}

}  // namespace
}  // namespace nopad::cuda
