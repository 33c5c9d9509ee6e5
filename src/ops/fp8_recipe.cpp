// Delayed scaling of FP8 tensors on the CPU: see fp8_recipe.h (rules, defaults and where they come from).
#include "ops/fp8_recipe.h"

#include <cmath>
#include <limits>

#include "core/error.h"

namespace nopad::ops {

void validate(const Fp8Recipe& r) {
  NOPAD_CHECK(r.history_len >= 1 && r.history_len <= 65536, "FP8 recipe: history_len ", r.history_len,
              " is outside [1, 65536] (the number of past amaxes each scale looks at; MLPerf BERT uses 1)");
  NOPAD_CHECK(r.margin >= 0 && r.margin <= 64, "FP8 recipe: margin ", r.margin,
              " is outside [0, 64] (scale = fp8_max / amax / 2^margin; MLPerf BERT uses 0)");
  NOPAD_CHECK(r.algo == AmaxAlgo::kMostRecent || r.algo == AmaxAlgo::kMax, "FP8 recipe: unknown amax algorithm ",
              static_cast<int>(r.algo));
}

const char* amax_algo_name(AmaxAlgo a) { return a == AmaxAlgo::kMax ? "max" : "most_recent"; }

AmaxAlgo parse_amax_algo(const std::string& name) {
  if (name == "most_recent") return AmaxAlgo::kMostRecent;
  if (name == "max") return AmaxAlgo::kMax;
  fail("FP8 recipe: amax algorithm '", name, "' is neither 'most_recent' nor 'max'");
}

Fp8TensorScaling make_fp8_scaling(const Fp8Recipe& r, Fp8Format format) {
  validate(r);
  Fp8TensorScaling s;
  s.format = format;
  s.history.assign(static_cast<size_t>(r.history_len), 0.0f);
  return s;
}

float fp8_scaled_max(Fp8Format format, int margin) { return std::ldexp(fp8_max(format), -margin); }

float fp8_scale_from_amax(float amax, float scaled_max, float previous) {
  if (!(std::isfinite(amax) && amax > 0.0f)) return previous;
  const float scale = scaled_max / amax;
  return std::isinf(scale) ? std::numeric_limits<float>::max() : scale;
}

void fp8_update_scaling(const Fp8Recipe& r, float step_amax, Fp8TensorScaling& s) {
  NOPAD_CHECK(s.history.size() == static_cast<size_t>(r.history_len), "FP8 recipe: a tensor's history has ",
              s.history.size(), " entries but the recipe's history_len is ", r.history_len);
  const bool record = std::isfinite(step_amax) && step_amax > 0.0f;
  if (record) {
    s.history[static_cast<size_t>(s.head)] = step_amax;
    s.head = (s.head + 1) % r.history_len;
  }
  float amax = step_amax;
  if (r.algo == AmaxAlgo::kMax) {
    amax = 0.0f;  // the ring holds only finite non-negative values: a plain maximum, independent of order
    for (const float a : s.history) amax = a > amax ? a : amax;
  }
  s.scale = fp8_scale_from_amax(amax, fp8_scaled_max(s.format, r.margin), s.scale);
  s.scale_inv = 1.0f / s.scale;
}

}  // namespace nopad::ops
