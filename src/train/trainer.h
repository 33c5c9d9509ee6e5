// The pre-training loop: config -> validated run -> steps of (micro-batches, backward, LAMB/AdamW) -> metrics,
// evaluation and checkpoints, resumable bit-exactly.
//
// Contract:
//  - train_config_schema() declares every key (defaults, help); an unknown key is an error.
//  - The Trainer constructor validates everything that could fail later (config values, model config, data folders,
//    vocab and position coverage, batch sizes, init_from shapes, resume/overwrite state, run_dir writable) and
//    writes nothing until all of it passed; then it writes RUN_DIR/config.toml.
//  - A step: the loader's global batch is split into grad_accumulation micro-batches; each runs forward with the
//    GLOBAL masked and sequence counts as loss denominators and backward accumulates, so the summed gradient is the
//    full batch's; then one optimizer update with the schedule's lr for the steps already taken.
//  - Dropout is keyed by (train.seed, step, sample id): a resumed run repeats exactly the steps of an uninterrupted
//    one (same losses, same parameters).
//  - Memory: the model's activations and the micro-batch buffers are sized once from the largest micro-batch
//    (micro-batch x the data's longest sequence, micro-batch x its most masked positions per sequence).
//  - A non-finite loss or gradient throws nopad::Error naming the step; checkpoints already written stay.
//  - The device (train.device: auto, cpu, cuda) is reached only through a TrainEngine (train/engine.h); the CPU
//    engine is the fp32 reference, the GPU engine runs bf16 ops with fp32 master weights (LAMB only).
//  - Data parallelism (started by mpirun/srun, dist/launch.h; CPU engine only for now): every rank draws the same
//    global batch, the balancer (dist.balance) gives each rank its share (at most ceil(global / ranks) sequences,
//    in grad_accumulation micro-batches), the loss denominators are the global batch's counts, the engine sums the
//    gradients over the ranks before the update, evaluation is split among the ranks. Rank 0 alone writes run_dir
//    (config, metrics, checkpoints) and prints progress; all ranks read a checkpoint to resume, so run_dir must be
//    on a file system every rank sees. The config and data are compared across ranks at start, the weights at
//    every checkpoint; a mismatch stops every rank with an error.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/io.h"
#include "data/dataset.h"
#include "model/bert.h"
#include "core/progress.h"
#include "train/config_file.h"
#include "train/engine.h"

namespace nopad {

ConfigSchema train_config_schema();

// Masked-LM / NSP evaluation of a whole dataset (or its first max_samples), in order, dropout off.
struct EvalResult {
  double mlm_accuracy = 0, nsp_accuracy = 0;
  double mlm_loss = 0;  // mean cross-entropy over all masked positions
  double nsp_loss = 0;  // mean over sequences
  double loss = 0;      // mlm_loss + nsp_loss (Hugging Face BertForPreTraining's loss on the same samples)
  uint64_t samples = 0, masked = 0;
};

// Batches of `batch` consecutive samples; the model must hold `batch` sequences of the dataset's longest length.
EvalResult evaluate(BertModel<ops::CpuF32>& model, const Dataset& data, uint64_t max_samples, int32_t batch);
// The same through a TrainEngine (CPU or GPU) built for `batch` such sequences; `progress` (optional) counts samples.
EvalResult evaluate(TrainEngine& engine, const Dataset& data, uint64_t max_samples, int32_t batch,
                    Progress* progress = nullptr);

// The masked-LM accuracy of always predicting the set's most common masked token (over its first max_samples, 0 = all):
// what a model that has learnt only token frequencies scores. A model learning from context rises above it.
double mlm_frequency_baseline(const Dataset& data, uint64_t max_samples);

// The most masked positions any one sample of the dataset has.
uint32_t max_masked_per_sample(const Dataset& data);

// MLPerf BERT's evaluation interval in samples: floor(0.05 (230.23 global_batch + 3,000,000) / 25,000) x 25,000
// (150,000 at batch 448, 175,000 at 3,072); eval.interval_samples = -1 selects it.
uint64_t mlperf_eval_interval(int64_t global_batch);

enum class StartMode { kFresh, kResume, kOverwrite };

// Test hooks.
struct TrainHooks {
  std::function<void(int64_t step, StepResult& result)> after_forward;  // may alter the step's summed result
};

struct StepRecord {
  int64_t step = 0;  // 1-based: the update this record describes
  uint64_t samples = 0;
  double loss = 0, mlm_loss = 0, nsp_loss = 0, mlm_accuracy = 0, lr = 0, grad_norm = 0;
};

struct TrainSummary {
  int64_t first_step = 0;  // steps already done when this run started (resume)
  int64_t final_step = 0;
  uint64_t samples = 0;
  std::vector<StepRecord> steps;  // every step of this run
  std::vector<EvalResult> evals;
  bool reached_target = false;
  fs::path final_checkpoint;
  double elapsed_s = 0;
  double mlm_baseline = 0;  // mlm_frequency_baseline of the eval set (0 without one)
  int rank = 0;  // this process's rank in a data-parallel job (0: it wrote metrics and checkpoints)
};

class Trainer {
 public:
  Trainer(const Config& config, StartMode mode, TrainHooks hooks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainSummary run();
  std::vector<float> params() const;  // host copy of the current fp32 parameters (on a GPU: the master weights)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nopad
