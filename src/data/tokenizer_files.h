// The tokenizer of a Hugging Face model folder, as nopad writes it beside the weights and reads it back.
//
// A model folder nopad writes (a training checkpoint, `nopad convert --from-tf-checkpoint`) carries the files that
// `transformers.AutoTokenizer.from_pretrained(dir)` reads for BERT's WordPiece tokenizer:
//   vocab.txt                one token per line (the vocabulary the data was made with, byte for byte canonical)
//   tokenizer_config.json    tokenizer_class BertTokenizer, do_lower_case, model_max_length, the special tokens
//   special_tokens_map.json  [UNK] [SEP] [PAD] [CLS] [MASK]
//   tokenizer.json           the same tokenizer in the `tokenizers` serialisation (BertNormalizer with the casing,
//                            BertPreTokenizer, WordPiece with "##" continuations and 100-character words, BERT's
//                            [CLS] ... [SEP] post-processing), so the fast tokenizer needs no conversion
// so that the folder tokenizes text exactly as `nopad prepare` did (docs/tokenizer.md names the one deliberate
// difference of the `tokenizers` crate, Greek final sigma).
//
// Casing: a vocabulary is cased when more than 1% of its ordinary tokens (not [bracketed] specials) hold an ASCII
// capital letter (bert-base-cased: most of its word tokens start with one; bert-base-uncased: none). Text is then
// tokenized without lower-casing and accent stripping (BasicTokenizer(do_lower_case=False)); "auto" casing follows
// the vocabulary, "true"/"false" force it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "data/vocab.h"

namespace nopad {

// True when `vocab` is a cased vocabulary (rule above).
bool vocab_is_cased(const Vocab& vocab);

// "auto", "true" or "false" (also yes/no, 1/0) -> lower-case or not; auto follows vocab_is_cased. Throws naming
// `what` (the option or key) and the choices for anything else.
bool resolve_lower_case(const std::string& choice, const Vocab& vocab, const std::string& what);

struct TokenizerFiles {
  Vocab vocab;
  bool lower_case = true;
  int64_t model_max_length = 512;
};

// The names of the files write_tokenizer_files writes, in the order written.
const std::vector<std::string>& tokenizer_file_names();

// Writes the four files into `dir` (each atomically). model_max_length is the model's max_position_embeddings.
void write_tokenizer_files(const std::filesystem::path& dir, const Vocab& vocab, bool lower_case,
                           int64_t model_max_length);

// True when `dir` holds a vocab.txt.
bool has_tokenizer_files(const std::filesystem::path& dir);

// Reads vocab.txt and the casing from tokenizer_config.json's do_lower_case (a folder without one: the
// vocabulary's casing). Throws naming the folder when vocab.txt is missing, with what to do.
TokenizerFiles read_tokenizer_files(const std::filesystem::path& dir);

}  // namespace nopad
