// The bf16 gradient reduction's conversions (dist.reduce = bf16, docs/distributed.md): a gradient bucket is rounded
// from the fp32 gradient buffer into a bf16 staging copy before its NCCL all-reduce (half the bytes on the wire), and
// the reduced bf16 sum is widened back into the fp32 buffer the optimizer reads. CPU twin: nopad::round_to_bf16
// (core/dtype.h), round to nearest even, NaN kept NaN. One launch each on the caller's stream, nothing read back;
// statuses checked (throws nopad::Error).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "core/dtype.h"

namespace nopad::cuda {

// out[i] = bf16(in[i]) for i < n (round to nearest even).
void launch_fp32_to_bf16(const float* in, bf16* out, size_t n, int sm_count, cudaStream_t stream);
// out[i] = float(in[i]) for i < n (exact).
void launch_bf16_to_fp32(const bf16* in, float* out, size_t n, int sm_count, cudaStream_t stream);

}  // namespace nopad::cuda
