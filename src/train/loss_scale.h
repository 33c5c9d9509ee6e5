// Dynamic loss scaling for fp16 training. The loss is multiplied by scale() before backward, so that small gradients
// do not underflow fp16's range; the optimizer divides it out again (grad_scale = 1 / scale()) and skips the update
// when the scaled gradients overflowed (a non-finite gradient norm). After a skipped step the scale is multiplied by
// `backoff`; after `growth_interval` applied steps in a row by `growth`.
//
// Steps may be read back one step late (the trainer enqueues step N+1 before it reads step N), so step N+1 can run
// with a scale that step N's overflow has just condemned. update() is therefore told the scale each step used: an
// overflow at a scale above the current one changes nothing (the scale was already lowered for it), so one
// overflow lowers the scale once, however many steps were in flight.
#pragma once
#include <cstdint>

#include <nlohmann/json.hpp>

namespace nopad {

struct LossScaleOptions {
  double init = 65536.0;          // 2^16
  double growth = 2.0;
  double backoff = 0.5;
  int64_t growth_interval = 2000;  // applied steps in a row before the scale grows
  double min_scale = 1.0;          // below this the run has diverged (overflow is not a range problem)
  double max_scale = 16777216.0;   // 2^24
  void validate() const;           // throws nopad::Error naming the field
};

class DynamicLossScale {
 public:
  explicit DynamicLossScale(LossScaleOptions o = {});

  double scale() const { return scale_; }
  // Records the outcome of a step that ran with `used` (the scale() it was enqueued with). Returns true when this
  // overflow lowered the scale (false for an applied step, or an overflow at a scale already lowered).
  bool update(double used, bool overflow);
  // The scale fell below min_scale: overflows persist whatever the scale, training diverged.
  bool exhausted() const { return scale_ < opts_.min_scale; }
  int64_t good_steps() const { return good_; }
  int64_t overflows() const { return overflows_; }

  // Checkpoint state (trainer_state.json "extra"): {"scale", "good_steps", "overflows"}.
  nlohmann::json to_json() const;
  void load_json(const nlohmann::json& j);  // throws nopad::Error on a malformed record

 private:
  LossScaleOptions opts_;
  double scale_;
  int64_t good_ = 0;       // applied steps in a row since the last change
  int64_t overflows_ = 0;  // steps skipped for overflow, over the whole run
};

}  // namespace nopad
