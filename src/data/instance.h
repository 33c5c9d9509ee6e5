// One BERT pre-training instance as the data pipeline produces it and shards store it:
//   tokens       = [CLS] A... [SEP] B... [SEP]  (after masking: masked positions hold [MASK] or a replacement)
//   a_length     = number of leading tokens with segment id 0 ([CLS], A and the first [SEP]); the rest are segment 1
//   mlm_positions (ascending, indices into tokens) and mlm_labels (the original token ids there)
//   nsp_label    = 0 when B really follows A (IsNext), 1 when B is random (BERT reference convention)
#pragma once
#include <cstdint>
#include <vector>

namespace nopad {

struct Instance {
  std::vector<int32_t> tokens;
  int32_t a_length = 0;
  std::vector<int32_t> mlm_positions;
  std::vector<int32_t> mlm_labels;
  int32_t nsp_label = 0;
};

}  // namespace nopad
