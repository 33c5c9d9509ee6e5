#include "data/dataset.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io.h"

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
  std::error_code ec;
  if (std::filesystem::is_directory(dir_or_file, ec)) {
    folder_ = dir_or_file;
    check_manifest(dir_or_file);
  } else {
    folder_ = dir_or_file.parent_path();
  }
}

// The folder's dataset.json, where there is one, must describe the shards found: a shard lost or added since (a copy
// or an overwrite that did not finish) would otherwise change the data without a word.
void Dataset::check_manifest(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "dataset.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("dataset ", dir.string(), ": ", path.string(), " is not valid JSON (", e.what(),
         "); re-run nopad prepare or nopad convert with --overwrite to rebuild the dataset");
  }
  NOPAD_CHECK(j.is_object(), "dataset ", dir.string(), ": ", path.string(), " is not a JSON object");
  const auto expect = [&](const char* key, uint64_t found, const char* what) {
    if (!j.contains(key)) return;
    NOPAD_CHECK(j[key].is_number_unsigned() && j[key].get<uint64_t>() == found, "dataset ", dir.string(), ": ",
                path.string(), " lists ", j[key].dump(), " ", what, ", the shards in the folder hold ", found,
                " (a shard lost or added since it was written?); restore the folder, or re-run nopad prepare or "
                "nopad convert with --overwrite (a rank's folder of a partitioned dataset, made by "
                "scripts/partition-shards.sh, is read by nopad train with data.placement = partitioned)");
  };
  expect("num_shards", shards_.size(), "shards");
  expect("num_seqs", size(), "sequences");
  expect("vocab_checksum", vocab_checksum(), "as the vocabulary checksum");
  manifest_ = std::move(j);
}

std::pair<size_t, uint64_t> Dataset::locate(uint64_t i) const {
  // offsets_ is sorted; the shard is the last one whose start is <= i.
  const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), i);
  const size_t s = static_cast<size_t>(it - offsets_.begin()) - 1;
  return {s, i - offsets_[s]};
}

}  // namespace nopad
