// `nopad prepare`: text files -> documents -> sentences -> WordPiece -> pre-training instances -> shards.
// Parallel over all cores and deterministic: the same inputs, vocabulary, options and seed give byte-identical
// shards whatever the thread count (each stage writes its results by index; randomness is keyed, see instances.h).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "data/documents.h"
#include "data/instances.h"

namespace nopad {

struct PrepareOptions {
  std::vector<std::filesystem::path> inputs;  // files, or folders (every regular file below, sorted)
  std::filesystem::path vocab;
  std::filesystem::path output;
  InstanceOptions instances;
  TextFormat format = TextFormat::kAuto;
  int threads = 0;  // <= 0: all cores
  int64_t seqs_per_shard = 65536;
  bool overwrite = false;  // replace an existing dataset in `output`
  bool progress = true;
};

struct PrepareResult {
  uint64_t input_files = 0, input_bytes = 0;
  uint64_t documents = 0, sentences = 0, text_tokens = 0;
  uint64_t instances = 0, instance_tokens = 0, masked = 0, random_next = 0;
  uint64_t shards = 0, output_bytes = 0;
  double read_s = 0, tokenize_s = 0, instances_s = 0, write_s = 0, total_s = 0;
  int threads = 1;
};

PrepareResult prepare_dataset(const PrepareOptions& options);

// Expands files and folders into the sorted list of input files; throws when a path is missing or nothing is found.
std::vector<std::filesystem::path> expand_inputs(const std::vector<std::filesystem::path>& inputs);

}  // namespace nopad
