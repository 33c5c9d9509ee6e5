// Building and validating imported records' instances; see record_check.h.
#include "data/record_check.h"

namespace nopad {

void fail_record(const RecordPlace& w, std::string_view field, const std::string& what) {
  if (w.packed_index >= 0)
    fail(w.format, " ", w.file, ", ", w.field_kind, " '", field, "', ", w.record_kind, " ", w.record,
         " (packed sequence ", w.packed_index, "): ", what, w.hint);
  fail(w.format, " ", w.file, ", ", w.field_kind, " '", field, "', ", w.record_kind, " ", w.record, ": ", what, w.hint);
}

Instance make_checked_instance(const RecordPlace& w, std::span<const int32_t> tokens, std::span<const int32_t> segments,
                               std::span<const int32_t> positions, std::span<const int32_t> labels, int32_t nsp,
                               int64_t position_base, const InstanceRules& opt) {
  const size_t n = tokens.size();
  if (segments.size() != n) bad(w, "segment_ids", segments.size(), " entries but input_ids has ", n);
  if (n < 2 || n > 65535) bad(w, "input_ids", "sequence length ", n, " outside [2, 65535]");
  size_t a_length = 0;
  while (a_length < n && segments[a_length] == 0) ++a_length;
  for (size_t i = a_length; i < n; ++i)
    if (segments[i] != 1)
      bad(w, "segment_ids", "segment id ", segments[i], " at position ", i,
          " breaks the form 0..0 1..1 ([CLS] A [SEP] then B [SEP])");
  if (a_length < 2) bad(w, "segment_ids", "segment A ([CLS] A [SEP]) has only ", a_length, " tokens");
  if (a_length == n) bad(w, "segment_ids", "no segment-B tokens (expected [CLS] A [SEP] B [SEP])");
  for (size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= opt.vocab_size)
      bad(w, "input_ids", "token id ", tokens[i], " at position ", i, " is outside the vocabulary of ", opt.vocab_size,
          " tokens (wrong --vocab?)");
  if (opt.cls_id >= 0 && tokens[0] != opt.cls_id)
    bad(w, "input_ids", "sequence starts with token ", tokens[0], ", not [CLS] (", opt.cls_id, ")");
  if (opt.sep_id >= 0 && (tokens[a_length - 1] != opt.sep_id || tokens[n - 1] != opt.sep_id))
    bad(w, "input_ids", "segment A or B does not end with [SEP] (", opt.sep_id, ")");
  if (nsp != 0 && nsp != 1) bad(w, "next_sentence_labels", "label ", nsp, " is not 0 (IsNext) or 1 (random)");
  if (positions.size() != labels.size())
    bad(w, "masked_lm_ids", labels.size(), " masked labels but ", positions.size(), " masked positions");

  Instance inst;
  inst.tokens.assign(tokens.begin(), tokens.end());
  inst.a_length = static_cast<int32_t>(a_length);
  inst.nsp_label = nsp;
  inst.mlm_positions.reserve(positions.size());
  inst.mlm_labels.reserve(labels.size());
  int64_t prev = 0;  // position 0 is [CLS], never masked
  for (size_t k = 0; k < positions.size(); ++k) {
    const int64_t p = static_cast<int64_t>(positions[k]) - position_base;
    if (p <= 0 || p >= static_cast<int64_t>(n))
      bad(w, "masked_lm_positions", "masked position ", positions[k], " lies outside the sequence (length ", n,
          position_base ? str_cat(", starting at ", position_base, " in the row") : std::string(), ")");
    if (p <= prev) bad(w, "masked_lm_positions", "masked positions are not strictly ascending at entry ", k);
    if (labels[k] < 0 || labels[k] >= opt.vocab_size)
      bad(w, "masked_lm_ids", "label ", labels[k], " is outside the vocabulary of ", opt.vocab_size, " tokens");
    inst.mlm_positions.push_back(static_cast<int32_t>(p));
    inst.mlm_labels.push_back(labels[k]);
    prev = p;
  }
  return inst;
}

size_t unpadded_masked_count(const RecordPlace& w, std::span<const int32_t> positions) {
  size_t k = 0;
  while (k < positions.size() && positions[k] != 0) ++k;
  for (size_t j = k; j < positions.size(); ++j)
    if (positions[j] != 0)
      bad(w, "masked_lm_positions", "non-zero position ", positions[j], " at entry ", j,
          " after zero padding (position 0 is [CLS] and is never masked)");
  return k;
}

}  // namespace nopad
