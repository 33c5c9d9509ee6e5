// Reading, validating and writing BertConfig (see config.h).
#include "model/config.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <type_traits>

#include "core/error.h"
#include "core/philox.h"

namespace nopad {
namespace {

// Keys Hugging Face writes into BERT configs (PretrainedConfig and BertConfig) that do not change the pre-training
// architecture we build; they are accepted and ignored. Keys with a value we cannot honour are checked separately.
const std::set<std::string>& ignored_hf_keys() {
  static const std::set<std::string> keys = {
      "architectures", "model_type", "pad_token_id", "torch_dtype", "transformers_version", "use_cache",
      "classifier_dropout", "gradient_checkpointing", "bos_token_id", "eos_token_id", "sep_token_id",
      "decoder_start_token_id", "_name_or_path", "name_or_path", "id2label", "label2id", "num_labels",
      "output_attentions", "output_hidden_states", "return_dict", "torchscript", "tie_word_embeddings",
      "is_decoder", "add_cross_attention", "chunk_size_feed_forward", "problem_type", "finetuning_task",
      "tokenizer_class", "prefix", "task_specific_params", "pruned_heads", "directionality", "pooler_fc_size",
      "pooler_num_attention_heads", "pooler_num_fc_layers", "pooler_size_per_head", "pooler_type",
      "vocab_file", "do_lower_case"};
  return keys;
}

template <class T>
T get_field(const nlohmann::json& j, const char* key, const std::string& source) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    // nlohmann converts 128.5 to 128 and 2^40 to 0 when asked for an int32: an integer field takes only integers
    // that fit.
    const nlohmann::json& v = j.at(key);
    NOPAD_CHECK(v.is_number_integer(), source, ": field \"", key, "\" must be an integer, got ", v.dump());
    constexpr int64_t lo = std::numeric_limits<T>::min(), hi = std::numeric_limits<T>::max();
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                                             : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
    NOPAD_CHECK(fits, source, ": field \"", key, "\" = ", v.dump(), " is out of range: it must be in [", lo, ", ",
                hi, "]");
    return static_cast<T>(v.get<int64_t>());
  } else {
    try {
      return j.at(key).get<T>();
    } catch (const nlohmann::json::exception& e) {
      fail(source, ": field \"", key, "\" has the wrong type (", e.what(), ")");
    }
  }
}

}  // namespace

void BertConfig::validate() const {
  NOPAD_CHECK(hidden_size > 0, "config: hidden_size must be positive, got ", hidden_size);
  NOPAD_CHECK(num_hidden_layers > 0, "config: num_hidden_layers must be positive, got ", num_hidden_layers);
  NOPAD_CHECK(num_attention_heads > 0, "config: num_attention_heads must be positive, got ", num_attention_heads);
  NOPAD_CHECK(hidden_size % num_attention_heads == 0, "config: hidden_size ", hidden_size,
              " is not divisible by num_attention_heads ", num_attention_heads);
  NOPAD_CHECK(intermediate_size > 0, "config: intermediate_size must be positive, got ", intermediate_size);
  NOPAD_CHECK(vocab_size > 1, "config: vocab_size must be at least 2, got ", vocab_size);
  NOPAD_CHECK(max_position_embeddings > 0, "config: max_position_embeddings must be positive, got ",
              max_position_embeddings);
  NOPAD_CHECK(type_vocab_size > 0, "config: type_vocab_size must be positive, got ", type_vocab_size);
  NOPAD_CHECK(hidden_dropout_prob >= 0 && hidden_dropout_prob < 1, "config: hidden_dropout_prob must be in [0, 1), got ",
              hidden_dropout_prob);
  // The attention masks draw 8 bits per element (core/philox.h): p runs as ceil(p * 256) / 256 and must keep something.
  NOPAD_CHECK(attention_probs_dropout_prob >= 0 && attention_probs_dropout_prob <= kAttentionDropoutMaxP,
              "config: attention_probs_dropout_prob must be in [0, 1 - 1/256] (the attention masks draw 8 bits per "
              "element), got ", attention_probs_dropout_prob);
  NOPAD_CHECK(initializer_range > 0, "config: initializer_range must be positive, got ", initializer_range);
  NOPAD_CHECK(hidden_act == "gelu" || hidden_act == "gelu_new" || hidden_act == "gelu_pytorch_tanh" ||
                  hidden_act == "gelu_fast",
              "config: hidden_act \"", hidden_act,
              "\" is not supported: use \"gelu\" (exact erf GELU) or \"gelu_new\" (its tanh approximation; also "
              "accepted as \"gelu_pytorch_tanh\" or \"gelu_fast\")");
  NOPAD_CHECK(layer_norm_eps > 0, "config: layer_norm_eps must be positive, got ", layer_norm_eps);
}

BertConfig BertConfig::from_json(const nlohmann::json& j, const std::string& source) {
  NOPAD_CHECK(j.is_object(), source, ": a config must be a JSON object");
  BertConfig c;
  for (const auto& [key, value] : j.items()) {
    if (key == "hidden_size") c.hidden_size = get_field<int32_t>(j, "hidden_size", source);
    else if (key == "num_hidden_layers") c.num_hidden_layers = get_field<int32_t>(j, "num_hidden_layers", source);
    else if (key == "num_attention_heads") c.num_attention_heads = get_field<int32_t>(j, "num_attention_heads", source);
    else if (key == "intermediate_size") c.intermediate_size = get_field<int32_t>(j, "intermediate_size", source);
    else if (key == "vocab_size") c.vocab_size = get_field<int32_t>(j, "vocab_size", source);
    else if (key == "max_position_embeddings")
      c.max_position_embeddings = get_field<int32_t>(j, "max_position_embeddings", source);
    else if (key == "type_vocab_size") c.type_vocab_size = get_field<int32_t>(j, "type_vocab_size", source);
    else if (key == "hidden_dropout_prob") c.hidden_dropout_prob = get_field<double>(j, "hidden_dropout_prob", source);
    else if (key == "attention_probs_dropout_prob")
      c.attention_probs_dropout_prob = get_field<double>(j, "attention_probs_dropout_prob", source);
    else if (key == "initializer_range") c.initializer_range = get_field<double>(j, "initializer_range", source);
    else if (key == "hidden_act") c.hidden_act = get_field<std::string>(j, "hidden_act", source);
    else if (key == "layer_norm_eps") c.layer_norm_eps = get_field<double>(j, "layer_norm_eps", source);
    else if (key == "position_embedding_type") {
      const auto type = get_field<std::string>(j, "position_embedding_type", source);
      NOPAD_CHECK(type == "absolute", source, ": position_embedding_type \"", type,
                  "\" is not supported (only \"absolute\")");
    } else if (key == "model_type") {
      const auto type = get_field<std::string>(j, "model_type", source);
      NOPAD_CHECK(type == "bert", source, ": model_type \"", type, "\" is not a BERT model");
    } else if (!ignored_hf_keys().count(key)) {
      fail(source, ": unknown config key \"", key, "\" (not a BERT field nor a standard Hugging Face key)");
    }
  }
  c.validate();
  return c;
}

BertConfig BertConfig::from_file(const std::string& path) {
  std::error_code ec;
  NOPAD_CHECK(!std::filesystem::is_directory(path, ec), path, " is a folder, where a config.json file was expected");
  std::ifstream in(path);
  NOPAD_CHECK(in.good(), "cannot open config file ", path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  return from_json(j, path);
}

nlohmann::json BertConfig::to_json() const {
  nlohmann::json j;
  j["architectures"] = nlohmann::json::array({"BertForPreTraining"});
  j["model_type"] = "bert";
  j["attention_probs_dropout_prob"] = attention_probs_dropout_prob;
  j["hidden_act"] = hidden_act;
  j["hidden_dropout_prob"] = hidden_dropout_prob;
  j["hidden_size"] = hidden_size;
  j["initializer_range"] = initializer_range;
  j["intermediate_size"] = intermediate_size;
  j["layer_norm_eps"] = layer_norm_eps;
  j["max_position_embeddings"] = max_position_embeddings;
  j["num_attention_heads"] = num_attention_heads;
  j["num_hidden_layers"] = num_hidden_layers;
  j["pad_token_id"] = 0;
  j["position_embedding_type"] = "absolute";
  j["type_vocab_size"] = type_vocab_size;
  j["vocab_size"] = vocab_size;
  j["torch_dtype"] = "float32";
  return j;
}

}  // namespace nopad
