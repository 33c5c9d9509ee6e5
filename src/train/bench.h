// The model benchmark (`nopad bench model`): trains a BertModel for warm-up plus timed steps on real batches and
// reports throughput, model FLOP/s (counted as the peer benchmarks count them) and peak memory as one JSON line.
// The timing loop, FLOP count and report live here, free of CUDA, so they run and are tested on the CPU; the device
// is reached only through StepRunner (CPU runner here, GPU runner in ops/cuda/gpu_session.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/energy.h"
#include "data/batch.h"
#include "model/bert.h"
#include "model/config.h"
#include "optim/optimizer.h"

namespace nopad {

// One training step on some device: zero grads, forward (train), backward, optimiser step.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Enqueues the step; on a device nothing is waited for. last_result() gives the loss of the last step (waits).
  virtual void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) = 0;
  virtual StepResult last_result() = 0;
  // Optimiser steps skipped so far because the gradients were not finite (an fp16 loss scale that overflows); waits.
  virtual int64_t skipped_steps() { return 0; }
  virtual void synchronize() = 0;                 // returns once all queued work has finished
  virtual size_t peak_memory_bytes() = 0;         // high-water mark of the memory the run uses
  virtual std::string device_name() const = 0;
  // Per-op device time (bench --breakdown). set_breakdown(true) clears the totals and starts timing;
  // breakdown_ms() waits for queued work and returns ms per op name since then. Empty: not supported (CPU).
  virtual void set_breakdown(bool /*on*/) {}
  virtual std::vector<std::pair<std::string, double>> breakdown_ms() { return {}; }
  // Launch-overhead measurement (bench --graph): capture one whole step on `batch` as a CUDA graph (after an eager
  // run of the same step, so nothing is allocated or planned inside the capture); replay_captured() enqueues it
  // again. Replays repeat the identical step (same batch, same dropout masks). false: not supported (CPU).
  virtual bool capture_step(const HostBatch& /*batch*/, float /*lr*/, uint64_t /*seed*/, uint64_t /*step*/) {
    return false;
  }
  virtual void replay_captured() {}
  // The device's energy meter (core/energy.h), read over the timed steps; null: none (the CPU). A GPU runner always
  // has one, which may be unavailable (no NVML): bench says why.
  virtual EnergyMeter* energy_meter() { return nullptr; }
};

// CpuBackend<CpuF32> + BertModel + the CPU LAMB; BERT init from `seed`. threads <= 0: all cores. loss_scale as
// ModelBenchOptions::loss_scale.
std::unique_ptr<StepRunner> make_cpu_runner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs,
                                            int32_t max_masked, uint64_t seed, const OptimizerOptions& options,
                                            int threads = 0, double loss_scale = 1.0);

// Training FLOPs of one sequence of n tokens with m masked positions: 3x the forward matmul FLOPs (encoder GEMMs,
// attention QK^T and PV, MLM head on masked rows, pooler + NSP), exactly as peers/common.py model_flops.
uint64_t sequence_train_flops(const BertConfig& config, int64_t n, int64_t m);
// Sum over the batch's sequences.
uint64_t batch_train_flops(const BertConfig& config, const HostBatch& batch);

struct ModelBenchOptions {
  std::string model;      // config.json path
  std::string data;       // dataset folder
  uint64_t batch = 32;    // sequences per step
  uint64_t steps = 20;    // timed steps
  uint64_t warmup = 5;    // untimed steps first
  std::string device = "cuda";  // cuda or cpu
  std::string precision = "auto";  // the ops' type: auto (bf16 on cuda, fp32 on cpu), bf16 or fp16 (cuda), fp32 (cpu)
  double loss_scale = 1.0;  // fixed: backward of loss_scale * loss, the update divides it out (fp16 runs may raise it)
  std::string workload;   // optional: write "length masked" lines of the timed batches
  uint64_t seed = 1;
  double dropout = -1;    // < 0: the config's dropout probabilities
  std::string hidden_act;  // empty: the config's; else replaces it ("gelu", "gelu_new", ...)
  double lr = 1e-4;
  bool per_step = false;  // synchronise around every step and report the median step time
  bool breakdown = false; // rerun the timed batches with per-op event timing; table on stderr, ms/step in the JSON
  bool graph = false;     // also time one step replayed as a CUDA graph against the same step run eagerly
  int threads = 0;        // CPU runner only
  // Several ranks (launched by mpirun/srun/torchrun; run_model_bench_ranks): --batch is per rank, the global batch
  // batch x ranks is split by the balancer as nopad train splits it, and the gradients are summed over the ranks.
  std::string balance = "cost";   // none, stratified or cost (dist.balance)
  double cost_per_token = 1.0;    // the balancer's cost a L + b L^2 (dist.cost_per_token, dist.cost_per_token_sq)
  double cost_per_token_sq = 0.0;
  bool overlap = true;            // GPUs: all-reduce gradient buckets during backward (dist.overlap)
  std::string reduce = "fp32";    // gradient all-reduce in fp32 or bf16 (dist.reduce)
  int nccl_max_ctas = 0;          // GPUs: cap on the SMs of an NCCL all-reduce (dist.nccl_max_ctas; 0: NCCL's own)
};

struct ModelBenchResult {
  std::string json;  // the one-line JSON report (no newline)
  double step_ms = 0, seqs_per_s = 0, real_tokens_per_s = 0, model_tflops = 0, mfu = 0, max_mem_gib = 0;
  double final_loss = 0;
  uint64_t seqs = 0, tokens = 0, flops = 0;
  EnergyReading energy;  // over the timed steps (valid only where the device has a meter)
  bool lead = true;  // this process prints the report (rank 0 of a multi-rank run)
};

constexpr double kPeakBf16Flops = 989e12;  // H100/H200 SXM dense bf16 datasheet (dense fp16: the same)

// Runs the benchmark; prints a short table on stderr and returns the report. Throws nopad::Error on bad input.
// Under a multi-process launcher (dist::detect_rank_info) it runs run_model_bench_ranks instead.
ModelBenchResult run_model_bench(const ModelBenchOptions& options);

// The benchmark on every rank of a data-parallel job (bench_ranks.cpp): each rank trains its share of each global
// batch through the TrainEngine that nopad train uses (NCCL gradient buckets on GPUs, MPI on CPUs), the host reading
// each step one step late. Rank 0 reports the global throughput, per-GPU throughput and, per rank, the compute time
// per step (zero_grad to the end of backward), the gradient-reduction time after it (exposed communication plus
// waiting for slower ranks) and max/mean of the compute time over the ranks (the balancer's figure of merit).
ModelBenchResult run_model_bench_ranks(const ModelBenchOptions& options, const BertConfig& config,
                                       const std::string& precision);

// Masked positions per sequence of a packed batch (mlm_positions are its rows).
std::vector<int64_t> masked_per_sequence(const HostBatch& b);

}  // namespace nopad
