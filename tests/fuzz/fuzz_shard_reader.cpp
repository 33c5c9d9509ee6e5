// libFuzzer target for ShardReader (built with -DNOPAD_FUZZ=ON and clang): arbitrary bytes must be rejected with
// nopad::Error or read safely. The same body runs deterministically in tests/test_shard.cpp (ShardFuzz.*).
#include <unistd.h>

#include <filesystem>
#include <string>

#include "shard_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::filesystem::path scratch =
      std::filesystem::temp_directory_path() / ("nopad_fuzz_shard_" + std::to_string(::getpid()) + ".nopad");
  nopad::fuzz::shard_fuzz_one(data, size, scratch);
  return 0;
}
