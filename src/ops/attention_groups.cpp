// Grouped attention scheduling: see attention_groups.h.
#include "ops/attention_groups.h"

#include <algorithm>
#include <cstdlib>

#include "core/error.h"

namespace nopad::ops {

const char* attention_mode_name(AttentionMode mode) {
  switch (mode) {
    case AttentionMode::kSingle: return "single";
    case AttentionMode::kSorted: return "sorted";
    case AttentionMode::kGrouped: return "grouped";
  }
  return "?";
}

AttentionMode parse_attention_mode(const std::string& name) {
  if (name == "single") return AttentionMode::kSingle;
  if (name == "sorted") return AttentionMode::kSorted;
  if (name == "grouped") return AttentionMode::kGrouped;
  throw Error("attention schedule '" + name + "' is not one of single, sorted, grouped");
}

void validate(const AttentionSchedule& s) {
  NOPAD_CHECK(s.streams >= 1 && s.streams <= AttentionSchedule::kMaxStreams, "attention streams must be in [1, ",
              AttentionSchedule::kMaxStreams, "], got ", s.streams);
  NOPAD_CHECK(s.bucket_tokens >= 16 && s.bucket_tokens % 16 == 0 && s.bucket_tokens <= 65536,
              "attention bucket width must be a positive multiple of 16 tokens (at most 65536), got ",
              s.bucket_tokens);
}

namespace {
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  NOPAD_CHECK(*end == '\0' && x >= -(1L << 30) && x <= (1L << 30), "environment variable ", name, "=", v,
              " is not an integer");
  return static_cast<int>(x);
}
}  // namespace

AttentionSchedule attention_schedule_from_env() {
  AttentionSchedule s;
  if (const char* m = std::getenv("NOPAD_FMHA_SCHEDULE"); m != nullptr && *m != '\0') {
    try {
      s.mode = parse_attention_mode(m);
    } catch (const Error& e) {
      throw Error(std::string("environment variable NOPAD_FMHA_SCHEDULE: ") + e.what());
    }
  }
  s.streams = env_int("NOPAD_FMHA_STREAMS", s.streams);
  s.bucket_tokens = env_int("NOPAD_FMHA_BUCKET", s.bucket_tokens);
  validate(s);
  return s;
}

void order_by_length(const int32_t* cu_seqlens, int32_t num_seqs, int32_t* order) {
  for (int32_t i = 0; i < num_seqs; ++i) order[i] = i;
  // std::sort with a total order (length, then index) is deterministic and does not allocate (std::stable_sort may).
  std::sort(order, order + num_seqs, [cu_seqlens](int32_t a, int32_t b) {
    const int32_t la = cu_seqlens[a + 1] - cu_seqlens[a], lb = cu_seqlens[b + 1] - cu_seqlens[b];
    return la != lb ? la > lb : a < b;
  });
}

namespace {
int64_t tile_cost(int32_t len) {
  const int64_t t = (static_cast<int64_t>(len) + 63) / 64;
  return t * t;
}
}  // namespace

void plan_attention(const int32_t* cu_seqlens, const int32_t* order, int32_t num_seqs, const AttentionSchedule& s,
                    AttentionPlan& plan) {
  validate(s);
  NOPAD_CHECK(num_seqs >= 0, "plan_attention: negative num_seqs");
  plan.num_groups = 0;
  plan.num_streams = 1;
  plan.mode = order == nullptr ? AttentionMode::kSingle : s.mode;
  plan.uses_order = plan.mode != AttentionMode::kSingle;
  if (num_seqs == 0) return;
  const auto len = [&](int32_t i) { return cu_seqlens[i + 1] - cu_seqlens[i]; };

  if (plan.mode != AttentionMode::kGrouped) {  // one launch over everything
    AttentionGroup& g = plan.groups[0];
    g = AttentionGroup{};
    g.count = num_seqs;
    for (int32_t i = 0; i < num_seqs; ++i) {
      g.max_seqlen = std::max(g.max_seqlen, len(i));
      g.cost += tile_cost(len(i));
    }
    plan.num_groups = 1;
    return;
  }

  // Runs of equal bucket in the length order (longest first); past kMaxGroups - 1 groups, the rest is one group.
  const auto bucket = [&](int32_t l) { return (static_cast<int64_t>(l) + s.bucket_tokens - 1) / s.bucket_tokens; };
  int32_t i = 0;
  while (i < num_seqs && len(order[i]) > 0) {
    AttentionGroup& g = plan.groups[plan.num_groups++];
    g = AttentionGroup{};
    g.begin = i;
    g.max_seqlen = len(order[i]);
    const int64_t b = bucket(g.max_seqlen);
    const bool last = plan.num_groups == AttentionPlan::kMaxGroups;
    while (i < num_seqs && len(order[i]) > 0 && (last || bucket(len(order[i])) == b)) {
      g.cost += tile_cost(len(order[i]));
      ++i;
    }
    g.count = i - g.begin;
  }
  // Longest-processing-time first: groups by cost, each to the stream with the least work so far (ties: the lower
  // stream, so one group always runs on the caller's stream).
  int64_t load[AttentionSchedule::kMaxStreams] = {};
  int idx[AttentionPlan::kMaxGroups];
  for (int g = 0; g < plan.num_groups; ++g) idx[g] = g;
  std::sort(idx, idx + plan.num_groups, [&plan](int a, int b) {
    return plan.groups[a].cost != plan.groups[b].cost ? plan.groups[a].cost > plan.groups[b].cost : a < b;
  });
  for (int k = 0; k < plan.num_groups; ++k) {
    AttentionGroup& g = plan.groups[idx[k]];
    int best = 0;
    for (int st = 1; st < s.streams; ++st)
      if (load[st] < load[best]) best = st;
    g.stream = best;
    load[best] += g.cost;
    plan.num_streams = std::max(plan.num_streams, best + 1);
  }
}

}  // namespace nopad::ops
