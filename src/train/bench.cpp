// The model benchmark: batches, timing loop, FLOP count and report (see bench.h). No CUDA here: the GPU runner is
// reached through gpu_session.h, which is plain C++ and only present in CUDA builds.
#include "train/bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "dist/launch.h"
#include "ops/cpu/cpu_backend.h"

#ifdef NOPAD_HAVE_CUDA
#include "ops/cuda/gpu_session.h"
#endif

namespace nopad {
namespace {

class CpuRunner final : public StepRunner {
 public:
  CpuRunner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked, uint64_t seed,
            const OptimizerOptions& options, int threads, double loss_scale)
      : backend_(threads), model_(config, backend_, max_tokens, max_seqs, max_masked), loss_scale_(loss_scale) {
    model_.init_params(seed);
    std::vector<ParamView> views;
    for (const ParamTensor& t : model_.layout().tensors())
      views.push_back({t.name, model_.params() + t.offset, model_.grads() + t.offset, t.numel, t.no_weight_decay});
    optimizer_ = std::make_unique<Lamb>(std::move(views), options);
  }
  void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) override {
    model_.zero_grad();
    last_ = model_.forward(batch, /*train=*/true, seed, step);
    model_.backward(loss_scale_);
    skipped_ += optimizer_->step(lr, 1.0 / loss_scale_).skipped ? 1 : 0;
  }
  StepResult last_result() override { return last_; }
  int64_t skipped_steps() override { return skipped_; }
  void synchronize() override {}  // the CPU backend is synchronous
  size_t peak_memory_bytes() override {
    rusage u{};
    if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
    return static_cast<size_t>(u.ru_maxrss) * 1024;  // Linux reports KiB; process peak RSS
  }
  std::string device_name() const override { return "cpu"; }

 private:
  ops::CpuBackend<ops::CpuF32> backend_;
  BertModel<ops::CpuF32> model_;
  std::unique_ptr<Lamb> optimizer_;
  double loss_scale_ = 1.0;
  int64_t skipped_ = 0;
  StepResult last_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::vector<int64_t> masked_per_sequence(const HostBatch& b) {
  std::vector<int64_t> counts(static_cast<size_t>(b.num_seqs()), 0);
  for (const int32_t row : b.mlm_positions) {
    const auto it = std::upper_bound(b.cu_seqlens.begin(), b.cu_seqlens.end(), row);
    const auto seq = static_cast<size_t>(it - b.cu_seqlens.begin()) - 1;
    NOPAD_CHECK(row >= 0 && seq < counts.size(), "masked row ", row, " outside the batch");
    ++counts[seq];
  }
  return counts;
}


std::unique_ptr<StepRunner> make_cpu_runner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs,
                                            int32_t max_masked, uint64_t seed, const OptimizerOptions& options,
                                            int threads, double loss_scale) {
  return std::make_unique<CpuRunner>(config, max_tokens, max_seqs, max_masked, seed, options, threads, loss_scale);
}

uint64_t sequence_train_flops(const BertConfig& c, int64_t n, int64_t m) {
  const auto h = static_cast<uint64_t>(c.hidden_size), layers = static_cast<uint64_t>(c.num_hidden_layers),
             ffn = static_cast<uint64_t>(c.intermediate_size), v = static_cast<uint64_t>(c.vocab_size);
  const auto un = static_cast<uint64_t>(n), um = static_cast<uint64_t>(m);
  uint64_t f = un * layers * 2 * (4 * h * h + 2 * h * ffn);
  f += layers * 4 * un * un * h;
  f += um * 2 * (h * h + h * v);
  f += 2 * (h * h + 2 * h);
  return 3 * f;
}

uint64_t batch_train_flops(const BertConfig& config, const HostBatch& b) {
  const std::vector<int64_t> masked = masked_per_sequence(b);
  uint64_t f = 0;
  for (int32_t s = 0; s < b.num_seqs(); ++s)
    f += sequence_train_flops(config, b.cu_seqlens[s + 1] - b.cu_seqlens[s], masked[static_cast<size_t>(s)]);
  return f;
}

ModelBenchResult run_model_bench(const ModelBenchOptions& o) {
  NOPAD_CHECK(o.device == "cuda" || o.device == "cpu", "--device must be cuda or cpu, got \"", o.device, "\"");
  NOPAD_CHECK(o.batch >= 1, "--batch must be at least 1");
  NOPAD_CHECK(o.steps >= 1, "--steps must be at least 1");
  NOPAD_CHECK(o.lr > 0 && std::isfinite(o.lr), "--lr must be positive");
  NOPAD_CHECK(o.dropout < 1, "--dropout must be below 1");
  NOPAD_CHECK(std::isfinite(o.loss_scale) && o.loss_scale > 0, "--loss-scale must be a positive number, got ",
              o.loss_scale);
  NOPAD_CHECK(o.precision == "auto" || o.precision == "fp32" || o.precision == "bf16" || o.precision == "fp16",
              "--precision must be auto, fp32, bf16 or fp16, got \"", o.precision, "\"");
  const std::string precision = o.precision != "auto" ? o.precision : (o.device == "cpu" ? "fp32" : "bf16");
  NOPAD_CHECK(o.device == "cuda" || precision == "fp32", "--precision ", precision,
              " needs --device cuda (the CPU runs fp32)");
  NOPAD_CHECK(o.device == "cpu" || precision != "fp32", "--precision fp32 needs --device cpu (the GPU runs bf16 or "
              "fp16)");
#ifndef NOPAD_HAVE_CUDA
  NOPAD_CHECK(o.device != "cuda", "this nopad was built without the CUDA backend; rebuild with -DNOPAD_CUDA=ON or "
                                  "use --device cpu");
#endif
  BertConfig config = BertConfig::from_file(o.model);
  if (o.dropout >= 0) config.hidden_dropout_prob = config.attention_probs_dropout_prob = o.dropout;
  if (!o.hidden_act.empty()) {
    config.hidden_act = o.hidden_act;
    config.validate();
  }

  if (dist::detect_rank_info().distributed()) {
    NOPAD_CHECK(!o.breakdown && !o.graph && !o.per_step && o.workload.empty(),
                "--breakdown, --graph, --per-step and --workload measure one GPU: run them without mpirun/torchrun");
    NOPAD_CHECK(o.loss_scale == 1.0, "--loss-scale is for one GPU; the multi-rank bench runs bf16 without scaling");
    return run_model_bench_ranks(o, config, precision);
  }

  const Dataset ds(o.data);
  NOPAD_CHECK(o.batch <= ds.size(), "--batch ", o.batch, " is larger than the dataset ", o.data, " (", ds.size(),
              " sequences)");
  NOPAD_CHECK(ds.vocab_size() <= static_cast<uint32_t>(config.vocab_size), "the dataset's vocabulary (",
              ds.vocab_size(), ") is larger than the model's vocab_size (", config.vocab_size, ")");

  // Every batch is built before timing (copies), so the loop times the model, not the loader; and the model is
  // sized exactly for the largest of them.
  LoaderOptions lo;
  lo.global_batch = o.batch;
  lo.seed = o.seed;
  lo.background = false;
  Loader loader(ds, lo);
  const uint64_t total = o.warmup + o.steps;
  std::vector<HostBatch> batches;
  batches.reserve(total);
  int32_t max_tokens = 1, max_seqs = 1, max_masked = 1;
  for (uint64_t i = 0; i < total; ++i) {
    batches.push_back(loader.next());
    const HostBatch& b = batches.back();
    NOPAD_CHECK(b.num_seqs() == static_cast<int32_t>(o.batch), "loader returned ", b.num_seqs(),
                " sequences, expected ", o.batch);
    max_tokens = std::max(max_tokens, b.num_tokens());
    max_seqs = std::max(max_seqs, b.num_seqs());
    max_masked = std::max(max_masked, b.num_masked());
  }

  OptimizerOptions oo;  // LAMB with MLPerf's defaults
  std::unique_ptr<StepRunner> runner;
  if (o.device == "cpu") {
    runner = make_cpu_runner(config, max_tokens, max_seqs, max_masked, o.seed, oo, o.threads, o.loss_scale);
  } else {
#ifdef NOPAD_HAVE_CUDA
    runner = cuda::make_gpu_runner(config, max_tokens, max_seqs, max_masked, o.seed, oo, precision, o.loss_scale);
#endif
  }
  NOPAD_CHECK(runner != nullptr, "no runner for device ", o.device);

  const auto lr = static_cast<float>(o.lr);
  for (uint64_t i = 0; i < o.warmup; ++i) {
    runner->train_step(batches[i], lr, o.seed, i);
    const StepResult r = runner->last_result();  // warm-up may wait: it is not timed
    NOPAD_CHECK(std::isfinite(r.loss), "warm-up step ", i, " gave a non-finite loss (", r.loss, ")");
  }

  using Clock = std::chrono::steady_clock;
  std::vector<double> step_ms;
  double final_loss = 0;
  runner->synchronize();
  EnergyMeter* meter = runner->energy_meter();
  if (meter != nullptr) meter->begin();  // between two synchronisations: the timed steps' work and nothing else
  const auto t0 = Clock::now();
  for (uint64_t i = o.warmup; i < total; ++i) {
    const auto s0 = Clock::now();
    runner->train_step(batches[i], lr, o.seed, i);
    if (o.per_step) {
      runner->synchronize();
      step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
    }
  }
  runner->synchronize();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const EnergyReading energy = meter != nullptr ? meter->end() : EnergyReading{};
  final_loss = runner->last_result().loss;
  const int64_t skipped = runner->skipped_steps();  // warm-up and timed steps whose update was skipped
  NOPAD_CHECK(secs > 0, "timed loop took no time");

  ModelBenchResult res;
  for (uint64_t i = o.warmup; i < total; ++i) {
    res.seqs += static_cast<uint64_t>(batches[i].num_seqs());
    res.tokens += static_cast<uint64_t>(batches[i].num_tokens());
    res.flops += batch_train_flops(config, batches[i]);
  }
  res.step_ms = o.per_step ? median(step_ms) : 1000.0 * secs / static_cast<double>(o.steps);
  res.seqs_per_s = static_cast<double>(res.seqs) / secs;
  res.real_tokens_per_s = static_cast<double>(res.tokens) / secs;
  const double flops_per_s = static_cast<double>(res.flops) / secs;
  res.model_tflops = flops_per_s / 1e12;
  res.mfu = flops_per_s / kPeakBf16Flops;
  res.max_mem_gib = static_cast<double>(runner->peak_memory_bytes()) / (1024.0 * 1024.0 * 1024.0);
  res.final_loss = final_loss;
  res.energy = energy;
  const double joules_per_seq = energy.valid ? energy.joules / static_cast<double>(res.seqs) : 0.0;
  const std::string gpu = runner->device_name();

  // --breakdown: the same timed batches once more with per-op event timing, after (never during) the timed run, so
  // the numbers above are unaffected. Event timing serialises nothing, but adds small gaps between ops, so the
  // event-timed step sum is a little above the plain step time.
  std::vector<std::pair<std::string, double>> breakdown;
  if (o.breakdown) {
    runner->set_breakdown(true);
    for (uint64_t i = o.warmup; i < total; ++i) runner->train_step(batches[i], lr, o.seed, i);
    breakdown = runner->breakdown_ms();  // waits for the queued work
    runner->set_breakdown(false);
    std::stable_sort(breakdown.begin(), breakdown.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
  }

  // --graph: launch overhead. The last timed batch as one fixed step, run eagerly and replayed as a CUDA graph, the
  // same number of times each (identical work: same batch, same dropout masks); and what rounding T up to a bucket
  // (needed to replay graphs on real batches, whose T varies) would add in padded rows over the timed batches.
  nlohmann::ordered_json graph_json;
  if (o.graph) {
    const HostBatch& b = batches[total - 1];
    const uint64_t g_step = total - 1;
    const int reps = static_cast<int>(std::max<uint64_t>(o.steps, 5));
    if (runner->capture_step(b, lr, o.seed, g_step)) {
      auto time_reps = [&](const std::function<void()>& one) {
        one();  // warm
        runner->synchronize();
        const auto t = Clock::now();
        for (int r = 0; r < reps; ++r) one();
        runner->synchronize();
        return std::chrono::duration<double, std::milli>(Clock::now() - t).count() / reps;
      };
      const double eager_ms = time_reps([&] { runner->train_step(b, lr, o.seed, g_step); });
      const double graph_ms = time_reps([&] { runner->replay_captured(); });
      const double eager2_ms = time_reps([&] { runner->train_step(b, lr, o.seed, g_step); });  // drift check
      graph_json["tokens"] = b.num_tokens();
      graph_json["reps"] = reps;
      graph_json["eager_ms"] = 0.5 * (eager_ms + eager2_ms);
      graph_json["eager_ms_spread"] = std::fabs(eager_ms - eager2_ms);
      graph_json["graph_ms"] = graph_ms;
      graph_json["graph_saving"] = 1.0 - graph_ms / (0.5 * (eager_ms + eager2_ms));
    } else {
      graph_json["note"] = "not supported on this device";
    }
    for (const int bucket : {128, 256, 1024}) {
      double padded = 0, real = 0;
      for (uint64_t i = o.warmup; i < total; ++i) {
        const double t = batches[i].num_tokens();
        real += t;
        padded += std::ceil(t / bucket) * bucket;
      }
      graph_json["bucket_" + std::to_string(bucket) + "_padding"] = padded / real - 1.0;
    }
  }

  if (!o.workload.empty()) {
    std::ofstream f(o.workload);
    NOPAD_CHECK(f.good(), "cannot write the workload file ", o.workload);
    for (uint64_t i = o.warmup; i < total; ++i) {
      const HostBatch& b = batches[i];
      const std::vector<int64_t> masked = masked_per_sequence(b);
      for (int32_t s = 0; s < b.num_seqs(); ++s)
        f << (b.cu_seqlens[s + 1] - b.cu_seqlens[s]) << ' ' << masked[static_cast<size_t>(s)] << '\n';
    }
    f.close();
    NOPAD_CHECK(!f.fail(), "error writing the workload file ", o.workload);
  }

  nlohmann::ordered_json j;
  j["bench"] = "model";
  j["device"] = o.device;
  j["precision"] = precision;
  j["loss_scale"] = o.loss_scale;
  j["skipped_steps"] = skipped;
  j["gpu"] = gpu;
  j["model"] = std::filesystem::path(o.model).stem().string();
  j["hidden_act"] = config.hidden_act;
  j["batch"] = o.batch;
  j["steps"] = o.steps;
  j["warmup"] = o.warmup;
  j["step_ms"] = res.step_ms;
  j["step_ms_stat"] = o.per_step ? "median" : "mean";
  j["seqs_per_s"] = res.seqs_per_s;
  j["real_tokens_per_s"] = res.real_tokens_per_s;
  j["model_tflops"] = res.model_tflops;
  j["mfu"] = res.mfu;
  j["max_mem_gib"] = res.max_mem_gib;
  j["final_loss"] = res.final_loss;  // a non-finite loss is written as null
  j["mean_length"] = static_cast<double>(res.tokens) / static_cast<double>(res.seqs);
  if (energy.valid) {  // the board's energy counter over the timed steps, and the SM clock they ran at
    j["power_w"] = energy.watts();
    j["energy_j_per_seq"] = joules_per_seq;
    j["sm_clock_mhz"] = energy.sm_mhz;
    j["power_capped"] = energy.power_capped;
  }
  if (o.graph) j["graph_experiment"] = graph_json;
  if (o.breakdown) {
    nlohmann::ordered_json per_step = nlohmann::ordered_json::object();
    for (const auto& [name, ms] : breakdown) per_step[name] = ms / static_cast<double>(o.steps);
    j["breakdown_ms_per_step"] = per_step;
  }
  res.json = j.dump();

  std::fprintf(stderr,
               "bench model: %s on %s (%s, %s), batch %llu, %llu timed steps after %llu warm-up\n"
               "  step_ms %10.2f (%s)   seqs/s %10.1f   real tokens/s %12.0f\n"
               "  model TFLOP/s %7.1f   MFU %5.1f%%   peak memory %.2f GiB   final loss %.4f\n",
               j["model"].get<std::string>().c_str(), gpu.c_str(), o.device.c_str(), precision.c_str(),
               static_cast<unsigned long long>(o.batch), static_cast<unsigned long long>(o.steps),
               static_cast<unsigned long long>(o.warmup), res.step_ms, o.per_step ? "median" : "mean",
               res.seqs_per_s, res.real_tokens_per_s, res.model_tflops, 100.0 * res.mfu, res.max_mem_gib,
               res.final_loss);
  if (energy.valid)
    std::fprintf(stderr, "  power %.0f W   energy %.3f J/sequence   SM clock %.0f MHz   power cap holding the clock in "
                 "%.0f%% of %d samples\n", energy.watts(), joules_per_seq, energy.sm_mhz,
                 100.0 * energy.power_capped, energy.samples);
  else if (meter != nullptr)
    std::fprintf(stderr, "  no energy reading: %s\n",
                 meter->available() ? "the energy counter could not be read" : meter->why_unavailable().c_str());
  if (!std::isfinite(final_loss)) std::fprintf(stderr, "  WARNING: the last timed step's loss is not finite\n");
  if (skipped > 0)
    std::fprintf(stderr, "  WARNING: %lld of %llu steps skipped their update (gradients not finite: lower "
                 "--loss-scale)\n", static_cast<long long>(skipped), static_cast<unsigned long long>(total));
  if (o.breakdown) {
    double sum = 0;
    for (const auto& op : breakdown) sum += op.second;
    if (breakdown.empty()) {
      std::fprintf(stderr, "  no per-op breakdown on device %s\n", o.device.c_str());
    } else {
      std::fprintf(stderr, "  per-op breakdown (event-timed rerun of the %llu timed steps; %.2f ms/step summed):\n",
                   static_cast<unsigned long long>(o.steps), sum / static_cast<double>(o.steps));
      std::fprintf(stderr, "  %-28s %12s %10s %7s\n", "op", "total ms", "ms/step", "%");
      for (const auto& [name, ms] : breakdown)
        std::fprintf(stderr, "  %-28s %12.3f %10.3f %6.1f%%\n", name.c_str(), ms, ms / static_cast<double>(o.steps),
                     sum > 0 ? 100.0 * ms / sum : 0.0);
    }
  }
  return res;
}

}  // namespace nopad
