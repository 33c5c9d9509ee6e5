// The pre-training loop over a TrainEngine (CPU or GPU; see trainer.h for the contract).
#include "train/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "core/error.h"
#include "core/philox.h"
#include "core/progress.h"
#include "core/threads.h"
#include "data/loader.h"
#include "dist/balance.h"
#include "dist/watchdog.h"
#include "dist/comm.h"
#include "dist/partitioned.h"
#include "dist/launch.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "data/tokenizer_files.h"
#include "train/tf_checkpoint.h"
#include "train/engine.h"
#include "train/loss_scale.h"
#include "train/metrics.h"
#include "train/mllog.h"

namespace nopad {

ConfigSchema train_config_schema() {
  ConfigSchema s;
  s.add_path("run_dir", "", "output folder: config.toml, metrics.jsonl, checkpoints/ (required). Paths in a config "
             "file are relative to the file's folder, paths given with --set to the working directory");
  s.add_path("init_from", "",
        "weights to start from: a Hugging Face BertForPreTraining folder or .safetensors file, or a TensorFlow "
        "checkpoint (prefix, .index file or folder; e.g. MLPerf's phase-1 model.ckpt-28252) ('' = random init)");
  s.add_path("model.config", "", "Hugging Face config.json of the BERT architecture (required)");
  s.add_path("data.train", "", "folder of .nopad training shards (required)");
  s.add_path("data.eval", "", "folder of .nopad evaluation shards, read in order ('' = no evaluation)");
  s.add_path("data.vocab", "", "the WordPiece vocabulary the data was made with, written with its tokenizer config beside "
        "every checkpoint so that the folder loads with transformers' AutoTokenizer ('' = the vocab.txt that nopad "
        "prepare or convert put in data.train's folder); its checksum must be the data's");
  s.add("data.do_lower_case", "auto", "the tokenizer's casing written beside the checkpoints: auto (what the data was "
        "made with, from data.train's dataset.json; else the vocabulary's casing), true or false");
  s.add("data.placement", "shared", "data parallelism: shared (every rank reads data.train whole: one file system) or "
        "partitioned (rank r holds only the shards i with i % ranks == r, plus dataset.json, in data.train, where "
        "{rank} stands for r; each global batch is assembled by exchanging samples between the ranks; "
        "docs/distributed.md)");
  s.add("train.global_batch", 32, "sequences per optimizer step");
  s.add("train.grad_accumulation", 1, "micro-batches per step (must divide train.global_batch)");
  s.add("train.max_steps", 1000, "stop after this many optimizer steps");
  s.add("train.max_samples", 0, "stop after this many training samples (0 = unlimited)");
  s.add("train.seed", 12345, "seed of initialisation, data order and dropout");
  s.add("train.target_mlm_accuracy", 0.0, "stop once the eval masked-LM accuracy reaches this (0 = no target)");
  s.add("train.threads", 0, "CPU threads (0 = all cores, divided among the ranks a launcher starts on this node)");
  s.add("train.device", "auto", "auto, cpu or cuda (auto: cuda when built with CUDA and a GPU is visible)");
  s.add("train.precision", "auto", "auto, fp32 (CPU), bf16 or fp16 (GPU): the ops' activation type (auto: fp32 on "
        "the CPU, bf16 on a GPU)");
  s.add("train.loss_scale", "auto", "auto (dynamic for fp16, none otherwise), dynamic, none, or a fixed number: "
        "the loss is multiplied by it before backward and the gradients divided by it");
  s.add("train.loss_scale_init", 65536.0, "first dynamic loss scale");
  s.add("train.loss_scale_window", 2000, "applied steps in a row after which the dynamic loss scale doubles");
  s.add("dist.balance", "cost", "data parallelism (mpirun/srun): how each global batch is split among the ranks: none "
        "(contiguous slices), stratified (length-sorted, dealt in snake order) or cost (longest-first greedy on "
        "dist.cost_per_token * L + dist.cost_per_token_sq * L^2)");
  s.add("dist.cost_per_token", 1.0, "balancing cost of a sequence per token (linear work: GEMMs, memory-bound ops)");
  s.add("dist.cost_per_token_sq", 0.0, "balancing cost per token^2 (attention)");
  s.add("dist.overlap", true, "data parallelism on GPUs: all-reduce each layer's gradients while backward goes on "
        "(false: one all-reduce after backward, for ablation)");
  s.add("dist.nccl_max_ctas", 0, "data parallelism on GPUs: cap on the thread blocks (SMs) an NCCL all-reduce may "
        "occupy (0 = NCCL's default, measured fastest on 2 H200s and on 4 H100s: docs/performance.md)");
  s.add("dist.clip", "global", "gradient clipping to optim.max_grad_norm: global (LAMB clips the norm of all the "
        "summed gradients) or bucket (each gradient bucket, one per encoder layer, is clipped as soon as backward has "
        "produced it, before its all-reduce: each rank scales its share to max_grad_norm / ranks, so every summed "
        "bucket's norm is at most max_grad_norm; docs/distributed.md)");
  s.add("dist.reduce", "fp32", "data parallelism: the precision of the gradient all-reduce: fp32, or bf16 (each "
        "rank's gradients rounded to bf16 and summed in bf16: half the bytes on the wire, ~3 significant digits)");
  s.add("dist.timeout_s", 600.0, "data parallelism: a rank that makes no progress for this long (a peer rank died or "
        "hangs in a collective) stops the job with an error naming it (0 = wait forever)");
  s.add("mllog.submission_org", "nopad", "MLPerf log (run_dir/mllog.txt): submission_org");
  s.add("mllog.submission_platform", "", "MLPerf log: submission_platform ('' = the device nopad trains on)");
  s.add("mllog.submission_division", "closed", "MLPerf log: submission_division, closed or open");
  s.add("mllog.cache_clear", false, "MLPerf log: cache_clear's value; set it when the launcher dropped the OS caches "
        "before this run (nopad does not)");
  s.add("mllog.stdout", false, "also print the MLPerf log lines on standard output (nopad train --mllog-stdout)");
  s.add("optim.name", "lamb", "optimizer: lamb or adamw");
  s.add("optim.lr", 1e-3, "peak learning rate");
  s.add("optim.beta1", 0.9, "Adam beta1");
  s.add("optim.beta2", 0.999, "Adam beta2");
  s.add("optim.eps", 1e-6, "Adam epsilon");
  s.add("optim.weight_decay", 0.01, "decoupled weight decay (not applied to biases and LayerNorm)");
  s.add("optim.max_grad_norm", 1.0, "clip the global gradient norm to this (0 = no clipping)");
  s.add("schedule.warmup_steps", 0, "linear warm-up steps");
  s.add("schedule.start_warmup_step", 0, "step at which warm-up starts (MLPerf's start_warmup_step, may be negative)");
  s.add("schedule.total_steps", 0, "steps of the polynomial decay to 0 (0 = train.max_steps)");
  s.add("schedule.power", 1.0, "power of the polynomial decay");
  s.add("eval.interval_samples", 0, "evaluate every this many training samples (0 = only at the end; -1 = MLPerf "
        "BERT's rule, floor(0.05 (230.23 global_batch + 3,000,000) / 25,000) x 25,000)");
  s.add("eval.max_samples", 0, "evaluate on the first this many samples of data.eval (0 = all)");
  s.add("log.interval_steps", 10, "write a metrics.jsonl line (and a plain log line) every this many steps");
  s.add("log.tensorboard", true, "also write every metrics.jsonl line as TensorBoard scalars (train/<key>, eval/<key>) "
        "into an event file of log.tensorboard_dir: `tensorboard --logdir RUN_DIR` shows them (docs/training.md)");
  s.add_path("log.tensorboard_dir", "", "folder of the run's TensorBoard event files ('' = RUN_DIR/tensorboard); give each "
        "run a folder of its own (a resumed run's event file tells TensorBoard to drop the folder's later steps)");
  s.add("checkpoint.interval_steps", 0, "write a checkpoint every this many steps (0 = only at the end)");
  s.add("checkpoint.keep", 3, "newest checkpoints to keep (0 = all)");
  return s;
}

uint64_t mlperf_eval_interval(int64_t global_batch) {
  NOPAD_CHECK(global_batch > 0, "global batch must be positive, got ", global_batch);
  const double samples = 0.05 * (230.23 * static_cast<double>(global_batch) + 3'000'000.0);
  return static_cast<uint64_t>(std::floor(samples / 25'000.0)) * 25'000;
}

double mlm_frequency_baseline(const Dataset& data, uint64_t max_samples) {
  const uint64_t n = max_samples > 0 ? std::min<uint64_t>(max_samples, data.size()) : data.size();
  std::vector<uint64_t> counts(data.vocab_size(), 0);
  uint64_t total = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const SampleRef s = data.sample(i);
    for (uint32_t k = 0; k < s.num_masked; ++k) {
      const int32_t label = s.mlm_label(k);
      if (label >= 0 && static_cast<size_t>(label) < counts.size()) ++counts[static_cast<size_t>(label)];
    }
    total += s.num_masked;
  }
  if (total == 0) return 0;
  return static_cast<double>(*std::max_element(counts.begin(), counts.end())) / static_cast<double>(total);
}

uint32_t max_masked_per_sample(const Dataset& data) {
  uint32_t most = 0;
  for (size_t s = 0; s < data.num_shards(); ++s) most = std::max(most, data.shard(s).max_num_masked());
  return most;
}

namespace {

// The evaluation loop; forward(batch) runs one batch with dropout off and loss denominators of 1. With a
// communicator of several ranks, rank r evaluates the r-th contiguous slice of the samples and the sums are added
// over the ranks, so every rank returns the whole set's result.
template <class Forward>
EvalResult evaluate_with(Forward&& forward, const Dataset& data, uint64_t max_samples, int32_t batch,
                         dist::Communicator* comm = nullptr, Progress* progress = nullptr) {
  NOPAD_CHECK(batch > 0, "evaluation batch must be positive, got ", batch);
  const uint64_t n = max_samples > 0 ? std::min<uint64_t>(max_samples, data.size()) : data.size();
  const uint64_t ranks = comm ? static_cast<uint64_t>(comm->size()) : 1, rank = comm ? comm->rank() : 0;
  const uint64_t first = n * rank / ranks, last = n * (rank + 1) / ranks;
  EvalResult r;
  double mlm_sum = 0, nsp_sum = 0;
  int64_t mlm_correct = 0, nsp_correct = 0;
  HostBatch hb;
  std::vector<uint64_t> ids;
  for (uint64_t start = first; start < last; start += static_cast<uint64_t>(batch)) {
    const uint64_t end = std::min<uint64_t>(last, start + static_cast<uint64_t>(batch));
    ids.clear();
    for (uint64_t i = start; i < end; ++i) ids.push_back(i);
    build_batch(data, ids, hb);
    // Denominators of 1: the forward returns loss sums, averaged over the whole set below.
    const StepResult s = forward(hb);
    mlm_sum += s.mlm_loss;
    nsp_sum += s.nsp_loss;
    mlm_correct += s.mlm_correct;
    nsp_correct += s.nsp_correct;
    r.masked += static_cast<uint64_t>(s.mlm_count);
    r.samples += static_cast<uint64_t>(s.nsp_count);
    if (progress) progress->add(static_cast<double>(end - start));
  }
  if (ranks > 1) {
    std::array<double, 2> sums = {mlm_sum, nsp_sum};
    std::array<int64_t, 4> counts = {mlm_correct, nsp_correct, static_cast<int64_t>(r.masked),
                                     static_cast<int64_t>(r.samples)};
    comm->all_reduce_sum(std::span<double>(sums));
    comm->all_reduce_sum(std::span<int64_t>(counts));
    mlm_sum = sums[0];
    nsp_sum = sums[1];
    mlm_correct = counts[0];
    nsp_correct = counts[1];
    r.masked = static_cast<uint64_t>(counts[2]);
    r.samples = static_cast<uint64_t>(counts[3]);
  }
  if (r.masked) {
    r.mlm_loss = mlm_sum / static_cast<double>(r.masked);
    r.mlm_accuracy = static_cast<double>(mlm_correct) / static_cast<double>(r.masked);
  }
  if (r.samples) {
    r.nsp_loss = nsp_sum / static_cast<double>(r.samples);
    r.nsp_accuracy = static_cast<double>(nsp_correct) / static_cast<double>(r.samples);
  }
  r.loss = r.mlm_loss + r.nsp_loss;
  return r;
}

}  // namespace

EvalResult evaluate(BertModel<ops::CpuF32>& model, const Dataset& data, uint64_t max_samples, int32_t batch) {
  return evaluate_with(
      [&](const HostBatch& hb) { return model.forward(hb, /*train=*/false, 0, 0, LossDenominators{1.0, 1.0}); }, data,
      max_samples, batch);
}

EvalResult evaluate(TrainEngine& engine, const Dataset& data, uint64_t max_samples, int32_t batch,
                    Progress* progress) {
  return evaluate_with([&](const HostBatch& hb) { return engine.evaluate(hb); }, data, max_samples, batch, nullptr,
                       progress);
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Copies sequences [b0, b1) of `global` into `out` (rows renumbered from 0). Within the capacity reserved at start
// this allocates nothing.
void slice_batch(const HostBatch& global, int32_t b0, int32_t b1, HostBatch& out) {
  const int32_t row0 = global.cu_seqlens[static_cast<size_t>(b0)], row1 = global.cu_seqlens[static_cast<size_t>(b1)];
  out.tokens.assign(global.tokens.begin() + row0, global.tokens.begin() + row1);
  out.positions.assign(global.positions.begin() + row0, global.positions.begin() + row1);
  out.segments.assign(global.segments.begin() + row0, global.segments.begin() + row1);
  out.cu_seqlens.resize(static_cast<size_t>(b1 - b0 + 1));
  out.max_seqlen = 0;
  for (int32_t b = b0; b <= b1; ++b) {
    out.cu_seqlens[static_cast<size_t>(b - b0)] = global.cu_seqlens[static_cast<size_t>(b)] - row0;
    if (b < b1)
      out.max_seqlen = std::max(out.max_seqlen, global.cu_seqlens[static_cast<size_t>(b) + 1] -
                                                    global.cu_seqlens[static_cast<size_t>(b)]);
  }
  out.mlm_positions.clear();
  out.mlm_labels.clear();
  for (size_t m = 0; m < global.mlm_positions.size(); ++m) {
    const int32_t row = global.mlm_positions[m];
    if (row >= row0 && row < row1) {
      out.mlm_positions.push_back(row - row0);
      out.mlm_labels.push_back(global.mlm_labels[m]);
    }
  }
  out.nsp_labels.assign(global.nsp_labels.begin() + b0, global.nsp_labels.begin() + b1);
  out.sample_ids.assign(global.sample_ids.begin() + b0, global.sample_ids.begin() + b1);
}

void reserve_batch(HostBatch& b, size_t tokens, size_t seqs, size_t masked) {
  b.tokens.reserve(tokens);
  b.positions.reserve(tokens);
  b.segments.reserve(tokens);
  b.cu_seqlens.reserve(seqs + 1);
  b.mlm_positions.reserve(masked);
  b.mlm_labels.reserve(masked);
  b.nsp_labels.reserve(seqs);
  b.sample_ids.reserve(seqs);
}

// Opens a dataset, naming the config key in the error.
std::unique_ptr<Dataset> open_data(const std::string& key, const std::string& path) {
  std::error_code ec;
  NOPAD_CHECK(fs::exists(path, ec), key, ": ", path, " does not exist (expected a folder of .nopad shards made by "
              "`nopad prepare`)");
  try {
    return std::make_unique<Dataset>(path);
  } catch (const Error& e) {
    fail(key, ": cannot read the dataset ", path, ": ", e.what());
  }
}

nlohmann::json eval_json(const EvalResult& e) {
  return {{"mlm_accuracy", e.mlm_accuracy}, {"nsp_accuracy", e.nsp_accuracy}, {"eval_loss", e.loss},
          {"mlm_loss", e.mlm_loss},         {"nsp_loss", e.nsp_loss},         {"eval_samples", e.samples}};
}

}  // namespace

struct Trainer::Impl {
  Config cfg;
  StartMode mode;
  TrainHooks hooks;

  // config values
  fs::path run_dir;
  int64_t global_batch = 0, grad_accumulation = 0, micro_batch = 0, max_steps = 0;
  uint64_t max_samples = 0, seed = 0, eval_interval = 0, eval_max_samples = 0;
  double target_accuracy = 0;
  int64_t log_interval = 1, checkpoint_interval = 0, checkpoint_keep = 3;
  int threads = 0;
  std::string device;  // resolved: "cpu" or "cuda"
  std::string device_note;  // why auto chose the CPU
  std::string precision;    // resolved: fp32, bf16 or fp16
  double fixed_loss_scale = 1;  // train.loss_scale as a number (1 = none)
  std::unique_ptr<DynamicLossScale> loss_scaler;  // train.loss_scale dynamic

  // Data parallelism: this process's rank, the communicator (single process when not launched by mpirun/srun), the
  // balancing of each global batch among the ranks and the largest share of one rank (ceil(global / ranks)).
  dist::RankInfo rank_info;
  std::unique_ptr<dist::Communicator> comm;
  dist::BalanceMode balance = dist::BalanceMode::kCost;
  dist::CostModel cost;
  int64_t rank_batch = 0;
  double dist_timeout_s = 600;
  std::unique_ptr<dist::Watchdog> watchdog;  // data parallel, dist.timeout_s > 0: ends a rank stuck in a collective
  void kick() {
    if (watchdog) watchdog->kick();
  }
  bool lead() const { return comm->rank() == 0; }  // rank 0 writes metrics, checkpoints and progress

  BertConfig model_config;
  std::unique_ptr<Dataset> train_data, eval_data;
  std::unique_ptr<dist::PartitionedData> train_part;  // data.placement = partitioned: this rank's shards (else null)
  uint64_t train_size() const { return train_part ? train_part->size() : train_data->size(); }
  uint32_t train_max_len() const { return train_part ? train_part->max_seq_length() : train_data->max_seq_length(); }
  std::unique_ptr<TrainEngine> engine;
  LrSchedule schedule;
  TrainerState state;
  double prior_elapsed_s = 0;
  fs::path last_checkpoint;
  HostBatch micro;
  std::unique_ptr<MetricsLog> metrics;
  MlLog mllog;  // MLPerf log, rank 0: run_dir/mllog.txt

  // The tokenizer every checkpoint carries (data/tokenizer_files.h); null when the data came without a vocabulary.
  std::unique_ptr<Vocab> tokenizer_vocab;
  bool tokenizer_lower_case = true;
  double mlm_baseline = 0;  // mlm_frequency_baseline of the eval set

  Impl(const Config& c, StartMode m, TrainHooks h) : cfg(c), mode(m), hooks(std::move(h)) {}
  void setup();
  void setup_tokenizer(const std::string& train_path, const fs::path& train_folder, const std::string& eval_path);
  fs::path save_checkpoint();
  EvalResult run_eval();
};

void Trainer::Impl::setup() {
  // 0. Which process of the job this is (mpirun/srun/torchrun), and the communicator to the others.
  rank_info = dist::detect_rank_info();
  comm = dist::make_communicator(rank_info);
  if (!lead()) mllog.disable();
  // MLPerf's timing points: initialisation starts here (the lines wait in memory until run_dir is known writable).
  mllog.point("cache_clear", cfg.get_bool("mllog.cache_clear"));
  mllog.start("init_start");

  // 1. Config values and their ranges.
  run_dir = cfg.get_string("run_dir");
  NOPAD_CHECK(!run_dir.empty(), "run_dir is not set: give the output folder (run_dir = \"...\" or --set run_dir=...)");
  const std::string model_config_path = cfg.get_string("model.config");
  NOPAD_CHECK(!model_config_path.empty(), "model.config is not set: give a Hugging Face config.json "
              "(e.g. data/configs/bert-tiny.json)");
  const std::string train_path = cfg.get_string("data.train");
  NOPAD_CHECK(!train_path.empty(), "data.train is not set: give a folder of .nopad shards");
  const std::string eval_path = cfg.get_string("data.eval");
  const std::string init_from = cfg.get_string("init_from");

  global_batch = cfg.get_int("train.global_batch");
  grad_accumulation = cfg.get_int("train.grad_accumulation");
  NOPAD_CHECK(global_batch > 0, "train.global_batch must be positive, got ", global_batch);
  NOPAD_CHECK(grad_accumulation > 0, "train.grad_accumulation must be positive, got ", grad_accumulation);
  NOPAD_CHECK(global_batch % grad_accumulation == 0, "train.global_batch (", global_batch,
              ") must be a multiple of train.grad_accumulation (", grad_accumulation, ")");
  NOPAD_CHECK(global_batch >= comm->size(), "train.global_batch (", global_batch, ") is smaller than the number of ",
              "ranks (", comm->size(), "): every rank needs at least one sequence per step");
  // Each rank trains its share of the global batch (at most rank_batch sequences: the balancer's cap) in
  // grad_accumulation micro-batches.
  rank_batch = (global_batch + comm->size() - 1) / comm->size();
  micro_batch = (rank_batch + grad_accumulation - 1) / grad_accumulation;
  max_steps = cfg.get_int("train.max_steps");
  NOPAD_CHECK(max_steps > 0, "train.max_steps must be positive, got ", max_steps);
  const int64_t max_samples_i = cfg.get_int("train.max_samples");
  NOPAD_CHECK(max_samples_i >= 0, "train.max_samples must be >= 0, got ", max_samples_i);
  max_samples = static_cast<uint64_t>(max_samples_i);
  seed = static_cast<uint64_t>(cfg.get_int("train.seed"));
  target_accuracy = cfg.get_double("train.target_mlm_accuracy");
  NOPAD_CHECK(target_accuracy >= 0 && target_accuracy <= 1, "train.target_mlm_accuracy must be in [0, 1], got ",
              target_accuracy);
  NOPAD_CHECK(target_accuracy == 0 || !eval_path.empty(),
              "train.target_mlm_accuracy is set but data.eval is not: the target is measured on the eval data");
  threads = cfg.get<int>("train.threads");
  NOPAD_CHECK(threads >= 0, "train.threads must be >= 0, got ", threads);
  if (threads == 0) threads = dist::default_cpu_threads(rank_info, hardware_threads());
  device = resolve_device(cfg.get_string("train.device"), &device_note);
  precision = resolve_precision(cfg.get_string("train.precision"), device);
  balance = dist::parse_balance_mode(cfg.get_string("dist.balance"));
  cost.per_token = cfg.get_double("dist.cost_per_token");
  cost.per_token_sq = cfg.get_double("dist.cost_per_token_sq");
  NOPAD_CHECK(std::isfinite(cost.per_token) && cost.per_token >= 0 && std::isfinite(cost.per_token_sq) &&
                  cost.per_token_sq >= 0 && cost.per_token + cost.per_token_sq > 0,
              "dist.cost_per_token and dist.cost_per_token_sq must be >= 0 and not both 0, got ", cost.per_token,
              " and ", cost.per_token_sq);
  dist_timeout_s = cfg.get_double("dist.timeout_s");
  NOPAD_CHECK(std::isfinite(dist_timeout_s) && dist_timeout_s >= 0, "dist.timeout_s must be >= 0 (0 = no timeout), "
              "got ", dist_timeout_s);
  {
    std::string ls = cfg.get_string("train.loss_scale");
    if (ls == "auto") ls = precision == "fp16" ? "dynamic" : "none";
    if (ls == "dynamic") {
      LossScaleOptions lso;
      lso.init = cfg.get_double("train.loss_scale_init");
      lso.growth_interval = cfg.get_int("train.loss_scale_window");
      try {
        loss_scaler = std::make_unique<DynamicLossScale>(lso);
      } catch (const Error& e) {
        fail("train.loss_scale_init / train.loss_scale_window: ", e.what());
      }
    } else if (ls != "none") {
      char* end = nullptr;
      fixed_loss_scale = std::strtod(ls.c_str(), &end);
      NOPAD_CHECK(end != ls.c_str() && *end == '\0' && std::isfinite(fixed_loss_scale) && fixed_loss_scale > 0,
                  "train.loss_scale must be auto, dynamic, none or a positive number, got \"", ls, "\"");
    }
  }

  const std::string optim_name = cfg.get_string("optim.name");
  NOPAD_CHECK(optim_name == "lamb" || optim_name == "adamw", "optim.name must be lamb or adamw, got \"", optim_name,
              "\"");
  NOPAD_CHECK(device == "cpu" || optim_name == "lamb", "optim.name ", optim_name,
              " is CPU-only for now; use lamb or --set train.device=cpu");
  OptimizerOptions oo;
  const double lr = cfg.get_double("optim.lr");
  NOPAD_CHECK(std::isfinite(lr) && lr > 0, "optim.lr must be a positive number, got ", lr);
  oo.beta1 = cfg.get_double("optim.beta1");
  oo.beta2 = cfg.get_double("optim.beta2");
  NOPAD_CHECK(oo.beta1 >= 0 && oo.beta1 < 1, "optim.beta1 must be in [0, 1), got ", oo.beta1);
  NOPAD_CHECK(oo.beta2 >= 0 && oo.beta2 < 1, "optim.beta2 must be in [0, 1), got ", oo.beta2);
  oo.eps = cfg.get_double("optim.eps");
  NOPAD_CHECK(oo.eps > 0, "optim.eps must be positive, got ", oo.eps);
  oo.weight_decay = cfg.get_double("optim.weight_decay");
  NOPAD_CHECK(oo.weight_decay >= 0, "optim.weight_decay must be >= 0, got ", oo.weight_decay);
  oo.max_grad_norm = cfg.get_double("optim.max_grad_norm");
  NOPAD_CHECK(oo.max_grad_norm >= 0, "optim.max_grad_norm must be >= 0 (0 = no clipping), got ", oo.max_grad_norm);
  oo.threads = threads;

  schedule.base_lr = lr;
  schedule.warmup_steps = cfg.get_int("schedule.warmup_steps");
  schedule.start_warmup_step = cfg.get_int("schedule.start_warmup_step");
  const int64_t total_steps = cfg.get_int("schedule.total_steps");
  NOPAD_CHECK(total_steps >= 0, "schedule.total_steps must be >= 0 (0 = train.max_steps), got ", total_steps);
  schedule.total_steps = total_steps > 0 ? total_steps : max_steps;
  schedule.power = cfg.get_double("schedule.power");
  try {
    schedule.validate();
  } catch (const Error& e) {
    fail("schedule: ", e.what());
  }

  const int64_t eval_interval_i = cfg.get_int("eval.interval_samples");
  const int64_t eval_max_i = cfg.get_int("eval.max_samples");
  NOPAD_CHECK(eval_interval_i >= -1, "eval.interval_samples must be >= 0, or -1 for MLPerf's rule, got ",
              eval_interval_i);
  NOPAD_CHECK(eval_max_i >= 0, "eval.max_samples must be >= 0, got ", eval_max_i);
  eval_interval = eval_interval_i == -1 ? mlperf_eval_interval(global_batch) : static_cast<uint64_t>(eval_interval_i);
  eval_max_samples = static_cast<uint64_t>(eval_max_i);
  log_interval = cfg.get_int("log.interval_steps");
  NOPAD_CHECK(log_interval > 0, "log.interval_steps must be positive, got ", log_interval);
  checkpoint_interval = cfg.get_int("checkpoint.interval_steps");
  NOPAD_CHECK(checkpoint_interval >= 0, "checkpoint.interval_steps must be >= 0 (0 = only at the end), got ",
              checkpoint_interval);
  checkpoint_keep = cfg.get_int("checkpoint.keep");
  NOPAD_CHECK(checkpoint_keep >= 0, "checkpoint.keep must be >= 0 (0 = keep all), got ", checkpoint_keep);

  // 2. Model architecture.
  try {
    model_config = read_hf_config(model_config_path);
  } catch (const Error& e) {
    fail("model.config ", model_config_path, ": ", e.what());
  }

  // 3. Data: readable, and covered by the model's vocabulary and positions.
  const std::string placement = cfg.get_string("data.placement");
  NOPAD_CHECK(placement == "shared" || placement == "partitioned", "data.placement must be shared or partitioned, got "
              "\"", placement, "\"");
  // The model's vocabulary and positions must cover a dataset's tokens and longest sequence.
  const auto check_covered = [&](const char* key, const std::string& path, uint32_t vocab_size, uint32_t max_seq) {
    NOPAD_CHECK(static_cast<uint64_t>(model_config.vocab_size) >= vocab_size, "model.config ", model_config_path,
                ": vocab_size ", model_config.vocab_size, " is smaller than the vocabulary of ", key, " ", path, " (",
                vocab_size, " tokens)");
    NOPAD_CHECK(static_cast<uint64_t>(model_config.max_position_embeddings) >= max_seq, "model.config ",
                model_config_path, ": max_position_embeddings ", model_config.max_position_embeddings,
                " is smaller than the longest sequence of ", key, " ", path, " (", max_seq, " tokens)");
  };
  // Pre-training sequences have two segments (sentence A, then B), whatever the data format.
  NOPAD_CHECK(model_config.type_vocab_size >= 2, "model.config ", model_config_path, ": type_vocab_size ",
              model_config.type_vocab_size, " is below 2, but pre-training sequences have two segments (sentence A "
              "and sentence B); use 2, as BERT does");
  uint32_t max_len = 0, max_masked = 0;
  fs::path train_folder;  // where the shards and their vocab.txt are (this rank's folder when partitioned)
  if (placement == "partitioned") {  // collective: the ranks learn each other's shard sizes
    // "{rank}" in data.train stands for this rank's number (node-local folders: /scratch/shards-{rank}).
    std::string local_path = train_path;
    for (size_t at; (at = local_path.find("{rank}")) != std::string::npos;)
      local_path.replace(at, 6, std::to_string(comm->rank()));
    train_folder = local_path;
    try {
      train_part = std::make_unique<dist::PartitionedData>(local_path, *comm);
    } catch (const Error& e) {
      fail("data.train (data.placement = partitioned): ", e.what());
    }
    check_covered("data.train", train_path, train_part->vocab_size(), train_part->max_seq_length());
    max_len = train_part->max_seq_length();
    max_masked = train_part->max_masked();
  } else {
    train_data = open_data("data.train", train_path);
    train_folder = train_data->folder();
  }
  NOPAD_CHECK(train_size() >= static_cast<uint64_t>(global_batch), "data.train ", train_path, " has ", train_size(),
              " samples, fewer than train.global_batch (", global_batch, ")");
  if (!eval_path.empty()) eval_data = open_data("data.eval", eval_path);
  for (const auto& [key, path, data] : {std::tuple{"data.train", train_path, train_data.get()},
                                        std::tuple{"data.eval", eval_path, eval_data.get()}}) {
    if (!data) continue;
    check_covered(key, path, data->vocab_size(), data->max_seq_length());
    NOPAD_CHECK(data->size() > 0, key, " ", path, " holds no samples");
    max_len = std::max(max_len, data->max_seq_length());
    max_masked = std::max(max_masked, max_masked_per_sample(*data));
  }
  setup_tokenizer(train_path, train_folder, eval_path);
  if (eval_data) mlm_baseline = mlm_frequency_baseline(*eval_data, eval_max_samples);

  // The MLPerf log's keys are checked here, before anything in run_dir is written or deleted.
  const std::string division = cfg.get_string("mllog.submission_division");
  NOPAD_CHECK(division == "closed" || division == "open", "mllog.submission_division must be closed or open, got \"",
              division, "\"");

  // 4. Starting point: init_from weights (checked now), or the checkpoint to resume.
  const ParamLayout layout(model_config);
  std::vector<float> start_params;
  std::unique_ptr<LoadedCheckpoint> resume_from;
  std::error_code ec;
  fs::path latest;
  if (fs::is_directory(run_dir, ec)) latest = latest_checkpoint(run_dir);
  if (!latest.empty() && mode == StartMode::kFresh)
    fail("run_dir ", run_dir.string(), " already holds a run (checkpoints/latest -> ", latest.filename().string(),
         "): pass --resume to continue it or --overwrite to start over");
  // Without checkpoints/latest, a run's other traces still mean a run is there: its checkpoint folders must not be
  // pruned by a new run's checkpoint.keep, nor its metrics replaced, unless --overwrite says so.
  if (latest.empty() && mode != StartMode::kOverwrite && fs::is_directory(run_dir, ec)) {
    if (const std::vector<fs::path> found = list_checkpoints(run_dir); !found.empty())
      fail("run_dir ", run_dir.string(), " holds checkpoint folders (the newest ", found.back().filename().string(),
           ") but no checkpoints/latest naming one: write the name of the one to continue from into ",
           (checkpoints_dir(run_dir) / "latest").string(), " and pass --resume, or pass --overwrite to start over "
           "(deleting them)");
    if (mode == StartMode::kFresh && fs::exists(run_dir / "metrics.jsonl", ec))
      fail("run_dir ", run_dir.string(), " already holds a run's metrics.jsonl (a run stopped before its first "
           "checkpoint): pass --resume to start it again from step 0, or --overwrite to start over");
  }
  if (mode == StartMode::kResume && !latest.empty()) {
    resume_from = std::make_unique<LoadedCheckpoint>(load_checkpoint(latest, &model_config, true));
    NOPAD_CHECK(resume_from->state.seed == seed, "train.seed ", seed, " differs from the seed of checkpoint ",
                latest.string(), " (", resume_from->state.seed, "): a resumed run must keep its seed");
    NOPAD_CHECK(resume_from->optimizer_kind == optim_name, "optim.name \"", optim_name,
                "\" differs from the optimizer of checkpoint ", latest.string(), " (\"", resume_from->optimizer_kind,
                "\")");
  } else if (!init_from.empty()) {
    start_params.resize(layout.total_numel());
    try {
      if (const fs::path tf = resolve_tf_checkpoint(init_from); !tf.empty()) {
        const TfImportReport r = load_tf_bert_weights(tf, layout, start_params.data());
        if (lead())
          std::fprintf(stderr, "init_from: TensorFlow checkpoint %s: %s\n", tf.string().c_str(), r.summary().c_str());
      } else {
        load_hf_weights(init_from, layout, start_params.data());
      }
    } catch (const Error& e) {
      fail("init_from: ", e.what());
    }
  }

  // 4b. Data parallelism: every rank runs the same config on the same data (refused with the ranks that differ),
  // and every rank has read what it resumes from before rank 0 writes or deletes anything in run_dir.
  if (rank_info.distributed()) {
    dist::check_same_on_all_ranks(*comm, dist::hash_string(cfg.dump()), "the config (with its --set overrides)");
    uint64_t h = dist::hash_string("data");
    if (train_part) {  // its global shape (every rank computed it from the same all-reduce)
      const uint64_t fields[3] = {train_part->size(), train_part->vocab_checksum(), train_part->num_shards()};
      h = dist::hash_bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(fields), sizeof fields), h);
    }
    for (const Dataset* d : {train_data.get(), eval_data.get()}) {
      if (d == nullptr) continue;
      const uint64_t fields[3] = {d->size(), d->vocab_checksum(), d->num_shards()};
      h = dist::hash_bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(fields), sizeof fields), h);
      for (size_t k = 0; k < d->num_shards(); ++k) {
        const uint64_t n = d->shard(k).num_seqs();
        h = dist::hash_bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&n), sizeof n), h);
      }
    }
    dist::check_same_on_all_ranks(*comm, h, "the training/eval data (sample counts, shards, vocabulary)");
    comm->barrier();
  }

  // 5. The output folder, last: nothing is written before everything above passed. Rank 0 writes it.
  if (lead()) {
    try {
      ensure_writable_dir(run_dir);
    } catch (const Error& e) {
      fail("run_dir: ", e.what());
    }
  }

  // 6. Engine (model and optimizer on the device): every buffer sized once for the largest micro-batch.
  const size_t cap_tokens = static_cast<size_t>(micro_batch) * max_len;
  const size_t cap_masked = static_cast<size_t>(micro_batch) * max_masked;
  NOPAD_CHECK(cap_tokens < static_cast<size_t>(INT32_MAX), "train.global_batch / train.grad_accumulation (",
              micro_batch, ") x the longest sequence (", max_len, ") is too many tokens for one micro-batch");
  EngineOptions eo;
  eo.config = model_config;
  eo.max_tokens = static_cast<int32_t>(cap_tokens);
  eo.max_seqs = static_cast<int32_t>(micro_batch);
  eo.max_masked = static_cast<int32_t>(cap_masked);
  eo.micro_batches_per_step = static_cast<int32_t>(grad_accumulation);
  eo.precision = precision;
  eo.optimizer = optim_name;
  eo.optim = oo;
  eo.threads = threads;
  eo.device = rank_info.local_rank;  // one GPU per process (modulo the GPUs visible)
  eo.dist_timeout_s = dist_timeout_s;
  eo.overlap_grad_reduce = cfg.get_bool("dist.overlap");
  eo.nccl_max_ctas = cfg.get<int>("dist.nccl_max_ctas");
  NOPAD_CHECK(eo.nccl_max_ctas >= 0, "dist.nccl_max_ctas must be >= 0 (0 = NCCL's default), got ", eo.nccl_max_ctas);
  {
    const std::string clip = cfg.get_string("dist.clip");
    NOPAD_CHECK(clip == "global" || clip == "bucket", "dist.clip must be global or bucket, got \"", clip, "\"");
    if (clip == "bucket") {
      NOPAD_CHECK(oo.max_grad_norm > 0, "dist.clip = bucket clips to optim.max_grad_norm, which is 0 (no clipping); "
                  "set optim.max_grad_norm > 0 or dist.clip = global");
      eo.bucket_clip_norm = oo.max_grad_norm;
      eo.world_size = rank_info.world_size;
      eo.optim.max_grad_norm = 0;  // the buckets are clipped instead of the global norm
    }
  }
  {
    const std::string reduce = cfg.get_string("dist.reduce");
    NOPAD_CHECK(reduce == "fp32" || reduce == "bf16", "dist.reduce must be fp32 or bf16, got \"", reduce, "\"");
    eo.reduce_bf16 = reduce == "bf16";
  }
  engine = make_engine(device, eo);
  if (rank_info.distributed()) {
    engine->connect(*comm);  // the device collective (GPU: NCCL), bootstrapped over the host communicator
    // The process-wide watchdog fires 30 s after a device wait's own timeout would (that one aborts NCCL with a
    // clearer message); it also catches ranks stuck in the host's MPI collectives.
    if (dist_timeout_s > 0)
      watchdog = std::make_unique<dist::Watchdog>(dist_timeout_s + 30, dist::describe(rank_info) +
                                                                             " (dist.timeout_s + 30 s watchdog)");
  }
  if (lead()) {
    std::fprintf(stderr, "device: %s, %s%s%s\n", engine->device_name().c_str(), engine->precision().c_str(),
                 loss_scaler ? ", dynamic loss scale" : (fixed_loss_scale != 1 ? ", fixed loss scale" : ""),
                 device_note.empty() ? "" : (" (train.device auto: " + device_note + ")").c_str());
    // The attention masks draw 8 bits per element (core/philox.h): say so when that rounds the configured p.
    const float p_attn = static_cast<float>(model_config.attention_probs_dropout_prob);
    if (p_attn > 0.0f && attention_dropout_effective_p(p_attn) != p_attn)
      std::fprintf(stderr, "attention dropout: %g runs as %u/256 = %.7g (8-bit draws)\n", p_attn,
                   attention_dropout_threshold(p_attn), attention_dropout_effective_p(p_attn));
    if (rank_info.distributed())
      std::fprintf(stderr, "data parallel: %d ranks (%s, %s), dist.balance %s, up to %lld sequences per rank and "
                   "step, gradients summed in %s\n", comm->size(), rank_info.launcher.c_str(), comm->name().c_str(),
                   dist::balance_mode_name(balance), static_cast<long long>(rank_batch),
                   eo.reduce_bf16 ? "bf16" : "fp32");
  }
  reserve_batch(micro, cap_tokens, static_cast<size_t>(micro_batch), cap_masked);

  state.seed = seed;
  state.optimizer = optim_name;
  if (resume_from) {
    engine->set_params(resume_from->params.data());
    engine->load_optimizer_state(resume_from->optimizer_steps, resume_from->optimizer_state());
    state = resume_from->state;
    if (state.extra.contains("elapsed_s")) prior_elapsed_s = state.extra.at("elapsed_s").get<double>();
    if (loss_scaler && state.extra.contains("loss_scale")) {
      try {
        loss_scaler->load_json(state.extra.at("loss_scale"));
      } catch (const Error& e) {
        fail("checkpoint ", latest.string(), ": ", e.what());
      }
    }
    last_checkpoint = resume_from->dir;
    if (lead()) std::fprintf(stderr, "resuming from %s (step %lld, %llu samples)\n", latest.string().c_str(),
                 static_cast<long long>(state.step), static_cast<unsigned long long>(state.samples));
    if (lead() && state.step >= max_steps)
      std::fprintf(stderr, "warning: the checkpoint is at step %lld and train.max_steps is %lld: nothing to train; "
                   "raise train.max_steps to continue\n", static_cast<long long>(state.step),
                   static_cast<long long>(max_steps));
  } else {
    if (mode == StartMode::kResume && lead())
      std::fprintf(stderr, "no checkpoint in %s: starting at step 0\n", run_dir.c_str());
    if (!start_params.empty()) engine->set_params(start_params.data());
    else engine->init_params(seed);
  }
  if (!lead()) return;  // the other ranks write nothing
  if (mode == StartMode::kOverwrite) {
    fs::remove_all(checkpoints_dir(run_dir), ec);
    fs::remove(run_dir / "metrics.jsonl", ec);
  }
  // Partial checkpoint folders of a crashed writer.
  if (fs::is_directory(checkpoints_dir(run_dir), ec))
    for (const auto& e : fs::directory_iterator(checkpoints_dir(run_dir)))
      if (e.path().filename().string().find(".tmp") != std::string::npos) fs::remove_all(e.path(), ec);

  write_file_atomic(run_dir / "config.toml", cfg.dump());
  std::unique_ptr<EventWriter> events;  // log.tensorboard: the metrics lines as TensorBoard scalars too
  if (cfg.get_bool("log.tensorboard")) {
    const std::string tb_dir = cfg.get_string("log.tensorboard_dir");
    // --overwrite deletes the run's own event files, never those in a folder named by log.tensorboard_dir.
    if (mode == StartMode::kOverwrite && tb_dir.empty()) remove_nopad_event_files(run_dir / "tensorboard");
    events = std::make_unique<EventWriter>(tb_dir.empty() ? run_dir / "tensorboard" : fs::path(tb_dir));
  }
  metrics = std::make_unique<MetricsLog>(run_dir / "metrics.jsonl", state.step, std::move(events));

  // The MLPerf log: submission and hyper-parameter keys (closed-division BERT), then the end of initialisation.
  const std::string platform = cfg.get_string("mllog.submission_platform");
  mllog.point("submission_benchmark", "bert");
  mllog.point("submission_division", division);
  mllog.point("submission_org", cfg.get_string("mllog.submission_org"));
  mllog.point("submission_platform", platform.empty() ? engine->device_name() : platform);
  mllog.point("submission_status", "onprem");
  mllog.point("seed", seed);
  mllog.point("global_batch_size", global_batch);
  mllog.point("gradient_accumulation_steps", grad_accumulation);
  mllog.point("max_sequence_length", train_max_len());
  mllog.point("opt_base_learning_rate", schedule.base_lr);
  mllog.point("opt_lamb_epsilon", cfg.get_double("optim.eps"));
  mllog.point("opt_lamb_beta_1", cfg.get_double("optim.beta1"));
  mllog.point("opt_lamb_beta_2", cfg.get_double("optim.beta2"));
  mllog.point("opt_lamb_weight_decay_rate", cfg.get_double("optim.weight_decay"));
  mllog.point("opt_learning_rate_training_steps", schedule.total_steps);
  mllog.point("opt_learning_rate_warmup_steps", schedule.warmup_steps);
  mllog.point("num_warmup_steps", schedule.warmup_steps);
  mllog.point("start_warmup_step", schedule.start_warmup_step);
  mllog.point("opt_learning_rate_decay_poly_power", schedule.power);
  mllog.point("train_samples", train_size());
  mllog.point("eval_samples", eval_data ? (eval_max_samples > 0 ? std::min<uint64_t>(eval_max_samples, eval_data->size())
                                                                 : eval_data->size())
                                        : 0);
  mllog.end("init_stop");
  mllog.open(run_dir / "mllog.txt", cfg.get_bool("mllog.stdout"));
}

// The data's vocabulary (data.vocab, else the vocab.txt beside the shards) must be the one the shards were made with,
// and data.eval must share it: a model trained on one vocabulary's ids and evaluated on another's learns and reports
// nonsense without a word.
void Trainer::Impl::setup_tokenizer(const std::string& train_path, const fs::path& train_folder,
                                    const std::string& eval_path) {
  const uint32_t train_checksum = train_part ? train_part->vocab_checksum() : train_data->vocab_checksum();
  if (eval_data)
    NOPAD_CHECK(eval_data->vocab_checksum() == train_checksum, "data.eval ", eval_path, " was made with another "
                "vocabulary than data.train ", train_path, " (vocabulary checksums ", eval_data->vocab_checksum(),
                " and ", train_checksum, "): make the eval set with the training data's vocabulary");
  fs::path vocab_path = cfg.get_string("data.vocab");
  const bool given = !vocab_path.empty();
  if (!given && has_tokenizer_files(train_folder)) vocab_path = train_folder / "vocab.txt";
  if (vocab_path.empty()) {
    if (lead())
      std::fprintf(stderr, "warning: data.train %s has no vocab.txt (made by an older nopad): the checkpoints will "
                   "hold no tokenizer; set data.vocab to the vocabulary the data was made with\n", train_path.c_str());
    return;
  }
  try {
    tokenizer_vocab = std::make_unique<Vocab>(Vocab::load(vocab_path));
  } catch (const Error& e) {
    fail(given ? "data.vocab: " : "data.train's vocab.txt: ", e.what());
  }
  NOPAD_CHECK(tokenizer_vocab->checksum() == train_checksum, given ? "data.vocab " : "", vocab_path.string(),
              " is not the vocabulary data.train ", train_path, " was made with (checksum ",
              tokenizer_vocab->checksum(), ", the shards' ", train_checksum, ")",
              given ? ": give the vocab.txt the data was prepared with" : ": the dataset folder was altered; "
              "re-run nopad prepare, or set data.vocab");
  std::string casing = cfg.get_string("data.do_lower_case");
  const nlohmann::json& manifest = train_data ? train_data->manifest() : nlohmann::json();
  if (casing == "auto" && manifest.is_object() && manifest.contains("do_lower_case") &&
      manifest["do_lower_case"].is_boolean())
    casing = manifest["do_lower_case"].get<bool>() ? "true" : "false";
  tokenizer_lower_case = resolve_lower_case(casing, *tokenizer_vocab, "data.do_lower_case");
}

fs::path Trainer::Impl::save_checkpoint() {
  kick();
  if (loss_scaler) state.extra["loss_scale"] = loss_scaler->to_json();
  std::vector<float> host;
  engine->get_params(host);
  // The ranks' replicas must be identical (the same updates from the same summed gradients): a checkpoint is where a
  // drift would be written down, so it is checked here, on every rank.
  if (rank_info.distributed())
    dist::check_same_on_all_ranks(
        *comm, dist::hash_bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(host.data()),
                                                         host.size() * sizeof(float))),
        "the model weights at step " + std::to_string(state.step));
  if (!lead()) return last_checkpoint;
  state.optimizer_steps = engine->optimizer_steps();
  state.schedule_steps = state.step;
  metrics->sync();
  CheckpointWriteOptions o;
  o.keep = static_cast<int>(checkpoint_keep);
  o.tokenizer_vocab = tokenizer_vocab.get();
  o.tokenizer_lower_case = tokenizer_lower_case;
  last_checkpoint =
      write_checkpoint(run_dir, model_config, engine->layout(), host.data(), &engine->optimizer_state(), state, o);
  kick();
  return last_checkpoint;
}

EvalResult Trainer::Impl::run_eval() {
  // MLPerf BERT counts "epochs" in training samples.
  mllog.start("eval_start", nullptr, {{"epoch_num", state.samples}});
  const EvalResult e = evaluate_with(
      [&](const HostBatch& hb) {
        kick();
        return engine->evaluate(hb);
      },
      *eval_data, eval_max_samples, static_cast<int32_t>(micro_batch), comm.get());
  kick();
  state.extra["last_eval"] = eval_json(e);
  mllog.point("eval_accuracy", e.mlm_accuracy, {{"epoch_num", state.samples}});
  mllog.end("eval_stop", nullptr, {{"epoch_num", state.samples}});
  if (!lead()) return e;
  nlohmann::json j = {{"eval", true}, {"step", state.step}, {"samples", state.samples}};
  j.update(eval_json(e));
  j["mlm_frequency_baseline"] = mlm_baseline;
  metrics->write(j);
  std::fprintf(stderr, "%seval at step %lld (%llu samples): mlm accuracy %.4f (frequency baseline %.4f), nsp "
               "accuracy %.4f, loss %.4f\n", Progress::stderr_is_terminal() ? "\n" : "",
               static_cast<long long>(state.step), static_cast<unsigned long long>(state.samples), e.mlm_accuracy,
               mlm_baseline, e.nsp_accuracy, e.loss);
  return e;
}

Trainer::Trainer(const Config& config, StartMode mode, TrainHooks hooks)
    : impl_(std::make_unique<Impl>(config, mode, std::move(hooks))) {
  impl_->setup();
}

Trainer::~Trainer() = default;

std::vector<float> Trainer::params() const {
  std::vector<float> host;
  impl_->engine->get_params(host);
  return host;
}

TrainSummary Trainer::run() {
  Impl& m = *impl_;
  TrainSummary summary;
  summary.first_step = m.state.step;
  const auto start = Clock::now();
  const bool tty = Progress::stderr_is_terminal();

  // MLPerf's timed run starts before any training data is touched. Training between evaluations is a "block" whose
  // epoch numbers are samples. run_stop says success when the target accuracy was reached, aborted otherwise (also
  // when an error ends the run: the guard logs it on the way out).
  m.mllog.start("run_start");
  struct RunStop {
    MlLog& log;
    const uint64_t& samples;
    bool success = false;
    ~RunStop() { log.end("run_stop", nullptr, {{"status", success ? "success" : "aborted"}, {"epoch_num", samples}}); }
  } run_stop{m.mllog, m.state.samples};
  uint64_t block_first = m.state.samples;
  const auto block_start = [&] {
    block_first = m.state.samples;
    const uint64_t left = m.max_samples > 0 && m.max_samples > m.state.samples ? m.max_samples - m.state.samples
                          : static_cast<uint64_t>(std::max<int64_t>(1, m.max_steps - m.state.step)) *
                                static_cast<uint64_t>(m.global_batch);
    m.mllog.start("block_start", nullptr,
                  {{"first_epoch_num", block_first},
                   {"epoch_count", m.eval_interval > 0 ? std::min(m.eval_interval, left) : left}});
  };
  const auto block_stop = [&] { m.mllog.end("block_stop", nullptr, {{"first_epoch_num", block_first}}); };
  block_start();
  bool in_block = true;

  LoaderOptions lo;
  lo.global_batch = static_cast<uint64_t>(m.global_batch);
  lo.seed = m.seed;
  lo.shuffle = true;
  lo.start = m.state.cursor;
  lo.rank = m.comm->rank();
  lo.world_size = m.comm->size();
  // Every rank draws the same global batch (same seed and cursor) and plans the same split; it builds only its share:
  // from the whole dataset (shared), or by exchanging the samples each rank holds (partitioned: collective, so it
  // runs here on the main thread, while the device works on the step enqueued before).
  std::unique_ptr<Loader> shared_loader;
  std::unique_ptr<dist::PartitionedLoader> part_loader;
  if (m.train_part)
    part_loader = std::make_unique<dist::PartitionedLoader>(*m.train_part, *m.comm, lo, m.balance, m.cost,
                                                            static_cast<int>(m.rank_batch));
  else
    shared_loader = std::make_unique<Loader>(*m.train_data, lo, std::make_shared<dist::BalancedAssigner>(
                                                                    m.balance, m.cost, static_cast<int>(m.rank_batch)));
  auto next_batch = [&]() -> const HostBatch& { return part_loader ? part_loader->next() : shared_loader->next(); };
  auto loader_cursor = [&] { return part_loader ? part_loader->cursor() : shared_loader->cursor(); };
  const bool lead = m.lead();

  // m.state describes the steps ENQUEUED on the engine. The host reads a step's results one step late (it enqueues
  // step N, then reads step N-1 while the device works on N), so the device never waits for the host between
  // steps. Before anything that needs the weights of a step (evaluation, a checkpoint, the end), every enqueued step
  // is read first ("drained"), so checkpoints and evaluations always see a state whose results were checked.
  auto done = [&] {
    return m.state.step >= m.max_steps || (m.max_samples > 0 && m.state.samples >= m.max_samples);
  };
  struct Enqueued {
    int64_t step = 0;  // 1-based
    uint64_t samples = 0;
    double lr = 0;
    int64_t seqs = 0, tokens = 0;
    bool last = false;
    double loss_scale = 1;  // what its backward was scaled by
  };
  struct {  // per-rank timing summed over the steps read (data parallel: printed at the end)
    int64_t steps = 0;
    double compute_ms = 0, imbalance = 0, reduce_ms = 0;
  } timing;
  std::array<Enqueued, TrainEngine::kMaxStepsInFlight> queue{};
  int q_first = 0, q_count = 0;
  int64_t last_eval_step = -1, last_checkpoint_step = m.last_checkpoint.empty() ? -1 : m.state.step;
  double last_draw_s = -1;
  double paused_s = 0;  // time spent in evaluations and checkpoints (not training)
  struct {
    double mark_s = 0;  // training time at the last logged line
    int64_t seqs = 0, tokens = 0;  // read since then
  } rate;
  // Runs an evaluation or a checkpoint, its time counted as paused.
  auto paused = [&](auto&& work) {
    const auto t0 = Clock::now();
    work();
    paused_s += seconds_since(t0);
  };

  // Reads the oldest enqueued step: checks it, records it, reports progress.
  auto read_oldest = [&] {
    const Enqueued e = queue[static_cast<size_t>(q_first)];
    q_first = (q_first + 1) % TrainEngine::kMaxStepsInFlight;
    --q_count;
    StepOutcome out = m.engine->finish_step();  // waits for that step only
    m.kick();
    // Per-rank timing (data parallel): the slowest and the mean rank's compute time, and the time until the summed
    // gradients were usable (exposed communication plus waiting for the slowest rank).
    // One all_gather of every rank's pair gives both the sums and the maxima.
    std::array<double, 2> t_sum = {out.compute_ms, out.reduce_ms}, t_max = t_sum;
    if (m.rank_info.distributed()) {
      std::vector<double> all(2 * static_cast<size_t>(m.comm->size()));
      m.comm->all_gather(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(t_sum.data()), sizeof t_sum),
                         std::span<uint8_t>(reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(double)));
      t_sum = t_max = {all[0], all[1]};
      for (size_t i = 2; i < all.size(); i += 2) {
        t_sum[0] += all[i];
        t_sum[1] += all[i + 1];
        t_max[0] = std::max(t_max[0], all[i]);
        t_max[1] = std::max(t_max[1], all[i + 1]);
      }
    }
    const double ranks = static_cast<double>(m.comm->size());
    const double compute_mean = t_sum[0] / ranks, reduce_mean = t_sum[1] / ranks;
    const double imbalance = compute_mean > 0 ? t_max[0] / compute_mean : 1.0;  // slowest rank / mean
    if (std::isfinite(compute_mean) && compute_mean > 0) {  // run totals for the closing per-rank timing line
      timing.steps += 1;
      timing.compute_ms += compute_mean;
      timing.imbalance += imbalance;
      timing.reduce_ms += reduce_mean;
    }
    if (m.hooks.after_forward) m.hooks.after_forward(e.step, out.result);
    const std::string keep_note =
        m.last_checkpoint.empty() ? std::string(" (no checkpoint was written yet)")
                                  : " (the last good checkpoint, " + m.last_checkpoint.string() + ", is kept; "
                                    "restart from it with --resume)";
    // With a dynamic loss scale, an overflow (non-finite loss or gradients) is expected now and then: the update
    // was not applied (the optimizer skips non-finite gradients; see TrainEngine), the scale backs off, the run goes
    // on. Only when the scale is exhausted has training diverged.
    bool overflow_skipped = false;
    if (m.loss_scaler) {
      const bool overflow = !std::isfinite(out.result.loss) || out.stats.skipped;
      m.loss_scaler->update(e.loss_scale, overflow);
      if (overflow && m.loss_scaler->exhausted()) {
        m.metrics->sync();
        fail("step ", e.step, ": the loss or gradients overflow even at loss scale ", e.loss_scale,
             ": training diverged; lower optim.lr, add schedule.warmup_steps or use train.precision bf16", keep_note);
      }
      overflow_skipped = overflow;
    }
    if (!overflow_skipped && !std::isfinite(out.result.loss)) {
      m.metrics->sync();
      fail("step ", e.step, ": the loss is not finite (", out.result.loss,
           "): training diverged; lower optim.lr or add schedule.warmup_steps", keep_note);
    }
    if (!overflow_skipped && out.stats.skipped) {
      m.metrics->sync();
      fail("step ", e.step, ": the gradients are not finite: training diverged; lower optim.lr or add "
           "schedule.warmup_steps", keep_note);
    }
    // Throughput: the sequences and tokens read since the last logged line over the training time since then (the
    // run's clock less the time evaluations and checkpoints took). Over a whole run the lines' times add up to the
    // training time, whatever the engine's pipelining does to the time between two single reads (a device engine
    // reads a step while the next one runs; reads can come back to back at a drain).
    const double train_s = seconds_since(start) - paused_s;
    rate.seqs += e.seqs;
    rate.tokens += e.tokens;
    const double window_s = train_s - rate.mark_s;
    const double seq_per_s = window_s > 0 ? static_cast<double>(rate.seqs) / window_s : 0,
                 tokens_per_s = window_s > 0 ? static_cast<double>(rate.tokens) / window_s : 0;
    const double elapsed_s = m.prior_elapsed_s + seconds_since(start);
    m.state.extra["elapsed_s"] = elapsed_s;

    StepRecord rec;
    rec.step = e.step;
    rec.samples = e.samples;
    rec.loss = out.result.loss;
    rec.mlm_loss = out.result.mlm_loss;
    rec.nsp_loss = out.result.nsp_loss;
    rec.mlm_accuracy = out.result.mlm_count ? static_cast<double>(out.result.mlm_correct) /
                                                  static_cast<double>(out.result.mlm_count)
                                            : 0;
    rec.lr = e.lr;
    rec.grad_norm = out.stats.grad_norm;
    summary.steps.push_back(rec);
    const bool log_line = rec.step % m.log_interval == 0 || e.last || overflow_skipped;
    if (log_line) rate = {train_s, 0, 0};  // the next line's window starts here
    if (lead && log_line) {
      nlohmann::json line = {{"step", rec.step},
                             {"samples", rec.samples},
                             {"loss", std::isfinite(rec.loss) ? nlohmann::json(rec.loss) : nlohmann::json()},
                             {"mlm_loss", rec.mlm_loss},
                             {"nsp_loss", rec.nsp_loss},
                             {"mlm_accuracy", rec.mlm_accuracy},
                             {"lr", rec.lr},
                             {"grad_norm",
                              std::isfinite(rec.grad_norm) ? nlohmann::json(rec.grad_norm) : nlohmann::json()},
                             {"seq_per_s", seq_per_s},
                             {"tokens_per_s", tokens_per_s},
                             {"elapsed_s", elapsed_s}};
      if (std::isfinite(compute_mean)) {
        line["compute_ms"] = compute_mean;
        if (m.rank_info.distributed()) {
          line["compute_ms_max"] = t_max[0];
          line["compute_imbalance"] = imbalance;
          line["reduce_ms"] = reduce_mean;
          line["reduce_ms_max"] = t_max[1];
        }
      }
      if (m.loss_scaler) {
        line["loss_scale"] = e.loss_scale;
        line["skipped"] = overflow_skipped;
      }
      m.metrics->write(line);
    }
    if (overflow_skipped && lead)
      std::fprintf(stderr, "%sstep %lld: overflow at loss scale %g, update skipped; loss scale now %g\n",
                   tty ? "\r\x1b[K" : "", static_cast<long long>(e.step), e.loss_scale, m.loss_scaler->scale());
    // Progress: a live line on a terminal, plain lines at the log interval otherwise.
    const double run_s = seconds_since(start);
    const double steps_done = static_cast<double>(rec.step - summary.first_step);
    const double eta_s = run_s / steps_done * static_cast<double>(m.max_steps - rec.step);
    if (lead && (tty ? (run_s - last_draw_s >= 0.1 || e.last) : (rec.step % m.log_interval == 0 || e.last))) {
      last_draw_s = run_s;
      std::fprintf(stderr, "%sstep %lld/%lld  loss %.4f  mlm acc %.4f  lr %.3g  %.1f seq/s  ETA %s%s",
                   tty ? "\r" : "", static_cast<long long>(rec.step), static_cast<long long>(m.max_steps), rec.loss,
                   rec.mlm_accuracy, rec.lr, seq_per_s, format_duration(eta_s).c_str(), tty ? "\x1b[K" : "\n");
      std::fflush(stderr);
    }
  };
  auto drain = [&] {
    while (q_count > 0) read_oldest();
  };

  while (!done()) {
    const int64_t step_index = m.state.step;  // updates already taken: dropout key and schedule position
    // This rank's share of the global batch (the whole batch in a single process); the loss denominators are the
    // global batch's counts, so the ranks' gradients add up to the global batch's.
    const HostBatch& mine = next_batch();
    std::array<int64_t, 3> global_counts = {mine.num_masked(), mine.num_seqs(), mine.num_tokens()};
    if (m.rank_info.distributed()) m.comm->all_reduce_sum(std::span<int64_t>(global_counts));
    const auto [global_masked, global_seqs, global_tokens] = global_counts;
    const LossDenominators denoms{std::max(1.0, static_cast<double>(global_masked)),
                                  static_cast<double>(global_seqs)};
    const double lr = m.schedule.lr(step_index);
    const double loss_scale = m.loss_scaler ? m.loss_scaler->scale() : m.fixed_loss_scale;
    // Enqueue the whole step: micro-batches (forward + backward accumulating the gradients), the gradient sum over
    // the ranks, then the update.
    m.engine->zero_grad();
    for (int64_t a = 0; a < m.grad_accumulation; ++a) {
      const int32_t b0 = static_cast<int32_t>(a * m.micro_batch), b1 = static_cast<int32_t>((a + 1) * m.micro_batch);
      if (b0 >= mine.num_seqs()) break;  // a rank's share may be a little smaller than the others'
      slice_batch(mine, b0, std::min(b1, mine.num_seqs()), m.micro);
      const bool last = a + 1 == m.grad_accumulation || b1 >= mine.num_seqs();
      m.engine->micro_step(m.micro, m.seed, static_cast<uint64_t>(step_index), denoms, loss_scale, last);
    }
    if (m.rank_info.distributed()) m.engine->reduce_gradients(*m.comm);
    m.engine->optimizer_step(lr, 1.0 / loss_scale);
    m.state.step = step_index + 1;
    m.state.samples += static_cast<uint64_t>(global_seqs);
    m.state.cursor = loader_cursor();
    m.state.lr = lr;
    Enqueued& e = queue[static_cast<size_t>((q_first + q_count) % TrainEngine::kMaxStepsInFlight)];
    e = Enqueued{m.state.step, m.state.samples, lr, global_seqs, global_tokens, done(), loss_scale};
    ++q_count;

    // Evaluation every eval.interval_samples samples (crossing a multiple), checkpoints, the end: drain first.
    const uint64_t before = m.state.samples - static_cast<uint64_t>(global_seqs);
    const bool eval_due =
        m.eval_data && m.eval_interval > 0 && m.state.samples / m.eval_interval > before / m.eval_interval;
    const bool checkpoint_due =
        m.checkpoint_interval > 0 && m.state.step % m.checkpoint_interval == 0 && !e.last;
    if (eval_due || checkpoint_due || e.last) {
      drain();
    } else if (q_count > 1) {
      read_oldest();  // the previous step, while the device runs this one
    }
    if (eval_due) {
      block_stop();
      in_block = false;
      paused([&] { summary.evals.push_back(m.run_eval()); });
      last_eval_step = m.state.step;
      if (m.target_accuracy > 0 && summary.evals.back().mlm_accuracy >= m.target_accuracy) {
        summary.reached_target = true;
        if (lead) std::fprintf(stderr, "reached train.target_mlm_accuracy %.4f at step %lld\n", m.target_accuracy,
                     static_cast<long long>(m.state.step));
        break;
      }
    }
    if (checkpoint_due) {
      paused([&] { m.save_checkpoint(); });
      last_checkpoint_step = m.state.step;
    }
    if (!in_block && !done()) {
      block_start();
      in_block = true;
    }
  }
  drain();
  if (in_block) block_stop();
  if (tty && lead) std::fprintf(stderr, "\n");
  if (m.eval_data && last_eval_step != m.state.step) {
    summary.evals.push_back(m.run_eval());
    if (m.target_accuracy > 0 && summary.evals.back().mlm_accuracy >= m.target_accuracy) summary.reached_target = true;
  }
  run_stop.success = summary.reached_target;
  if (last_checkpoint_step != m.state.step) m.save_checkpoint();
  if (lead) m.metrics->sync();
  summary.final_checkpoint = m.last_checkpoint;
  summary.final_step = m.state.step;
  summary.samples = m.state.samples;
  summary.elapsed_s = seconds_since(start);
  summary.mlm_baseline = m.mlm_baseline;
  summary.rank = m.comm->rank();
  if (lead && m.rank_info.distributed() && timing.steps > 0)
    std::fprintf(stderr, "per-rank timing over %lld steps: compute %.1f ms per step (mean rank), slowest rank %.3fx the "
                 "mean, gradient reduction %.1f ms (exposed + waiting)\n", static_cast<long long>(timing.steps),
                 timing.compute_ms / static_cast<double>(timing.steps), timing.imbalance / static_cast<double>(timing.steps),
                 timing.reduce_ms / static_cast<double>(timing.steps));
  if (lead) std::fprintf(stderr, "done: step %lld, %llu samples, %.1f s; checkpoint %s\n", static_cast<long long>(m.state.step),
               static_cast<unsigned long long>(m.state.samples), summary.elapsed_s,
               summary.final_checkpoint.string().c_str());
  return summary;
}

}  // namespace nopad
