// Optimisers over fp32 master weights given as plain views (LAMB as MLPerf BERT uses it, and AdamW for comparison).
//
// Contract: the caller owns parameters and gradients; the optimiser owns the Adam moments m and v, allocated once at
// construction as one buffer, and never allocates in step(). Gradient accumulation is the caller's: grads hold the
// sum over micro-steps and step(lr, grad_scale) multiplies them by grad_scale (1/accumulation steps, a loss-scale
// inverse) before anything else, norm included. Every reduction runs in double in a fixed order, so a step is
// bit-identical whatever the thread count.
//
// LAMB follows NVIDIA apex FusedLAMB / multi_tensor_lamb (the optimiser of NVIDIA's MLPerf BERT code):
//   norm = ||grad_scale * g|| over ALL tensors (reported, before clipping)
//   if max_grad_norm > 0 and norm > max_grad_norm: g <- g / (norm / max_grad_norm)
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   u = (m / c1) / (sqrt(v / c2) + eps) + wd * w      (c1 = 1-b1^t, c2 = 1-b2^t, or 1 without bias correction;
//                                                      wd = 0 for no_weight_decay tensors)
//   r = ||w|| / ||u|| when both are non-zero, else 1  (w before the update)
//   w -= lr * r * u
// Trust ratio: apex applies r only to tensors whose weight decay is non-zero unless use_nvlamb=True (default False,
// and MLPerf's code keeps the default), so by default bias and LayerNorm tensors get a plain Adam step with
// ratio 1. TrustRatio::kAllTensors selects the use_nvlamb behaviour. The TF MLPerf reference's LAMB agrees with
// the default (its exclude_from_layer_adaptation defaults to exclude_from_weight_decay).
//
// Non-finite gradients (an fp16 overflow, a diverged run): step() changes nothing (no weight, moment or step-count
// update) and reports skipped = true, so that a dynamic loss scaler can lower its scale and go on.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace nopad {

// One trainable tensor: fp32 weights updated in place, and their (accumulated) gradient.
struct ParamView {
  std::string name;
  float* param = nullptr;
  const float* grad = nullptr;
  size_t numel = 0;
  bool no_weight_decay = false;
};

enum class TrustRatio {
  kDecayedOnly,  // apex default (use_nvlamb=False): trust ratio only where weight decay != 0
  kAllTensors,   // apex use_nvlamb=True: trust ratio on every tensor
};

struct OptimizerOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;  // <= 0: no clipping
  bool bias_correction = true;
  TrustRatio trust_ratio = TrustRatio::kDecayedOnly;  // LAMB only
  int threads = 1;                                    // <= 0: all cores
};

struct StepStats {
  double grad_norm = 0;     // global norm of grad_scale * g, before clipping
  double clip_factor = 1;   // what the gradients were multiplied by (after grad_scale); 1 when not clipped
  bool skipped = false;     // true when the gradients held inf/NaN and nothing was changed
};

// A read-only view of one piece of optimiser state, for checkpoints.
struct StateTensor {
  std::string name;  // "<param>.exp_avg" (m) or "<param>.exp_avg_sq" (v)
  const float* data = nullptr;
  size_t numel = 0;
};

class Optimizer {
 public:
  Optimizer(std::vector<ParamView> params, OptimizerOptions options);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update with learning rate lr; gradients are multiplied by grad_scale first.
  StepStats step(double lr, double grad_scale = 1.0);

  // Completed (non-skipped) steps; the bias-correction t of the next step is step_count() + 1.
  int64_t step_count() const { return step_; }
  const std::vector<ParamView>& params() const { return params_; }
  const OptimizerOptions& options() const { return options_; }
  virtual const char* kind() const = 0;

  // m then v for every parameter, in parameter order; plus step_count() for the step.
  std::vector<StateTensor> state_tensors() const;
  // Restores state saved from state_tensors(): every expected name exactly once, with the same numel; throws a
  // clear error naming the tensor otherwise (nothing is changed on error).
  void load_state(int64_t step, const std::vector<StateTensor>& tensors);

 protected:
  // Applies the update for tensor i with the already clipped/scaled gradient multiplier g_mul, bias corrections
  // c1, c2 (already 1 when disabled), into params_[i] and its moments.
  virtual void update_tensor(size_t i, float g_mul, float lr, float c1, float c2) = 0;

  float* m(size_t i) { return state_.get() + offsets_[i]; }
  float* v(size_t i) { return state_.get() + total_ + offsets_[i]; }

  std::vector<ParamView> params_;
  OptimizerOptions options_;

 private:
  std::vector<size_t> offsets_;
  size_t total_ = 0;
  std::unique_ptr<float[]> state_;  // [m of all tensors | v of all tensors]
  std::vector<double> scratch_;     // per-tensor sums of squares, sized at construction
  int64_t step_ = 0;
};

class Lamb final : public Optimizer {
 public:
  using Optimizer::Optimizer;
  const char* kind() const override { return "lamb"; }

 protected:
  void update_tensor(size_t i, float g_mul, float lr, float c1, float c2) override;
};

// AdamW with decoupled weight decay: w -= lr * (m̂ / (sqrt(v̂) + eps) + wd * w), global-norm clipping as LAMB.
class AdamW final : public Optimizer {
 public:
  using Optimizer::Optimizer;
  const char* kind() const override { return "adamw"; }

 protected:
  void update_tensor(size_t i, float g_mul, float lr, float c1, float c2) override;
};

// "lamb" or "adamw"; throws naming the choices otherwise.
std::unique_ptr<Optimizer> make_optimizer(const std::string& kind, std::vector<ParamView> params,
                                          OptimizerOptions options);

}  // namespace nopad
