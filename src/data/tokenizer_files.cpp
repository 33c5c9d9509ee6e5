// Hugging Face tokenizer files of a model folder (see tokenizer_files.h).
#include "data/tokenizer_files.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io.h"

namespace nopad {

namespace fs = std::filesystem;

namespace {

constexpr const char* kVocabFile = "vocab.txt";
constexpr const char* kConfigFile = "tokenizer_config.json";
constexpr const char* kSpecialFile = "special_tokens_map.json";
constexpr const char* kTokenizerJson = "tokenizer.json";

bool is_bracketed(const std::string& t) { return t.size() >= 2 && t.front() == '[' && t.back() == ']'; }

nlohmann::ordered_json special_tokens_map() {
  return {{"unk_token", "[UNK]"},
          {"sep_token", "[SEP]"},
          {"pad_token", "[PAD]"},
          {"cls_token", "[CLS]"},
          {"mask_token", "[MASK]"}};
}

// The `tokenizers` serialisation of BERT's WordPiece tokenizer over `vocab`.
std::string tokenizer_json(const Vocab& vocab, bool lower_case) {
  const SpecialIds& sp = vocab.special();
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  std::vector<std::pair<int32_t, std::string>> specials = {
      {sp.pad, "[PAD]"}, {sp.unk, "[UNK]"}, {sp.cls, "[CLS]"}, {sp.sep, "[SEP]"}, {sp.mask, "[MASK]"}};
  std::sort(specials.begin(), specials.end());
  for (const auto& [id, content] : specials)
    added.push_back(nlohmann::ordered_json{{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  // The vocabulary in id order. Its tokens are unique (Vocab checks), so they are appended to the object's entries
  // directly: ordered_json's own insertion looks each key up linearly, quadratic over 30k tokens.
  nlohmann::ordered_json vocab_map = nlohmann::ordered_json::object();
  auto& entries = vocab_map.get_ref<nlohmann::ordered_json::object_t&>();
  entries.reserve(static_cast<size_t>(vocab.size()));
  for (int32_t id = 0; id < vocab.size(); ++id) entries.emplace_back(vocab.token(id), nlohmann::ordered_json(id));
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = added;
  j["normalizer"] = {{"type", "BertNormalizer"},
                     {"clean_text", true},
                     {"handle_chinese_chars", true},
                     {"strip_accents", nullptr},  // null: strip accents exactly when lower-casing (BERT's rule)
                     {"lowercase", lower_case}};
  j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  j["post_processor"] = {{"type", "BertProcessing"},
                         {"sep", nlohmann::ordered_json::array({"[SEP]", sp.sep})},
                         {"cls", nlohmann::ordered_json::array({"[CLS]", sp.cls})}};
  j["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}};
  nlohmann::ordered_json model = nlohmann::ordered_json::object();
  model["type"] = "WordPiece";
  model["unk_token"] = "[UNK]";
  model["continuing_subword_prefix"] = "##";
  model["max_input_chars_per_word"] = 100;
  model["vocab"] = std::move(vocab_map);
  j["model"] = std::move(model);
  return j.dump();
}

}  // namespace

bool vocab_is_cased(const Vocab& vocab) {
  int64_t ordinary = 0, capitalised = 0;
  for (const std::string& t : vocab.tokens()) {
    if (is_bracketed(t)) continue;
    ++ordinary;
    if (std::any_of(t.begin(), t.end(), [](char c) { return c >= 'A' && c <= 'Z'; })) ++capitalised;
  }
  return ordinary > 0 && capitalised * 100 > ordinary;
}

bool resolve_lower_case(const std::string& choice, const Vocab& vocab, const std::string& what) {
  if (choice == "auto") return !vocab_is_cased(vocab);
  if (choice == "true" || choice == "yes" || choice == "1") return true;
  if (choice == "false" || choice == "no" || choice == "0") return false;
  fail(what, " must be auto (follow the vocabulary: ", vocab_is_cased(vocab) ? "cased" : "uncased", " for ",
       vocab.origin(), "), true (lower-case the text, as uncased BERT) or false (keep the case, as cased BERT); got \"",
       choice, "\"");
}

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {kVocabFile, kConfigFile, kSpecialFile, kTokenizerJson};
  return names;
}

void write_tokenizer_files(const fs::path& dir, const Vocab& vocab, bool lower_case, int64_t model_max_length) {
  std::string vocab_text;
  for (const std::string& t : vocab.tokens()) vocab_text += t + "\n";
  write_file_atomic(dir / kVocabFile, vocab_text);
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  config["tokenizer_class"] = "BertTokenizer";
  config["do_lower_case"] = lower_case;
  config["do_basic_tokenize"] = true;
  config["tokenize_chinese_chars"] = true;
  config["strip_accents"] = nullptr;
  config["model_max_length"] = model_max_length;
  config["clean_up_tokenization_spaces"] = true;
  const nlohmann::ordered_json special = special_tokens_map();
  for (const auto& [key, value] : special.items()) config[key] = value;
  write_file_atomic(dir / kConfigFile, config.dump(2) + "\n");
  write_file_atomic(dir / kSpecialFile, special_tokens_map().dump(2) + "\n");
  write_file_atomic(dir / kTokenizerJson, tokenizer_json(vocab, lower_case) + "\n");
}

bool has_tokenizer_files(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kVocabFile, ec);
}

TokenizerFiles read_tokenizer_files(const fs::path& dir) {
  NOPAD_CHECK(has_tokenizer_files(dir), "model folder ", dir.string(), " has no ", kVocabFile,
              ": it was written without its tokenizer (an older nopad, or a folder of weights only); give the "
              "vocabulary it was trained with, e.g. --vocab data/vocab/bert-uncased-vocab.txt");
  TokenizerFiles t{Vocab::load(dir / kVocabFile)};
  t.lower_case = !vocab_is_cased(t.vocab);
  const fs::path config = dir / kConfigFile;
  std::error_code ec;
  if (fs::exists(config, ec)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_file(config));
    } catch (const nlohmann::json::exception& e) {
      fail(config.string(), ": not valid JSON (", e.what(), ")");
    }
    NOPAD_CHECK(j.is_object(), config.string(), ": a tokenizer config must be a JSON object");
    if (j.contains("do_lower_case")) {
      NOPAD_CHECK(j["do_lower_case"].is_boolean(), config.string(), ": do_lower_case must be true or false, got ",
                  j["do_lower_case"].dump());
      t.lower_case = j["do_lower_case"].get<bool>();
    }
    if (j.contains("model_max_length") && j["model_max_length"].is_number_integer())
      t.model_max_length = j["model_max_length"].get<int64_t>();
  }
  return t;
}

}  // namespace nopad
