// The parameter layout of BertForPreTraining: every tensor lives in ONE flat buffer, carved by a table of named
// tensors whose names and shapes are exactly Hugging Face's state-dict names, so a checkpoint is a walk over the
// table. Gradients and optimizer state use the same layout (same offsets).
//
// Layout rules:
//  - Tensors follow in table order, each starting at a multiple of kParamAlign elements (128 bytes of bf16, 256 of
//    fp32), so every tensor can be read with 16-byte vector loads and handed to cuBLASLt well aligned whatever
//    the sizes before it (the vocabulary, 30522, is not a multiple of 8). The gap elements belong to no tensor:
//    they stay zero and nothing reads them.
//  - Per layer, query/key/value weights are adjacent (so [3H, H] at the query weight's offset is the fused QKV
//    weight) and the three biases are adjacent (a [3H] fused bias): only the group's start is aligned.
//  - bert.embeddings.word_embeddings.weight and cls.predictions.bias are each followed by the rows / entries that
//    round the vocabulary up to padded_vocab_size(V) (gap elements, zero): the MLM decoder may then run its products
//    over padded_vocab_size(V) columns, aligned for cuBLASLt (ops.h MlmHeadWeights::padded_vocab).
//  - The MLM decoder weight is tied to bert.embeddings.word_embeddings.weight; Hugging Face also lists
//    cls.predictions.decoder.weight (the tied alias) and cls.predictions.decoder.bias (an alias of
//    cls.predictions.bias) in its state dict. They are not separate tensors here; exporters write the aliases.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace nopad {

constexpr size_t kParamAlign = 64;  // elements

// The vocabulary rounded up to a multiple of 8 (16 bytes of bf16): BERT's 30522 -> 30528.
constexpr int64_t padded_vocab_size(int64_t vocab_size) { return (vocab_size + 7) / 8 * 8; }

struct ParamTensor {
  std::string name;            // Hugging Face state-dict name
  std::vector<int64_t> shape;  // Hugging Face shape
  size_t offset = 0;           // in elements, from the start of the flat buffer
  size_t numel = 0;
  bool no_weight_decay = false;  // biases and LayerNorm parameters
  enum class Init { kNormal, kZeros, kOnes } init = Init::kNormal;
};

class ParamLayout {
 public:
  explicit ParamLayout(const BertConfig& config);

  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  size_t total_numel() const { return total_; }  // the flat buffer, alignment gaps included
  size_t num_values() const;                      // parameters proper: the sum of the tensors' numel
  // Throws nopad::Error if there is no tensor of that name.
  const ParamTensor& find(const std::string& name) const;
  size_t offset(const std::string& name) const { return find(name).offset; }

 private:
  // aligned = false continues right after the previous tensor (the q/k/v groups).
  void add(std::string name, std::vector<int64_t> shape, ParamTensor::Init init, bool no_weight_decay,
           bool aligned = true);
  std::vector<ParamTensor> tensors_;
  size_t total_ = 0;
};

// Hugging Face / original BERT initialisation into host memory params[layout.total_numel()]: weights and embeddings
// ~ normal(0, initializer_range) truncated at 2 standard deviations; biases 0; LayerNorm weight 1, bias 0.
// Each tensor draws from its own stream keyed by (seed, tensor index), so the result does not depend on threads.
template <class S>
void initialize_params(const ParamLayout& layout, const BertConfig& config, uint64_t seed, S* params);

}  // namespace nopad
