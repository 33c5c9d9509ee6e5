// FP8 quantisation on the GPU: the scaled bf16 -> fp8 cast (with the tensor's amax and, optionally, the transposed
// copy) and the device-side delayed-scaling update of a batch of tensors. CPU twins: fp8_quantize (core/fp8.h) for the
// cast, fp8_update_scaling (ops/fp8_recipe.h) for the update; tests/cuda/test_fp8.cu compares them bit for bit.
//
// launch_fp8_cast: x is bf16 [rows, cols] row-major. With the scale read from device memory (*scale; no host sync):
//   q[r][c]     = fp8(float(x[r][c]) * scale)            (row-major [rows, cols]; optional)
//   q_t[c][r]   = q[r][c] for r < rows, 0 for rows <= r < ld_t   ([cols, ld_t]; optional: the transposed copy)
//   *amax       = max(*amax, max |x|)                     (optional; over the unscaled input)
// The fp8 rounding is cuda_fp8.h's __nv_cvt_float2_to_fp8x2(.., __NV_SATFINITE, ..): the cvt.rn.satfinite instruction
// on sm_89+, the header's software conversion elsewhere; both equal core/fp8.h's rule (round to nearest even, +-inf and
// overflow to +-max, NaN to 0x7F). The amax is an atomicMax on the bits of |x| (sign cleared): every non-negative
// float orders like its bits and NaN sorts above inf, so the result is NaN if any x is NaN, and it does not depend on
// the order of the blocks (deterministic). It is a running maximum: the caller zeroes *amax before the step's first
// cast (launch_fp8_update_scales does, after reading it), so several casts of one tensor in a step (micro-batches)
// give the maximum over all of them.
//   The transposed copy exists because Hopper's FP8 tensor cores take only K-major operands (the "TN" layout of
//   gemm_fp8.h): the weight gradient reduces over the rows, so it needs x^T and dy^T; its rows are padded with zeros
//   to ld_t (a multiple of 16, fp8_transposed_ld) because cuBLASLt needs FP8 leading dimensions that are multiples of
//   16, and the zeros add nothing to the product.
// Layout: 64 x 64 tiles, 256 threads, each thread 16 consecutive elements of a row (two 16-byte loads, one 16-byte
// store; all scalar when cols % 16 != 0 or a row pointer is not 16-byte aligned); the transposed copy goes through a
// shared-memory tile, 16 consecutive rows per thread, one 16-byte store each. Needs ld_t % 16 == 0 and q_t 16-byte
// aligned. One launch on the caller's stream; statuses checked (nopad::Error).
//
// launch_fp8_update_scales: one step of the recipe (ops/fp8_recipe.h) for every tensor of a table, one thread per
// tensor, in one launch: reads amax[i], resets it to 0, records it in tensor i's ring when finite and > 0, computes
// scale[i] and scale_inv[i] by the rule and the numbers of fp8_recipe.h (__fdiv_rn: round to nearest, as the host's
// float division; the same numerator fp8_scaled_max).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/fp8.h"
#include "ops/fp8_recipe.h"

namespace nopad::cuda {

struct Fp8CastArgs {
  const bf16* x = nullptr;  // [rows, cols], row-major
  int64_t rows = 0, cols = 0;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;  // device, one float (required)
  uint8_t* q = nullptr;          // [rows, cols] or null
  uint8_t* q_t = nullptr;        // [cols, ld_t] or null
  int64_t ld_t = 0;              // >= rows and a multiple of 16 when q_t is set
  float* amax = nullptr;         // device, one float, or null
};
// The leading dimension of a transposed copy of `rows` rows: rows rounded up to a multiple of 16.
inline int64_t fp8_transposed_ld(int64_t rows) { return (rows + 15) / 16 * 16; }

// Throws nopad::Error (what is wrong, with the values) for a missing scale, negative sizes, or a bad ld_t / q_t.
void launch_fp8_cast(const Fp8CastArgs& a, cudaStream_t stream);

// Tensor i's amax, scale and scale_inv are at [i * kFp8ScalarStride] of their arrays: each on its own 256 bytes.
// cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED, every candidate algorithm) FP8 products whose scale pointers lie at
// 4-byte offsets of one array, and runs them when each pointer is 256-byte aligned (dev/fp8/gemm_bench.cu
// --scale-offset-bytes, docs/fp8.md); gemm_fp8.h checks the alignment.
inline constexpr int kFp8ScalarStride = 64;  // floats (256 bytes)

// The delayed-scaling state of n tensors on the device (struct of arrays).
struct Fp8ScalingTable {
  int n = 0;
  int history_len = 1;
  float* amax = nullptr;          // [n * kFp8ScalarStride] the step's amax (the casts' running maximum); zeroed by
                                  // the update
  float* history = nullptr;       // [n * history_len], tensor i's ring at i * history_len
  int32_t* head = nullptr;        // [n] next ring slot
  float* scale = nullptr;         // [n * kFp8ScalarStride]
  float* scale_inv = nullptr;     // [n * kFp8ScalarStride]
  const uint8_t* format = nullptr;  // [n] Fp8Format
};
// One update step; r.history_len must equal t.history_len (checked, with the recipe validated).
void launch_fp8_update_scales(const Fp8ScalingTable& t, const ops::Fp8Recipe& r, cudaStream_t stream);

// Owns a table's device arrays (one allocation, every array 256-byte aligned), initialised like make_fp8_scaling: scale = scale_inv = 1, rings and
// amaxes zero. The constructor and reset() wait for the device (setup only).
class Fp8Scalings {
 public:
  Fp8Scalings(const std::vector<Fp8Format>& formats, const ops::Fp8Recipe& recipe);
  ~Fp8Scalings();
  Fp8Scalings(const Fp8Scalings&) = delete;
  Fp8Scalings& operator=(const Fp8Scalings&) = delete;
  const Fp8ScalingTable& table() const { return table_; }
  const ops::Fp8Recipe& recipe() const { return recipe_; }
  float* amax(int i) const { return table_.amax + static_cast<ptrdiff_t>(i) * kFp8ScalarStride; }
  float* scale(int i) const { return table_.scale + static_cast<ptrdiff_t>(i) * kFp8ScalarStride; }
  float* scale_inv(int i) const { return table_.scale_inv + static_cast<ptrdiff_t>(i) * kFp8ScalarStride; }
  void update(cudaStream_t stream) const { launch_fp8_update_scales(table_, recipe_, stream); }
  void reset();

 private:
  ops::Fp8Recipe recipe_;
  std::vector<Fp8Format> formats_;
  void* memory_ = nullptr;
  Fp8ScalingTable table_;
};

}  // namespace nopad::cuda
