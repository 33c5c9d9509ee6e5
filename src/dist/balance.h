// The data-parallel workload balancer. With unpadded batches a rank that draws long sequences works longer, and
// every all-reduce waits for the slowest rank. For one global batch (its sequence lengths, the same list on every
// rank) plan_balance decides which rank trains which sequence. The plan is a pure function of its arguments, so
// every rank computes the same plan without communicating.
//  * kNone: rank r gets the r-th contiguous slice (the split of ContiguousAssigner, data/loader.h).
//  * kStratified: sequences sorted by length are dealt in snake order, so every rank gets the same count (+-1) and
//    the same mix of lengths.
//  * kCost: longest-processing-time greedy on a cost model (each sequence, most expensive first, goes to the rank
//    with the least cost so far), optionally capped in sequences per rank.
// BalancedAssigner plugs a mode into the Loader; read_length_histogram reads length histograms (data/lengths/) for
// simulating the balance of a dataset without its shards.
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "data/loader.h"

namespace nopad::dist {

enum class BalanceMode { kNone, kStratified, kCost };

// "none" | "stratified" | "cost"; anything else is an Error naming the three choices.
BalanceMode parse_balance_mode(std::string_view name);
const char* balance_mode_name(BalanceMode m);

// Cost of one sequence of L tokens, in arbitrary units: per_token * L + per_token_sq * L^2 (the GEMMs and the rest
// are linear in L, attention quadratic). The caller measures the coefficients from the model's step time; the
// defaults (1, 0) make cost = tokens. Both must be finite and >= 0 (checked by plan_balance), so cost never
// decreases with length.
struct CostModel {
  double per_token = 1.0;
  double per_token_sq = 0.0;
  double operator()(int64_t length) const {
    const auto l = static_cast<double>(length);
    return per_token * l + per_token_sq * l * l;
  }
};

struct BalancePlan {
  std::vector<int32_t> rank_of;    // [n] rank of sequence i of the global batch
  std::vector<double> rank_cost;   // [world] summed cost per rank
  std::vector<int32_t> rank_seqs;  // [world] sequences per rank
  // max(rank_cost) / mean(rank_cost): 1 is perfect balance (1 also when all costs are zero or there are no ranks).
  double max_over_mean() const;

  // Working memory of plan_balance, not part of the result: kept with the plan so that planning every step does
  // not allocate.
  struct Item {
    double key;     // sort key: length (kStratified) or cost (kCost)
    int32_t index;  // position in the global batch
  };
  struct Load {  // a rank's load so far, an entry of the greedy's min-heap
    double cost;
    int32_t seqs, rank;
  };
  std::vector<Item> scratch_items;     // [n]
  std::vector<Load> scratch_heap;      // [world]
  std::vector<int64_t> scratch_slots;  // [max length + 1] counting sort by length
};

// Fills `plan` for one global batch of sequences with the given lengths (tokens). Deterministic: a pure function of
// its arguments (no RNG; every floating-point sum runs in an order fixed by the inputs). Reuses plan's vectors (no
// allocation once they are large enough).
// max_seqs_per_rank: 0 = no cap; otherwise no rank gets more than that many sequences (must be >= ceil(n / world),
// else Error). world >= 1; n may be 0; lengths must be >= 1 (Error naming the index otherwise).
// Ties are broken by lower index (sorting) and then by fewer sequences and lower rank (kCost's choice of rank).
void plan_balance(std::span<const int32_t> lengths, int world, BalanceMode mode, const CostModel& cost,
                  int max_seqs_per_rank, BalancePlan& plan);

// RankAssigner for the Loader (data/loader.h): plans each global batch with plan_balance on the dataset's lengths
// (Dataset::length(id)); rank r receives its sequences in global-batch order (ascending position), so batches are
// deterministic. Owns its scratch (no allocation per batch once warm).
// Note that kCost (without a cap) gives ranks different numbers of sequences: losses averaged per rank and then
// across ranks would weight sequences unequally.
class BalancedAssigner final : public RankAssigner {
 public:
  BalancedAssigner(BalanceMode mode, CostModel cost, int max_seqs_per_rank = 0);
  void assign(std::span<const uint64_t> global_ids, const Dataset& dataset, int world_size,
              std::vector<std::vector<uint64_t>>& per_rank) override;
  // The plan of the last assign() call (for logging max/mean). Read it on the thread that calls assign(): with a
  // background Loader that is the loader thread, which also plans ahead of the batch being trained.
  const BalancePlan& last_plan() const { return plan_; }
  BalanceMode mode() const { return mode_; }

 private:
  BalanceMode mode_;
  CostModel cost_;
  int max_seqs_per_rank_;
  std::vector<int32_t> lengths_;  // [n] lengths of the global batch being planned
  BalancePlan plan_;
};

// Reads a length histogram file ("length count" lines, '#' comments, blank lines ignored) into (length, count)
// pairs in file order; lengths >= 1, counts >= 0, each length at most once. Errors name the file and line number.
std::vector<std::pair<int32_t, int64_t>> read_length_histogram(const std::filesystem::path& path);

}  // namespace nopad::dist
