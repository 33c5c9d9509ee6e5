#include "data/stats.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace nopad {

DatasetStats compute_stats(const Dataset& dataset, uint32_t padded_length) {
  DatasetStats s;
  // The tables grow with the lengths seen, never from a header's claim.
  s.length_counts.assign(1, 0);
  s.min_length = UINT32_MAX;
  for (size_t sh = 0; sh < dataset.num_shards(); ++sh) {
    const ShardReader& r = dataset.shard(sh);
    for (uint64_t i = 0; i < r.num_seqs(); ++i) {
      const uint32_t len = r.length(i), masked = r.num_masked(i);
      if (len >= s.length_counts.size()) s.length_counts.resize(len + 1, 0);
      ++s.length_counts[len];
      if (masked >= s.masked_counts.size()) s.masked_counts.resize(masked + 1, 0);
      ++s.masked_counts[masked];
      s.num_tokens += len;
      s.num_masked += masked;
      s.min_length = std::min(s.min_length, len);
      s.max_length = std::max(s.max_length, len);
      s.max_masked = std::max(s.max_masked, masked);
      s.random_next += r.sample(i).nsp_label;
    }
    s.num_seqs += r.num_seqs();
  }
  if (s.num_seqs == 0) s.min_length = 0;
  NOPAD_CHECK(padded_length == 0 || padded_length >= s.max_length, "padded length ", padded_length,
              " is shorter than the longest sequence of the data (", s.max_length,
              " tokens): a padded batch holds every sequence whole; give at least ", s.max_length,
              " or leave it unset");
  s.padded_length = padded_length > 0 ? padded_length : std::max<uint32_t>(1, s.max_length);
  return s;
}

double DatasetStats::length_percentile(double q) const {
  if (num_seqs == 0) return 0.0;
  const double target = q * static_cast<double>(num_seqs);
  uint64_t seen = 0;
  for (size_t len = 0; len < length_counts.size(); ++len) {
    seen += length_counts[len];
    if (static_cast<double>(seen) >= target) return static_cast<double>(len);
  }
  return static_cast<double>(max_length);
}

std::string format_stats(const DatasetStats& s, uint32_t bin) {
  std::string out;
  char line[1024];
  std::snprintf(line, sizeof line,
                "sequences %llu, real tokens %llu, masked %llu, random-next %.1f%%\n"
                "length: min %u, mean %.1f, median %.0f, p90 %.0f, max %u\n"
                "padding to %u would waste %.1f%% of every batch (%.2fx the real tokens)\n"
                "masked per sequence: mean %.2f, max %u (%.2f%% of real tokens)\n",
                static_cast<unsigned long long>(s.num_seqs), static_cast<unsigned long long>(s.num_tokens),
                static_cast<unsigned long long>(s.num_masked),
                s.num_seqs ? 100.0 * static_cast<double>(s.random_next) / s.num_seqs : 0.0, s.min_length,
                s.mean_length(), s.length_percentile(0.5), s.length_percentile(0.9), s.max_length, s.padded_length,
                100.0 * s.padding_fraction(), s.padding_fraction() < 1 ? 1.0 / (1.0 - s.padding_fraction()) : 0.0,
                s.mean_masked(), s.max_masked,
                s.num_tokens ? 100.0 * static_cast<double>(s.num_masked) / s.num_tokens : 0.0);
  out += line;
  out += "length histogram:\n";
  uint64_t peak = 1;
  std::vector<uint64_t> bins((s.length_counts.size() + bin - 1) / bin + 1, 0);
  for (size_t len = 0; len < s.length_counts.size(); ++len) bins[len / bin] += s.length_counts[len];
  for (uint64_t b : bins) peak = std::max(peak, b);
  for (size_t b = 0; b < bins.size(); ++b) {
    if (b * bin > s.max_length) break;
    const int width = static_cast<int>(50.0 * static_cast<double>(bins[b]) / static_cast<double>(peak) + 0.5);
    std::snprintf(line, sizeof line, "  %4zu-%-4zu %9llu %5.1f%% %s\n", b * bin, (b + 1) * bin - 1,
                  static_cast<unsigned long long>(bins[b]),
                  s.num_seqs ? 100.0 * static_cast<double>(bins[b]) / s.num_seqs : 0.0,
                  std::string(static_cast<size_t>(width), '#').c_str());
    out += line;
  }
  return out;
}

std::string stats_json(const DatasetStats& s) {
  nlohmann::json j = {
      {"num_seqs", s.num_seqs},
      {"num_tokens", s.num_tokens},
      {"num_masked", s.num_masked},
      {"random_next_fraction", s.num_seqs ? static_cast<double>(s.random_next) / s.num_seqs : 0.0},
      {"min_length", s.min_length},
      {"max_length", s.max_length},
      {"mean_length", s.mean_length()},
      {"median_length", s.length_percentile(0.5)},
      {"p90_length", s.length_percentile(0.9)},
      {"padded_length", s.padded_length},
      {"padding_fraction", s.padding_fraction()},
      {"mean_masked", s.mean_masked()},
      {"max_masked", s.max_masked},
      {"length_counts", s.length_counts},
      {"masked_counts", s.masked_counts},
  };
  return j.dump() + "\n";
}

}  // namespace nopad
