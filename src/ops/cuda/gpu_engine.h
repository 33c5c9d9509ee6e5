// The GPU TrainEngine: CudaBackend + BertModel<GpuBf16> + FusedLamb (fp32 master weights and moments on the device,
// bf16 weight copy refreshed by each LAMB step). Declared without CUDA headers; only built with the CUDA backend:
// include it under #ifdef NOPAD_HAVE_CUDA.
#pragma once
#include <memory>
#include <string>

#include "train/engine.h"

namespace nopad::cuda {

// True when a CUDA device is visible; otherwise false and *why says what the runtime reported.
bool cuda_device_visible(std::string* why);

// LAMB only (AdamW throws). Throws nopad::Error when no device is usable or memory runs out.
std::unique_ptr<TrainEngine> make_gpu_engine(const EngineOptions& options);

}  // namespace nopad::cuda
