// Every fuzz target by name: the name is its corpus folder (tests/fuzz/corpus/NAME), its regression folder
// (tests/fuzz/regressions/NAME) and, prefixed with fuzz_, its libFuzzer executable (tests/fuzz/fuzz_NAME.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "config_fuzz_body.h"
#include "fuzz_common.h"
#include "hdf5_fuzz_body.h"
#include "shard_fuzz_body.h"
#include "text_input_fuzz_body.h"
#include "tf_checkpoint_fuzz_body.h"
#include "tfrecord_fuzz_body.h"
#include "tokenizer_fuzz_body.h"

namespace nopad::fuzz {

inline void shard_reader_fuzz_one(const uint8_t* data, size_t size) {
  shard_fuzz_one(data, size, scratch_dir() / "input.nopad");
}

struct Target {
  std::string_view name;
  void (*run)(const uint8_t* data, size_t size);
};

inline constexpr Target kTargets[] = {
    {"shard_reader", shard_reader_fuzz_one}, {"text_input", text_input_fuzz_one},
    {"tokenizer", tokenizer_fuzz_one},       {"tfrecord", tfrecord_fuzz_one},
    {"hdf5", hdf5_fuzz_one},                 {"tf_checkpoint", tf_checkpoint_fuzz_one},
    {"config", config_fuzz_one},
};

}  // namespace nopad::fuzz
