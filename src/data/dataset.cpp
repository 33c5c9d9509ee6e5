#include "data/dataset.h"

#include <algorithm>

#include "core/error.h"

namespace nopad {

Dataset::Dataset(const std::filesystem::path& dir_or_file) : Dataset(dir_or_file, Options{}) {}

Dataset::Dataset(const std::filesystem::path& dir_or_file, const Options& options) {
  const auto paths = list_shards(dir_or_file);
  shards_.reserve(paths.size());
  ShardReader::Options ro;
  ro.verify_checksums = options.verify_checksums;
  ro.expect_vocab_checksum = options.expect_vocab_checksum;
  for (const auto& p : paths) {
    shards_.emplace_back(p, ro);
    const ShardFileHeader& h = shards_.back().header();
    const ShardFileHeader& first = shards_.front().header();
    NOPAD_CHECK(h.vocab_checksum == first.vocab_checksum && h.vocab_size == first.vocab_size, "shard ", p.string(),
                " was built with another vocabulary than ", shards_.front().path().string(),
                ": a dataset must use one vocabulary");
    offsets_.push_back(offsets_.back() + h.num_seqs);
    max_seq_length_ = std::max(max_seq_length_, h.max_seq_length);
  }
}

std::pair<size_t, uint64_t> Dataset::locate(uint64_t i) const {
  // offsets_ is sorted; the shard is the last one whose start is <= i.
  const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), i);
  const size_t s = static_cast<size_t>(it - offsets_.begin()) - 1;
  return {s, i - offsets_[s]};
}

}  // namespace nopad
