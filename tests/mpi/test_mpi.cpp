// Multi-process tests of data-parallel training's host side, run under mpirun with 1, 2 and 4 ranks (CTest entries
// mpi.np1, mpi.np2, mpi.np4): the MPI communicator's collectives, the config-agreement check, the sample exchange
// (every sample arrives exactly once, at its rank), and the core equality of data parallelism: N ranks, each running
// its share of one global batch with the global loss denominators and summing gradients with an all-reduce, give the
// same loss and gradients as one process running the whole batch (dropout on: its masks are keyed by sample id, so
// they do not depend on which rank a sequence lands on), for every balancing mode.
// A failure on any rank makes mpirun exit non-zero; only rank 0 prints GoogleTest's report.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/io.h"
#include "data/dataset.h"
#include "data/instance.h"
#include "data/loader.h"
#include "data/shard.h"
#include "dist/balance.h"
#include "dist/comm.h"
#include "dist/partitioned.h"
#include "model/bert.h"
#include "ops/cpu/cpu_backend.h"
#include "train/engine.h"
#include "support/batches.h"

namespace nopad::dist {
namespace {

Communicator* g_comm = nullptr;

TEST(Mpi, RankInfoMatchesTheLauncher) {
  const RankInfo info = detect_rank_info();
  EXPECT_EQ(info.rank, g_comm->rank());
  EXPECT_EQ(info.world_size, g_comm->size());
  EXPECT_EQ(g_comm->name(), "mpi");
}

TEST(Mpi, Collectives) {
  Communicator& c = *g_comm;
  const int r = c.rank(), n = c.size();
  std::vector<float> f = {1.0f + r, 0.5f * r, -2.0f};
  c.all_reduce_sum(f);
  EXPECT_FLOAT_EQ(f[0], n + n * (n - 1) / 2.0f);
  EXPECT_FLOAT_EQ(f[1], 0.5f * n * (n - 1) / 2.0f);
  EXPECT_FLOAT_EQ(f[2], -2.0f * n);
  std::vector<double> d(1000);
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(i) * (r + 1);
  c.all_reduce_sum(d);
  for (size_t i = 0; i < d.size(); i += 97) EXPECT_DOUBLE_EQ(d[i], static_cast<double>(i) * n * (n + 1) / 2);
  std::vector<int64_t> k = {int64_t{1} << 40, r};
  c.all_reduce_sum(k);
  EXPECT_EQ(k[0], (int64_t{1} << 40) * n);
  EXPECT_EQ(k[1], int64_t{n} * (n - 1) / 2);
  std::vector<double> mx = {static_cast<double>(r), -static_cast<double>(r)};
  c.all_reduce_max(mx);
  EXPECT_EQ(mx[0], n - 1);
  EXPECT_EQ(mx[1], 0);

  const uint8_t mine[3] = {static_cast<uint8_t>(r), static_cast<uint8_t>(2 * r), 7};
  std::vector<uint8_t> all(3 * static_cast<size_t>(n), 0xEE);
  c.all_gather(mine, all);
  for (int q = 0; q < n; ++q) {
    EXPECT_EQ(all[3 * q], q);
    EXPECT_EQ(all[3 * q + 1], 2 * q);
    EXPECT_EQ(all[3 * q + 2], 7);
  }
  std::vector<uint8_t> b(5, static_cast<uint8_t>(r == n - 1 ? 42 : 0));
  c.broadcast(b, n - 1);
  for (const uint8_t v : b) EXPECT_EQ(v, 42);

  // All-to-all with uneven counts: rank r sends q + r bytes (value 10 r + q) to rank q, including 0 bytes.
  std::vector<size_t> send_bytes(static_cast<size_t>(n));
  std::vector<uint8_t> send;
  for (int q = 0; q < n; ++q) {
    send_bytes[q] = static_cast<size_t>(q + r);
    send.insert(send.end(), send_bytes[q], static_cast<uint8_t>(10 * r + q));
  }
  std::vector<uint8_t> recv;
  std::vector<size_t> recv_bytes;
  c.all_to_all_v(send, send_bytes, recv, recv_bytes);
  ASSERT_EQ(recv_bytes.size(), static_cast<size_t>(n));
  size_t at = 0;
  for (int q = 0; q < n; ++q) {
    ASSERT_EQ(recv_bytes[q], static_cast<size_t>(r + q)) << "from rank " << q;
    for (size_t i = 0; i < recv_bytes[q]; ++i) EXPECT_EQ(recv[at + i], 10 * q + r);
    at += recv_bytes[q];
  }
  EXPECT_EQ(at, recv.size());
  c.barrier();
}

TEST(Mpi, ConfigMismatchIsRefusedOnEveryRank) {
  Communicator& c = *g_comm;
  EXPECT_NO_THROW(check_same_on_all_ranks(c, hash_string("bert-large, batch 448"), "the config"));
  if (c.size() == 1) return;
  const std::string mine = c.rank() == c.size() - 1 ? "bert-large, batch 447" : "bert-large, batch 448";
  try {
    check_same_on_all_ranks(c, hash_string(mine), "the config");
    ADD_FAILURE() << "rank " << c.rank() << ": a config that differs on the last rank was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the config differs between ranks"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(c.size() - 1)), std::string::npos) << "names the rank: " << msg;
  }
}

TEST(Mpi, ExchangeDeliversEverySampleOnceToItsRank) {
  Communicator& c = *g_comm;
  const int r = c.rank(), n = c.size();
  constexpr uint64_t kSamples = 97;
  // Rank r holds samples r, r + n, ...; payload of sample i: (i % 13) + 1 bytes of value i % 251. Destination: a
  // scrambled rank, so most samples move.
  std::vector<uint64_t> ids;
  std::vector<int32_t> dest;
  std::vector<uint8_t> payload;
  std::vector<size_t> offsets = {0};
  const auto dest_of = [n](uint64_t i) { return static_cast<int32_t>((i * 7 + 3) % static_cast<uint64_t>(n)); };
  for (uint64_t i = static_cast<uint64_t>(r); i < kSamples; i += static_cast<uint64_t>(n)) {
    ids.push_back(i);
    dest.push_back(dest_of(i));
    payload.insert(payload.end(), i % 13 + 1, static_cast<uint8_t>(i % 251));
    offsets.push_back(payload.size());
  }
  const SampleExchange got = exchange_samples(c, ids, dest, payload, offsets);
  ASSERT_EQ(got.offsets.size(), got.ids.size() + 1);
  std::vector<uint64_t> expect;
  for (uint64_t i = 0; i < kSamples; ++i)
    if (dest_of(i) == r) expect.push_back(i);
  EXPECT_EQ(got.ids, expect);
  for (size_t k = 0; k < got.ids.size(); ++k) {
    const uint64_t i = got.ids[k];
    ASSERT_EQ(got.offsets[k + 1] - got.offsets[k], i % 13 + 1) << "sample " << i;
    for (size_t b = got.offsets[k]; b < got.offsets[k + 1]; ++b) ASSERT_EQ(got.payload[b], i % 251);
  }
  std::vector<int64_t> total = {static_cast<int64_t>(got.ids.size())};
  c.all_reduce_sum(total);
  EXPECT_EQ(total[0], static_cast<int64_t>(kSamples));
}

// One global batch of 12 sequences; each rank runs the sequences the balancing plan gives it (lengths are the same on
// every rank, so the plan is), with the global denominators; gradients all-reduced. Every rank also runs the whole
// batch alone: the two must agree to float summation-order rounding.
// A global batch of 12 sequences (ids from first_id, contents from seed) and this rank's share of it under the
// balancing plan (lengths are the same on every rank, so the plan is), with the global loss denominators.
struct Share {
  HostBatch full, part;
  bool empty = true;
  LossDenominators denoms;
};
Share my_share(const Communicator& c, const BertConfig& cfg, BalanceMode mode, uint64_t first_id, uint64_t seed) {
  const std::vector<int> lengths = {9, 3, 12, 5, 1, 7, 11, 2, 8, 6, 10, 4};
  std::vector<uint64_t> ids(lengths.size());
  std::iota(ids.begin(), ids.end(), first_id);
  Share s;
  s.full = test_support::make_batch(lengths, ids, cfg.vocab_size, seed);
  std::vector<int32_t> lens32(lengths.begin(), lengths.end());
  BalancePlan plan;
  plan_balance(lens32, c.size(), mode, CostModel{}, 0, plan);
  std::vector<int> mine;
  for (size_t i = 0; i < lengths.size(); ++i)
    if (plan.rank_of[i] == c.rank()) mine.push_back(static_cast<int>(i));
  s.part = test_support::select_batch(s.full, mine);
  s.empty = mine.empty();
  s.denoms = {static_cast<double>(s.full.num_masked()), static_cast<double>(s.full.num_seqs())};
  return s;
}

void expect_data_parallel_equals_one_process(BalanceMode mode) {
  Communicator& c = *g_comm;
  const BertConfig cfg = test_support::small_config();
  const Share share = my_share(c, cfg, mode, 1000, 77);
  const HostBatch& full = share.full;
  ops::CpuBackend<ops::CpuF32> backend(1);
  BertModel<ops::CpuF32> model(cfg, backend, 128, 12, 64);
  model.init_params(5);
  const size_t np = model.num_params();

  model.zero_grad();
  const StepResult whole = model.forward(full, /*train=*/true, 3, 41);
  model.backward();
  std::vector<float> g_whole(np), g_dp(np);
  model.get_grads(g_whole.data());

  model.zero_grad();
  StepResult r = share.empty ? StepResult{} : model.forward(share.part, true, 3, 41, share.denoms);
  if (!share.empty) model.backward();
  model.get_grads(g_dp.data());
  c.all_reduce_sum(g_dp);
  std::vector<double> loss = {r.loss};
  c.all_reduce_sum(loss);
  std::vector<int64_t> correct = {r.mlm_correct};
  c.all_reduce_sum(correct);

  EXPECT_NEAR(loss[0], whole.loss, 1e-5 * std::fabs(whole.loss)) << balance_mode_name(mode);
  EXPECT_EQ(correct[0], whole.mlm_correct);
  double max_g = 0;
  for (const float g : g_whole) max_g = std::max(max_g, std::fabs(static_cast<double>(g)));
  ASSERT_GT(max_g, 0.0);
  int bad = 0;
  for (size_t i = 0; i < np; ++i)
    if (!(std::fabs(static_cast<double>(g_whole[i]) - g_dp[i]) <= 1e-5 * max_g) && bad++ < 5)
      ADD_FAILURE() << balance_mode_name(mode) << ", rank " << c.rank() << ": param " << i << " one process "
                    << g_whole[i] << ", " << c.size() << " ranks " << g_dp[i];
  EXPECT_EQ(bad, 0);
}
TEST(Mpi, DataParallelEqualsOneProcessNoBalancing) { expect_data_parallel_equals_one_process(BalanceMode::kNone); }
TEST(Mpi, DataParallelEqualsOneProcessStratified) {
  expect_data_parallel_equals_one_process(BalanceMode::kStratified);
}
TEST(Mpi, DataParallelEqualsOneProcessCostBalanced) { expect_data_parallel_equals_one_process(BalanceMode::kCost); }

// dist.reduce = bf16 through the CPU engine: the same step on every rank's share with fp32 and with bf16 reduction.
// The bf16 sum is the rounding of the fp32 sum of rounded shares, so the gradient norm agrees with fp32's to a few
// bf16 ulps but not bit for bit (the rounding happened), and every rank ends with the same weights.
TEST(Mpi, Bf16GradientReductionRoundsAndKeepsRanksIdentical) {
  Communicator& c = *g_comm;
  const BertConfig cfg = test_support::small_config();
  const Share share = my_share(c, cfg, BalanceMode::kCost, 2000, 78);

  auto run = [&](bool bf16, std::vector<float>& weights) {
    EngineOptions o;
    o.config = cfg;
    o.max_tokens = 128;
    o.max_seqs = 12;
    o.max_masked = 64;
    o.threads = 1;
    o.world_size = c.size();
    o.reduce_bf16 = bf16;
    auto e = make_cpu_engine(o);
    e->init_params(5);
    e->connect(c);
    e->zero_grad();
    if (!share.empty) e->micro_step(share.part, 3, 0, share.denoms);
    e->reduce_gradients(c);
    e->optimizer_step(1e-2, 1.0);
    const StepOutcome out = e->finish_step();
    e->get_params(weights);
    return out;
  };
  std::vector<float> w32, w16;
  const StepOutcome o32 = run(false, w32), o16 = run(true, w16);
  ASSERT_FALSE(o32.stats.skipped);
  ASSERT_FALSE(o16.stats.skipped);
  const double n32 = o32.stats.grad_norm, n16 = o16.stats.grad_norm;
  ASSERT_GT(n32, 0.0);
  EXPECT_NEAR(n16, n32, n32 / 64) << "bf16 has 8 significant bits";
  EXPECT_NE(n16, n32) << "the bf16 reduction left the gradients as they were";
  EXPECT_NEAR(o16.result.loss, o32.result.loss, 1e-12 * std::fabs(o32.result.loss)) << "the forward is the same";
  // Same bits on every rank: all-gather a hash of the weights.
  const uint64_t h = hash_bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(w16.data()),
                                                         w16.size() * sizeof(float)));
  std::vector<uint8_t> all(sizeof h * static_cast<size_t>(c.size()));
  c.all_gather(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof h), all);
  for (int r = 0; r < c.size(); ++r)
    EXPECT_EQ(0, std::memcmp(all.data() + sizeof h * static_cast<size_t>(r), &h, sizeof h)) << "rank " << r;
  double max_diff = 0, max_w = 0;
  for (size_t i = 0; i < w32.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(w16[i]) - w32[i]));
    max_w = std::max(max_w, std::fabs(static_cast<double>(w32[i])));
  }
  EXPECT_GT(max_diff, 0.0) << "the update did not see the rounding";
  EXPECT_LT(max_diff, 1e-2 * max_w);
}

// data.placement = partitioned: a dataset of 7 shards of random samples (rank 0 writes it), every rank then opens a
// folder holding only its shards (shard i on rank i % ranks) plus the manifest. PartitionedLoader must build exactly
// the batches Loader + BalancedAssigner build from the whole dataset on one disk, in every balancing mode, across an
// epoch boundary; the sample counts add up; a rank whose folder lacks one of its shards is refused by name.
TEST(Mpi, PartitionedDataBuildsTheBatchesOfTheSharedDataset) {
  Communicator& c = *g_comm;
  const int rank = c.rank(), world = c.size();
  // A folder every rank agrees on: rank 0's name, broadcast.
  std::string root(256, '\0');
  if (rank == 0) {
    const std::string name = (std::filesystem::temp_directory_path() /
                              ("nopad-mpi-partitioned-" + std::to_string(::getpid()))).string();
    std::copy(name.begin(), name.end(), root.begin());
  }
  c.broadcast(std::span<uint8_t>(reinterpret_cast<uint8_t*>(root.data()), root.size()), 0);
  root.resize(root.find('\0'));
  const std::filesystem::path full = std::filesystem::path(root) / "full";
  constexpr int kShards = 7, kVocab = 50;
  if (rank == 0) {
    std::filesystem::create_directories(full);
    std::mt19937 rng(9);
    for (int s = 0; s < kShards; ++s) {
      char name[32];
      std::snprintf(name, sizeof name, "shard_%05d.nopad", s);
      ShardWriter w(full / name, kVocab, 1234);
      for (int k = 0; k < 5 + 3 * s; ++k) {  // uneven shard sizes
        Instance in;
        const int n = 2 + static_cast<int>(rng() % 40);
        for (int i = 0; i < n; ++i) in.tokens.push_back(static_cast<int32_t>(rng() % kVocab));
        in.a_length = 2 + static_cast<int32_t>(rng() % static_cast<unsigned>(n - 1));
        for (int i = 0; i < n; i += 1 + static_cast<int>(rng() % 5)) {
          in.mlm_positions.push_back(i);
          in.mlm_labels.push_back(static_cast<int32_t>(rng() % kVocab));
        }
        in.nsp_label = static_cast<int32_t>(rng() % 2);
        w.add(in);
      }
      w.finish();
    }
    write_file_atomic(full / "dataset.json", "{\"format\": \"nopad-shards\", \"num_shards\": " + std::to_string(kShards) +
                                          "}\n");
    for (int r = 0; r < world; ++r) {  // rank r's disk: its shards and the manifest
      const std::filesystem::path mine = std::filesystem::path(root) / ("rank" + std::to_string(r));
      std::filesystem::create_directories(mine);
      std::filesystem::copy_file(full / "dataset.json", mine / "dataset.json");
      for (int s = r; s < kShards; s += world) {
        char name[32];
        std::snprintf(name, sizeof name, "shard_%05d.nopad", s);
        std::filesystem::copy_file(full / name, mine / name);
      }
    }
    std::filesystem::create_directories(std::filesystem::path(root) / "manifest-only");
    std::filesystem::copy_file(full / "dataset.json", std::filesystem::path(root) / "manifest-only" / "dataset.json");
  }
  c.barrier();

  const Dataset shared(full);
  const PartitionedData part(std::filesystem::path(root) / ("rank" + std::to_string(rank)), c);
  EXPECT_EQ(part.size(), shared.size());
  EXPECT_EQ(part.num_shards(), static_cast<size_t>(kShards));
  EXPECT_EQ(part.vocab_size(), static_cast<uint32_t>(kVocab));
  EXPECT_EQ(part.max_seq_length(), shared.max_seq_length());
  uint32_t most_masked = 0;
  for (uint64_t i = 0; i < shared.size(); ++i) most_masked = std::max(most_masked, shared.num_masked(i));
  EXPECT_EQ(part.max_masked(), most_masked);
  std::vector<int64_t> local = {static_cast<int64_t>(part.local_samples())};
  c.all_reduce_sum(std::span<int64_t>(local));
  EXPECT_EQ(local[0], static_cast<int64_t>(shared.size())) << "every sample held by exactly one rank";

  for (const BalanceMode mode : {BalanceMode::kNone, BalanceMode::kStratified, BalanceMode::kCost}) {
    LoaderOptions lo;
    lo.global_batch = 12;
    lo.seed = 5;
    lo.background = false;
    lo.rank = rank;
    lo.world_size = world;
    const int per_rank = (12 + world - 1) / world;
    Loader reference(shared, lo, std::make_shared<BalancedAssigner>(mode, CostModel{1.0, 0.01}, per_rank));
    PartitionedLoader loader(part, c, lo, mode, CostModel{1.0, 0.01}, per_rank);
    for (int step = 0; step < 20; ++step) {  // 20 x 12 > the 84 samples: crosses epochs
      const HostBatch& want = reference.next();
      const HostBatch& got = loader.next();
      SCOPED_TRACE(std::string(balance_mode_name(mode)) + ", rank " + std::to_string(rank) + ", step " +
                   std::to_string(step));
      EXPECT_EQ(got.sample_ids, want.sample_ids);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.positions, want.positions);
      EXPECT_EQ(got.segments, want.segments);
      EXPECT_EQ(got.cu_seqlens, want.cu_seqlens);
      EXPECT_EQ(got.max_seqlen, want.max_seqlen);
      EXPECT_EQ(got.mlm_positions, want.mlm_positions);
      EXPECT_EQ(got.mlm_labels, want.mlm_labels);
      EXPECT_EQ(got.nsp_labels, want.nsp_labels);
      EXPECT_EQ(loader.cursor(), reference.cursor());
    }
  }

  // Every rank's folder without its shards: refused before any collective, naming the shard.
  try {
    PartitionedData none(std::filesystem::path(root) / "manifest-only", c);
    ADD_FAILURE() << "a folder without this rank's shards was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard " + std::to_string(rank) + " of 7"), std::string::npos) << e.what();
  }
  // Only the ranks above 0 lack their shards: rank 0 must not wait for them; it stops naming them.
  if (world > 1) {
    const std::filesystem::path dir =
        rank == 0 ? std::filesystem::path(root) / "rank0" : std::filesystem::path(root) / "manifest-only";
    try {
      PartitionedData some(dir, c);
      ADD_FAILURE() << "rank " << rank << ": a job with ranks missing their shards was accepted";
    } catch (const Error& e) {
      const std::string want = rank == 0 ? "could not open their shards" : "is missing from";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  c.barrier();
  if (rank == 0) std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace nopad::dist

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<nopad::dist::Communicator> comm;
  try {
    comm = nopad::dist::make_mpi_communicator();
  } catch (const nopad::Error& e) {
    std::fprintf(stderr, "nopad_mpi_tests: %s\n", e.what());
    return 1;
  }
  nopad::dist::g_comm = comm.get();
  if (comm->rank() != 0) {  // one report, from rank 0; failures elsewhere still fail the run through the exit code
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // Every rank's result decides: rank 0 exits non-zero when any rank failed.
  std::vector<int64_t> failed = {rc != 0 ? 1 : 0};
  comm->all_reduce_sum(failed);
  if (comm->rank() == 0 && failed[0] > 0) std::fprintf(stderr, "nopad_mpi_tests: %lld rank(s) failed\n",
                                                       static_cast<long long>(failed[0]));
  return failed[0] > 0 ? 1 : 0;
}
