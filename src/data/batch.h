// The unpadded batch: B sequences packed back to back, no padding anywhere (see docs/architecture.md).
//   tokens[T], positions[T] (restart at 0 per sequence), segments[T]     int32, T = sum of real lengths
//   cu_seqlens[B+1]  int32 prefix sums of lengths; sequence b is rows [cu_seqlens[b], cu_seqlens[b+1])
//   max_seqlen       longest sequence, known on the host
//   mlm_positions[M] int32 row indices into [0, T) (not positions within a sequence); mlm_labels[M] token ids
//   nsp_labels[B]    0 IsNext, 1 random
//   sample_ids[B]    global identity of each sequence (its index in the dataset), used to key dropout so that
//                    results do not depend on how a global batch is split across ranks or ordered in a batch
// The CLS row of sequence b is cu_seqlens[b]. Buffers are reused between batches (capacity only grows).
#pragma once
#include <cstdint>
#include <vector>

namespace nopad {

struct HostBatch {
  std::vector<int32_t> tokens, positions, segments;
  std::vector<int32_t> cu_seqlens{0};
  int32_t max_seqlen = 0;
  std::vector<int32_t> mlm_positions, mlm_labels;
  std::vector<int32_t> nsp_labels;
  std::vector<uint64_t> sample_ids;

  int32_t num_seqs() const { return static_cast<int32_t>(nsp_labels.size()); }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_masked() const { return static_cast<int32_t>(mlm_positions.size()); }
  void clear() {
    tokens.clear();
    positions.clear();
    segments.clear();
    cu_seqlens.assign(1, 0);
    max_seqlen = 0;
    mlm_positions.clear();
    mlm_labels.clear();
    nsp_labels.clear();
    sample_ids.clear();
  }
};

}  // namespace nopad
