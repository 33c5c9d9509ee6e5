// The GPU TrainEngine: CudaBackendT<P> + BertModel<P> + FusedLamb (fp32 master weights and moments on the device,
// 16-bit weight copy refreshed by each LAMB step), P = GpuBf16 or GpuF16 by EngineOptions::precision. Declared
// without CUDA headers; only built with the CUDA backend: include it under #ifdef NOPAD_HAVE_CUDA.
#pragma once
#include <memory>
#include <string>

#include "train/engine.h"

namespace nopad::cuda {

// True when a CUDA device is visible; otherwise false and *why says what the runtime reported.
bool cuda_device_visible(std::string* why);

// precision "bf16" (also "auto") or "fp16"; LAMB only (AdamW throws). The fp16 engine expects the trainer's loss scale
// (micro_step's loss_scale, optimizer_step's grad_scale = 1 / it); an overflowing step shows as stats.skipped.
// Throws nopad::Error when no device is usable or memory runs out.
std::unique_ptr<TrainEngine> make_gpu_engine(const EngineOptions& options);

}  // namespace nopad::cuda
