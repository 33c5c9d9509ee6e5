// Per-tensor delayed scaling of FP8 tensors, defined on the CPU (plain C++): the rule that the device-side scale update
// (ops/cuda/fp8_cast.h, launch_fp8_update_scales) implements for a batch of tensors, and that its test compares with
// step by step. The cast of a tensor at step t uses scale(t), which was computed from the amaxes of steps <= t - 1
// ("delayed": the cast does not wait for its own tensor's maximum); its amax(t) is recorded after the step.
//
// Per FP8 tensor: a ring of the last `history_len` recorded amaxes (zeros until filled), the scale the casts multiply
// by and its inverse (what the FP8 products are given to undo it, ops/cuda/gemm_fp8.h). One update per step:
//   1. record: amax(t) enters the ring (overwriting the oldest) only when it is finite and > 0.
//        * amax == 0 (the tensor was all zeros, or not cast this step): not recorded, as Transformer Engine's bulk
//          update does (transformer_engine/common/recipe/delayed_scaling.cu, kernel_bulk: the history is rolled only
//          when the new amax != 0);
//        * amax non-finite (inf, or NaN: the cast's amax propagates NaN, core/fp8.h): not recorded either. This departs
//          from TE, which records it: an inf in a "max" history would then hold the scale for history_len steps (and
//          TE's fmaxf drops a NaN). A non-finite amax means the step overflowed and its update is skipped anyway (the
//          optimizer skips non-finite gradients), so it should not steer the scales of the next history_len steps.
//   2. the amax the scale is computed from: kMostRecent = amax(t) itself; kMax = the maximum over the ring (including
//      amax(t) when it was recorded).
//   3. scale: if that amax is finite and > 0, scale = (fp8_max x 2^-margin) / amax in float (round to nearest; TE's
//      order of operations, the same value as (fp8_max / amax) / 2^margin without overflow); if that is +inf (amax
//      tiny) scale = FLT_MAX (TE, same file). Otherwise (amax == 0, inf or NaN) the previous scale is kept (TE: "No
//      action is possible, set scale to the previous scale"). scale_inv = 1 / scale (float, round to nearest),
//      recomputed each update, so a kept scale keeps its inverse.
// The state starts at scale = scale_inv = 1 and an all-zero ring (TE initialises scale to 1 and the history to zeros).
//
// Defaults: as NVIDIA's MLPerf BERT submission configures Transformer Engine (mlcommons/training_results_v3.1,
// NVIDIA/benchmarks/bert/implementations/pytorch/modeling.py, BertEncoder: DelayedScaling(margin=0, interval=1,
// fp8_format=Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent", reduce_amax=False)): history length 1,
// the most recent amax, margin 0; HYBRID = E4M3 for the forward tensors (activations, weights), E5M2 for the gradients.
// TE's own defaults (transformer_engine/common/recipe/__init__.py, DelayedScaling) differ: amax_history_len=1024,
// amax_compute_algo="max", margin=0, fp8_format=HYBRID.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/fp8.h"

namespace nopad::ops {

enum class AmaxAlgo : uint8_t { kMostRecent = 0, kMax = 1 };

struct Fp8Recipe {
  int history_len = 1;  // >= 1 (MLPerf BERT: 1; TE default: 1024)
  AmaxAlgo algo = AmaxAlgo::kMostRecent;  // MLPerf BERT: most_recent; TE default: max
  int margin = 0;  // scale = fp8_max / amax / 2^margin; 0 <= margin <= 64
};
// Throws nopad::Error naming the field when history_len < 1 or > 65536, or margin outside [0, 64].
void validate(const Fp8Recipe& r);
const char* amax_algo_name(AmaxAlgo a);      // "most_recent", "max"
AmaxAlgo parse_amax_algo(const std::string& name);  // throws naming the choices

// One FP8 tensor's scaling state.
struct Fp8TensorScaling {
  Fp8Format format = Fp8Format::kE4M3;
  std::vector<float> history;  // the ring, history_len entries
  int head = 0;                // the slot the next recorded amax goes to
  float scale = 1.0f, scale_inv = 1.0f;
};
Fp8TensorScaling make_fp8_scaling(const Fp8Recipe& r, Fp8Format format);

// fp8_max(format) x 2^-margin, the numerator of the scale (exact for margins that keep it a normal float).
float fp8_scaled_max(Fp8Format format, int margin);
// The scale for an amax: (scaled_max / amax, FLT_MAX when that overflows) for a finite amax > 0, else `previous`.
float fp8_scale_from_amax(float amax, float scaled_max, float previous);
// The update of step t with the step's amax (rules 1-3 above).
void fp8_update_scaling(const Fp8Recipe& r, float step_amax, Fp8TensorScaling& s);

}  // namespace nopad::ops
