// Masked-token prediction with a trained encoder (`nopad fill-mask`): the first thing one does with a BERT checkpoint,
// as Hugging Face's pipeline("fill-mask") does it.
//
// Contract: each text is tokenized with the model folder's own tokenizer (data/tokenizer_files.h; the literal
// [MASK] and [SEP] in the text stand for those tokens, as added special tokens do in Hugging Face), wrapped as
// [CLS] ... [SEP] in segment 0, and run through the model with dropout off on the CPU (fp32) or a GPU (bf16); for
// every [MASK] the top_k tokens of the MLM head's softmax are returned, most probable first. A text without a
// [MASK], or longer than the model's max_position_embeddings, is an error naming it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace nopad {

struct FillMaskOptions {
  std::filesystem::path model_dir;  // a checkpoint or Hugging Face folder with config.json and the weights
  std::string vocab;                // '' = the folder's vocab.txt (with its tokenizer_config.json's casing)
  std::string lower_case = "auto";  // with `vocab`: auto, true or false
  std::string device = "auto";      // auto, cpu or cuda
  int top_k = 5;
  int threads = 0;  // CPU threads (0: default_cpu_threads)
};

struct FillMaskCandidate {
  int32_t id = 0;
  std::string token;  // the vocabulary entry ("##s" for a continuation)
  double probability = 0;
};

struct FillMaskAnswer {
  std::string text;
  std::vector<std::vector<FillMaskCandidate>> masks;  // one list per [MASK] of the text, in order
  std::string filled;  // the text with each [MASK] replaced by its most probable token
};

// Token ids of one text as fill-mask feeds it: [CLS], the pieces, [SEP]; literal "[MASK]" and "[SEP]" in the text
// become those tokens.
std::vector<int32_t> encode_with_special_tokens(const WordPieceTokenizer& tokenizer, std::string_view text);

// Loads the model once and answers every text. Returns the device the model ran on in *device_name (optional).
std::vector<FillMaskAnswer> fill_mask(const FillMaskOptions& options, const std::vector<std::string>& texts,
                                      std::string* device_name = nullptr);

}  // namespace nopad
