// libFuzzer target: shard_fuzz_one (shard_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "fuzz_common.h"
#include "shard_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::shard_fuzz_one(data, size, nopad::fuzz::scratch_dir() / "input.nopad");
  return 0;
}
