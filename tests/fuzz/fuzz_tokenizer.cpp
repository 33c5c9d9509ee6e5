// libFuzzer target: tokenizer_fuzz_one (tokenizer_fuzz_body.h). Built with -DNOPAD_FUZZ=ON (scripts/fuzz.sh).
#include "tokenizer_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nopad::fuzz::tokenizer_fuzz_one(data, size);
  return 0;
}
