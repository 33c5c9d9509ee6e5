// libFuzzer target: tfrecord_fuzz_one (tfrecord_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "tfrecord_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::tfrecord_fuzz_one(data, size);
  return 0;
}
