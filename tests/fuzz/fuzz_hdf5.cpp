// libFuzzer target: hdf5_fuzz_one (hdf5_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "hdf5_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::hdf5_fuzz_one(data, size);
  return 0;
}
