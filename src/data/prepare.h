// `nopad prepare`: text files (plain or compressed, or standard input; data/text_input.h) -> documents -> sentences
// -> WordPiece -> pre-training instances -> shards.
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
  std::vector<std::filesystem::path> inputs;  // files, folders (every regular file below, sorted), or "-" (stdin)
  std::filesystem::path vocab;
  std::filesystem::path output;
  InstanceOptions instances;
  TextFormat format = TextFormat::kAuto;  // kAuto: detected per file (detect_text_format)
  std::string text_field = "text";        // the field of a JSON-lines record that holds its text
  // Casing of the tokenizer: "auto" follows the vocabulary (data/tokenizer_files.h), "true"/"false" force it.
  std::string lower_case = "auto";
  int threads = 0;  // <= 0: all cores
  int64_t seqs_per_shard = 65536;
  bool overwrite = false;  // replace an existing dataset in `output`
  bool progress = true;
  // Held-out evaluation set (MLPerf's protocol: exactly eval_samples instances from documents that training never
  // sees). When eval_output is set, documents are drawn in a seeded random order and held out until their instances
  // (eval_dupe_factor passes, random next segments drawn only from held-out documents) reach eval_samples; a seeded
  // shuffle picks exactly eval_samples of them for eval_output; the training set is made from the other documents.
  std::filesystem::path eval_output;
  int64_t eval_samples = 10000;
  int eval_dupe_factor = 0;  // 0: the training dupe_factor
};

struct PrepareResult {
  uint64_t input_files = 0, input_bytes = 0;  // bytes of text read (decompressed; JSON lines: the records' texts)
  uint64_t documents = 0, sentences = 0, text_tokens = 0;
  uint64_t instances = 0, instance_tokens = 0, masked = 0, random_next = 0;
  uint64_t shards = 0, output_bytes = 0;
  uint64_t eval_documents = 0, eval_instances = 0, eval_candidates = 0;  // held out; written; made before the pick
  double read_s = 0, tokenize_s = 0, instances_s = 0, write_s = 0, total_s = 0;
  int threads = 1;
};

PrepareResult prepare_dataset(const PrepareOptions& options);

// Expands files and folders into the list of input files (each folder's files sorted; hidden ones skipped); "-"
// (standard input, at most once) and named pipes stay as given. Throws when a path is missing or nothing is found.
std::vector<std::filesystem::path> expand_inputs(const std::vector<std::filesystem::path>& inputs);

}  // namespace nopad
