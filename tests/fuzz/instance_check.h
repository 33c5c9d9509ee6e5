// The invariants of an Instance that an importer accepted (data/record_check.h's make_checked_instance): what a
// reader hands on must be what the shard writer and the trainer assume, whatever the file held.
#pragma once
#include <cstddef>
#include <cstdint>

#include "data/instance.h"
#include "fuzz_common.h"

namespace nopad::fuzz {

inline void check_instance(const Instance& inst, int32_t vocab_size) {
  const size_t n = inst.tokens.size();
  require(n >= 3, "an accepted instance has at least [CLS] A [SEP] B");
  for (const int32_t t : inst.tokens) require(t >= 0 && t < vocab_size, "token id inside the vocabulary");
  require(inst.a_length >= 2 && static_cast<size_t>(inst.a_length) < n, "segment A inside the sequence");
  require(inst.mlm_positions.size() == inst.mlm_labels.size(), "one label per masked position");
  int64_t previous = 0;
  for (size_t k = 0; k < inst.mlm_positions.size(); ++k) {
    const int32_t p = inst.mlm_positions[k];
    require(p > previous && static_cast<size_t>(p) < n, "masked positions ascending, inside, never 0");
    require(inst.mlm_labels[k] >= 0 && inst.mlm_labels[k] < vocab_size, "masked label inside the vocabulary");
    previous = p;
  }
  require(inst.nsp_label == 0 || inst.nsp_label == 1, "NSP label 0 or 1");
}

}  // namespace nopad::fuzz
