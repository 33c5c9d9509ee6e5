// Shared optimiser machinery: moment storage, global gradient norm and clipping, skip on non-finite gradients,
// checkpoint state; plus the LAMB and AdamW per-tensor updates (formulas in optimizer.h).
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "core/threads.h"

namespace nopad {

Optimizer::Optimizer(std::vector<ParamView> params, OptimizerOptions options)
    : params_(std::move(params)), options_(options) {
  NOPAD_CHECK(options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 && options_.beta2 < 1,
              "optimizer: betas must lie in [0, 1), got beta1=", options_.beta1, " beta2=", options_.beta2);
  NOPAD_CHECK(options_.eps > 0, "optimizer: eps must be > 0, got ", options_.eps);
  NOPAD_CHECK(options_.weight_decay >= 0, "optimizer: weight_decay must be >= 0, got ", options_.weight_decay);
  std::unordered_map<std::string, size_t> seen;
  offsets_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamView& p = params_[i];
    NOPAD_CHECK(seen.emplace(p.name, i).second, "optimizer: parameter '", p.name, "' is listed twice");
    NOPAD_CHECK(p.numel == 0 || (p.param != nullptr && p.grad != nullptr), "optimizer: parameter '", p.name,
                "' has no weight or gradient buffer");
    offsets_.push_back(total_);
    total_ += p.numel;
  }
  // One zero-initialised buffer for all moments: m in the first half, v in the second.
  state_ = std::make_unique<float[]>(2 * total_ + 1);
  scratch_.assign(params_.size(), 0.0);
}

StepStats Optimizer::step(double lr, double grad_scale) {
  StepStats stats;
  const size_t n = params_.size();
  // Sum of squares per tensor (in double), then over tensors in a fixed order: deterministic for any thread count.
  parallel_for(n, options_.threads, [&](size_t i) {
    const float* g = params_[i].grad;
    double s = 0;
    for (size_t j = 0; j < params_[i].numel; ++j) s += static_cast<double>(g[j]) * g[j];
    scratch_[i] = s;
  });
  double sumsq = 0;
  for (size_t i = 0; i < n; ++i) sumsq += scratch_[i];
  stats.grad_norm = std::fabs(grad_scale) * std::sqrt(sumsq);
  if (!std::isfinite(stats.grad_norm) || !std::isfinite(grad_scale)) {
    stats.skipped = true;
    return stats;
  }
  double g_mul = grad_scale;
  if (options_.max_grad_norm > 0 && stats.grad_norm > options_.max_grad_norm) {
    stats.clip_factor = options_.max_grad_norm / stats.grad_norm;
    g_mul = grad_scale / (stats.grad_norm / options_.max_grad_norm);
  }
  const int64_t t = step_ + 1;
  double c1 = 1, c2 = 1;
  if (options_.bias_correction) {
    c1 = 1 - std::pow(options_.beta1, static_cast<double>(t));
    c2 = 1 - std::pow(options_.beta2, static_cast<double>(t));
  }
  parallel_for(n, options_.threads, [&](size_t i) {
    update_tensor(i, static_cast<float>(g_mul), static_cast<float>(lr), static_cast<float>(c1),
                  static_cast<float>(c2));
  });
  step_ = t;
  return stats;
}

std::vector<StateTensor> Optimizer::state_tensors() const {
  std::vector<StateTensor> out;
  out.reserve(2 * params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    out.push_back({params_[i].name + ".exp_avg", state_.get() + offsets_[i], params_[i].numel});
    out.push_back({params_[i].name + ".exp_avg_sq", state_.get() + total_ + offsets_[i], params_[i].numel});
  }
  return out;
}

void Optimizer::load_state(int64_t step, const std::vector<StateTensor>& tensors) {
  NOPAD_CHECK(step >= 0, "optimizer state: step count must be >= 0, got ", step);
  const std::vector<StateTensor> expected = state_tensors();
  std::unordered_map<std::string, const StateTensor*> given;
  for (const StateTensor& t : tensors) {
    NOPAD_CHECK(given.emplace(t.name, &t).second, "optimizer state: tensor '", t.name, "' is given twice");
  }
  // Validate everything before copying anything, so a bad checkpoint leaves the optimiser untouched.
  for (const StateTensor& e : expected) {
    auto it = given.find(e.name);
    NOPAD_CHECK(it != given.end(), "optimizer state: tensor '", e.name,
                "' is missing (was the checkpoint written for a different model or optimizer?)");
    NOPAD_CHECK(it->second->numel == e.numel, "optimizer state: tensor '", e.name, "' has ", it->second->numel,
                " elements, the model needs ", e.numel);
    NOPAD_CHECK(e.numel == 0 || it->second->data != nullptr, "optimizer state: tensor '", e.name, "' has no data");
  }
  for (const StateTensor& t : tensors) {
    bool known = false;
    for (const StateTensor& e : expected) known = known || e.name == t.name;
    NOPAD_CHECK(known, "optimizer state: tensor '", t.name, "' does not belong to any parameter of this model");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const StateTensor& sm = *given.at(params_[i].name + ".exp_avg");
    const StateTensor& sv = *given.at(params_[i].name + ".exp_avg_sq");
    std::copy(sm.data, sm.data + params_[i].numel, m(i));
    std::copy(sv.data, sv.data + params_[i].numel, v(i));
  }
  step_ = step;
}

void Lamb::update_tensor(size_t i, float g_mul, float lr, float c1, float c2) {
  const ParamView& p = params_[i];
  float* w = p.param;
  const float* g = p.grad;
  float* mm = m(i);
  float* vv = v(i);
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float eps = static_cast<float>(options_.eps);
  const float wd = p.no_weight_decay ? 0.0f : static_cast<float>(options_.weight_decay);
  const size_t n = p.numel;
  // Pass 1: new moments, and the norms of w and of the update u. u is not stored (grads are the caller's and
  // read-only); pass 2 recomputes it from the same inputs with the same float operations, so it is identical.
  double w_sq = 0, u_sq = 0;
  for (size_t j = 0; j < n; ++j) {
    const float gj = g[j] * g_mul;
    mm[j] = b1 * mm[j] + (1.0f - b1) * gj;
    vv[j] = b2 * vv[j] + (1.0f - b2) * gj * gj;
    const float u = (mm[j] / c1) / (std::sqrt(vv[j] / c2) + eps) + wd * w[j];
    w_sq += static_cast<double>(w[j]) * w[j];
    u_sq += static_cast<double>(u) * u;
  }
  float ratio = 1.0f;
  if (options_.trust_ratio == TrustRatio::kAllTensors || wd != 0.0f) {
    const double w_norm = std::sqrt(w_sq), u_norm = std::sqrt(u_sq);
    if (w_norm != 0 && u_norm != 0) ratio = static_cast<float>(w_norm / u_norm);
  }
  const float step = lr * ratio;
  for (size_t j = 0; j < n; ++j) {
    const float u = (mm[j] / c1) / (std::sqrt(vv[j] / c2) + eps) + wd * w[j];
    w[j] -= step * u;
  }
}

void AdamW::update_tensor(size_t i, float g_mul, float lr, float c1, float c2) {
  const ParamView& p = params_[i];
  float* w = p.param;
  const float* g = p.grad;
  float* mm = m(i);
  float* vv = v(i);
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float eps = static_cast<float>(options_.eps);
  const float wd = p.no_weight_decay ? 0.0f : static_cast<float>(options_.weight_decay);
  for (size_t j = 0; j < p.numel; ++j) {
    const float gj = g[j] * g_mul;
    mm[j] = b1 * mm[j] + (1.0f - b1) * gj;
    vv[j] = b2 * vv[j] + (1.0f - b2) * gj * gj;
    w[j] -= lr * ((mm[j] / c1) / (std::sqrt(vv[j] / c2) + eps) + wd * w[j]);
  }
}

std::unique_ptr<Optimizer> make_optimizer(const std::string& kind, std::vector<ParamView> params,
                                          OptimizerOptions options) {
  if (kind == "lamb") return std::make_unique<Lamb>(std::move(params), options);
  if (kind == "adamw") return std::make_unique<AdamW>(std::move(params), options);
  fail("unknown optimizer '", kind, "': choose 'lamb' or 'adamw'");
}

}  // namespace nopad
