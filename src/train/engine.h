// TrainEngine: what the training loop needs from a device (model, gradients, optimizer), behind plain C++ types so
// that trainer.cpp carries no backend or CUDA code.
//
// Contract:
//  - Parameters cross the interface as fp32 host arrays in ParamLayout order (get_params/set_params): on the CPU the
//    model's own weights, on a GPU the optimizer's fp32 master weights (never the bf16 copy the ops read).
//  - A step: zero_grad(); per micro-batch micro_step() (forward with dropout + backward, which accumulates into the
//    gradients); then optimizer_step(lr, grad_scale). On a device all three only enqueue work: the host never waits
//    inside a step. finish_step() then waits for the oldest step not yet finished and returns its outcome, so a
//    caller may enqueue step N+1 before reading step N (at most kMaxStepsInFlight steps unread).
//  - A step whose loss is not finite is not applied: the CPU engine sees the loss (it skips that micro-batch's
//    backward and the update); a device engine skips the update on the device when the gradient norm is not finite,
//    which a non-finite loss makes it. The outcome says so (stats.skipped); the caller stops the run either way.
//  - optimizer_state() / load_optimizer_state() use the CPU Optimizer's checkpoint form (StateTensor names
//    "<param>.exp_avg" / "<param>.exp_avg_sq", optimizer kind and step count), so checkpoints are the same files
//    whichever device wrote them.
//  - Every buffer is allocated at construction; a step allocates nothing.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/host_memory.h"
#include "data/batch.h"
#include "dist/comm.h"
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
  int32_t micro_batches_per_step = 1;  // largest number of micro_step calls in one step
  std::string precision = "auto";      // resolved by resolve_precision: fp32 (CPU), bf16 or fp16 (GPU)
  std::string optimizer = "lamb";  // "lamb" or "adamw" (CPU only)
  OptimizerOptions optim;
  int threads = 0;  // CPU threads (<= 0: all cores); ignored on a GPU
  int device = 0;   // GPU index (data-parallel jobs: the local rank modulo the visible GPUs); ignored on the CPU
  bool overlap_grad_reduce = true;  // data parallel on GPUs: all-reduce gradient buckets during backward
  int nccl_max_ctas = 0;            // data parallel on GPUs: SMs an NCCL all-reduce may take (0: NCCL's default)
  double dist_timeout_s = 600;  // data parallel: longest wait for a step's collectives before the job stops (0: none)
  // Bucket-wise clipping (dist.clip = bucket; optim/clip.h): > 0 clips each gradient bucket of the model
  // (BertModel::grad_buckets) on the last micro-batch of a step, before its all-reduce, so that this rank's share has
  // a norm of at most bucket_clip_norm / world_size (the gradient as the optimizer applies it: divided by the loss
  // scale). The optimizer's own clipping (optim.max_grad_norm) is then 0.
  double bucket_clip_norm = 0;
  int world_size = 1;
  // dist.reduce = bf16: the gradient sum over the ranks is taken in bf16 (half the bytes on the wire): each rank's
  // gradient is rounded to bf16, summed, and the sum rounded to bf16 (round_to_bf16, core/dtype.h); false: fp32.
  bool reduce_bf16 = false;
};

// What finish_step() returns for one step.
struct StepOutcome {
  StepResult result;  // summed over the step's micro-batches (losses are sums of the per-micro-batch losses)
  StepStats stats;    // of the update; skipped when it was not applied
  // This rank's time in the step (device time on a GPU, from events; wall time on the CPU), for data-parallel
  // timing: compute_ms = zero_grad to the end of the last backward; reduce_ms = from there until the summed
  // gradients are usable (exposed communication plus waiting for slower ranks; 0 in a single process). NaN when
  // not measured.
  double compute_ms = std::numeric_limits<double>::quiet_NaN();
  double reduce_ms = std::numeric_limits<double>::quiet_NaN();
};

class TrainEngine {
 public:
  static constexpr int kMaxStepsInFlight = 2;
  virtual ~TrainEngine() = default;

  virtual std::string device_name() const = 0;  // "cuda (NVIDIA H200)", "cpu (8 threads)"
  virtual std::string precision() const = 0;    // "fp32", "bf16" or "fp16": the ops' activation type
  virtual const ParamLayout& layout() const = 0;
  size_t num_params() const { return layout().total_numel(); }

  virtual void init_params(uint64_t seed) = 0;          // BERT initialisation (model/params.h)
  virtual void set_params(const float* host) = 0;       // [num_params()]
  virtual void get_params(std::vector<float>& host) = 0;  // resized to num_params()

  virtual void zero_grad() = 0;  // begins a step
  // Forward (train, dropout keyed by seed/step/sample id) with the given loss denominators, then backward of
  // loss_scale x the loss (fp16 loss scaling: pass grad_scale = 1 / loss_scale to optimizer_step).
  // last_micro_batch: no micro_step follows in this step (a data-parallel GPU engine then starts each gradient
  // bucket's all-reduce as soon as backward has produced it; earlier micro-batches only accumulate).
  virtual void micro_step(const HostBatch& batch, uint64_t seed, uint64_t step, LossDenominators denoms,
                          double loss_scale = 1.0, bool last_micro_batch = true) = 0;
  // Data parallelism: called once at setup on every rank of a multi-rank job, before the first step (collective):
  // builds the device's collective (the GPU's NCCL communicator, bootstrapped over `comm`, which must outlive the
  // engine). The default does nothing (the CPU engine reduces over `comm` itself).
  virtual void connect(dist::Communicator& comm) {}
  // Data parallelism: called between the last micro_step and optimizer_step of a step on every rank. Sums the
  // gradients and the step's result over the ranks (so every rank then holds the global batch's gradient and loss)
  // and makes the step's fate the same everywhere (a non-finite loss on any rank skips the update on all). On a GPU
  // the gradient sum is enqueued (NCCL, after connect) and the result sum happens in finish_step. The default throws.
  virtual void reduce_gradients(dist::Communicator& comm);
  // Ends the step: multiplies the gradients by grad_scale and updates the weights.
  virtual void optimizer_step(double lr, double grad_scale) = 0;
  // Waits for the oldest ended, unread step and returns its outcome. Throws if no step is unread.
  virtual StepOutcome finish_step() = 0;
  // Forward with dropout off and loss denominators of 1 (loss sums); the gradients are untouched. Waits.
  virtual StepResult evaluate(const HostBatch& batch) = 0;
  // The same forward, returning the MLM head's probabilities over the vocabulary at each masked position,
  // [num_masked, vocab_size] row-major in mlm_positions order (nopad fill-mask). Waits.
  virtual std::vector<float> mlm_probabilities(const HostBatch& batch) = 0;

  virtual int64_t optimizer_steps() = 0;  // completed, non-skipped updates
  // The optimizer state as write_checkpoint takes it (on a device: a host snapshot taken by this call).
  virtual const Optimizer& optimizer_state() = 0;
  // Restores state saved by optimizer_state() (as LoadedCheckpoint::optimizer_state() gives it); throws a clear
  // error naming the tensor on a mismatch.
  virtual void load_optimizer_state(int64_t step, const std::vector<StateTensor>& tensors) = 0;
};

// Adds one micro-batch's result into a step's sum (the trainer's per-step record).
void accumulate(StepResult& sum, const StepResult& r);

// CpuBackend<CpuF32> + BertModel + the CPU optimizer: exactly the CPU trainer's arithmetic.
std::unique_ptr<TrainEngine> make_cpu_engine(const EngineOptions& options);
// The host memory make_cpu_engine(options) and a forward take, in bytes: the model's (BertModel::planned_bytes), the
// optimizer's two moments and the backend's forward scratch. For sizing a batch to memory before building it.
uint64_t cpu_engine_bytes(const EngineOptions& options);
// `options` with room for a batch of `batch` sequences of up to max_len tokens and max_masked masked positions each.
EngineOptions with_batch(EngineOptions options, int32_t batch, int64_t max_len, int64_t max_masked);
// Refuses (nopad::Error), before anything is allocated, a CPU batch (`batch` sequences as with_batch) whose engine
// and host batch take more than 90% of `memory`: a process that allocates past what is available is killed by the
// kernel without a word. The error names the memory needed, the memory available and the largest batch that fits;
// `asked` is the batch as the user gave it (--batch).
void check_cpu_batch_fits(const EngineOptions& options, int32_t asked, int32_t batch, int64_t max_len,
                          int64_t max_masked, const HostMemory& memory);

// "auto", "cpu" or "cuda" -> "cpu" or "cuda". auto: cuda when the build has CUDA and a device is visible. "cuda"
// without either throws ("no CUDA device: ... use --set train.device=cpu"); anything else throws naming the choices.
// When auto falls back to the CPU and `note` is given, *note says why ("no CUDA device: ...").
std::string resolve_device(const std::string& device, std::string* note = nullptr);

// train.precision for a resolved device: auto -> fp32 on the CPU, bf16 on a GPU; fp32 needs the CPU, bf16 and fp16
// a GPU; anything else throws naming the choices.
std::string resolve_precision(const std::string& precision, const std::string& device);

// The engine for a resolved device ("cpu" or "cuda").
std::unique_ptr<TrainEngine> make_engine(const std::string& device, const EngineOptions& options);

}  // namespace nopad
