// Dynamic loss scaling (see loss_scale.h).
#include "train/loss_scale.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace nopad {

void LossScaleOptions::validate() const {
  NOPAD_CHECK(std::isfinite(init) && init > 0, "loss scale: init must be a positive number, got ", init);
  NOPAD_CHECK(std::isfinite(growth) && growth >= 1, "loss scale: growth must be >= 1, got ", growth);
  NOPAD_CHECK(std::isfinite(backoff) && backoff > 0 && backoff < 1, "loss scale: backoff must be in (0, 1), got ",
              backoff);
  NOPAD_CHECK(growth_interval > 0, "loss scale: growth_interval must be positive, got ", growth_interval);
  NOPAD_CHECK(std::isfinite(min_scale) && min_scale > 0 && min_scale <= init,
              "loss scale: min_scale must be in (0, init], got ", min_scale);
  NOPAD_CHECK(std::isfinite(max_scale) && max_scale >= init, "loss scale: max_scale must be >= init, got ",
              max_scale);
}

DynamicLossScale::DynamicLossScale(LossScaleOptions o) : opts_(o), scale_(o.init) { opts_.validate(); }

bool DynamicLossScale::update(double used, bool overflow) {
  if (overflow) {
    ++overflows_;
    if (used > scale_) return false;  // ran before the last backoff took effect: already accounted for
    scale_ *= opts_.backoff;
    good_ = 0;
    return true;
  }
  if (used != scale_) return false;  // ran at an older scale: the current one counts its own steps
  if (++good_ >= opts_.growth_interval) {
    scale_ = std::min(scale_ * opts_.growth, opts_.max_scale);
    good_ = 0;
  }
  return false;
}

nlohmann::json DynamicLossScale::to_json() const {
  return {{"scale", scale_}, {"good_steps", good_}, {"overflows", overflows_}};
}

void DynamicLossScale::load_json(const nlohmann::json& j) {
  NOPAD_CHECK(j.is_object() && j.contains("scale") && j["scale"].is_number() && j.contains("good_steps") &&
                  j["good_steps"].is_number_integer() && j.contains("overflows") &&
                  j["overflows"].is_number_integer(),
              "loss scale state: expected {\"scale\", \"good_steps\", \"overflows\"}, got ", j.dump());
  const double s = j["scale"].get<double>();
  NOPAD_CHECK(std::isfinite(s) && s > 0, "loss scale state: scale must be positive, got ", s);
  scale_ = s;
  good_ = j["good_steps"].get<int64_t>();
  overflows_ = j["overflows"].get<int64_t>();
}

}  // namespace nopad
