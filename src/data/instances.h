// Pre-training instance creation with the semantics of BERT's create_pretraining_data.py as MLPerf runs it
// (max_seq_length 512, max_predictions 76, masked_lm_prob 0.15, short_seq_prob 0.1, random next sentence 50%,
// 80/10/10 masking, [CLS]/[SEP] never masked, no whole-word masking).
//
// Determinism: every (dupe, document) pair draws from its own random stream keyed by (seed, dupe, document), so
// instances can be made in parallel and the output is identical whatever the thread count. (The reference draws
// everything from one sequential stream; the distribution is the same, the individual draws are not.)
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/rng.h"
#include "data/instance.h"
#include "data/vocab.h"

namespace nopad {

struct InstanceOptions {
  int32_t max_seq_length = 512;
  int32_t max_predictions = 76;
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  int32_t dupe_factor = 10;
  uint64_t seed = 12345;

  void validate() const;  // throws nopad::Error on nonsense values
};

// Documents of tokenised sentences, stored flat: sentence s is tokens[sentence_offsets[s], sentence_offsets[s+1]),
// document d is sentences [doc_offsets[d], doc_offsets[d+1]). Every sentence and document is non-empty.
struct TokenizedCorpus {
  std::vector<int32_t> tokens;
  std::vector<uint64_t> sentence_offsets{0};
  std::vector<uint64_t> doc_offsets{0};

  size_t num_docs() const { return doc_offsets.size() - 1; }
  size_t num_sentences(size_t doc) const { return doc_offsets[doc + 1] - doc_offsets[doc]; }
  std::span<const int32_t> sentence(size_t doc, size_t j) const {
    const uint64_t s = doc_offsets[doc] + j;
    return {tokens.data() + sentence_offsets[s], tokens.data() + sentence_offsets[s + 1]};
  }
  // Appends a document given as its sentences' token lists; empty sentences are skipped, an empty document too.
  void add_document(const std::vector<std::vector<int32_t>>& sentences);
};

// All instances of one document for one dupe round, in document order.
std::vector<Instance> create_instances_from_document(const TokenizedCorpus& corpus, size_t doc_index,
                                                     const Vocab& vocab, const InstanceOptions& options,
                                                     Rng& rng);

// Masks `inst.tokens` in place and fills mlm_positions/mlm_labels (create_masked_lm_predictions).
void mask_instance(Instance& inst, const Vocab& vocab, const InstanceOptions& options, Rng& rng);

}  // namespace nopad
