// The balancer's three plans, its Loader adapter and the length-histogram reader (see balance.h).
#include "dist/balance.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "core/io.h"

namespace nopad::dist {
namespace {

void check_cost_model(const CostModel& cost) {
  NOPAD_CHECK(std::isfinite(cost.per_token) && cost.per_token >= 0 && std::isfinite(cost.per_token_sq) &&
                  cost.per_token_sq >= 0,
              "balance cost model (per_token ", cost.per_token, ", per_token_sq ", cost.per_token_sq,
              ") needs finite coefficients >= 0: a cost that falls with length cannot be balanced");
}

// Most expensive (or longest) first; ties: lower index first. A strict total order, so the sorted order is unique.
bool before(const BalancePlan::Item& a, const BalancePlan::Item& b) {
  return a.key != b.key ? a.key > b.key : a.index < b.index;
}

// The min-heap's order on (cost, seqs, rank): a is the lighter load.
bool lighter(const BalancePlan::Load& a, const BalancePlan::Load& b) {
  if (a.cost != b.cost) return a.cost < b.cost;
  if (a.seqs != b.seqs) return a.seqs < b.seqs;
  return a.rank < b.rank;
}

// Restores the min-heap after its top entry got heavier: moves the top down past lighter children. One sift instead
// of std::pop_heap + std::push_heap halves the greedy's work.
void sift_down_top(std::vector<BalancePlan::Load>& heap) {
  const size_t n = heap.size();
  if (n == 0) return;
  const BalancePlan::Load moving = heap[0];
  size_t i = 0;
  for (;;) {
    size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && lighter(heap[child + 1], heap[child])) ++child;
    if (!lighter(heap[child], moving)) break;
    heap[i] = heap[child];
    i = child;
  }
  heap[i] = moving;
}

// Fills plan.scratch_items with the global batch sorted by `before`, keyed by length (by_cost false) or by cost.
// Lengths are small integers, so a counting sort by length (descending, stable in index) does it in O(n + max
// length) where std::sort of a batch full of equal lengths was the planner's slowest part. Cost never decreases with
// length (coefficients >= 0, and rounding is monotonic), so the length order is also the cost order; only different
// lengths with equal costs (all-zero coefficients, say) need their index order restored.
void sort_items(std::span<const int32_t> lengths, const CostModel& cost, bool by_cost, BalancePlan& plan) {
  auto& items = plan.scratch_items;
  items.resize(lengths.size());
  const auto key = [&](int32_t length) { return by_cost ? cost(length) : static_cast<double>(length); };
  int32_t max_length = 0;
  for (const int32_t l : lengths) max_length = std::max(max_length, l);
  constexpr int32_t kCountingLimit = 1 << 20;  // beyond this, counting slots cost more than they save
  if (max_length > std::max<int64_t>(kCountingLimit, static_cast<int64_t>(lengths.size()))) {
    for (size_t i = 0; i < lengths.size(); ++i) items[i] = {key(lengths[i]), static_cast<int32_t>(i)};
    std::sort(items.begin(), items.end(), before);
    return;
  }
  auto& slot = plan.scratch_slots;  // slot[l]: next position for a sequence of length l
  slot.assign(static_cast<size_t>(max_length) + 1, 0);
  for (const int32_t l : lengths) ++slot[static_cast<size_t>(l)];
  int64_t position = 0;
  for (int32_t l = max_length; l >= 1; --l) {
    const int64_t count = slot[static_cast<size_t>(l)];
    slot[static_cast<size_t>(l)] = position;
    position += count;
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int32_t l = lengths[i];
    items[static_cast<size_t>(slot[static_cast<size_t>(l)]++)] = {key(l), static_cast<int32_t>(i)};
  }
  if (!by_cost) return;
  for (size_t begin = 0; begin < items.size();) {
    size_t end = begin + 1;
    while (end < items.size() && items[end].key == items[begin].key) ++end;
    if (!std::is_sorted(items.begin() + static_cast<std::ptrdiff_t>(begin),
                        items.begin() + static_cast<std::ptrdiff_t>(end), before))
      std::sort(items.begin() + static_cast<std::ptrdiff_t>(begin), items.begin() + static_cast<std::ptrdiff_t>(end),
                before);
    begin = end;
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

bool parse_int(std::string_view t, int64_t* out) {
  if (t.empty()) return false;
  const auto r = std::from_chars(t.data(), t.data() + t.size(), *out);
  return r.ec == std::errc() && r.ptr == t.data() + t.size();
}

}  // namespace

BalanceMode parse_balance_mode(std::string_view name) {
  if (name == "none") return BalanceMode::kNone;
  if (name == "stratified") return BalanceMode::kStratified;
  if (name == "cost") return BalanceMode::kCost;
  fail("unknown balance mode '", name, "': choose none, stratified or cost");
}

const char* balance_mode_name(BalanceMode m) {
  switch (m) {
    case BalanceMode::kNone: return "none";
    case BalanceMode::kStratified: return "stratified";
    case BalanceMode::kCost: return "cost";
  }
  return "?";
}

double BalancePlan::max_over_mean() const {
  double sum = 0, max = 0;
  for (const double c : rank_cost) {
    sum += c;
    max = std::max(max, c);
  }
  if (rank_cost.empty() || !(sum > 0)) return 1.0;
  return max / (sum / static_cast<double>(rank_cost.size()));
}

void plan_balance(std::span<const int32_t> lengths, int world, BalanceMode mode, const CostModel& cost,
                  int max_seqs_per_rank, BalancePlan& plan) {
  NOPAD_CHECK(world >= 1, "balance: world size ", world, " must be at least 1");
  NOPAD_CHECK(lengths.size() <= static_cast<size_t>(INT32_MAX), "balance: a global batch of ", lengths.size(),
              " sequences is more than the 2^31 - 1 the plan can index; use a smaller global batch");
  NOPAD_CHECK(max_seqs_per_rank >= 0, "balance: max_seqs_per_rank ", max_seqs_per_rank,
              " must be >= 0 (0 = no cap)");
  check_cost_model(cost);
  const auto n = static_cast<int64_t>(lengths.size());
  const auto w = static_cast<int64_t>(world);
  const int64_t fair_share = (n + w - 1) / w;  // ceil(n / world): the fewest sequences the fullest rank can have
  NOPAD_CHECK(max_seqs_per_rank == 0 || max_seqs_per_rank >= fair_share, "balance: max_seqs_per_rank ",
              max_seqs_per_rank, " cannot hold ", n, " sequences on ", world, " ranks; it must be at least ",
              fair_share, " (ceil(", n, " / ", world, ")), or 0 for no cap");
  for (size_t i = 0; i < lengths.size(); ++i)
    NOPAD_CHECK(lengths[i] >= 1, "balance: sequence at index ", i, " of the global batch has length ", lengths[i],
                "; every sequence needs at least 1 token");

  plan.rank_of.resize(static_cast<size_t>(n));
  plan.rank_cost.assign(static_cast<size_t>(world), 0.0);
  plan.rank_seqs.assign(static_cast<size_t>(world), 0);
  // kNone and kStratified give no rank more than ceil(n / world) sequences, so they always respect the cap.
  switch (mode) {
    case BalanceMode::kNone:
      for (int64_t r = 0; r < w; ++r) {
        const int64_t begin = n * r / w, end = n * (r + 1) / w;  // ContiguousAssigner's slice
        for (int64_t i = begin; i < end; ++i) {
          plan.rank_of[static_cast<size_t>(i)] = static_cast<int32_t>(r);
          plan.rank_cost[static_cast<size_t>(r)] += cost(lengths[static_cast<size_t>(i)]);
        }
        plan.rank_seqs[static_cast<size_t>(r)] = static_cast<int32_t>(end - begin);
      }
      break;
    case BalanceMode::kStratified:
      sort_items(lengths, cost, /*by_cost=*/false, plan);
      for (int64_t k = 0; k < n; ++k) {
        // Snake order 0..W-1, W-1..0: the rank that got the longer one of a round gets the shorter one next round.
        const int64_t round = k / w, pos = k % w;
        const auto r = static_cast<size_t>(round % 2 == 0 ? pos : w - 1 - pos);
        const BalancePlan::Item& item = plan.scratch_items[static_cast<size_t>(k)];
        plan.rank_of[static_cast<size_t>(item.index)] = static_cast<int32_t>(r);
        plan.rank_cost[r] += cost(lengths[static_cast<size_t>(item.index)]);
        ++plan.rank_seqs[r];
      }
      break;
    case BalanceMode::kCost: {
      sort_items(lengths, cost, /*by_cost=*/true, plan);
      // All ranks empty, in rank order: already a valid min-heap.
      plan.scratch_heap.resize(static_cast<size_t>(world));
      for (int32_t r = 0; r < world; ++r) plan.scratch_heap[static_cast<size_t>(r)] = {0.0, 0, r};
      auto& heap = plan.scratch_heap;
      for (const BalancePlan::Item& item : plan.scratch_items) {
        // heap is never empty here: the cap check above leaves room for every sequence.
        BalancePlan::Load& least = heap.front();
        plan.rank_of[static_cast<size_t>(item.index)] = least.rank;
        least.cost += item.key;
        ++least.seqs;
        plan.rank_cost[static_cast<size_t>(least.rank)] = least.cost;
        plan.rank_seqs[static_cast<size_t>(least.rank)] = least.seqs;
        if (max_seqs_per_rank != 0 && least.seqs >= max_seqs_per_rank) {  // full: it takes no more sequences
          least = heap.back();
          heap.pop_back();
        }
        sift_down_top(heap);
      }
      break;
    }
  }
}

BalancedAssigner::BalancedAssigner(BalanceMode mode, CostModel cost, int max_seqs_per_rank)
    : mode_(mode), cost_(cost), max_seqs_per_rank_(max_seqs_per_rank) {
  // Fail when the run is configured, not at its first batch.
  check_cost_model(cost_);
  NOPAD_CHECK(max_seqs_per_rank >= 0, "balance: max_seqs_per_rank ", max_seqs_per_rank,
              " must be >= 0 (0 = no cap)");
}

void BalancedAssigner::assign(std::span<const uint64_t> global_ids, const Dataset& dataset, int world_size,
                              std::vector<std::vector<uint64_t>>& per_rank) {
  lengths_.resize(global_ids.size());
  for (size_t i = 0; i < global_ids.size(); ++i) {
    const uint32_t length = dataset.length(global_ids[i]);
    NOPAD_CHECK(length >= 1 && length <= static_cast<uint32_t>(INT32_MAX), "balance: sample ", global_ids[i],
                " of the dataset has length ", length, "; the balancer needs 1 to 2^31 - 1 tokens (corrupt shard?)");
    lengths_[i] = static_cast<int32_t>(length);
  }
  plan_balance(lengths_, world_size, mode_, cost_, max_seqs_per_rank_, plan_);
  per_rank.resize(static_cast<size_t>(world_size));
  for (auto& ids : per_rank) ids.clear();  // keeps capacity: no allocation once warm
  for (size_t i = 0; i < global_ids.size(); ++i)
    per_rank[static_cast<size_t>(plan_.rank_of[i])].push_back(global_ids[i]);
}

std::vector<std::pair<int32_t, int64_t>> read_length_histogram(const std::filesystem::path& path) {
  const std::string text = read_file(path);
  std::vector<std::pair<int32_t, int64_t>> out;
  std::unordered_map<int32_t, size_t> first_line;
  std::string_view rest = text;
  for (size_t line_no = 1; !rest.empty(); ++line_no) {
    const size_t nl = rest.find('\n');
    const std::string_view raw = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    const std::string_view line = trim(raw.substr(0, raw.find('#')));
    if (line.empty()) continue;
    const size_t gap = line.find_first_of(" \t");
    int64_t length = 0, count = 0;
    NOPAD_CHECK(gap != std::string_view::npos && parse_int(line.substr(0, gap), &length) &&
                    parse_int(trim(line.substr(gap)), &count),
                "length histogram ", path.string(), " line ", line_no,
                ": expected 'length count' (two integers), got '", trim(raw), "'");
    NOPAD_CHECK(length >= 1 && length <= INT32_MAX, "length histogram ", path.string(), " line ", line_no,
                ": length ", length, " is outside 1 to 2^31 - 1");
    NOPAD_CHECK(count >= 0, "length histogram ", path.string(), " line ", line_no, ": count ", count,
                " is negative");
    const auto [it, fresh] = first_line.emplace(static_cast<int32_t>(length), line_no);
    NOPAD_CHECK(fresh, "length histogram ", path.string(), " line ", line_no, ": length ", length,
                " appears twice (first on line ", it->second,
                "); a histogram lists each length once (a per-sequence `nopad stats --workload` file is not one)");
    out.emplace_back(static_cast<int32_t>(length), count);
  }
  NOPAD_CHECK(!out.empty(), "length histogram ", path.string(),
              " holds no 'length count' lines; give a histogram such as data/lengths/enwiki-phase2-lengths.txt");
  return out;
}

}  // namespace nopad::dist
