// Import of the MLPerf reference's pre-training data: TFRecord files of tf.train.Example records as BERT's
// create_pretraining_data.py writes them (google-research/bert, mlcommons/training), one instance per record:
//   input_ids, input_mask, segment_ids     int64 [max_seq_length], padded with 0; input_mask 1..1 0..0
//   masked_lm_positions, masked_lm_ids     int64 [max_predictions_per_seq], padded with 0
//   masked_lm_weights                      float [max_predictions_per_seq], 1.0 for a real mask, 0.0 for padding
//                                          (optional; when present it must agree with the positions' padding)
//   next_sentence_labels                   int64 [1]
// Other features are ignored. TFRecord framing: per record a u64 length, the masked CRC-32C of those 8 bytes, the
// serialized Example, the masked CRC-32C of it; both checksums are verified. Compressed (GZIP/ZLIB) files are
// refused with a message. Every problem throws one nopad::Error naming the file, the record and the feature.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "data/instance.h"
#include "data/record_check.h"

namespace nopad {

struct TfRecordSummary {
  uint64_t num_records = 0;
  uint64_t num_tokens = 0;
  uint64_t num_masked = 0;
};

// Reads every record of `path` in file order and hands its instance to `sink`.
TfRecordSummary read_tfrecord_instances(const std::filesystem::path& path, const InstanceRules& rules,
                                        const std::function<void(Instance&&)>& sink);

// Convenience: all instances of a file in a vector.
std::vector<Instance> read_tfrecord_file(const std::filesystem::path& path, const InstanceRules& rules,
                                         TfRecordSummary* summary = nullptr);

}  // namespace nopad
