// Small BERT models and random unpadded batches for the CPU and MPI tests: a tiny config whose every path carries a
// visible gradient, a random batch of given lengths (sample ids, masked rows, labels from a seed), and sub-batches
// (a contiguous range, or any list of sequences) that keep each sequence's tokens and sample id.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "data/batch.h"
#include "model/config.h"

namespace nopad::test_support {

inline BertConfig small_config() {
  BertConfig c;
  c.hidden_size = 8;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.intermediate_size = 16;
  c.vocab_size = 13;
  c.max_position_embeddings = 12;
  c.type_vocab_size = 2;
  c.hidden_dropout_prob = 0.1;
  c.attention_probs_dropout_prob = 0.1;
  c.initializer_range = 0.5;  // large weights so every path carries a visible gradient
  return c;
}

// A random batch with the given lengths; sample ids, masked rows and labels drawn from `seed`.
inline HostBatch make_batch(const std::vector<int>& lengths, const std::vector<uint64_t>& sample_ids, int vocab,
                     uint64_t seed, double mask_rate = 0.3) {
  std::mt19937_64 rng(seed);
  HostBatch b;
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int L = lengths[s];
    const int32_t start = b.cu_seqlens.back();
    bool masked_any = false;
    for (int i = 0; i < L; ++i) {
      b.tokens.push_back(static_cast<int32_t>(rng() % vocab));
      b.positions.push_back(i);
      b.segments.push_back(i > L / 2 ? 1 : 0);
      if (i > 0 && (std::uniform_real_distribution<double>(0, 1)(rng) < mask_rate || (!masked_any && i == L - 1))) {
        b.mlm_positions.push_back(start + i);
        b.mlm_labels.push_back(static_cast<int32_t>(rng() % vocab));
        masked_any = true;
      }
    }
    b.cu_seqlens.push_back(start + L);
    b.max_seqlen = std::max(b.max_seqlen, L);
    b.nsp_labels.push_back(static_cast<int32_t>(rng() % 2));
    b.sample_ids.push_back(sample_ids[s]);
  }
  return b;
}

// The sub-batch of sequences [first, last) of `full`, sample ids preserved.
inline HostBatch sub_batch(const HostBatch& full, int first, int last) {
  HostBatch b;
  const int32_t r0 = full.cu_seqlens[first], r1 = full.cu_seqlens[last];
  for (int32_t r = r0; r < r1; ++r) {
    b.tokens.push_back(full.tokens[r]);
    b.positions.push_back(full.positions[r]);
    b.segments.push_back(full.segments[r]);
  }
  for (int s = first; s < last; ++s) {
    b.cu_seqlens.push_back(full.cu_seqlens[s + 1] - r0);
    b.max_seqlen = std::max(b.max_seqlen, full.cu_seqlens[s + 1] - full.cu_seqlens[s]);
    b.nsp_labels.push_back(full.nsp_labels[s]);
    b.sample_ids.push_back(full.sample_ids[s]);
  }
  for (int i = 0; i < full.num_masked(); ++i)
    if (full.mlm_positions[i] >= r0 && full.mlm_positions[i] < r1) {
      b.mlm_positions.push_back(full.mlm_positions[i] - r0);
      b.mlm_labels.push_back(full.mlm_labels[i]);
    }
  return b;
}

// The sequences `seqs` of `full` (in that order) as one batch, sample ids preserved.
inline HostBatch select_batch(const HostBatch& full, std::span<const int> seqs) {
  HostBatch b;
  for (const int s : seqs) {
    const int32_t r0 = full.cu_seqlens[s], r1 = full.cu_seqlens[s + 1], base = b.cu_seqlens.back();
    for (int32_t r = r0; r < r1; ++r) {
      b.tokens.push_back(full.tokens[r]);
      b.positions.push_back(full.positions[r]);
      b.segments.push_back(full.segments[r]);
    }
    for (int i = 0; i < full.num_masked(); ++i)
      if (full.mlm_positions[i] >= r0 && full.mlm_positions[i] < r1) {
        b.mlm_positions.push_back(full.mlm_positions[i] - r0 + base);
        b.mlm_labels.push_back(full.mlm_labels[i]);
      }
    b.cu_seqlens.push_back(base + (r1 - r0));
    b.max_seqlen = std::max(b.max_seqlen, r1 - r0);
    b.nsp_labels.push_back(full.nsp_labels[s]);
    b.sample_ids.push_back(full.sample_ids[s]);
  }
  return b;
}

}  // namespace nopad::test_support
