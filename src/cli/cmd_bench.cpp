// nopad bench: benchmarks as programs, each printing one JSON line. `bench loader` times the batch builder on one
// core (synchronous mode: the calling thread does all the work) or with the background loader thread. `bench model`
// times training steps of a BERT model on real batches (train/bench.h).
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "train/attention_bench.h"
#include "train/bench.h"

namespace {

struct LoaderBenchOptions {
  std::string data;
  uint64_t batch = 256;
  uint64_t steps = 2000;
  bool background = false;
  uint64_t seed = 1;
  std::string dump_ids;  // write each batch's sample ids here (one line per batch)
};

void run_loader_bench(const LoaderBenchOptions& o) {
  const nopad::Dataset ds(o.data);
  nopad::LoaderOptions lo;
  lo.global_batch = o.batch;
  lo.seed = o.seed;
  lo.background = o.background;
  nopad::Loader loader(ds, lo);
  // --dump-ids: the order a training run of this seed and batch draws (checked against python/nopad_order.py).
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> dump(nullptr, &std::fclose);
  if (!o.dump_ids.empty()) {
    dump.reset(std::fopen(o.dump_ids.c_str(), "w"));
    NOPAD_CHECK(dump != nullptr, "--dump-ids: cannot write ", o.dump_ids);
  }
  const auto record = [&](const nopad::HostBatch& b) {
    if (!dump) return;
    for (size_t i = 0; i < b.sample_ids.size(); ++i)
      std::fprintf(dump.get(), i ? " %llu" : "%llu", static_cast<unsigned long long>(b.sample_ids[i]));
    std::fputc('\n', dump.get());
  };
  // Warm-up: touch the data once so the page cache, not the disk, is measured (as in a long training run).
  for (int i = 0; i < 10; ++i) record(loader.next());
  uint64_t seqs = 0, tokens = 0, masked = 0, checksum = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t s = 0; s < o.steps; ++s) {
    const nopad::HostBatch& b = loader.next();
    record(b);
    seqs += static_cast<uint64_t>(b.num_seqs());
    tokens += static_cast<uint64_t>(b.num_tokens());
    masked += static_cast<uint64_t>(b.num_masked());
    checksum += static_cast<uint64_t>(b.tokens[static_cast<size_t>(b.num_tokens()) / 2]);  // use the data
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  NOPAD_CHECK(seqs == o.steps * o.batch, "loader returned ", seqs, " sequences, expected ", o.steps * o.batch);
  std::printf(
      "{\"bench\": \"loader\", \"mode\": \"%s\", \"batch\": %llu, \"steps\": %llu, \"seconds\": %.4f, "
      "\"seqs_per_s\": %.0f, \"tokens_per_s\": %.0f, \"mean_length\": %.1f, \"mean_masked\": %.2f, "
      "\"checksum\": %llu}\n",
      o.background ? "background" : "sync", static_cast<unsigned long long>(o.batch),
      static_cast<unsigned long long>(o.steps), secs, static_cast<double>(seqs) / secs,
      static_cast<double>(tokens) / secs, static_cast<double>(tokens) / static_cast<double>(seqs),
      static_cast<double>(masked) / static_cast<double>(seqs), static_cast<unsigned long long>(checksum));
}

void setup(CLI::App& sub) {
  sub.require_subcommand(1);
  auto lo = std::make_shared<LoaderBenchOptions>();
  CLI::App* loader = sub.add_subcommand("loader", "sequences per second the loader builds into unpadded batches");
  loader->add_option("--data", lo->data, "dataset folder")->required();
  loader->add_option("--batch", lo->batch, "sequences per batch")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  loader->add_option("--steps", lo->steps, "timed batches")->capture_default_str()->check(CLI::Range(1, 1 << 30));
  loader->add_option("--seed", lo->seed, "shuffle seed")->capture_default_str();
  loader->add_option("--dump-ids", lo->dump_ids,
                     "write the sample ids of every batch drawn (the 10 warm-up batches, then --steps), one line "
                     "per batch: the order nopad train uses for this --seed and --batch");
  loader->add_flag("--background", lo->background,
                   "build batches on the loader thread (default: on the calling thread, i.e. one core)");
  loader->callback([lo] { run_loader_bench(*lo); });

  auto mo = std::make_shared<nopad::ModelBenchOptions>();
  CLI::App* model = sub.add_subcommand("model", "training steps per second of a BERT model on real batches");
  model->add_option("--model", mo->model, "model config.json")->required();
  model->add_option("--data", mo->data, "dataset folder")->required();
  model->add_option("--batch", mo->batch, "sequences per step")->capture_default_str();
  model->add_option("--steps", mo->steps, "timed steps")->capture_default_str();
  model->add_option("--warmup", mo->warmup, "untimed steps first")->capture_default_str();
  model->add_option("--device", mo->device, "cuda or cpu")->capture_default_str();
  model->add_option("--precision", mo->precision,
                    "the ops' type: auto (bf16 on cuda, fp32 on cpu), bf16 or fp16 (cuda), fp32 (cpu)")
      ->capture_default_str();
  model->add_option("--loss-scale", mo->loss_scale,
                    "fixed loss scale: backward of scale * loss, the update divides it out (skipped_steps in the "
                    "JSON counts updates skipped for overflow)")
      ->capture_default_str();
  model->add_option("--workload", mo->workload, "write the timed batches' 'length masked' lines here (for peers)");
  model->add_option("--seed", mo->seed, "init, shuffle and dropout seed")->capture_default_str();
  model->add_option("--dropout", mo->dropout, "dropout probability (default: the config's)");
  model->add_option("--hidden-act", mo->hidden_act,
                    "replace the config's activation: gelu (exact erf) or gelu_new (tanh approximation, fused into "
                    "the GEMMs on the GPU)");
  model->add_option("--lr", mo->lr, "LAMB learning rate")->capture_default_str();
  model->add_option("--threads", mo->threads, "CPU threads for --device cpu (0: all cores)")->capture_default_str();
  model->add_flag("--per-step", mo->per_step, "synchronise after every step and report the median step time");
  model->add_flag("--breakdown", mo->breakdown,
                  "after the timed run, rerun its batches with per-op GPU event timing: a table on stderr and "
                  "breakdown_ms_per_step in the JSON");
  model->add_flag("--graph", mo->graph,
                  "also measure launch overhead: the last timed step run eagerly vs replayed as a CUDA graph "
                  "(graph_experiment in the JSON, with the padding that bucketing T for graphs would add)");
  model->add_option("--balance", mo->balance,
                    "several ranks (mpirun/srun/torchrun; --batch is then per rank): how each global batch is split: "
                    "none, stratified or cost (as dist.balance)")
      ->capture_default_str();
  model->add_option("--cost-per-token", mo->cost_per_token, "several ranks: balancing cost per token (a in a L + b L^2)")
      ->capture_default_str();
  model->add_option("--cost-per-token-sq", mo->cost_per_token_sq,
                    "several ranks: balancing cost per token^2 (b; 0.00062 measured for BERT-large on H200s)")
      ->capture_default_str();
  model->add_option("--reduce", mo->reduce, "several ranks: gradient all-reduce in fp32 or bf16 (as dist.reduce)")
      ->capture_default_str();
  model->add_flag("!--no-overlap", mo->overlap,
                  "several GPUs: one all-reduce after backward instead of per-layer buckets during it");
  model->add_option("--nccl-max-ctas", mo->nccl_max_ctas,
                    "several GPUs: cap on the thread blocks (SMs) of an NCCL all-reduce (as dist.nccl_max_ctas; 0: "
                    "NCCL's own)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  model->callback([mo] {
    const nopad::ModelBenchResult r = nopad::run_model_bench(*mo);
    if (!r.lead) return;  // a multi-rank run reports once, from rank 0
    std::printf("%s\n", r.json.c_str());
    std::fflush(stdout);
  });

  auto ao = std::make_shared<nopad::AttentionBenchOptions>();
  CLI::App* attn = sub.add_subcommand(
      "attention", "fused attention forward/backward time on real lengths, per launch schedule (GPU); one JSON line "
                   "per measurement, a table on stderr");
  attn->add_option("--data", ao->data, "dataset folder: the batches bench model draws with the same --seed");
  attn->add_option("--lengths", ao->lengths, "or a file of 'length [masked]' lines, cut into batches in order");
  attn->add_option("--batch", ao->batch, "sequences per batch")->capture_default_str();
  attn->add_option("--batches", ao->batches, "batches measured")->capture_default_str();
  attn->add_option("--seed", ao->seed, "shuffle seed (--data) and input values")->capture_default_str();
  attn->add_option("--heads", ao->heads, "attention heads")->capture_default_str();
  attn->add_option("--head-dim", ao->head_dim, "head dimension: 32, 64 or 128")->capture_default_str();
  attn->add_option("--precision", ao->precision, "bf16 or fp16")->capture_default_str();
  attn->add_option("--dropout", ao->dropouts, "attention dropout probabilities, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  attn->add_option("--schedules", ao->schedules,
                   "launch schedules, comma-separated: single (one launch in batch order), sorted (one launch, "
                   "longest sequences first), grouped (one launch per length bucket, over --streams streams)")
      ->delimiter(',')
      ->capture_default_str();
  attn->add_option("--streams", ao->streams, "grouped: stream counts to time, comma-separated (1-8)")
      ->delimiter(',')
      ->capture_default_str();
  attn->add_option("--buckets", ao->buckets, "grouped: bucket widths in tokens, comma-separated (multiples of 16)")
      ->delimiter(',')
      ->capture_default_str();
  attn->add_flag("--variants", ao->variants,
                 "also time every kernel variant on each length group (which kernel suits which lengths)");
  attn->add_flag("--bias-grad", ao->bias_grad,
                 "the backward also sums the QKV bias gradient from the d_qkv it writes, as training does");
  attn->add_option("--warmup", ao->warmup, "untimed calls before each measurement")->capture_default_str();
  attn->add_option("--reps", ao->reps, "timed calls per measurement (the median is reported)")->capture_default_str();
  attn->add_option("--workload", ao->workload,
                   "write the batches' 'length masked' lines here (peers/peer_attention.py --lengths)");
  attn->callback([ao] {
    for (const std::string& line : nopad::run_attention_bench(*ao)) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  });
}

NOPAD_REGISTER_COMMAND("bench", "benchmarks: loader, model, attention", 70, setup);

}  // namespace
