// TrainEngine: what the training loop needs from a device (model, gradients, optimizer), behind plain C++ types so
// that trainer.cpp carries no backend or CUDA code.
//
// Contract:
//  - Parameters cross the interface as fp32 host arrays in ParamLayout order (get_params/set_params): on the CPU the
//    model's own weights, on a GPU the optimizer's fp32 master weights (never the bf16 copy the ops read).
//  - A step: zero_grad(); then per micro-batch micro_step() (forward with dropout + backward, which accumulates into
//    the gradients) and micro_result(); then optimizer_step(lr, grad_scale). On a device micro_step only enqueues;
//    micro_result() and optimizer_step()'s stats wait for the device.
//  - micro_step skips the backward of a micro-batch whose loss is not finite where it can see the loss (CPU); the
//    caller stops the run on a non-finite loss either way.
//  - optimizer_state() / load_optimizer_state() use the CPU Optimizer's checkpoint form (StateTensor names
//    "<param>.exp_avg" / "<param>.exp_avg_sq", optimizer kind and step count), so checkpoints are the same files
//    whichever device wrote them.
//  - Every buffer is allocated at construction; a step allocates nothing.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/batch.h"
#include "model/bert.h"
#include "model/config.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace nopad {

struct EngineOptions {
  BertConfig config;
  int32_t max_tokens = 0;  // largest micro-batch, in tokens
  int32_t max_seqs = 0;    // ... in sequences
  int32_t max_masked = 0;  // ... in masked positions
  std::string optimizer = "lamb";  // "lamb" or "adamw" (CPU only)
  OptimizerOptions optim;
  int threads = 0;  // CPU threads (<= 0: all cores); ignored on a GPU
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;

  virtual std::string device_name() const = 0;  // "cuda (NVIDIA H200)", "cpu (8 threads)"
  virtual const ParamLayout& layout() const = 0;
  size_t num_params() const { return layout().total_numel(); }

  virtual void init_params(uint64_t seed) = 0;          // BERT initialisation (model/params.h)
  virtual void set_params(const float* host) = 0;       // [num_params()]
  virtual void get_params(std::vector<float>& host) = 0;  // resized to num_params()

  virtual void zero_grad() = 0;
  // Forward (train, dropout keyed by seed/step/sample id) with the given loss denominators, then backward.
  virtual void micro_step(const HostBatch& batch, uint64_t seed, uint64_t step, LossDenominators denoms) = 0;
  virtual StepResult micro_result() = 0;  // of the last micro_step; may wait for the device
  // Multiplies the gradients by grad_scale, updates the weights; stats as Optimizer::step (may wait).
  virtual StepStats optimizer_step(double lr, double grad_scale) = 0;
  // Forward with dropout off and loss denominators of 1 (loss sums); the gradients are untouched.
  virtual StepResult evaluate(const HostBatch& batch) = 0;

  virtual int64_t optimizer_steps() = 0;  // completed, non-skipped updates
  // The optimizer state as write_checkpoint takes it (on a device: a host snapshot taken by this call).
  virtual const Optimizer& optimizer_state() = 0;
  // Restores state saved by optimizer_state() (as LoadedCheckpoint::optimizer_state() gives it); throws a clear
  // error naming the tensor on a mismatch.
  virtual void load_optimizer_state(int64_t step, const std::vector<StateTensor>& tensors) = 0;
};

// CpuBackend<CpuF32> + BertModel + the CPU optimizer: exactly the CPU trainer's arithmetic.
std::unique_ptr<TrainEngine> make_cpu_engine(const EngineOptions& options);

// "auto", "cpu" or "cuda" -> "cpu" or "cuda". auto: cuda when the build has CUDA and a device is visible. "cuda"
// without either throws ("no CUDA device: ... use --set train.device=cpu"); anything else throws naming the choices.
std::string resolve_device(const std::string& device);

// The engine for a resolved device ("cpu" or "cuda").
std::unique_ptr<TrainEngine> make_engine(const std::string& device, const EngineOptions& options);

}  // namespace nopad
