// A dataset: every shard of a folder (or one shard file), memory-mapped, seen as one array of samples indexed
// 0..size()-1 in shard order. All shards must share one vocabulary (checked against each other and, optionally,
// against the vocabulary a run expects). A folder's dataset.json, where there is one, must match its shards: their
// number, their sequences and their vocabulary checksum.
#pragma once
#include <cstdint>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/shard.h"

namespace nopad {

class Dataset {
 public:
  struct Options {
    bool verify_checksums = true;
    int64_t expect_vocab_checksum = -1;  // >= 0: required vocabulary checksum
  };
  Dataset() = default;
  explicit Dataset(const std::filesystem::path& dir_or_file);
  Dataset(const std::filesystem::path& dir_or_file, const Options& options);

  uint64_t size() const { return offsets_.back(); }
  size_t num_shards() const { return shards_.size(); }
  const ShardReader& shard(size_t s) const { return shards_[s]; }
  uint32_t vocab_checksum() const { return shards_.front().header().vocab_checksum; }
  uint32_t vocab_size() const { return shards_.front().header().vocab_size; }
  uint32_t max_seq_length() const { return max_seq_length_; }
  // The folder of the shards (a single shard file: its folder), and its dataset.json (null when there is none).
  const std::filesystem::path& folder() const { return folder_; }
  const nlohmann::json& manifest() const { return manifest_; }

  // Shard and index within it of global sample i.
  std::pair<size_t, uint64_t> locate(uint64_t i) const;
  SampleRef sample(uint64_t i) const {
    const auto [s, j] = locate(i);
    return shards_[s].sample(j);
  }
  uint32_t length(uint64_t i) const {
    const auto [s, j] = locate(i);
    return shards_[s].length(j);
  }
  uint32_t num_masked(uint64_t i) const {
    const auto [s, j] = locate(i);
    return shards_[s].num_masked(j);
  }

 private:
  void check_manifest(const std::filesystem::path& dir);
  std::vector<ShardReader> shards_;
  std::vector<uint64_t> offsets_{0};
  uint32_t max_seq_length_ = 0;
  std::filesystem::path folder_;
  nlohmann::json manifest_;
};

}  // namespace nopad
