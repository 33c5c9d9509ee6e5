#include "data/instances.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace nopad {

void InstanceOptions::validate() const {
  NOPAD_CHECK(max_seq_length >= 5 && max_seq_length <= 65535, "--max-seq-length ", max_seq_length,
              " must be in [5, 65535]");
  NOPAD_CHECK(max_predictions >= 1 && max_predictions <= max_seq_length, "--max-predictions ", max_predictions,
              " must be in [1, max_seq_length]");
  NOPAD_CHECK(masked_lm_prob > 0 && masked_lm_prob < 1, "--masked-lm-prob ", masked_lm_prob, " must be in (0, 1)");
  NOPAD_CHECK(short_seq_prob >= 0 && short_seq_prob <= 1, "--short-seq-prob ", short_seq_prob, " must be in [0, 1]");
  NOPAD_CHECK(dupe_factor >= 1, "--dupe-factor ", dupe_factor, " must be at least 1");
}

void TokenizedCorpus::add_document(const std::vector<std::vector<int32_t>>& sentences) {
  size_t added = 0;
  for (const auto& s : sentences) {
    if (s.empty()) continue;
    tokens.insert(tokens.end(), s.begin(), s.end());
    sentence_offsets.push_back(tokens.size());
    ++added;
  }
  if (added > 0) doc_offsets.push_back(sentence_offsets.size() - 1);
}

namespace {

// Removes tokens from the longer side, at its front or back with equal probability, until the pair fits. The draws
// are those of Google BERT's loop (one per token removed); the removals are counted first and done once, so a
// sentence of n tokens costs O(n), not the O(n^2) of erasing its front token by token.
void truncate_seq_pair(std::vector<int32_t>& a, std::vector<int32_t>& b, size_t max_num_tokens, Rng& rng) {
  size_t len_a = a.size(), len_b = b.size();
  size_t front_a = 0, front_b = 0;
  while (len_a + len_b > max_num_tokens) {
    const bool from_a = len_a > len_b;
    if (rng.uniform() < 0.5) ++(from_a ? front_a : front_b);
    --(from_a ? len_a : len_b);
  }
  a.erase(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(front_a));
  a.resize(len_a);
  b.erase(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(front_b));
  b.resize(len_b);
}

}  // namespace

void mask_instance(Instance& inst, const Vocab& vocab, const InstanceOptions& options, Rng& rng) {
  const SpecialIds& sp = vocab.special();
  std::vector<int32_t> candidates;
  candidates.reserve(inst.tokens.size());
  for (int32_t i = 0; i < static_cast<int32_t>(inst.tokens.size()); ++i)
    if (inst.tokens[i] != sp.cls && inst.tokens[i] != sp.sep) candidates.push_back(i);
  rng.shuffle(candidates.begin(), candidates.end());
  // Python's round() rounds halves to even, as nearbyint does in the default rounding mode.
  const auto rounded = static_cast<int64_t>(std::nearbyint(static_cast<double>(inst.tokens.size()) * options.masked_lm_prob));
  const size_t num_to_predict =
      static_cast<size_t>(std::min<int64_t>(options.max_predictions, std::max<int64_t>(1, rounded)));
  std::vector<std::pair<int32_t, int32_t>> masked;  // (position, original token)
  for (int32_t index : candidates) {
    if (masked.size() >= num_to_predict) break;
    const int32_t original = inst.tokens[index];
    int32_t replacement;
    if (rng.uniform() < 0.8) {
      replacement = sp.mask;
    } else if (rng.uniform() < 0.5) {
      replacement = original;
    } else {
      replacement = static_cast<int32_t>(rng.uniform_int(0, vocab.size() - 1));
    }
    inst.tokens[index] = replacement;
    masked.emplace_back(index, original);
  }
  std::sort(masked.begin(), masked.end());
  inst.mlm_positions.clear();
  inst.mlm_labels.clear();
  for (const auto& [pos, label] : masked) {
    inst.mlm_positions.push_back(pos);
    inst.mlm_labels.push_back(label);
  }
}

std::vector<Instance> create_instances_from_document(const TokenizedCorpus& corpus, size_t doc_index,
                                                     const Vocab& vocab, const InstanceOptions& options,
                                                     Rng& rng) {
  std::vector<Instance> instances;
  const size_t num_docs = corpus.num_docs();
  const size_t doc_len = corpus.num_sentences(doc_index);
  const int64_t max_num_tokens = options.max_seq_length - 3;  // [CLS], [SEP], [SEP]
  // Mostly fill the sequence; sometimes (short_seq_prob) aim shorter so that the model also sees short inputs.
  int64_t target_seq_length = max_num_tokens;
  if (rng.uniform() < options.short_seq_prob) target_seq_length = rng.uniform_int(2, max_num_tokens);

  std::vector<size_t> chunk;  // sentence indices of the current chunk
  int64_t current_length = 0;
  std::vector<int32_t> tokens_a, tokens_b;
  for (int64_t i = 0; i < static_cast<int64_t>(doc_len); ++i) {
    chunk.push_back(static_cast<size_t>(i));
    current_length += static_cast<int64_t>(corpus.sentence(doc_index, static_cast<size_t>(i)).size());
    if (i != static_cast<int64_t>(doc_len) - 1 && current_length < target_seq_length) continue;

    size_t a_end = 1;
    if (chunk.size() >= 2) a_end = static_cast<size_t>(rng.uniform_int(1, static_cast<int64_t>(chunk.size()) - 1));
    tokens_a.clear();
    for (size_t j = 0; j < a_end; ++j) {
      const auto s = corpus.sentence(doc_index, chunk[j]);
      tokens_a.insert(tokens_a.end(), s.begin(), s.end());
    }
    tokens_b.clear();
    bool is_random_next = false;
    if (chunk.size() == 1 || rng.uniform() < 0.5) {
      is_random_next = true;
      const int64_t target_b_length = target_seq_length - static_cast<int64_t>(tokens_a.size());
      // Up to ten tries to pick another document (a corpus of one document falls back to itself).
      size_t random_doc = doc_index;
      for (int attempt = 0; attempt < 10; ++attempt) {
        random_doc = static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(num_docs) - 1));
        if (random_doc != doc_index) break;
      }
      const size_t random_len = corpus.num_sentences(random_doc);
      const auto random_start = static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(random_len) - 1));
      for (size_t j = random_start; j < random_len; ++j) {
        const auto s = corpus.sentence(random_doc, j);
        tokens_b.insert(tokens_b.end(), s.begin(), s.end());
        if (static_cast<int64_t>(tokens_b.size()) >= target_b_length) break;
      }
      // The unused sentences of this chunk go back so the next instance starts with them.
      i -= static_cast<int64_t>(chunk.size() - a_end);
    } else {
      for (size_t j = a_end; j < chunk.size(); ++j) {
        const auto s = corpus.sentence(doc_index, chunk[j]);
        tokens_b.insert(tokens_b.end(), s.begin(), s.end());
      }
    }
    truncate_seq_pair(tokens_a, tokens_b, static_cast<size_t>(max_num_tokens), rng);
    if (!tokens_a.empty() && !tokens_b.empty()) {
      Instance inst;
      const SpecialIds& sp = vocab.special();
      inst.tokens.reserve(tokens_a.size() + tokens_b.size() + 3);
      inst.tokens.push_back(sp.cls);
      inst.tokens.insert(inst.tokens.end(), tokens_a.begin(), tokens_a.end());
      inst.tokens.push_back(sp.sep);
      inst.a_length = static_cast<int32_t>(inst.tokens.size());
      inst.tokens.insert(inst.tokens.end(), tokens_b.begin(), tokens_b.end());
      inst.tokens.push_back(sp.sep);
      inst.nsp_label = is_random_next ? 1 : 0;
      mask_instance(inst, vocab, options, rng);
      instances.push_back(std::move(inst));
    }
    chunk.clear();
    current_length = 0;
  }
  return instances;
}

}  // namespace nopad
