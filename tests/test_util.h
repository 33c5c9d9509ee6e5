// Shared helpers for the tests: temporary folders, random instances and datasets, the shipped sample data.
#pragma once
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/instance.h"
#include "data/shard.h"

namespace nopad::test {

inline std::filesystem::path source_dir() { return NOPAD_SOURCE_DIR; }
inline std::filesystem::path vocab_path() { return source_dir() / "data/vocab/bert-uncased-vocab.txt"; }
inline std::filesystem::path wiki_sample_dir() { return source_dir() / "data/wiki-sample"; }

// The message of the nopad::Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Expects `stmt` to throw a nopad::Error whose message contains `needle` (GoogleTest files only).
#define NOPAD_EXPECT_ERROR_HAS(stmt, needle)                                                 \
  do {                                                                                       \
    const std::string error_ = ::nopad::test::error_of([&] { stmt; });                        \
    EXPECT_NE(error_.find(needle), std::string::npos) << "error: " << error_;                 \
  } while (0)

// A fresh empty folder, removed when the object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "t") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("nopad-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// A random, well-formed instance: [CLS]=101 A [SEP]=102 B [SEP], ids in [1000, vocab_size).
inline Instance random_instance(Rng& rng, int32_t vocab_size = 30522, int32_t min_len = 5, int32_t max_len = 512,
                                int32_t max_masked = 76) {
  Instance inst;
  const auto len = static_cast<int32_t>(rng.uniform_int(min_len, max_len));
  const auto a_len = static_cast<int32_t>(rng.uniform_int(2, len - 3)) ;
  inst.tokens.resize(static_cast<size_t>(len));
  for (auto& t : inst.tokens) t = static_cast<int32_t>(rng.uniform_int(1000, vocab_size - 1));
  inst.tokens[0] = 101;
  inst.tokens[static_cast<size_t>(a_len) - 1] = 102;
  inst.tokens[static_cast<size_t>(len) - 1] = 102;
  inst.a_length = a_len;
  inst.nsp_label = static_cast<int32_t>(rng.uniform_int(0, 1));
  const auto masked = static_cast<int32_t>(rng.uniform_int(0, std::min(max_masked, len - 3)));
  std::vector<int32_t> cand;
  for (int32_t i = 1; i < len - 1; ++i)
    if (i != a_len - 1) cand.push_back(i);
  rng.shuffle(cand.begin(), cand.end());
  cand.resize(static_cast<size_t>(std::min<int32_t>(masked, static_cast<int32_t>(cand.size()))));
  std::sort(cand.begin(), cand.end());
  for (int32_t p : cand) {
    inst.mlm_positions.push_back(p);
    inst.mlm_labels.push_back(static_cast<int32_t>(rng.uniform_int(1000, vocab_size - 1)));
  }
  return inst;
}

// Writes `num_shards` shards of random instances into dir; returns all instances in dataset order.
inline std::vector<Instance> write_random_dataset(const std::filesystem::path& dir, size_t num_seqs,
                                                  size_t num_shards, uint64_t seed, int32_t max_len = 512) {
  Rng rng(seed);
  std::vector<Instance> all;
  for (size_t s = 0; s < num_shards; ++s) {
    ShardWriter w(dir / ("shard_" + std::to_string(10000 + s) + ".nopad"), 30522, 0x1234u);
    const size_t begin = num_seqs * s / num_shards, end = num_seqs * (s + 1) / num_shards;
    for (size_t i = begin; i < end; ++i) {
      all.push_back(random_instance(rng, 30522, 5, max_len));
      w.add(all.back());
    }
    w.finish();
  }
  return all;
}

}  // namespace nopad::test
