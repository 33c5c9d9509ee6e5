// BertConfig: the architecture of a BERT encoder, read from and written to a Hugging Face config.json.
// Validation is strict: a key that is neither a field we use nor a standard Hugging Face key is an error naming it
// (a typo such as "num_hidden_layer" must not silently train a different model).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace nopad {

struct BertConfig {
  int32_t hidden_size = 768;
  int32_t num_hidden_layers = 12;
  int32_t num_attention_heads = 12;
  int32_t intermediate_size = 3072;
  int32_t vocab_size = 30522;
  int32_t max_position_embeddings = 512;
  int32_t type_vocab_size = 2;
  double hidden_dropout_prob = 0.1;
  double attention_probs_dropout_prob = 0.1;
  double initializer_range = 0.02;
  // "gelu": the exact erf GELU; "gelu_new", "gelu_pytorch_tanh" or "gelu_fast": its tanh approximation (the same
  // function under Hugging Face's names; the name given is kept, so a checkpoint exports what it was loaded with).
  std::string hidden_act = "gelu";
  double layer_norm_eps = 1e-12;

  int32_t head_dim() const { return hidden_size / num_attention_heads; }
  bool gelu_tanh() const { return hidden_act != "gelu"; }  // after validate(): the tanh approximation

  // Throws nopad::Error naming the first invalid field.
  void validate() const;
  // Parses a config.json object; `source` names it in error messages.
  static BertConfig from_json(const nlohmann::json& j, const std::string& source = "config");
  static BertConfig from_file(const std::string& path);
  // An HF-loadable config (model_type "bert", architectures ["BertForPreTraining"]).
  nlohmann::json to_json() const;
};

}  // namespace nopad
