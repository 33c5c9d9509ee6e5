// MLPerf BERT learning-rate schedule (see schedule.h for the formula and the references it matches).
#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace nopad {

void LrSchedule::validate() const {
  NOPAD_CHECK(std::isfinite(base_lr) && base_lr >= 0, "lr schedule: base learning rate must be >= 0, got ", base_lr);
  NOPAD_CHECK(total_steps > 0, "lr schedule: total_steps (opt_learning_rate_training_steps) must be > 0, got ",
              total_steps);
  NOPAD_CHECK(warmup_steps >= 0, "lr schedule: warmup_steps must be >= 0, got ", warmup_steps);
  NOPAD_CHECK(power > 0, "lr schedule: decay power must be > 0, got ", power);
  NOPAD_CHECK(end_lr >= 0 && end_lr <= base_lr, "lr schedule: end learning rate must lie in [0, base lr], got ",
              end_lr);
}

double LrSchedule::lr(int64_t steps_taken) const {
  validate();
  int64_t s = steps_taken;
  if (convention == Convention::kNvidiaPyTorch) s = steps_taken + 1 - (start_warmup_step == 0 ? 1 : 0);
  const int64_t adjusted = s - start_warmup_step;
  if (warmup_steps > 0 && adjusted < warmup_steps) {
    return base_lr * static_cast<double>(std::max<int64_t>(adjusted, 0)) / static_cast<double>(warmup_steps);
  }
  const double progress = static_cast<double>(std::clamp<int64_t>(s, 0, total_steps)) / total_steps;
  return (base_lr - end_lr) * std::pow(1.0 - progress, power) + end_lr;
}

}  // namespace nopad
