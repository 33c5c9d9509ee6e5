// Builds and validates one Instance from the arrays a BERT pre-training record of another tool stores (input_ids,
// segment_ids, masked positions and labels, the NSP label): what the HDF5 and TFRecord importers share. Every
// problem throws one nopad::Error naming the file, the field, the record and (for packed rows) the sequence:
//   "<format> <file>, <field kind> '<field>', <record kind> <n>[ (packed sequence j)]: <what><hint>"
// e.g. "HDF5 file a.hdf5, dataset 'segment_ids', row 7: ..." or "TFRecord file b, feature 'input_ids', record 3: ...".
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/error.h"
#include "data/instance.h"

namespace nopad {

struct RecordPlace {
  std::string_view format;  // "HDF5 file", "TFRecord file"
  std::string_view file;
  std::string_view field_kind;   // "dataset", "feature"
  std::string_view record_kind;  // "row", "record"
  uint64_t record = 0;
  int packed_index = -1;  // the sequence within a packed row; -1 when the record holds one sequence
  std::string_view hint;  // appended to every message (what the file is expected to be)
};

[[noreturn]] void fail_record(const RecordPlace& where, std::string_view field, const std::string& what);

template <class... Args>
[[noreturn]] void bad(const RecordPlace& where, std::string_view field, const Args&... what) {
  fail_record(where, field, str_cat(what...));
}

struct InstanceRules {
  int32_t vocab_size = 0;  // token ids and masked labels must be < vocab_size
  int32_t cls_id = -1;     // when >= 0: every sequence starts with it
  int32_t sep_id = -1;     // when >= 0: both segments end with it
};

// tokens/segments of one sequence (segments 0..0 1..1, both parts non-empty, segment A >= 2 tokens), its masked
// positions (strictly ascending, inside the sequence, never 0, after subtracting position_base) and labels, NSP
// label 0 or 1.
Instance make_checked_instance(const RecordPlace& where, std::span<const int32_t> tokens,
                               std::span<const int32_t> segments, std::span<const int32_t> positions,
                               std::span<const int32_t> labels, int32_t nsp, int64_t position_base,
                               const InstanceRules& rules);

// Masked positions padded with trailing zeros (position 0 is [CLS], never masked): the count before the padding;
// a non-zero position after a zero is an error.
size_t unpadded_masked_count(const RecordPlace& where, std::span<const int32_t> positions);

}  // namespace nopad
