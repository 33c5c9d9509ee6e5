// Import of NVIDIA / MLPerf BERT pre-training HDF5 files into nopad Instances. Three layouts, detected per file:
//   fixed     input_ids/input_mask/segment_ids [N,S], masked_lm_positions/masked_lm_ids [N,P] (0 = padding),
//             next_sentence_labels [N]; the real length of a row is sum(input_mask), mask must be 1..1 0..0.
//   variable  vlen rows input_ids, segment_ids, masked_lm_positions, masked_lm_ids; next_sentence_labels [N].
//   packed    vlen rows as "variable" holding up to 3 sequences each, plus vlen packed_input_len,
//             packed_masked_lm_len and next_sentence_labels (one entry per packed sequence); a sequence's masked
//             positions are offset by the lengths of the sequences before it in the row.
// Any integer dtype is accepted (converted to int32, saturating); float dtypes, wrong ranks, missing fields, mismatched
// row counts, inconsistent content and damaged variable-length data (parsed by nopad, bounded by the file, never by
// libhdf5's conversion) throw one nopad::Error naming the file, field and row.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "data/instance.h"

namespace nopad {

enum class Hdf5Layout { kFixed, kVariable, kPacked };
const char* hdf5_layout_name(Hdf5Layout layout);

struct Hdf5ImportOptions {
  int32_t vocab_size = 0;  // token ids and masked labels must be < vocab_size (required, > 0)
  // When >= 0, every sequence must start with cls_id and both segments must end with sep_id.
  int32_t cls_id = -1;
  int32_t sep_id = -1;
  int64_t rows_per_block = 4096;  // rows read from the file at once (bounds memory on big files)
};

struct Hdf5FileSummary {
  Hdf5Layout layout = Hdf5Layout::kFixed;
  uint64_t num_rows = 0;    // rows in the file
  uint64_t num_seqs = 0;    // instances produced (> rows for packed files)
  uint64_t num_tokens = 0;
  uint64_t num_masked = 0;
};

// Detects the layout of `path` without reading the data.
Hdf5Layout detect_hdf5_layout(const std::filesystem::path& path);

// Reads every instance of `path` in file order and hands each to `sink`. Throws nopad::Error on the first problem.
// Safe to call from several threads at once (HDF5 calls are serialised internally).
Hdf5FileSummary read_hdf5_instances(const std::filesystem::path& path, const Hdf5ImportOptions& options,
                                    const std::function<void(Instance&&)>& sink);

// Convenience: all instances of a file in a vector.
std::vector<Instance> read_hdf5_file(const std::filesystem::path& path, const Hdf5ImportOptions& options,
                                     Hdf5FileSummary* summary = nullptr);

}  // namespace nopad
