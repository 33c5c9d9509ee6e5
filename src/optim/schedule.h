// The MLPerf BERT learning-rate schedule: linear warm-up, then polynomial decay to end_lr (0 in MLPerf).
//
// lr(s), s = optimizer steps already taken (0 for the first update), follows the MLPerf TensorFlow reference
// (mlcommons/training language_model/tensorflow/bert/optimization.py, create_optimizer), whose global_step is
// exactly s when the update is computed:
//   adjusted = s - start_warmup_step
//   if warmup_steps > 0 and adjusted < warmup_steps:  lr = base_lr * max(adjusted, 0) / warmup_steps
//   else:  lr = (base_lr - end_lr) * (1 - min(s, total_steps) / total_steps)^power + end_lr
// A negative start_warmup_step means warm-up began before step 0 (the first update already has a partial lr).
// The max(., 0) is ours: TF would give a negative lr for steps before a positive start_warmup_step.
//
// Convention::kNvidiaPyTorch reproduces NVIDIA's MLPerf PyTorch LinearWarmupPolyDecayScheduler instead: it computes
// the lr from last_epoch = s + 1 and subtracts offset_step = (start_warmup_step == 0 ? 1 : 0), so it equals the TF
// rule when start_warmup_step == 0 and runs one step ahead (uses s + 1) when start_warmup_step != 0. (Its warm-up
// also divides by warmup_steps + 1e-6; that 1e-6 is not reproduced.)
#pragma once
#include <cstdint>

namespace nopad {

struct LrSchedule {
  enum class Convention { kTfReference, kNvidiaPyTorch };

  double base_lr = 0;
  int64_t warmup_steps = 0;       // 0: no warm-up
  int64_t start_warmup_step = 0;  // may be negative
  int64_t total_steps = 1;        // opt_learning_rate_training_steps
  double power = 1.0;
  double end_lr = 0.0;
  Convention convention = Convention::kTfReference;

  // Throws a clear error for impossible settings (total_steps <= 0, negative warm-up or power, ...).
  void validate() const;
  // The learning rate for the update made after `steps_taken` completed optimizer steps.
  double lr(int64_t steps_taken) const;
};

}  // namespace nopad
