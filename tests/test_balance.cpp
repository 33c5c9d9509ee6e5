// The workload balancer: every mode assigns each sequence exactly once, deterministically; none is the
// ContiguousAssigner split; stratified deals equal counts with the same mix of lengths; cost (greedy LPT) balances
// real enwiki length mixes within 2% from 8 to 1,024 ranks and plans a 4,096-sequence batch in under a
// millisecond; caps and bad inputs fail clearly; BalancedAssigner partitions a real dataset's global batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "core/error.h"
#include "data/loader.h"
#include "dist/balance.h"
#include "test_util.h"

namespace nopad::dist {
namespace {

constexpr BalanceMode kModes[] = {BalanceMode::kNone, BalanceMode::kStratified, BalanceMode::kCost};

#ifdef NDEBUG
constexpr double kTimeSlack = 1.0;  // optimized build: the real budget
#else
constexpr double kTimeSlack = 10.0;  // unoptimized build: the same check, scaled
#endif

using test::error_of;

std::filesystem::path enwiki_lengths_path() {
  return std::string(NOPAD_SOURCE_DIR) + "/data/lengths/enwiki-phase2-lengths.txt";
}

std::vector<int32_t> uniform_lengths(size_t n, int32_t max_length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(1, max_length);
  std::vector<int32_t> out(n);
  for (auto& l : out) l = dist(rng);
  return out;
}

// Draws sequence lengths with the frequencies of a (length, count) histogram.
class LengthSampler {
 public:
  explicit LengthSampler(const std::vector<std::pair<int32_t, int64_t>>& histogram) {
    int64_t total = 0;
    for (const auto& [length, count] : histogram) {
      total += count;
      lengths_.push_back(length);
      cumulative_.push_back(total);
    }
  }
  std::vector<int32_t> draw(size_t n, std::mt19937_64& rng) const {
    std::uniform_int_distribution<int64_t> dist(0, cumulative_.back() - 1);
    std::vector<int32_t> out(n);
    for (auto& l : out) {
      const auto it = std::upper_bound(cumulative_.begin(), cumulative_.end(), dist(rng));
      l = lengths_[static_cast<size_t>(it - cumulative_.begin())];
    }
    return out;
  }

 private:
  std::vector<int32_t> lengths_;
  std::vector<int64_t> cumulative_;  // [bins] sequences of this length or an earlier line
};

// The plan's invariants: one rank per sequence, in range; per-rank sums and counts match rank_of; the cap holds.
void expect_consistent(std::span<const int32_t> lengths, int world, const CostModel& cost, const BalancePlan& plan,
                       int cap = 0) {
  ASSERT_EQ(plan.rank_of.size(), lengths.size());
  ASSERT_EQ(plan.rank_cost.size(), static_cast<size_t>(world));
  ASSERT_EQ(plan.rank_seqs.size(), static_cast<size_t>(world));
  std::vector<double> cost_sum(static_cast<size_t>(world), 0.0);
  std::vector<int32_t> seqs(static_cast<size_t>(world), 0);
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int32_t r = plan.rank_of[i];
    ASSERT_GE(r, 0) << "sequence " << i;
    ASSERT_LT(r, world) << "sequence " << i;
    cost_sum[static_cast<size_t>(r)] += cost(lengths[i]);
    ++seqs[static_cast<size_t>(r)];
  }
  int64_t total = 0;
  for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
    EXPECT_EQ(plan.rank_seqs[r], seqs[r]) << "rank " << r;
    EXPECT_NEAR(plan.rank_cost[r], cost_sum[r], 1e-9 * std::max(1.0, cost_sum[r])) << "rank " << r;
    if (cap > 0) {
      EXPECT_LE(plan.rank_seqs[r], cap) << "rank " << r;
    }
    total += plan.rank_seqs[r];
  }
  EXPECT_EQ(total, static_cast<int64_t>(lengths.size()));
}

void expect_same_plan(const BalancePlan& a, const BalancePlan& b) {
  EXPECT_EQ(a.rank_of, b.rank_of);
  EXPECT_EQ(a.rank_cost, b.rank_cost);  // bit-exact: the sums run in an order fixed by the inputs
  EXPECT_EQ(a.rank_seqs, b.rank_seqs);
}

// Sorted lengths per rank: what a rank trains on, whatever the order of the global batch.
std::vector<std::vector<int32_t>> lengths_per_rank(std::span<const int32_t> lengths, int world,
                                                   const BalancePlan& plan) {
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(world));
  for (size_t i = 0; i < lengths.size(); ++i) out[static_cast<size_t>(plan.rank_of[i])].push_back(lengths[i]);
  for (auto& v : out) std::sort(v.begin(), v.end());
  return out;
}

TEST(Balance, EveryModeAssignsEachSequenceOnceAndDeterministically) {
  const CostModel tokens, quadratic{1.0, 1.0 / 512};
  std::vector<std::vector<int32_t>> cases = {
      {},
      {7},
      uniform_lengths(5, 512, 1),
      uniform_lengths(37, 512, 2),
      uniform_lengths(256, 512, 3),
      uniform_lengths(1000, 64, 4),       // many ties
      std::vector<int32_t>(100, 128),     // all equal
  };
  for (const auto& lengths : cases) {
    for (const int world : {1, 3, 8, 64}) {
      for (const BalanceMode mode : kModes) {
        for (const CostModel& cost : {tokens, quadratic}) {
          SCOPED_TRACE(testing::Message() << balance_mode_name(mode) << " n " << lengths.size() << " world " << world
                                          << " per_token_sq " << cost.per_token_sq);
          BalancePlan a, b;
          plan_balance(lengths, world, mode, cost, 0, a);
          expect_consistent(lengths, world, cost, a);
          plan_balance(lengths, world, mode, cost, 0, b);
          expect_same_plan(a, b);
          plan_balance(lengths, world, mode, cost, 0, b);  // reusing a filled plan changes nothing
          expect_same_plan(a, b);
          if (mode == BalanceMode::kNone) continue;
          // stratified and cost see only the multiset of lengths: a permuted batch gives every rank the same lengths
          // and bit-identical sums.
          std::vector<int32_t> permuted = lengths;
          std::mt19937_64 rng(99);
          std::shuffle(permuted.begin(), permuted.end(), rng);
          BalancePlan p;
          plan_balance(permuted, world, mode, cost, 0, p);
          expect_consistent(permuted, world, cost, p);
          EXPECT_EQ(p.rank_cost, a.rank_cost);
          EXPECT_EQ(p.rank_seqs, a.rank_seqs);
          EXPECT_EQ(lengths_per_rank(permuted, world, p), lengths_per_rank(lengths, world, a));
        }
      }
    }
  }
}

// The modes as the brief states them, written for clarity (O(n log n + n world)), to check the fast planner's choices.
std::vector<int32_t> reference_plan(std::span<const int32_t> lengths, int world, BalanceMode mode,
                                    const CostModel& cost, int cap) {
  const size_t n = lengths.size(), w = static_cast<size_t>(world);
  std::vector<int32_t> rank_of(n);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  if (mode == BalanceMode::kNone) {
    for (size_t r = 0; r < w; ++r)
      for (size_t i = n * r / w; i < n * (r + 1) / w; ++i) rank_of[i] = static_cast<int32_t>(r);
  } else if (mode == BalanceMode::kStratified) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
    for (size_t k = 0; k < n; ++k) {
      const size_t round = k / w, pos = k % w;
      rank_of[order[k]] = static_cast<int32_t>(round % 2 == 0 ? pos : w - 1 - pos);
    }
  } else {
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return cost(lengths[a]) > cost(lengths[b]); });
    std::vector<double> load(w, 0.0);
    std::vector<int32_t> seqs(w, 0);
    for (const size_t i : order) {
      size_t best = w;
      for (size_t r = 0; r < w; ++r) {
        if (cap > 0 && seqs[r] >= cap) continue;
        if (best == w || load[r] < load[best] || (load[r] == load[best] && seqs[r] < seqs[best])) best = r;
      }
      rank_of[i] = static_cast<int32_t>(best);
      load[best] += cost(lengths[i]);
      ++seqs[best];
    }
  }
  return rank_of;
}

TEST(Balance, MatchesTheReferenceRules) {
  const CostModel tokens, quadratic{1.0, 1.0 / 512}, zero{0.0, 0.0}, attention_only{0.0, 1.0};
  std::vector<std::vector<int32_t>> cases = {uniform_lengths(300, 512, 11), uniform_lengths(1000, 16, 12),
                                             uniform_lengths(257, 1 << 30, 13)};  // the last sorts without counting
  std::mt19937_64 rng(3);
  const LengthSampler sampler(read_length_histogram(enwiki_lengths_path()));
  cases.push_back(sampler.draw(2048, rng));
  BalancePlan plan;
  for (const auto& lengths : cases) {
    for (const int world : {1, 5, 64}) {
      const int fair = static_cast<int>((lengths.size() + static_cast<size_t>(world) - 1) / static_cast<size_t>(world));
      for (const int cap : {0, fair, fair + 3}) {
        for (const BalanceMode mode : kModes) {
          for (const CostModel& cost : {tokens, quadratic, zero, attention_only}) {
            SCOPED_TRACE(testing::Message() << balance_mode_name(mode) << " n " << lengths.size() << " world "
                                            << world << " cap " << cap << " cost " << cost.per_token << " + "
                                            << cost.per_token_sq << " L^2");
            plan_balance(lengths, world, mode, cost, cap, plan);
            expect_consistent(lengths, world, cost, plan, cap);
            EXPECT_EQ(plan.rank_of, reference_plan(lengths, world, mode, cost, cap));
          }
        }
      }
    }
  }
}

TEST(Balance, SmallPlansByHand) {
  BalancePlan plan;
  // Snake order: sorted (60 50 40 30 20 10) dealt to ranks 0 1 1 0 0 1.
  const std::vector<int32_t> six = {10, 20, 30, 40, 50, 60};
  plan_balance(six, 2, BalanceMode::kStratified, {}, 0, plan);
  EXPECT_EQ(plan.rank_of, (std::vector<int32_t>{1, 0, 0, 1, 1, 0}));
  // LPT: 5->r0, 5->r1, 4->r0 (tie on cost and count: lower rank), 3->r1, 3->r1 (8 < 9), 3->r0.
  const std::vector<int32_t> lpt = {5, 5, 4, 3, 3, 3};
  plan_balance(lpt, 2, BalanceMode::kCost, {}, 0, plan);
  EXPECT_EQ(plan.rank_of, (std::vector<int32_t>{0, 1, 0, 1, 1, 0}));
  EXPECT_EQ(plan.rank_cost, (std::vector<double>{12, 11}));
  EXPECT_EQ(plan.rank_seqs, (std::vector<int32_t>{3, 3}));
  // Equal costs: round robin by (seqs, rank).
  plan_balance(std::vector<int32_t>(7, 4), 3, BalanceMode::kCost, {}, 0, plan);
  EXPECT_EQ(plan.rank_of, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0}));
  // Zero costs everywhere: max/mean is defined as 1.
  plan_balance(six, 3, BalanceMode::kCost, {0.0, 0.0}, 0, plan);
  EXPECT_EQ(plan.max_over_mean(), 1.0);
  plan_balance(six, 3, BalanceMode::kNone, {}, 0, plan);  // 30, 70, 110 tokens
  EXPECT_DOUBLE_EQ(plan.max_over_mean(), 110.0 / 70.0);
}

TEST(Balance, NoneIsTheContiguousSplit) {
  const Dataset unused;  // ContiguousAssigner never reads the dataset
  ContiguousAssigner contiguous;
  std::vector<std::vector<uint64_t>> expected;
  BalancePlan plan;
  for (const size_t n : {size_t{0}, size_t{5}, size_t{64}, size_t{97}, size_t{1000}}) {
    for (const int world : {1, 2, 7, 8, 64}) {
      const std::vector<int32_t> lengths = uniform_lengths(n, 512, n + static_cast<size_t>(world));
      std::vector<uint64_t> ids(n);
      for (size_t i = 0; i < n; ++i) ids[i] = 1000 + 3 * i;
      contiguous.assign(ids, unused, world, expected);
      plan_balance(lengths, world, BalanceMode::kNone, {}, 0, plan);
      std::vector<std::vector<uint64_t>> got(static_cast<size_t>(world));
      for (size_t i = 0; i < n; ++i) got[static_cast<size_t>(plan.rank_of[i])].push_back(ids[i]);
      EXPECT_EQ(got, expected) << "n " << n << " world " << world;
    }
  }
}

TEST(Balance, StratifiedDealsEqualCountsAndMixes) {
  BalancePlan plan;
  for (const size_t n : {size_t{10}, size_t{256}, size_t{1001}, size_t{4096}}) {
    for (const int world : {1, 3, 8, 64}) {
      const std::vector<int32_t> lengths = uniform_lengths(n, 512, 7 * n + static_cast<size_t>(world));
      plan_balance(lengths, world, BalanceMode::kStratified, {}, 0, plan);
      expect_consistent(lengths, world, {}, plan);
      const auto [min_seqs, max_seqs] = std::minmax_element(plan.rank_seqs.begin(), plan.rank_seqs.end());
      EXPECT_LE(*max_seqs - *min_seqs, 1) << "n " << n << " world " << world;
      if (n % static_cast<size_t>(world) != 0) continue;
      // With whole rounds, the snake keeps any two ranks' token sums within max - min length of each other.
      const auto [lo, hi] = std::minmax_element(lengths.begin(), lengths.end());
      const double count = static_cast<double>(n / static_cast<size_t>(world));
      const auto [min_cost, max_cost] = std::minmax_element(plan.rank_cost.begin(), plan.rank_cost.end());
      EXPECT_LE(*max_cost / count - *min_cost / count, (*hi - *lo) / count + 1e-9) << "n " << n << " world " << world;
    }
  }
}

TEST(Balance, RealLengthsBalanceWithinTwoPercent) {
  const auto histogram = read_length_histogram(enwiki_lengths_path());
  int64_t seqs = 0, tokens = 0, at_512 = 0;
  for (const auto& [length, count] : histogram) {
    seqs += count;
    tokens += length * count;
    if (length == 512) at_512 = count;
  }
  ASSERT_EQ(seqs, 73958);
  EXPECT_NEAR(static_cast<double>(tokens) / static_cast<double>(seqs), 385.7, 0.05);
  EXPECT_NEAR(static_cast<double>(at_512) / static_cast<double>(seqs), 0.59, 0.01);
  const LengthSampler sampler(histogram);

  constexpr int kBatches = 3;  // global batches per configuration; the table shows the worst
  struct Model {
    const char* name;
    CostModel cost;
  };
  const Model models[] = {{"tokens", {1.0, 0.0}}, {"L + L^2/512", {1.0, 1.0 / 512}}};
  std::printf("  max/mean rank cost, enwiki phase-2 lengths, worst of %d global batches:\n", kBatches);
  std::printf("  %-12s %5s %8s %8s %10s %8s %9s\n", "cost", "world", "per-rank", "none", "stratified", "cost",
              "cost+cap");
  BalancePlan plan;
  for (const Model& model : models) {
    for (const int world : {8, 64, 256, 1024}) {
      for (const int per_rank : {32, 56}) {
        SCOPED_TRACE(testing::Message() << model.name << " world " << world << " per-rank " << per_rank);
        std::mt19937_64 rng(static_cast<uint64_t>(world) * 1000 + static_cast<uint64_t>(per_rank));
        double worst[4] = {0, 0, 0, 0};  // none, stratified, cost, cost capped at the per-rank batch
        for (int b = 0; b < kBatches; ++b) {
          const std::vector<int32_t> lengths = sampler.draw(static_cast<size_t>(world) * per_rank, rng);
          double ratio[4];
          for (int m = 0; m < 3; ++m) {
            plan_balance(lengths, world, kModes[m], model.cost, 0, plan);
            ratio[m] = plan.max_over_mean();
          }
          plan_balance(lengths, world, BalanceMode::kCost, model.cost, per_rank, plan);
          expect_consistent(lengths, world, model.cost, plan, per_rank);
          ratio[3] = plan.max_over_mean();
          EXPECT_LE(ratio[2], 1.02);
          EXPECT_LE(ratio[2], ratio[0]);
          EXPECT_LE(ratio[3], 1.02);  // equal counts per rank cost almost nothing on this mix
          for (int m = 0; m < 4; ++m) worst[m] = std::max(worst[m], ratio[m]);
        }
        std::printf("  %-12s %5d %8d %8.4f %10.4f %8.4f %9.4f\n", model.name, world, per_rank, worst[0], worst[1],
                    worst[2], worst[3]);
      }
    }
  }
}

TEST(Balance, CostPlanIsFast) {
  const LengthSampler sampler(read_length_histogram(enwiki_lengths_path()));
  std::mt19937_64 rng(2024);
  struct Case {
    size_t n;
    int world, runs;
    double limit_ms;
  };
  for (const Case c : {Case{4096, 1024, 20, 1.0}, Case{4096, 8, 20, 1.0}, Case{57344, 1024, 9, 20.0}}) {
    const std::vector<int32_t> lengths = sampler.draw(c.n, rng);
    BalancePlan plan;
    plan_balance(lengths, c.world, BalanceMode::kCost, {}, 0, plan);  // warm: sizes the vectors
    const int32_t* rank_of = plan.rank_of.data();
    const BalancePlan::Item* items = plan.scratch_items.data();
    std::vector<double> ms;
    for (int run = 0; run < c.runs; ++run) {
      const auto t0 = std::chrono::steady_clock::now();
      plan_balance(lengths, c.world, BalanceMode::kCost, {}, 0, plan);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    std::printf("  cost plan of %zu sequences on %d ranks: median %.3f ms of %d runs (min %.3f ms)\n", c.n, c.world,
                median, c.runs, ms.front());
    EXPECT_LT(median, c.limit_ms * kTimeSlack) << c.n << " sequences on " << c.world << " ranks";
    EXPECT_EQ(plan.rank_of.data(), rank_of) << "a warm plan must not reallocate";
    EXPECT_EQ(plan.scratch_items.data(), items) << "a warm plan must not reallocate";
  }
}

TEST(Balance, CapsAndBadInputs) {
  BalancePlan plan;
  const std::vector<int32_t> lengths = uniform_lengths(100, 512, 5);
  // The cap holds; at exactly n / world every rank gets exactly that many.
  for (const int cap : {13, 20}) {
    for (const BalanceMode mode : kModes) {
      plan_balance(lengths, 8, mode, {}, cap, plan);
      expect_consistent(lengths, 8, {}, plan, cap);
    }
  }
  plan_balance(lengths, 10, BalanceMode::kCost, {1.0, 1.0 / 512}, 10, plan);
  expect_consistent(lengths, 10, {1.0, 1.0 / 512}, plan, 10);
  EXPECT_EQ(plan.rank_seqs, std::vector<int32_t>(10, 10));
  // A cap that cannot hold the batch: ceil(100 / 8) = 13.
  for (const BalanceMode mode : kModes) {
    const std::string msg = error_of([&] { plan_balance(lengths, 8, mode, {}, 12, plan); });
    EXPECT_NE(msg.find("at least 13"), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([&] { plan_balance(lengths, 8, BalanceMode::kCost, {}, -1, plan); }).find("max_seqs_per_rank"),
            std::string::npos);
  // Lengths below 1 name their index.
  for (const int32_t bad : {0, -5}) {
    std::vector<int32_t> broken = lengths;
    broken[3] = bad;
    for (const BalanceMode mode : kModes) {
      const std::string msg = error_of([&] { plan_balance(broken, 8, mode, {}, 0, plan); });
      EXPECT_NE(msg.find("index 3 "), std::string::npos) << msg;
    }
  }
  EXPECT_NE(error_of([&] { plan_balance(lengths, 0, BalanceMode::kNone, {}, 0, plan); }).find("world size 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { plan_balance(lengths, 8, BalanceMode::kCost, {-1.0, 0.0}, 0, plan); }).find("per_token"),
            std::string::npos);
  EXPECT_THROW(BalancedAssigner(BalanceMode::kCost, {}, -2), Error);
  EXPECT_THROW(BalancedAssigner(BalanceMode::kCost, {1.0, -0.5}), Error);
  // Empty batches are fine.
  plan_balance({}, 4, BalanceMode::kCost, {}, 1, plan);
  EXPECT_TRUE(plan.rank_of.empty());
  EXPECT_EQ(plan.rank_seqs, std::vector<int32_t>(4, 0));
  EXPECT_EQ(plan.max_over_mean(), 1.0);
}

TEST(Balance, ModeNames) {
  for (const BalanceMode mode : kModes) EXPECT_EQ(parse_balance_mode(balance_mode_name(mode)), mode);
  const std::string msg = error_of([] { parse_balance_mode("fast"); });
  for (const char* word : {"'fast'", "none", "stratified", "cost"})
    EXPECT_NE(msg.find(word), std::string::npos) << msg;
  EXPECT_THROW(parse_balance_mode(""), Error);
  EXPECT_THROW(parse_balance_mode("Cost"), Error);
}

TEST(Balance, HistogramFile) {
  test::TempDir dir("balance-hist");
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return dir / name;
  };
  const auto good = read_length_histogram(write("good.txt", "# lengths\n\n5 2\n  7\t0  # none\r\n512 40"));
  EXPECT_EQ(good, (std::vector<std::pair<int32_t, int64_t>>{{5, 2}, {7, 0}, {512, 40}}));
  const struct {
    const char* text;
    const char* expect;
  } bad[] = {
      {"# h\n5 2\n6 x\n", "line 3: expected 'length count'"},
      {"5\n", "line 1: expected"},
      {"5 2 9\n", "line 1: expected"},
      {"0 4\n", "line 1: length 0"},
      {"5 -1\n", "line 1: count -1"},
      {"5 1\n6 1\n5 3\n", "line 3: length 5 appears twice (first on line 1)"},
      {"# only a comment\n\n", "no 'length count' lines"},
  };
  for (const auto& b : bad) {
    const auto path = write("bad.txt", b.text);
    const std::string msg = error_of([&] { read_length_histogram(path); });
    EXPECT_NE(msg.find(b.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([&] { read_length_histogram(dir / "missing.txt"); }).find("missing.txt"), std::string::npos);
}

TEST(Balance, AssignerPartitionsRealDatasetBatches) {
  test::TempDir dir("balance");
  test::write_random_dataset(dir.path(), 300, 3, 17, 512);  // lengths 5..512
  const Dataset ds(dir.path());
  EpochSampler sampler(ds.size(), 11);
  Cursor cursor;
  std::vector<uint64_t> global;
  ContiguousAssigner contiguous;
  std::vector<std::vector<uint64_t>> per_rank, expected;
  for (int step = 0; step < 4; ++step) {
    sampler.next_global_batch(cursor, 96, global);
    std::map<uint64_t, size_t> position;  // global-batch position of each id (ids of a batch are distinct)
    for (size_t i = 0; i < global.size(); ++i) position[global[i]] = i;
    ASSERT_EQ(position.size(), global.size());
    for (const BalanceMode mode : kModes) {
      BalancedAssigner assigner(mode, {1.0, 1.0 / 512});
      for (const int world : {1, 4, 7}) {
        SCOPED_TRACE(testing::Message() << balance_mode_name(mode) << " world " << world << " step " << step);
        assigner.assign(global, ds, world, per_rank);
        ASSERT_EQ(per_rank.size(), static_cast<size_t>(world));
        const BalancePlan& plan = assigner.last_plan();
        std::vector<uint64_t> joined;
        for (size_t r = 0; r < per_rank.size(); ++r) {
          EXPECT_EQ(per_rank[r].size(), static_cast<size_t>(plan.rank_seqs[r]));
          double cost = 0;
          for (size_t k = 0; k < per_rank[r].size(); ++k) {
            const size_t pos = position.at(per_rank[r][k]);
            EXPECT_EQ(plan.rank_of[pos], static_cast<int32_t>(r));
            if (k > 0) {
              EXPECT_LT(position.at(per_rank[r][k - 1]), pos) << "rank " << r << " is out of batch order";
            }
            const double l = ds.length(per_rank[r][k]);
            cost += l + l * l / 512;
          }
          EXPECT_NEAR(plan.rank_cost[r], cost, 1e-9 * cost);
          joined.insert(joined.end(), per_rank[r].begin(), per_rank[r].end());
        }
        std::sort(joined.begin(), joined.end());
        std::vector<uint64_t> sorted_global = global;
        std::sort(sorted_global.begin(), sorted_global.end());
        EXPECT_EQ(joined, sorted_global);
        if (world == 1) {
          EXPECT_EQ(per_rank[0], global);
        }
        if (mode == BalanceMode::kNone) {
          contiguous.assign(global, ds, world, expected);
          EXPECT_EQ(per_rank, expected);
        }
      }
    }
  }
}

TEST(Balance, LoaderRanksTrainTheirPlannedShare) {
  test::TempDir dir("balance-loader");
  test::write_random_dataset(dir.path(), 200, 2, 23, 512);
  const Dataset ds(dir.path());
  LoaderOptions o;
  o.global_batch = 24;
  o.world_size = 3;
  o.seed = 5;
  LoaderOptions whole = o;
  whole.world_size = 1;
  Loader all(ds, whole);  // the contiguous split of a world of 1: the global batch itself
  std::vector<std::unique_ptr<Loader>> ranks;
  for (int r = 0; r < 3; ++r) {
    o.rank = r;
    // One assigner per loader: each plans on its own loader thread.
    ranks.push_back(std::make_unique<Loader>(ds, o, std::make_shared<BalancedAssigner>(BalanceMode::kCost,
                                                                                      CostModel{})));
  }
  BalancedAssigner reference(BalanceMode::kCost, {});
  std::vector<std::vector<uint64_t>> expected;
  for (int step = 0; step < 20; ++step) {  // crosses two epoch boundaries (8 steps per epoch)
    const std::vector<uint64_t> global = all.next().sample_ids;
    reference.assign(global, ds, 3, expected);
    for (size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(ranks[r]->next().sample_ids, expected[r]) << "rank " << r;
  }
}

}  // namespace
}  // namespace nopad::dist
