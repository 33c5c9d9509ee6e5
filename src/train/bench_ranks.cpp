// `nopad bench model` on several ranks (contract in bench.h): the data-parallel step of nopad train, timed per rank.
//
// Every rank draws the same global batches (batch x ranks sequences, same seed), the balancer gives each rank its
// share (at most --batch sequences, so each rank trains exactly --batch), and all batches are built before timing.
// A step is the trainer's: zero_grad, one micro-step with the global batch's loss denominators, the gradient sum over
// the ranks (NCCL buckets during backward on GPUs, MPI on CPUs), the LAMB update; the host reads step N after
// enqueueing step N+1, as nopad train does, so the device never waits for the host between steps. Per-rank times come
// from the engine's StepOutcome (CUDA events on a GPU, wall time on the CPU) and are gathered on rank 0 at the end.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "dist/balance.h"
#include "dist/comm.h"
#include "dist/launch.h"
#include "train/bench.h"
#include "train/engine.h"

namespace nopad {

ModelBenchResult run_model_bench_ranks(const ModelBenchOptions& o, const BertConfig& config,
                                       const std::string& precision) {
  const dist::RankInfo info = dist::detect_rank_info();
  std::unique_ptr<dist::Communicator> comm = dist::make_communicator(info);
  const int rank = comm->rank(), world = comm->size();
  const bool lead = rank == 0;
  NOPAD_CHECK(o.reduce == "fp32" || o.reduce == "bf16", "--reduce must be fp32 or bf16, got \"", o.reduce, "\"");
  const dist::BalanceMode mode = dist::parse_balance_mode(o.balance);
  const dist::CostModel cost{o.cost_per_token, o.cost_per_token_sq};
  NOPAD_CHECK(std::isfinite(cost.per_token) && std::isfinite(cost.per_token_sq) && cost.per_token >= 0 &&
                  cost.per_token_sq >= 0 && cost.per_token + cost.per_token_sq > 0,
              "--cost-per-token and --cost-per-token-sq must be >= 0 and not both 0");
  // Ranks that disagree on what they run would hang in the first collective: refuse instead.
  const std::string what = o.model + "|" + o.data + "|" + std::to_string(o.batch) + "|" + std::to_string(o.steps) +
                           "|" + std::to_string(o.warmup) + "|" + std::to_string(o.seed) + "|" + o.device + "|" +
                           precision + "|" + o.balance + "|" + std::to_string(o.cost_per_token) + "|" +
                           std::to_string(o.cost_per_token_sq) + "|" + o.reduce + "|" + std::to_string(o.overlap) +
                           "|" + std::to_string(o.nccl_max_ctas) + "|" + std::to_string(o.dropout) + "|" +
                           config.hidden_act + "|" + std::to_string(o.lr);
  dist::check_same_on_all_ranks(*comm, dist::hash_string(what), "the bench options");

  const Dataset ds(o.data);
  const uint64_t global_batch = o.batch * static_cast<uint64_t>(world);
  NOPAD_CHECK(global_batch <= ds.size(), "--batch ", o.batch, " x ", world, " ranks is larger than the dataset ",
              o.data, " (", ds.size(), " sequences)");
  NOPAD_CHECK(ds.vocab_size() <= static_cast<uint32_t>(config.vocab_size), "the dataset's vocabulary (",
              ds.vocab_size(), ") is larger than the model's vocab_size (", config.vocab_size, ")");

  LoaderOptions lo;
  lo.global_batch = global_batch;
  lo.seed = o.seed;
  lo.background = false;
  lo.rank = rank;
  lo.world_size = world;
  Loader loader(ds, lo, std::make_shared<dist::BalancedAssigner>(mode, cost, static_cast<int>(o.batch)));
  const uint64_t total = o.warmup + o.steps;
  std::vector<HostBatch> batches;
  std::vector<LossDenominators> denoms;
  batches.reserve(total);
  int32_t max_tokens = 1, max_seqs = 1, max_masked = 1;
  uint64_t timed_seqs = 0, timed_tokens = 0, timed_flops = 0;  // this rank's share of the timed batches
  for (uint64_t i = 0; i < total; ++i) {
    batches.push_back(loader.next());
    const HostBatch& b = batches.back();
    std::array<int64_t, 2> counts = {b.num_masked(), b.num_seqs()};
    comm->all_reduce_sum(std::span<int64_t>(counts));
    NOPAD_CHECK(counts[1] == static_cast<int64_t>(global_batch), "the ranks drew ", counts[1],
                " sequences for a global batch of ", global_batch);
    denoms.push_back({std::max(1.0, static_cast<double>(counts[0])), static_cast<double>(counts[1])});
    max_tokens = std::max(max_tokens, b.num_tokens());
    max_seqs = std::max(max_seqs, b.num_seqs());
    max_masked = std::max(max_masked, b.num_masked());
    if (i >= o.warmup) {
      timed_seqs += static_cast<uint64_t>(b.num_seqs());
      timed_tokens += static_cast<uint64_t>(b.num_tokens());
      timed_flops += batch_train_flops(config, b);
    }
  }

  EngineOptions eo;
  eo.config = config;
  eo.max_tokens = max_tokens;
  eo.max_seqs = max_seqs;
  eo.max_masked = max_masked;
  eo.precision = precision;
  eo.threads = o.threads;
  eo.device = info.local_rank;
  eo.world_size = world;
  eo.overlap_grad_reduce = o.overlap;
  eo.reduce_bf16 = o.reduce == "bf16";
  eo.nccl_max_ctas = o.nccl_max_ctas;
  std::unique_ptr<TrainEngine> engine = make_engine(o.device, eo);
  engine->init_params(o.seed);
  engine->connect(*comm);
  if (lead)
    std::fprintf(stderr, "bench model: %d ranks (%s), %s, %llu sequences per rank, balance %s, gradients summed in "
                 "%s%s\n", world, info.launcher.c_str(), engine->device_name().c_str(),
                 static_cast<unsigned long long>(o.batch), dist::balance_mode_name(mode), o.reduce.c_str(),
                 o.device == "cuda" ? (o.overlap ? " during backward" : " after backward") : "");

  const double lr = o.lr;
  auto enqueue = [&](uint64_t i) {
    engine->zero_grad();
    if (batches[i].num_seqs() > 0) engine->micro_step(batches[i], o.seed, i, denoms[i], 1.0, true);
    engine->reduce_gradients(*comm);
    engine->optimizer_step(lr, 1.0);
  };
  for (uint64_t i = 0; i < o.warmup; ++i) {
    enqueue(i);
    const StepOutcome out = engine->finish_step();  // warm-up waits: it is not timed
    NOPAD_CHECK(std::isfinite(out.result.loss), "warm-up step ", i, " gave a non-finite loss (", out.result.loss, ")");
  }
  comm->barrier();

  using Clock = std::chrono::steady_clock;
  std::vector<double> compute_ms, reduce_ms;
  StepOutcome last;
  int64_t skipped = 0;
  auto read_one = [&] {
    last = engine->finish_step();
    compute_ms.push_back(last.compute_ms);
    reduce_ms.push_back(last.reduce_ms);
    skipped += last.stats.skipped ? 1 : 0;
  };
  const auto t0 = Clock::now();
  for (uint64_t i = o.warmup; i < total; ++i) {
    enqueue(i);
    if (i > o.warmup) read_one();  // step i-1, while the device works on step i
  }
  read_one();
  std::array<double, 1> secs = {std::chrono::duration<double>(Clock::now() - t0).count()};
  comm->all_reduce_max(std::span<double>(secs));  // the job's time: its slowest rank

  // Gather every rank's per-step times and totals on every rank (small: 2 doubles per step).
  const size_t n = compute_ms.size();
  std::vector<double> mine(2 * n + 3);
  std::copy(compute_ms.begin(), compute_ms.end(), mine.begin());
  std::copy(reduce_ms.begin(), reduce_ms.end(), mine.begin() + static_cast<std::ptrdiff_t>(n));
  mine[2 * n] = static_cast<double>(timed_seqs);
  mine[2 * n + 1] = static_cast<double>(timed_tokens);
  mine[2 * n + 2] = static_cast<double>(timed_flops);
  std::vector<uint8_t> all_bytes(mine.size() * sizeof(double) * static_cast<size_t>(world));
  comm->all_gather(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(mine.data()), mine.size() * sizeof(double)),
                   all_bytes);
  std::vector<double> all(mine.size() * static_cast<size_t>(world));
  std::memcpy(all.data(), all_bytes.data(), all_bytes.size());
  auto at = [&](int r, size_t k) { return all[static_cast<size_t>(r) * mine.size() + k]; };

  ModelBenchResult res;
  res.lead = lead;
  double step_max_sum = 0, step_mean_sum = 0, imbalance_sum = 0, reduce_mean_sum = 0, reduce_max_sum = 0;
  for (size_t s = 0; s < n; ++s) {
    double mx = 0, sum = 0, rmx = 0, rsum = 0;
    for (int r = 0; r < world; ++r) {
      mx = std::max(mx, at(r, s));
      sum += at(r, s);
      rmx = std::max(rmx, at(r, n + s));
      rsum += at(r, n + s);
    }
    const double mean = sum / world;
    step_max_sum += mx;
    step_mean_sum += mean;
    imbalance_sum += mean > 0 ? mx / mean : 1.0;
    reduce_mean_sum += rsum / world;
    reduce_max_sum += rmx;
  }
  for (int r = 0; r < world; ++r) {
    res.seqs += static_cast<uint64_t>(at(r, 2 * n));
    res.tokens += static_cast<uint64_t>(at(r, 2 * n + 1));
    res.flops += static_cast<uint64_t>(at(r, 2 * n + 2));
  }
  const double s_total = secs[0];
  NOPAD_CHECK(s_total > 0, "timed loop took no time");
  res.step_ms = 1000.0 * s_total / static_cast<double>(o.steps);
  res.seqs_per_s = static_cast<double>(res.seqs) / s_total;
  res.real_tokens_per_s = static_cast<double>(res.tokens) / s_total;
  res.model_tflops = static_cast<double>(res.flops) / s_total / 1e12;
  res.mfu = static_cast<double>(res.flops) / s_total / (kPeakBf16Flops * world);
  res.final_loss = last.result.loss;
  const double dn = static_cast<double>(n);

  nlohmann::ordered_json j;
  j["bench"] = "model";
  j["device"] = o.device;
  j["precision"] = engine->precision();
  j["gpu"] = engine->device_name();
  j["model"] = std::filesystem::path(o.model).stem().string();
  j["hidden_act"] = config.hidden_act;
  j["ranks"] = world;
  j["launcher"] = info.launcher;
  j["batch"] = o.batch;  // per rank
  j["global_batch"] = global_batch;
  j["balance"] = dist::balance_mode_name(mode);
  j["reduce"] = o.reduce;
  j["overlap"] = o.overlap;
  j["nccl_max_ctas"] = o.nccl_max_ctas;
  j["steps"] = o.steps;
  j["warmup"] = o.warmup;
  j["step_ms"] = res.step_ms;
  j["seqs_per_s"] = res.seqs_per_s;
  j["seqs_per_s_per_rank"] = res.seqs_per_s / world;
  j["real_tokens_per_s"] = res.real_tokens_per_s;
  j["model_tflops"] = res.model_tflops;
  j["mfu"] = res.mfu;
  j["compute_ms"] = step_mean_sum / dn;      // per step: mean over ranks, then over steps
  j["compute_ms_max"] = step_max_sum / dn;   // per step: the slowest rank, then the mean over steps
  j["compute_imbalance"] = imbalance_sum / dn;  // per step: max / mean over ranks, then the mean over steps
  j["reduce_ms"] = reduce_mean_sum / dn;     // after backward: exposed communication plus waiting for slower ranks
  j["reduce_ms_max"] = reduce_max_sum / dn;
  j["skipped_steps"] = skipped;
  j["final_loss"] = res.final_loss;
  j["mean_length"] = static_cast<double>(res.tokens) / static_cast<double>(std::max<uint64_t>(1, res.seqs));
  nlohmann::ordered_json per_rank = nlohmann::ordered_json::array();
  for (int r = 0; r < world; ++r) {
    double c = 0, red = 0;
    for (size_t s = 0; s < n; ++s) {
      c += at(r, s);
      red += at(r, n + s);
    }
    per_rank.push_back({{"rank", r}, {"compute_ms", c / dn}, {"reduce_ms", red / dn},
                        {"tokens", static_cast<uint64_t>(at(r, 2 * n + 1))}});
  }
  j["per_rank"] = per_rank;
  res.json = j.dump();

  if (lead) {
    std::fprintf(stderr,
                 "  step_ms %10.2f   seqs/s %10.1f (%.1f per rank)   model TFLOP/s %7.1f   MFU %5.1f%%   final loss "
                 "%.4f\n  compute per step: %.2f ms mean rank, %.2f ms slowest (max/mean %.4f); gradient reduction "
                 "after backward %.2f ms mean, %.2f ms max\n  %-6s %12s %12s %14s\n",
                 res.step_ms, res.seqs_per_s, res.seqs_per_s / world, res.model_tflops, 100.0 * res.mfu,
                 res.final_loss, step_mean_sum / dn, step_max_sum / dn, imbalance_sum / dn, reduce_mean_sum / dn,
                 reduce_max_sum / dn, "rank", "compute ms", "reduce ms", "tokens/step");
    for (const auto& pr : per_rank)
      std::fprintf(stderr, "  %-6d %12.2f %12.2f %14.1f\n", pr["rank"].get<int>(), pr["compute_ms"].get<double>(),
                   pr["reduce_ms"].get<double>(), static_cast<double>(pr["tokens"].get<uint64_t>()) / dn);
    if (skipped > 0) std::fprintf(stderr, "  WARNING: %lld timed steps skipped their update\n",
                                  static_cast<long long>(skipped));
  }
  return res;
}

}  // namespace nopad
