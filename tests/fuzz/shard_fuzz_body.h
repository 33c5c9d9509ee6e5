// The shard-reader fuzz body, shared by the libFuzzer target (fuzz_shard_reader.cpp) and the deterministic regression
// loop in tests/test_shard.cpp: arbitrary bytes are written to a file and opened with ShardReader, with and without
// checksum verification; every sample of an accepted file is read. Contract: nopad::Error is the only way to reject
// a file; anything else (a crash, an out-of-bounds read, another exception type) is a bug.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "core/error.h"
#include "data/shard.h"

namespace nopad::fuzz {

// Returns the number of files (out of the two opening modes) that were accepted.
inline int shard_fuzz_one(const uint8_t* data, size_t size, const std::filesystem::path& scratch_file) {
  {
    std::FILE* f = std::fopen(scratch_file.c_str(), "wb");
    if (!f) throw std::runtime_error("fuzz: cannot create " + scratch_file.string());
    const size_t written = size ? std::fwrite(data, 1, size, f) : 0;
    std::fclose(f);
    if (written != size) throw std::runtime_error("fuzz: cannot write " + scratch_file.string());
  }
  int accepted = 0;
  for (const bool verify : {true, false}) {
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
      if (sink == 0xFFFFFFFFFFFFFFFFull) std::fputs("", stderr);  // keeps the reads observable
      ++accepted;
    } catch (const Error&) {
      // Rejected with a clear error: the expected outcome for damaged input.
    }
  }
  return accepted;
}

}  // namespace nopad::fuzz
