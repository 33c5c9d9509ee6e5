// Statistics of a dataset (`nopad stats`): counts, the length histogram, what padding would waste, masked counts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace nopad {

struct DatasetStats {
  uint64_t num_seqs = 0, num_tokens = 0, num_masked = 0, random_next = 0;
  uint32_t min_length = 0, max_length = 0, max_masked = 0;
  uint32_t padded_length = 0;            // the length a padded batch would use (the dataset's longest, >= 1)
  std::vector<uint64_t> length_counts;   // length_counts[L] = sequences of exactly L tokens
  std::vector<uint64_t> masked_counts;   // masked_counts[k] = sequences with k masked positions
  double mean_length() const { return num_seqs ? static_cast<double>(num_tokens) / num_seqs : 0.0; }
  double mean_masked() const { return num_seqs ? static_cast<double>(num_masked) / num_seqs : 0.0; }
  // Fraction of a padded [num_seqs, padded_length] batch that would be padding.
  double padding_fraction() const {
    return num_seqs ? 1.0 - static_cast<double>(num_tokens) / (static_cast<double>(num_seqs) * padded_length) : 0.0;
  }
  double length_percentile(double q) const;
};

DatasetStats compute_stats(const Dataset& dataset, uint32_t padded_length = 0);
// A human-readable report with a histogram in `bin`-token bins.
std::string format_stats(const DatasetStats& s, uint32_t bin = 32);
std::string stats_json(const DatasetStats& s);

}  // namespace nopad
