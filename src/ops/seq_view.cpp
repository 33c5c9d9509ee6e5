// ops/seq_view.h: the SeqView checks shared by the backends.
#include "ops/seq_view.h"

#include "core/error.h"

namespace nopad::ops {

void require_whole_sequences(const SeqView& seqs, const char* op) {
  NOPAD_CHECK(seqs.row_positions == nullptr, op,
              " needs whole sequences: a SeqView with row_positions (a subset of rows) cannot be used");
}

void require_query_rows(const SeqView& seqs, const SeqView& q_seqs, const char* op) {
  NOPAD_CHECK(q_seqs.num_seqs == seqs.num_seqs, op, ": the query rows cover ", q_seqs.num_seqs, " sequences, the keys ",
              seqs.num_seqs);
  NOPAD_CHECK(q_seqs.cu_seqlens != nullptr && q_seqs.row_positions != nullptr, op,
              ": the query rows need cu_seqlens and row_positions");
}

}  // namespace nopad::ops
