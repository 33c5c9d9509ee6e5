// The shard-reader fuzz body, shared by the libFuzzer target (fuzz_shard_reader.cpp), the deterministic mutation
// loop in tests/test_shard.cpp and the seed and regression replay (tests/test_fuzz_regressions.cpp): arbitrary bytes
// are written to a file and opened with ShardReader, with and without checksum verification; every sample of an
// accepted file is read, and its statistics computed and formatted as `nopad stats` does. A file whose header
// checksum is wrong is also opened with that checksum repaired
// (verification off), so that mutated header fields reach the checks behind it, as a lying but well-formed header
// would. Contract: nopad::Error is the only way to reject a file; anything else (a crash, an out-of-bounds read,
// another exception type) is a bug.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "core/crc32.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "data/stats.h"

namespace nopad::fuzz {

inline void shard_write_scratch(const uint8_t* data, size_t size, const std::filesystem::path& scratch_file) {
  std::FILE* f = std::fopen(scratch_file.c_str(), "wb");
  if (!f) throw std::runtime_error("fuzz: cannot create " + scratch_file.string());
  const size_t written = size ? std::fwrite(data, 1, size, f) : 0;
  std::fclose(f);
  if (written != size) throw std::runtime_error("fuzz: cannot write " + scratch_file.string());
}

// Opens the scratch file and reads every sample; true when it was accepted.
inline bool shard_read_all(const std::filesystem::path& scratch_file, bool verify) {
  try {
    ShardReader::Options options;
    options.verify_checksums = verify;
    const ShardReader reader(scratch_file, options);
    uint64_t sink = 0;  // touch every byte a sample exposes, so that a bad index is an out-of-bounds read
    for (uint64_t i = 0; i < reader.num_seqs(); ++i) {
      const SampleRef s = reader.sample(i);
      for (uint32_t k = 0; k < s.length; ++k) sink += static_cast<uint32_t>(s.token(k));
      for (uint32_t k = 0; k < s.num_masked; ++k) sink += s.mlm_positions[k] + static_cast<uint32_t>(s.mlm_label(k));
      sink += s.a_length + s.nsp_label;
    }
    reader.validate_samples();
    const Dataset dataset(scratch_file, Dataset::Options{verify, -1});
    const DatasetStats stats = compute_stats(dataset);
    sink += format_stats(stats).size() + stats_json(stats).size();
    if (sink == 0xFFFFFFFFFFFFFFFFull) std::fputs("", stderr);  // keeps the reads observable
    return true;
  } catch (const Error&) {
    return false;  // rejected with a clear error: the expected outcome for damaged input
  }
}

// Returns the number of files (out of the two opening modes of the bytes as given) that were accepted.
inline int shard_fuzz_one(const uint8_t* data, size_t size, const std::filesystem::path& scratch_file) {
  shard_write_scratch(data, size, scratch_file);
  int accepted = 0;
  for (const bool verify : {true, false}) accepted += shard_read_all(scratch_file, verify) ? 1 : 0;
  if (size >= sizeof(ShardFileHeader)) {
    ShardFileHeader h;
    std::memcpy(&h, data, sizeof h);
    const uint32_t stored = h.header_crc;
    h.header_crc = 0;
    const uint32_t crc = crc32(&h, sizeof h);
    if (crc != stored) {
      std::string repaired(reinterpret_cast<const char*>(data), size);
      h.header_crc = crc;
      std::memcpy(repaired.data(), &h, sizeof h);
      shard_write_scratch(reinterpret_cast<const uint8_t*>(repaired.data()), size, scratch_file);
      shard_read_all(scratch_file, false);
    }
  }
  return accepted;
}

}  // namespace nopad::fuzz
