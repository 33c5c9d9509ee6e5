// libFuzzer target: config_fuzz_one (config_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "config_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::config_fuzz_one(data, size);
  return 0;
}
