// libFuzzer target: text_input_fuzz_one (text_input_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "text_input_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::text_input_fuzz_one(data, size);
  return 0;
}
