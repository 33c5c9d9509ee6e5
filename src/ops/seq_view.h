// The view-level contracts of ops::SeqView that every backend checks the same way (host-side, on the view's fields
// only, never on its device arrays): whole sequences for the ops that need them, and a query-row view that matches
// its key view (attention_forward_rows / attention_backward_rows). A backend adds the checks its own data allows
// (the CPU twin, whose arrays are host memory, also checks each query's position).
#pragma once

#include "ops/ops.h"

namespace nopad::ops {

// The attention and embedding ops work on whole sequences: a view with row_positions (a subset of rows) is rejected.
void require_whole_sequences(const SeqView& seqs, const char* op);

// q_seqs, the query side of an attention over seqs: as many sequences, with cu_seqlens and row_positions.
void require_query_rows(const SeqView& seqs, const SeqView& q_seqs, const char* op);

}  // namespace nopad::ops
