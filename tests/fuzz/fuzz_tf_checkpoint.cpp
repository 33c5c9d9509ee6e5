// libFuzzer target: tf_checkpoint_fuzz_one (tf_checkpoint_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "tf_checkpoint_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::tf_checkpoint_fuzz_one(data, size);
  return 0;
}
