// Tests for LAMB, AdamW and the MLPerf learning-rate schedule, against independent double-precision math written
// here from the formulas (apex FusedLAMB semantics; MLPerf TF reference schedule), and against hand-computed values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace nopad {
namespace {

// Reference state for one tensor, in double.
struct RefTensor {
  std::vector<double> w, m, v;
  bool no_decay = false;
};

// One LAMB (or AdamW) step in double over grads `g` (already accumulated), straight from the formulas.
double ref_step(std::vector<RefTensor>& ts, const std::vector<std::vector<double>>& g, int t, double lr,
                double grad_scale, const OptimizerOptions& o, bool lamb) {
  double sq = 0;
  for (const auto& gi : g)
    for (double x : gi) sq += (x * grad_scale) * (x * grad_scale);
  const double norm = std::sqrt(sq);
  double mul = grad_scale;
  if (o.max_grad_norm > 0 && norm > o.max_grad_norm) mul *= o.max_grad_norm / norm;
  const double c1 = o.bias_correction ? 1 - std::pow(o.beta1, t) : 1.0;
  const double c2 = o.bias_correction ? 1 - std::pow(o.beta2, t) : 1.0;
  for (size_t k = 0; k < ts.size(); ++k) {
    RefTensor& r = ts[k];
    const double wd = r.no_decay ? 0.0 : o.weight_decay;
    std::vector<double> u(r.w.size());
    double wn = 0, un = 0;
    for (size_t j = 0; j < r.w.size(); ++j) {
      const double gj = g[k][j] * mul;
      r.m[j] = o.beta1 * r.m[j] + (1 - o.beta1) * gj;
      r.v[j] = o.beta2 * r.v[j] + (1 - o.beta2) * gj * gj;
      u[j] = (r.m[j] / c1) / (std::sqrt(r.v[j] / c2) + o.eps) + wd * r.w[j];
      wn += r.w[j] * r.w[j];
      un += u[j] * u[j];
    }
    wn = std::sqrt(wn);
    un = std::sqrt(un);
    double ratio = 1;
    if (lamb && (o.trust_ratio == TrustRatio::kAllTensors || wd != 0) && wn > 0 && un > 0) ratio = wn / un;
    for (size_t j = 0; j < r.w.size(); ++j) r.w[j] -= lr * ratio * u[j];
  }
  return norm;
}

struct Fixture {
  std::vector<float> w1{0.5f, -1.25f, 2.0f, 0.75f}, b1{0.1f, -0.2f}, ln{1.0f, 1.0f, 1.0f};
  std::vector<float> g1, gb, gl;
  std::vector<ParamView> views() {
    return {{"layer.weight", w1.data(), g1.data(), w1.size(), false},
            {"layer.bias", b1.data(), gb.data(), b1.size(), true},
            {"LayerNorm.gamma", ln.data(), gl.data(), ln.size(), true}};
  }
  std::vector<RefTensor> ref() const {
    auto mk = [](const std::vector<float>& w, bool nd) {
      RefTensor r;
      r.w.assign(w.begin(), w.end());
      r.m.assign(w.size(), 0.0);
      r.v.assign(w.size(), 0.0);
      r.no_decay = nd;
      return r;
    };
    return {mk(w1, false), mk(b1, true), mk(ln, true)};
  }
  // Writes into the existing buffers: the optimiser holds pointers to them.
  void set_grads(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& c) {
    g1.resize(a.size());
    gb.resize(b.size());
    gl.resize(c.size());
    std::copy(a.begin(), a.end(), g1.begin());
    std::copy(b.begin(), b.end(), gb.begin());
    std::copy(c.begin(), c.end(), gl.begin());
  }
  std::vector<std::vector<double>> grads() const {
    return {{g1.begin(), g1.end()}, {gb.begin(), gb.end()}, {gl.begin(), gl.end()}};
  }
  void expect_equal(const std::vector<RefTensor>& r, double tol) const {
    const std::vector<const std::vector<float>*> ws{&w1, &b1, &ln};
    for (size_t k = 0; k < ws.size(); ++k)
      for (size_t j = 0; j < ws[k]->size(); ++j)
        EXPECT_NEAR((*ws[k])[j], r[k].w[j], tol * std::max(1.0, std::fabs(r[k].w[j]))) << "tensor " << k << " [" << j << "]";
  }
};

void run_two_steps(const OptimizerOptions& o, bool lamb, double grad_scale, bool expect_clip) {
  Fixture f;
  f.set_grads({0.3f, -0.1f, 0.05f, 0.2f}, {0.02f, -0.04f}, {0.01f, 0.0f, -0.03f});
  auto opt = make_optimizer(lamb ? "lamb" : "adamw", f.views(), o);
  auto ref = f.ref();
  const double lrs[2] = {1e-2, 4e-3};
  for (int t = 1; t <= 2; ++t) {
    const double ref_norm = ref_step(ref, f.grads(), t, lrs[t - 1], grad_scale, o, lamb);
    const StepStats st = opt->step(lrs[t - 1], grad_scale);
    EXPECT_FALSE(st.skipped);
    EXPECT_NEAR(st.grad_norm, ref_norm, 1e-6 * ref_norm);
    if (expect_clip) EXPECT_NEAR(st.clip_factor, o.max_grad_norm / ref_norm, 1e-6);
    else EXPECT_EQ(st.clip_factor, 1.0);
    f.expect_equal(ref, 2e-6);
    // Second step's gradients differ from the first so the moments matter.
    f.set_grads({-0.2f, 0.4f, 0.1f, -0.05f}, {0.03f, 0.01f}, {-0.02f, 0.05f, 0.0f});
  }
  EXPECT_EQ(opt->step_count(), 2);
}

TEST(Lamb, HandComputedFirstStep) {
  // w = [3, 4] (norm 5), g = [1, -1], no decay, bias correction: m̂ = g, v̂ = g², u = g / (1 + eps).
  std::vector<float> w{3.0f, 4.0f}, g{1.0f, -1.0f};
  OptimizerOptions o;
  o.weight_decay = 0;
  o.max_grad_norm = 0;
  o.trust_ratio = TrustRatio::kAllTensors;
  Lamb lamb({{"w", w.data(), g.data(), 2, false}}, o);
  const StepStats st = lamb.step(0.1);
  EXPECT_NEAR(st.grad_norm, std::sqrt(2.0), 1e-7);
  const double u = 1.0 / (1.0 + 1e-6), ratio = 5.0 / (std::sqrt(2.0) * u);
  EXPECT_NEAR(w[0], 3.0 - 0.1 * ratio * u, 1e-6);
  EXPECT_NEAR(w[1], 4.0 + 0.1 * ratio * u, 1e-6);

  // Default (apex use_nvlamb=False) with weight decay 0: no trust ratio, a plain Adam step of ~lr.
  std::vector<float> w2{3.0f, 4.0f};
  o.trust_ratio = TrustRatio::kDecayedOnly;
  Lamb plain({{"w", w2.data(), g.data(), 2, false}}, o);
  plain.step(0.1);
  EXPECT_NEAR(w2[0], 3.0 - 0.1 * u, 1e-6);
  EXPECT_NEAR(w2[1], 4.0 + 0.1 * u, 1e-6);
}

TEST(Lamb, TwoStepsMatchReferenceNoClip) {
  OptimizerOptions o;
  o.max_grad_norm = 1.0;  // grad norm ~0.4: no clipping
  run_two_steps(o, true, 1.0, false);
}

TEST(Lamb, TwoStepsWithClippingAndGradScale) {
  OptimizerOptions o;
  o.max_grad_norm = 0.05;  // clips both steps
  o.weight_decay = 0.1;
  run_two_steps(o, true, 0.5, true);
}

TEST(Lamb, NvLambTrustRatioOnAllTensors) {
  OptimizerOptions o;
  o.trust_ratio = TrustRatio::kAllTensors;
  run_two_steps(o, true, 1.0, false);
}

TEST(Lamb, NoBiasCorrection) {
  OptimizerOptions o;
  o.bias_correction = false;
  run_two_steps(o, true, 1.0, false);
}

TEST(Lamb, NoDecayTensorGetsNoTrustRatioByDefault) {
  // A no-decay tensor with a large norm: with the apex default its step is ~lr per element, not lr * ||w||/||u||.
  std::vector<float> w{10.0f, 10.0f}, g{0.5f, 0.5f};
  OptimizerOptions o;
  o.max_grad_norm = 0;
  Lamb lamb({{"LayerNorm.gamma", w.data(), g.data(), 2, true}}, o);
  lamb.step(0.01);
  EXPECT_NEAR(w[0], 10.0 - 0.01 * (0.5 / (0.5 + 1e-6)), 1e-6);
}

TEST(Lamb, SkipsNonFiniteGradientsAndChangesNothing) {
  std::vector<float> w{1.0f, 2.0f}, g{INFINITY, 1.0f};
  Lamb lamb({{"w", w.data(), g.data(), 2, false}}, OptimizerOptions{});
  const StepStats st = lamb.step(0.1);
  EXPECT_TRUE(st.skipped);
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], 2.0f);
  EXPECT_EQ(lamb.step_count(), 0);
  for (const StateTensor& s : lamb.state_tensors())
    for (size_t j = 0; j < s.numel; ++j) EXPECT_EQ(s.data[j], 0.0f);
}

TEST(Lamb, ThreadCountDoesNotChangeResults) {
  OptimizerOptions o1, o4;
  o4.threads = 4;
  Fixture a, b;
  a.set_grads({0.3f, -0.1f, 0.05f, 0.2f}, {0.02f, -0.04f}, {0.01f, 0.0f, -0.03f});
  b.set_grads(a.g1, a.gb, a.gl);
  Lamb la(a.views(), o1), lb(b.views(), o4);
  EXPECT_EQ(la.step(0.01).grad_norm, lb.step(0.01).grad_norm);
  EXPECT_EQ(a.w1, b.w1);
  EXPECT_EQ(a.b1, b.b1);
  EXPECT_EQ(a.ln, b.ln);
}

TEST(Lamb, StateRoundTripResumesIdentically) {
  Fixture a, b;
  a.set_grads({0.3f, -0.1f, 0.05f, 0.2f}, {0.02f, -0.04f}, {0.01f, 0.0f, -0.03f});
  b.set_grads(a.g1, a.gb, a.gl);
  Lamb la(a.views(), OptimizerOptions{});
  la.step(0.01);
  // Save a's state, copy its weights into b, load, then both take the same step.
  std::vector<std::vector<float>> saved;
  std::vector<StateTensor> st = la.state_tensors();
  ASSERT_EQ(st.size(), 6u);
  EXPECT_EQ(st[0].name, "layer.weight.exp_avg");
  EXPECT_EQ(st[1].name, "layer.weight.exp_avg_sq");
  for (const StateTensor& s : st) saved.emplace_back(s.data, s.data + s.numel);
  std::vector<StateTensor> given;
  for (size_t k = 0; k < st.size(); ++k) given.push_back({st[k].name, saved[k].data(), saved[k].size()});
  b.w1 = a.w1;
  b.b1 = a.b1;
  b.ln = a.ln;
  Lamb lb(b.views(), OptimizerOptions{});
  lb.load_state(la.step_count(), given);
  EXPECT_EQ(lb.step_count(), 1);
  la.step(0.005);
  lb.step(0.005);
  EXPECT_EQ(a.w1, b.w1);
  EXPECT_EQ(a.ln, b.ln);

  // Bad state: a missing tensor, a wrong size, a stranger; the error names the tensor.
  std::vector<StateTensor> missing(given.begin() + 1, given.end());
  EXPECT_THROW(
      {
        try {
          lb.load_state(1, missing);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("layer.weight.exp_avg"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  std::vector<StateTensor> wrong = given;
  wrong[2].numel = 1;
  EXPECT_THROW(lb.load_state(1, wrong), Error);
  std::vector<StateTensor> extra = given;
  extra.push_back({"other.exp_avg", saved[0].data(), 1});
  EXPECT_THROW(lb.load_state(1, extra), Error);
}

TEST(Lamb, RejectsDuplicateNamesAndUnknownKind) {
  std::vector<float> w{1}, g{1};
  EXPECT_THROW(Lamb({{"a", w.data(), g.data(), 1, false}, {"a", w.data(), g.data(), 1, false}}, OptimizerOptions{}),
               Error);
  EXPECT_THROW(make_optimizer("sgd", {}, OptimizerOptions{}), Error);
}

TEST(AdamW, TwoStepsMatchReference) {
  OptimizerOptions o;
  o.max_grad_norm = 0;
  run_two_steps(o, false, 1.0, false);
}

TEST(AdamW, TwoStepsWithClipping) {
  OptimizerOptions o;
  o.max_grad_norm = 0.05;  // clips both steps
  run_two_steps(o, false, 0.25, true);
}

TEST(AdamW, HandComputedDecoupledDecay) {
  // One step, g = 0: moments stay 0, so only the decoupled decay acts: w <- w - lr * wd * w.
  std::vector<float> w{2.0f}, g{0.0f};
  OptimizerOptions o;
  o.weight_decay = 0.1;
  AdamW adamw({{"w", w.data(), g.data(), 1, false}}, o);
  adamw.step(0.5);
  EXPECT_NEAR(w[0], 2.0 - 0.5 * 0.1 * 2.0, 1e-7);
}

TEST(Schedule, WarmupThenLinearDecayTfReference) {
  LrSchedule s;
  s.base_lr = 1.0;
  s.warmup_steps = 10;
  s.total_steps = 100;
  EXPECT_DOUBLE_EQ(s.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(5), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(9), 0.9);
  EXPECT_DOUBLE_EQ(s.lr(10), 0.9);  // decay branch: 1 - 10/100
  EXPECT_DOUBLE_EQ(s.lr(50), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(100), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(150), 0.0);
}

TEST(Schedule, NegativeStartWarmupStep) {
  LrSchedule s;
  s.base_lr = 2.0;
  s.warmup_steps = 10;
  s.start_warmup_step = -4;  // warm-up began 4 steps before step 0
  s.total_steps = 100;
  EXPECT_DOUBLE_EQ(s.lr(0), 2.0 * 4 / 10);
  EXPECT_DOUBLE_EQ(s.lr(5), 2.0 * 9 / 10);
  EXPECT_DOUBLE_EQ(s.lr(6), 2.0 * (1 - 6.0 / 100));
  // NVIDIA PyTorch convention: one step ahead when start_warmup_step != 0.
  s.convention = LrSchedule::Convention::kNvidiaPyTorch;
  EXPECT_DOUBLE_EQ(s.lr(0), 2.0 * 5 / 10);
  EXPECT_DOUBLE_EQ(s.lr(5), 2.0 * (1 - 6.0 / 100));
  EXPECT_DOUBLE_EQ(s.lr(99), 0.0);
}

TEST(Schedule, NvidiaConventionEqualsTfWhenStartIsZero) {
  LrSchedule a;
  a.base_lr = 4.25e-4;
  a.warmup_steps = 7;
  a.total_steps = 50;
  LrSchedule b = a;
  b.convention = LrSchedule::Convention::kNvidiaPyTorch;
  for (int64_t s = 0; s < 60; ++s) EXPECT_DOUBLE_EQ(a.lr(s), b.lr(s)) << s;
}

TEST(Schedule, NoWarmupMlperfBatch448AndPower) {
  LrSchedule s;
  s.base_lr = 4.25e-4;
  s.total_steps = 6700;
  EXPECT_DOUBLE_EQ(s.lr(0), 4.25e-4);
  EXPECT_NEAR(s.lr(3350), 4.25e-4 * 0.5, 1e-15);
  s.power = 2.0;
  EXPECT_NEAR(s.lr(3350), 4.25e-4 * 0.25, 1e-15);
  s.end_lr = 1e-5;
  EXPECT_NEAR(s.lr(6700), 1e-5, 1e-18);
}

TEST(Schedule, RejectsBadSettings) {
  LrSchedule s;
  s.base_lr = 1e-3;
  s.total_steps = 0;
  EXPECT_THROW(s.lr(0), Error);
  s.total_steps = 10;
  s.warmup_steps = -1;
  EXPECT_THROW(s.validate(), Error);
}

// Bucket-wise clipping's definition (optim/clip.h), which the CUDA kernels are tested against: a bucket above the
// threshold is scaled to exactly the threshold, one at or below it and a non-finite one are left alone.
TEST(Clip, ScalesABucketToItsThresholdOnlyWhenAbove) {
  std::vector<float> g = {3.0f, -4.0f, 0.0f, 12.0f};  // norm 13
  EXPECT_DOUBLE_EQ(sum_of_squares(g.data(), g.size()), 169.0);
  EXPECT_DOUBLE_EQ(clip_to_norm(g.data(), g.size(), 6.5), 0.5);
  EXPECT_EQ(g, (std::vector<float>{1.5f, -2.0f, 0.0f, 6.0f}));
  EXPECT_NEAR(std::sqrt(sum_of_squares(g.data(), g.size())), 6.5, 1e-6);
  EXPECT_DOUBLE_EQ(clip_to_norm(g.data(), g.size(), 6.5), 1.0) << "at the threshold: unchanged";
  EXPECT_DOUBLE_EQ(clip_to_norm(g.data(), g.size(), 100.0), 1.0);
  EXPECT_EQ(g, (std::vector<float>{1.5f, -2.0f, 0.0f, 6.0f}));
  EXPECT_DOUBLE_EQ(clip_to_norm(g.data(), g.size(), 0.0), 1.0) << "threshold 0: no clipping";
  std::vector<float> bad = {1.0f, INFINITY, 2.0f};
  EXPECT_DOUBLE_EQ(clip_to_norm(bad.data(), bad.size(), 1.0), 1.0);
  EXPECT_TRUE(std::isinf(bad[1])) << "an overflow stays visible to the optimizer";
  EXPECT_DOUBLE_EQ(clip_factor(NAN, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_factor(4.0, 1.0), 0.5);
  std::vector<float> none;
  EXPECT_DOUBLE_EQ(clip_to_norm(none.data(), 0, 1.0), 1.0);
}

}  // namespace
}  // namespace nopad
