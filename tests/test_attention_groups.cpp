// The grouped attention scheduler (ops/attention_groups.h): the length order is longest first and deterministic;
// every plan covers each sequence of non-zero length exactly once; grouped launches hold one length bucket each (so
// no launch has row tiles its sequences lack), come longest first and are dealt to streams longest-processing-time
// first; the fallbacks and bad settings behave as documented. Checked on hand-made and real Wikipedia length mixes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/attention_groups.h"

namespace nopad::ops {
namespace {

std::vector<int32_t> cu_of(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + lens[i];
  return cu;
}

std::vector<int32_t> order_of(const std::vector<int32_t>& cu) {
  std::vector<int32_t> order(cu.size() - 1, -7);
  order_by_length(cu.data(), static_cast<int32_t>(order.size()), order.data());
  return order;
}

// Real phase-2 lengths (data/lengths, 73,958 sequences of the enwiki corpus), drawn with their frequencies.
std::vector<int32_t> enwiki_lengths(size_t n, uint64_t seed) {
  std::ifstream in(std::string(NOPAD_SOURCE_DIR) + "/data/lengths/enwiki-phase2-lengths.txt");
  std::vector<int32_t> values;
  std::vector<int64_t> cumulative;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    int32_t length = 0;
    int64_t count = 0;
    ls >> length >> count;
    values.push_back(length);
    cumulative.push_back((cumulative.empty() ? 0 : cumulative.back()) + count);
  }
  EXPECT_GT(values.size(), 100u) << "the length histogram did not load";
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, cumulative.back() - 1);
  std::vector<int32_t> out(n);
  for (auto& l : out) {
    const auto it = std::upper_bound(cumulative.begin(), cumulative.end(), dist(rng));
    l = values[static_cast<size_t>(it - cumulative.begin())];
  }
  return out;
}

int64_t tiles2(int32_t l) {
  const int64_t t = (l + 63) / 64;
  return t * t;
}

// Every structural promise of a plan, checked independently of the planner's code.
void check_plan(const std::vector<int32_t>& lens, const std::vector<int32_t>& order, const AttentionSchedule& s,
                const AttentionPlan& plan) {
  const int32_t n = static_cast<int32_t>(lens.size());
  std::vector<int> seen(lens.size(), 0);
  ASSERT_GE(plan.num_groups, 1);
  ASSERT_LE(plan.num_groups, AttentionPlan::kMaxGroups);
  if (plan.mode != AttentionMode::kGrouped) {
    ASSERT_EQ(plan.num_groups, 1);
    EXPECT_EQ(plan.groups[0].begin, 0);
    EXPECT_EQ(plan.groups[0].count, n);
    EXPECT_EQ(plan.groups[0].stream, 0);
    EXPECT_EQ(plan.groups[0].max_seqlen, *std::max_element(lens.begin(), lens.end()));
    EXPECT_EQ(plan.uses_order, plan.mode == AttentionMode::kSorted);
    EXPECT_EQ(plan.num_streams, 1);
    return;
  }
  EXPECT_TRUE(plan.uses_order);
  int32_t next = 0;
  int32_t prev_max = INT32_MAX;
  std::vector<int64_t> stream_cost(static_cast<size_t>(s.streams), 0);
  for (int g = 0; g < plan.num_groups; ++g) {
    const AttentionGroup& gr = plan.groups[g];
    EXPECT_EQ(gr.begin, next) << "groups are contiguous runs of the order";
    ASSERT_GE(gr.count, 1);
    next = gr.begin + gr.count;
    ASSERT_LE(next, n);
    EXPECT_EQ(gr.max_seqlen, lens[order[gr.begin]]) << "a group's longest sequence is its first";
    EXPECT_LE(gr.max_seqlen, prev_max) << "groups come longest first";
    prev_max = gr.max_seqlen;
    EXPECT_GE(gr.stream, 0);
    EXPECT_LT(gr.stream, s.streams);
    EXPECT_LT(gr.stream, plan.num_streams);
    int64_t cost = 0;
    const int32_t bucket = (gr.max_seqlen + s.bucket_tokens - 1) / s.bucket_tokens;
    for (int32_t i = gr.begin; i < next; ++i) {
      const int32_t l = lens[order[i]];
      ++seen[order[i]];
      EXPECT_GT(l, 0) << "sequences without rows are left out";
      if (g + 1 < AttentionPlan::kMaxGroups) {
        EXPECT_EQ((l + s.bucket_tokens - 1) / s.bucket_tokens, bucket) << "group " << g << " mixes buckets";
      }
      cost += tiles2(l);
    }
    EXPECT_EQ(gr.cost, cost);
    stream_cost[static_cast<size_t>(gr.stream)] += cost;
  }
  for (int32_t i = 0; i < n; ++i) EXPECT_EQ(seen[i], lens[i] > 0 ? 1 : 0) << "sequence " << i;
  // Longest-processing-time: replaying the groups by decreasing cost, each went to a least-loaded stream.
  std::vector<int> by_cost(static_cast<size_t>(plan.num_groups));
  std::iota(by_cost.begin(), by_cost.end(), 0);
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [&](int a, int b) { return plan.groups[a].cost > plan.groups[b].cost; });
  std::vector<int64_t> load(static_cast<size_t>(s.streams), 0);
  for (int g : by_cost) {
    const int64_t least = *std::min_element(load.begin(), load.end());
    EXPECT_EQ(load[static_cast<size_t>(plan.groups[g].stream)], least) << "group " << g << " not on a least-loaded stream";
    load[static_cast<size_t>(plan.groups[g].stream)] += plan.groups[g].cost;
  }
  EXPECT_EQ(load, stream_cost);
}

TEST(AttentionGroups, OrderIsLongestFirstWithTiesByIndex) {
  const std::vector<int32_t> lens = {5, 512, 64, 5, 65, 512, 1, 0, 128};
  const auto order = order_of(cu_of(lens));
  EXPECT_EQ(order, (std::vector<int32_t>{1, 5, 8, 4, 2, 0, 3, 6, 7}));
  const std::vector<int32_t> none;
  EXPECT_TRUE(order_of(cu_of(none)).empty());
}

TEST(AttentionGroups, SingleAndSortedAreOneLaunch) {
  const std::vector<int32_t> lens = {300, 17, 512, 64};
  const auto cu = cu_of(lens);
  const auto order = order_of(cu);
  for (AttentionMode m : {AttentionMode::kSingle, AttentionMode::kSorted}) {
    AttentionSchedule s;
    s.mode = m;
    AttentionPlan plan;
    plan_attention(cu.data(), order.data(), 4, s, plan);
    EXPECT_EQ(plan.mode, m);
    check_plan(lens, order, s, plan);
    EXPECT_EQ(plan.groups[0].cost, 25 + 1 + 64 + 1);
  }
  // Without an order every mode falls back to one launch in batch order.
  AttentionSchedule s;
  s.mode = AttentionMode::kGrouped;
  AttentionPlan plan;
  plan_attention(cu.data(), nullptr, 4, s, plan);
  EXPECT_EQ(plan.mode, AttentionMode::kSingle);
  EXPECT_FALSE(plan.uses_order);
  check_plan(lens, order, s, plan);
}

TEST(AttentionGroups, GroupedHandMadeBatch) {
  // Tile edges and a sequence without rows: buckets of 64 give {512, 500} {129} {128, 65} {64, 63, 1}.
  const std::vector<int32_t> lens = {63, 128, 0, 512, 1, 65, 129, 64, 500};
  const auto cu = cu_of(lens);
  const auto order = order_of(cu);
  AttentionSchedule s;
  s.mode = AttentionMode::kGrouped;
  s.streams = 2;
  AttentionPlan plan;
  plan_attention(cu.data(), order.data(), static_cast<int32_t>(lens.size()), s, plan);
  ASSERT_EQ(plan.num_groups, 4);
  const int32_t counts[] = {2, 1, 2, 3}, maxes[] = {512, 129, 128, 64}, costs[] = {128, 9, 8, 3};
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(plan.groups[g].count, counts[g]) << g;
    EXPECT_EQ(plan.groups[g].max_seqlen, maxes[g]) << g;
    EXPECT_EQ(plan.groups[g].cost, costs[g]) << g;
  }
  // The long group alone on stream 0, the rest on stream 1.
  EXPECT_EQ(plan.groups[0].stream, 0);
  for (int g = 1; g < 4; ++g) EXPECT_EQ(plan.groups[g].stream, 1) << g;
  EXPECT_EQ(plan.num_streams, 2);
  check_plan(lens, order, s, plan);
  // The paper's 128-token buckets: {512, 500} {129} {128, 65, 64, 63, 1}.
  s.bucket_tokens = 128;
  plan_attention(cu.data(), order.data(), static_cast<int32_t>(lens.size()), s, plan);
  EXPECT_EQ(plan.num_groups, 3);
  check_plan(lens, order, s, plan);
  // One stream: everything on the caller's stream.
  s.streams = 1;
  plan_attention(cu.data(), order.data(), static_cast<int32_t>(lens.size()), s, plan);
  for (int g = 0; g < plan.num_groups; ++g) EXPECT_EQ(plan.groups[g].stream, 0);
  EXPECT_EQ(plan.num_streams, 1);
}

TEST(AttentionGroups, GroupedRealLengthMixes) {
  for (int32_t batch : {1, 7, 64, 128, 256, 1024}) {
    for (int streams : {1, 2, 4, 8}) {
      for (int bucket : {64, 128}) {
        const auto lens = enwiki_lengths(static_cast<size_t>(batch), 1000u + static_cast<uint64_t>(batch));
        const auto cu = cu_of(lens);
        const auto order = order_of(cu);
        AttentionSchedule s;
        s.mode = AttentionMode::kGrouped;
        s.streams = streams;
        s.bucket_tokens = bucket;
        AttentionPlan plan;
        plan_attention(cu.data(), order.data(), batch, s, plan);
        SCOPED_TRACE("batch " + std::to_string(batch) + " streams " + std::to_string(streams) + " bucket " +
                     std::to_string(bucket));
        check_plan(lens, order, s, plan);
        EXPECT_LE(plan.num_groups, (512 + bucket - 1) / bucket);
      }
    }
  }
}

TEST(AttentionGroups, MoreBucketsThanGroupsMergeIntoTheLast) {
  std::vector<int32_t> lens;
  for (int32_t i = 1; i <= 60; ++i) lens.push_back(64 * i);  // 60 distinct buckets of 64
  lens.push_back(3);
  const auto cu = cu_of(lens);
  const auto order = order_of(cu);
  AttentionSchedule s;
  s.mode = AttentionMode::kGrouped;
  AttentionPlan plan;
  plan_attention(cu.data(), order.data(), static_cast<int32_t>(lens.size()), s, plan);
  EXPECT_EQ(plan.num_groups, AttentionPlan::kMaxGroups);
  EXPECT_EQ(plan.groups[AttentionPlan::kMaxGroups - 1].count, 61 - (AttentionPlan::kMaxGroups - 1));
  check_plan(lens, order, s, plan);
}

TEST(AttentionGroups, BadSettingsAreRefused) {
  AttentionSchedule s;
  s.streams = 0;
  EXPECT_THROW(validate(s), Error);
  s.streams = AttentionSchedule::kMaxStreams + 1;
  EXPECT_THROW(validate(s), Error);
  s.streams = 2;
  s.bucket_tokens = 40;
  EXPECT_THROW(validate(s), Error);
  s.bucket_tokens = 0;
  EXPECT_THROW(validate(s), Error);
  EXPECT_EQ(parse_attention_mode("sorted"), AttentionMode::kSorted);
  EXPECT_STREQ(attention_mode_name(AttentionMode::kGrouped), "grouped");
  try {
    parse_attention_mode("fast");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("single, sorted, grouped"), std::string::npos) << e.what();
  }
}

TEST(AttentionGroups, EnvironmentOverridesAndNamesBadValues) {
  setenv("NOPAD_FMHA_SCHEDULE", "sorted", 1);
  setenv("NOPAD_FMHA_STREAMS", "3", 1);
  setenv("NOPAD_FMHA_BUCKET", "128", 1);
  AttentionSchedule s = attention_schedule_from_env();
  EXPECT_EQ(s.mode, AttentionMode::kSorted);
  EXPECT_EQ(s.streams, 3);
  EXPECT_EQ(s.bucket_tokens, 128);
  setenv("NOPAD_FMHA_STREAMS", "many", 1);
  try {
    attention_schedule_from_env();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NOPAD_FMHA_STREAMS"), std::string::npos) << e.what();
  }
  setenv("NOPAD_FMHA_STREAMS", "2", 1);
  setenv("NOPAD_FMHA_SCHEDULE", "bogus", 1);
  try {
    attention_schedule_from_env();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NOPAD_FMHA_SCHEDULE"), std::string::npos) << e.what();
  }
  unsetenv("NOPAD_FMHA_SCHEDULE");
  unsetenv("NOPAD_FMHA_STREAMS");
  unsetenv("NOPAD_FMHA_BUCKET");
  s = attention_schedule_from_env();
  EXPECT_EQ(s.mode, AttentionSchedule{}.mode);
  EXPECT_EQ(s.streams, AttentionSchedule{}.streams);
}

}  // namespace
}  // namespace nopad::ops
