// cuda::FusedLamb against its CPU twin nopad::Lamb (optim/optimizer.h): the same fp32 weights and gradients go to
// both, several steps run, and after each step the master weights, m, v, the reported gradient norm, the skip flag
// and the step count are compared; the 16-bit weight copy (bf16, or fp16 for the GpuF16 model) must equal
// to_bf16(master) / to_f16(master) bit for bit. The layout mixes tensor sizes (1 element, chunk-boundary sizes,
// > 1M elements) and weight-decay flags.
//
// Tolerance 1e-5 (per element, relative to max(|cpu|, rms of the tensor)): the element-wise arithmetic is the CPU's
// without FMA contraction, so m and v agree bit for bit unless clipping is active; what differs is fp32 (GPU) vs
// double (CPU) sums of squares, ~1e-6 relative in the norm and in the trust ratios, which moves w by ~1e-6 of its
// update. The rms floor keeps elements near zero (whose relative change is meaningless) from failing.
// Needs a GPU (built as nopad_cuda_tests, not registered with CTest).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "ops/cuda/check.h"
#include "ops/cuda/lamb.h"
#include "optim/optimizer.h"

namespace nopad {
namespace {

constexpr double kTol = 1e-5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <class T>
struct DevBuf {  // device memory of n elements, freed at scope end
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    p = static_cast<T*>(cuda::cuda_malloc_or_throw(std::max<size_t>(n, 1) * sizeof(T), "test buffer"));
  }
  ~DevBuf() { (void)cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

struct StreamHolder {
  cudaStream_t s = nullptr;
  StreamHolder() { NOPAD_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~StreamHolder() { (void)cudaStreamDestroy(s); }
};

// Sizes: single elements, sizes around the chunk (16384) boundary, one > 1M; every other tensor without decay.
std::vector<cuda::LambTensor> test_layout(size_t* total) {
  const size_t sizes[] = {1, 7, 1000, (size_t{1} << 20) + 3, 16384, 1, 33333, 2 * 16384 + 5, 4096};
  const bool no_wd[] = {true, false, true, false, true, false, false, true, false};
  std::vector<cuda::LambTensor> t;
  size_t off = 0;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    t.push_back({off, sizes[i], no_wd[i]});
    off += sizes[i];
  }
  *total = off;
  return t;
}

std::vector<float> uniform(Rng& rng, size_t n, float amp) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(amp * (2 * rng.uniform() - 1));
  return v;
}

template <class T>
std::vector<T> download(const T* d, size_t n, cudaStream_t s) {
  std::vector<T> h(n);
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, s));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}

// Per element |gpu - cpu| <= tol * max(|cpu|, rms of the tensor's cpu values); reports the worst element.
void expect_close(const std::string& what, const std::vector<cuda::LambTensor>& layout, const float* gpu,
                  const float* cpu, double tol = kTol) {
  for (size_t t = 0; t < layout.size(); ++t) {
    const size_t o = layout[t].offset, n = layout[t].numel;
    double ss = 0;
    for (size_t j = 0; j < n; ++j) ss += double(cpu[o + j]) * cpu[o + j];
    const double rms = n ? std::sqrt(ss / n) : 0;
    double worst = 0;
    size_t worst_j = 0, bad = 0;
    for (size_t j = 0; j < n; ++j) {
      const double c = cpu[o + j], g = gpu[o + j];
      const double scale = std::max({std::fabs(c), rms, 1e-30});
      const double rel = std::isnan(g) ? INFINITY : std::fabs(g - c) / scale;
      if (rel > worst) worst = rel, worst_j = j;
      if (!(rel <= tol)) ++bad;
    }
    EXPECT_EQ(bad, 0u) << what << " tensor " << t << " (" << n << " elements): worst rel err " << worst
                       << " at element " << worst_j << " gpu " << gpu[o + worst_j] << " cpu " << cpu[o + worst_j];
  }
}

// The 16-bit copy's expected bits: round to nearest even of the master weight.
uint16_t copy_bits(float master, bool f16_copy) { return f16_copy ? to_f16(master).bits : to_bf16(master).bits; }

// The CPU Lamb and the FusedLamb on the same starting values; the weight copy is bf16 or fp16 (f16_copy).
struct Twin {
  std::vector<cuda::LambTensor> layout;
  size_t n = 0;
  OptimizerOptions options;
  StreamHolder stream;
  std::vector<float> w_cpu, g;
  std::unique_ptr<Lamb> cpu;
  std::unique_ptr<cuda::FusedLamb> gpu;
  std::unique_ptr<DevBuf<float>> d_g;
  std::unique_ptr<DevBuf<uint16_t>> d_w16;  // the bits of the bf16 or fp16 copy
  bool f16_copy = false;

  Twin(OptimizerOptions opt, uint64_t seed, bool fp16 = false) : options(opt), f16_copy(fp16) {
    layout = test_layout(&n);
    Rng rng(seed);
    w_cpu = uniform(rng, n, 0.05f);
    g.assign(n, 0.0f);
    std::vector<ParamView> views;
    for (size_t t = 0; t < layout.size(); ++t)
      views.push_back({"t" + std::to_string(t), w_cpu.data() + layout[t].offset, g.data() + layout[t].offset,
                       layout[t].numel, layout[t].no_weight_decay});
    cpu = std::make_unique<Lamb>(std::move(views), options);
    gpu = std::make_unique<cuda::FusedLamb>(layout, n, options, stream.s);
    gpu->load_master(w_cpu.data());
    d_g = std::make_unique<DevBuf<float>>(n);
    d_w16 = std::make_unique<DevBuf<uint16_t>>(n);
    // Poison: 0xFF bytes are NaN in bf16 and fp16, so any element the step forgets to write shows up.
    NOPAD_CUDA_CHECK(cudaMemsetAsync(d_w16->p, 0xFF, n * sizeof(uint16_t), stream.s));
  }

  // New gradients, uniform in (-amp, amp); uploaded to the GPU.
  void draw_grads(Rng& rng, float amp) {
    const std::vector<float> fresh = uniform(rng, n, amp);
    std::copy(fresh.begin(), fresh.end(), g.begin());
    upload_grads();
  }
  void upload_grads() {
    NOPAD_CUDA_CHECK(cudaMemcpyAsync(d_g->p, g.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream.s));
    NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }

  void gpu_step(cuda::FusedLamb& lamb, uint16_t* copy, float lr, float grad_scale) {
    if (f16_copy)
      lamb.step(d_g->p, reinterpret_cast<f16*>(copy), lr, grad_scale);
    else
      lamb.step(d_g->p, reinterpret_cast<bf16*>(copy), lr, grad_scale);
  }
  StepStats step(float lr, float grad_scale) {
    gpu_step(*gpu, d_w16->p, lr, grad_scale);
    return cpu->step(lr, grad_scale);
  }

  std::vector<float> gpu_master() const {
    std::vector<float> h(n, kNaN);  // poisoned: a short download shows as NaN
    gpu->download_master(h.data());
    return h;
  }

  // Everything after a step: norm, skip, step count, weights, moments, bf16 copy.
  void compare(const std::string& what, const StepStats& st) {
    SCOPED_TRACE(what);
    const double gn = gpu->last_grad_norm();
    EXPECT_EQ(gpu->last_step_skipped(), st.skipped);
    EXPECT_EQ(gpu->step_count(), cpu->step_count());
    if (std::isfinite(st.grad_norm)) {
      EXPECT_NEAR(gn, st.grad_norm, kTol * st.grad_norm) << "grad norm";
    } else {
      EXPECT_FALSE(std::isfinite(gn)) << "grad norm";
    }
    std::printf("    %-32s norm gpu %.9g cpu %.9g, clip %.6g, skipped %d, step %lld\n", what.c_str(), gn,
                st.grad_norm, st.clip_factor, int(st.skipped), static_cast<long long>(cpu->step_count()));
    const std::vector<float> master = gpu_master();
    expect_close("master", layout, master.data(), w_cpu.data());
    std::vector<float> m(n, kNaN), v(n, kNaN), m_cpu(n), v_cpu(n);
    gpu->download_moments(m.data(), v.data());
    const std::vector<StateTensor> state = cpu->state_tensors();  // m then v per tensor
    for (size_t t = 0; t < layout.size(); ++t) {
      std::copy_n(state[2 * t].data, layout[t].numel, m_cpu.begin() + layout[t].offset);
      std::copy_n(state[2 * t + 1].data, layout[t].numel, v_cpu.begin() + layout[t].offset);
    }
    expect_close("exp_avg", layout, m.data(), m_cpu.data());
    expect_close("exp_avg_sq", layout, v.data(), v_cpu.data());
    if (cpu->step_count() > 0) {  // before any applied step the copy is still poison
      const std::vector<uint16_t> w16 = download(d_w16->p, n, stream.s);
      size_t mismatches = 0, first = 0;
      for (size_t j = 0; j < n; ++j)
        if (w16[j] != copy_bits(master[j], f16_copy) && mismatches++ == 0) first = j;
      EXPECT_EQ(mismatches, 0u) << (f16_copy ? "fp16" : "bf16") << " copy != round(master), first at " << first
                                << ": bits " << w16[first] << " vs " << copy_bits(master[first], f16_copy)
                                << " (master " << master[first] << ")";
    }
  }
};

struct Case {
  const char* name;
  float grad_amp;    // gradient magnitude: large makes the norm exceed max_grad_norm (clipping)
  float grad_scale;
  TrustRatio trust;
  bool bias_correction;
  bool expect_clip;
  bool f16_copy = false;  // the weight copy is fp16 (the GpuF16 model's), else bf16
};

class FusedLambTest : public ::testing::TestWithParam<Case> {};

TEST_P(FusedLambTest, MatchesCpuLambOverThreeSteps) {
  const Case c = GetParam();
  OptimizerOptions opt;
  opt.trust_ratio = c.trust;
  opt.bias_correction = c.bias_correction;
  Twin twin(opt, 1234, c.f16_copy);
  Rng rng(99);
  const float lrs[] = {1e-2f, 5e-3f, 2e-3f};
  for (int s = 0; s < 3; ++s) {
    twin.draw_grads(rng, c.grad_amp);
    const StepStats st = twin.step(lrs[s], c.grad_scale);
    ASSERT_FALSE(st.skipped);
    EXPECT_EQ(st.clip_factor < 1.0, c.expect_clip) << "test setup: clip factor " << st.clip_factor;
    twin.compare(std::string(c.name) + " step " + std::to_string(s + 1), st);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FusedLambTest,
    ::testing::Values(
        // |g| ~ 10 over 1.2M elements: norm ~ 6e3 >> max_grad_norm 1
        Case{"clip_active", 10.0f, 1.0f, TrustRatio::kDecayedOnly, true, true},
        // |g| ~ 1e-4: norm ~ 0.06 < 1
        Case{"clip_inactive", 1e-4f, 1.0f, TrustRatio::kDecayedOnly, true, false},
        Case{"clip_inactive_scaled_nvlamb", 2e-4f, 0.5f, TrustRatio::kAllTensors, true, false},
        Case{"clip_active_no_bias_correction", 10.0f, 0.25f, TrustRatio::kDecayedOnly, false, true},
        // fp16 copies; grad_scale 1/4096 as a loss-scaled fp16 step divides it out (gradients 4096x larger)
        Case{"fp16_copy_clip_active", 10.0f, 1.0f, TrustRatio::kDecayedOnly, true, true, true},
        Case{"fp16_copy_clip_inactive_loss_scaled", 4096 * 1e-4f, 1.0f / 4096, TrustRatio::kDecayedOnly, true, false,
             true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A NaN gradient, an inf gradient and an inf grad_scale each skip the step on both sides: nothing changes (bit for
// bit on the GPU, the 16-bit copy included) and the step count stays; the next finite step goes on as on the CPU.
// For both copy types (an fp16 step whose loss-scaled gradients overflowed is exactly this case).
TEST(FusedLamb, NonFiniteGradientSkipsStep) {
  for (const bool fp16 : {false, true}) {
    SCOPED_TRACE(fp16 ? "fp16 copy" : "bf16 copy");
    Twin twin(OptimizerOptions{}, 7, fp16);
    Rng rng(5);
    twin.draw_grads(rng, 1e-3f);
    twin.compare("step 1", twin.step(1e-2f, 1.0f));

    for (int k = 0; k < 3; ++k) {
      const std::vector<float> master_before = twin.gpu_master();
      std::vector<float> m0(twin.n), v0(twin.n);
      twin.gpu->download_moments(m0.data(), v0.data());
      const std::vector<uint16_t> w16_before = download(twin.d_w16->p, twin.n, twin.stream.s);
      const std::vector<float> cpu_before = twin.w_cpu;

      twin.draw_grads(rng, 1e-3f);
      float scale = 1.0f;
      if (k == 0) twin.g[twin.n / 2] = kNaN;
      if (k == 1) twin.g[0] = std::numeric_limits<float>::infinity();
      if (k == 2) scale = std::numeric_limits<float>::infinity();
      twin.upload_grads();
      const StepStats st = twin.step(1e-2f, scale);
      const std::string what = "non-finite case " + std::to_string(k);
      EXPECT_TRUE(st.skipped) << what;
      EXPECT_TRUE(twin.gpu->last_step_skipped()) << what;
      EXPECT_EQ(twin.gpu->step_count(), 1) << what;
      EXPECT_EQ(twin.cpu->step_count(), 1) << what;
      EXPECT_EQ(twin.w_cpu, cpu_before) << what;
      const std::vector<float> master_after = twin.gpu_master();
      std::vector<float> m1(twin.n), v1(twin.n);
      twin.gpu->download_moments(m1.data(), v1.data());
      const std::vector<uint16_t> w16_after = download(twin.d_w16->p, twin.n, twin.stream.s);
      EXPECT_EQ(0, std::memcmp(master_before.data(), master_after.data(), twin.n * sizeof(float))) << what;
      EXPECT_EQ(0, std::memcmp(m0.data(), m1.data(), twin.n * sizeof(float))) << what;
      EXPECT_EQ(0, std::memcmp(v0.data(), v1.data(), twin.n * sizeof(float))) << what;
      EXPECT_EQ(0, std::memcmp(w16_before.data(), w16_after.data(), twin.n * sizeof(uint16_t))) << what;
    }

    twin.draw_grads(rng, 1e-3f);
    const StepStats st = twin.step(5e-3f, 1.0f);
    EXPECT_FALSE(st.skipped);
    twin.compare("finite step after skips", st);
    EXPECT_EQ(twin.gpu->step_count(), 2);
  }
}

// download_master/download_moments -> load_master/load_moments into a fresh FusedLamb resumes bit for bit.
TEST(FusedLamb, CheckpointRoundTripResumesExactly) {
  Twin twin(OptimizerOptions{}, 11);
  Rng rng(3);
  for (int s = 0; s < 2; ++s) {
    twin.draw_grads(rng, 1.0f);
    twin.step(1e-2f, 1.0f);
  }
  const std::vector<float> master = twin.gpu_master();
  std::vector<float> m(twin.n), v(twin.n);
  twin.gpu->download_moments(m.data(), v.data());

  cuda::FusedLamb restored(twin.layout, twin.n, twin.options, twin.stream.s);
  restored.load_master(master.data());
  restored.load_moments(m.data(), v.data(), twin.gpu->step_count());
  DevBuf<bf16> w16(twin.n);
  NOPAD_CUDA_CHECK(cudaMemsetAsync(w16.p, 0xFF, twin.n * sizeof(bf16), twin.stream.s));
  restored.write_weight_copy(w16.p);
  const std::vector<bf16> copy0 = download(w16.p, twin.n, twin.stream.s);
  for (size_t j = 0; j < twin.n; ++j) ASSERT_EQ(copy0[j].bits, to_bf16(master[j]).bits) << "element " << j;
  // The fp16 copy of the same masters (the GpuF16 model's), written the same way.
  DevBuf<f16> h16(twin.n);
  NOPAD_CUDA_CHECK(cudaMemsetAsync(h16.p, 0xFF, twin.n * sizeof(f16), twin.stream.s));
  restored.write_weight_copy(h16.p);
  const std::vector<f16> copy1 = download(h16.p, twin.n, twin.stream.s);
  for (size_t j = 0; j < twin.n; ++j) ASSERT_EQ(copy1[j].bits, to_f16(master[j]).bits) << "fp16 element " << j;
  EXPECT_EQ(restored.step_count(), 2);

  twin.draw_grads(rng, 1.0f);
  twin.gpu_step(*twin.gpu, twin.d_w16->p, 3e-3f, 1.0f);
  restored.step(twin.d_g->p, w16.p, 3e-3f, 1.0f);
  const std::vector<float> a = twin.gpu_master();
  std::vector<float> b(twin.n, kNaN);
  restored.download_master(b.data());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), twin.n * sizeof(float)));
  EXPECT_EQ(restored.step_count(), 3);
  EXPECT_EQ(restored.last_grad_norm(), twin.gpu->last_grad_norm());
}

TEST(FusedLamb, RejectsOverlappingOrOutOfRangeTensors) {
  StreamHolder s;
  EXPECT_THROW((cuda::FusedLamb({{0, 10, false}, {5, 10, false}}, 20, OptimizerOptions{}, s.s)), Error);
  EXPECT_THROW((cuda::FusedLamb({{15, 10, false}}, 20, OptimizerOptions{}, s.s)), Error);
}

}  // namespace
}  // namespace nopad
