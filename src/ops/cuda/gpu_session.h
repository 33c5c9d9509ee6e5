// GpuSession: everything one GPU training step needs (CudaBackendT<P>, BertModel<P>, FusedLamb with fp32 master
// weights; P = GpuBf16 or GpuF16 by the precision given) behind plain C++ types, so host-only code (the benchmark) can
// drive the GPU without CUDA headers. Only built with the CUDA backend: include it under #ifdef NOPAD_HAVE_CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/batch.h"
#include "model/bert.h"
#include "model/config.h"
#include "optim/optimizer.h"
#include "train/bench.h"

namespace nopad::cuda {

class GpuSession {
 public:
  // Sizes every buffer for the largest batch; weights get the BERT init from `seed` (fp32 masters, 16-bit copy).
  // precision: "bf16" or "fp16" (the ops' element type). loss_scale: backward computes the gradient of
  // loss_scale * loss and LAMB divides it out (grad_scale = 1 / loss_scale); fixed, for fp16 (a step whose scaled
  // gradients overflow is skipped by LAMB, and skipped_steps() counts it). Throws nopad::Error when no usable GPU
  // exists or the precision is unknown.
  GpuSession(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked, uint64_t seed,
             const OptimizerOptions& options, const std::string& precision = "bf16", double loss_scale = 1.0,
             int device = 0);
  ~GpuSession();
  GpuSession(const GpuSession&) = delete;
  GpuSession& operator=(const GpuSession&) = delete;

  // zero_grad, forward (train), backward, LAMB step refreshing the 16-bit weights: all enqueued, nothing waited for
  // (the batch goes through pinned staging). last_result() reads the loss of the last step back, which waits.
  void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step);
  StepResult last_result();
  // LAMB steps skipped so far (non-finite gradients: an fp16 loss scale too large); waits for the stream.
  int64_t skipped_steps();
  const std::string& precision() const;
  void synchronize();
  void mark();                    // synchronises and starts a host clock
  double elapsed_ms_since_mark();  // synchronises and reads it
  size_t peak_memory_bytes();     // device memory taken since the session started (cudaMemGetInfo), high-water
  std::string device_name() const;
  std::string pci_bus_id() const;  // the device's, as NVML takes it (core/energy.h)
  static bool available();  // a CUDA device is visible

  // Per-op GPU time (CudaBackend's op timing plus "lamb" for the optimiser step). Turning it on clears the totals;
  // op_times_ms() synchronises and returns ms per name accumulated since then.
  void set_op_timing(bool on);
  std::vector<std::pair<std::string, double>> op_times_ms();

  // One whole training step captured as a CUDA graph (StepRunner::capture_step) and its replay.
  void capture_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step);
  void replay_captured();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The benchmark's StepRunner over a GpuSession (precision and loss_scale as GpuSession's).
std::unique_ptr<StepRunner> make_gpu_runner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs,
                                            int32_t max_masked, uint64_t seed, const OptimizerOptions& options,
                                            const std::string& precision = "bf16", double loss_scale = 1.0);

}  // namespace nopad::cuda
