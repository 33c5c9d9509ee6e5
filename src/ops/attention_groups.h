// Scheduling of the grouped multi-stream attention (docs/fmha.md "Grouping"), plain C++ so that it is tested on the
// CPU and shared by the model (which orders a batch once) and a device backend (which cuts the groups per call).
//
//  * order_by_length: the batch's sequences, longest first (ties by index, so the order is deterministic). The model
//    computes it once per batch on the host and uploads it with the batch (SeqView::by_length).
//  * plan_attention: cuts that order into launches.
//      kSingle  one launch over the batch in its own order, sized by the longest sequence (no order needed);
//      kSorted  one launch over the sequences longest first (the block scheduler meets long sequences first, so the
//               short ones fill the tail);
//      kGrouped one launch per length bucket (sequences whose lengths round up to the same multiple of
//               bucket_tokens), so no launch carries row tiles that its sequences do not have, and each group can
//               run a kernel variant chosen for its length; groups are dealt to `streams` streams longest-processing-
//               time first on their cost (64 x 64 attention tiles per head: sum of ceil(L/64)^2).
// Contract: every sequence of the batch is in exactly one launch; groups appear longest first; nothing allocates
// (the plan is a fixed array; at most kMaxGroups groups, the shortest buckets merged into the last if there are more).
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace nopad::ops {

enum class AttentionMode { kSingle, kSorted, kGrouped };

struct AttentionSchedule {
  static constexpr int kMaxStreams = 8;
  // The default is one launch: on real phase-2 batches (65% of the sequences at the full 512 tokens) the grouped
  // launches measured no faster end to end (docs/performance.md, 2026-11-24); grouped is one switch away.
  AttentionMode mode = AttentionMode::kSingle;
  int streams = 4;          // kGrouped: launches spread over this many streams (1 = all on the caller's stream)
  int bucket_tokens = 64;   // kGrouped: group width in tokens (a multiple of 16)
};

// "single", "sorted", "grouped" <-> AttentionMode; parse throws naming the choices.
const char* attention_mode_name(AttentionMode mode);
AttentionMode parse_attention_mode(const std::string& name);
// Throws nopad::Error for streams outside [1, kMaxStreams] or a bucket width that is not a positive multiple of 16.
void validate(const AttentionSchedule& s);
// The process default: AttentionSchedule{} overridden by NOPAD_FMHA_SCHEDULE (single|sorted|grouped),
// NOPAD_FMHA_STREAMS and NOPAD_FMHA_BUCKET when set (read on every call; a bad value is an error naming it).
AttentionSchedule attention_schedule_from_env();

struct AttentionGroup {
  int32_t begin = 0;       // first position in the length order (kSingle: in batch order)
  int32_t count = 0;       // sequences in the launch
  int32_t max_seqlen = 0;  // longest sequence of the launch
  int32_t stream = 0;      // 0 = the caller's stream
  int64_t cost = 0;        // sum over the launch's sequences of ceil(L / 64)^2
};

struct AttentionPlan {
  static constexpr int kMaxGroups = 32;
  AttentionMode mode = AttentionMode::kSingle;
  bool uses_order = false;  // launches index the sequences through the length order (seq_index = order + begin)
  int num_groups = 0;
  int num_streams = 1;      // streams the launches use (1 + the highest group.stream)
  std::array<AttentionGroup, kMaxGroups> groups{};
};

// order[i] = index of the i-th longest sequence (ties: lower index first); cu_seqlens [num_seqs + 1] on the host.
void order_by_length(const int32_t* cu_seqlens, int32_t num_seqs, int32_t* order);

// The launches for one attention call. `order` may be null only for kSingle (with another mode and no order the plan
// falls back to kSingle). Sequences of length 0 are left out of grouped launches (they have no rows).
void plan_attention(const int32_t* cu_seqlens, const int32_t* order, int32_t num_seqs, const AttentionSchedule& s,
                    AttentionPlan& plan);

}  // namespace nopad::ops
