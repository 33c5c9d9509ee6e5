// BERT's uncased WordPiece tokenizer, matching Google BERT's BasicTokenizer + WordpieceTokenizer (and Hugging Face's
// BertTokenizer / tokenizers BertWordPiece with lowercase=True) token for token:
//   1. clean: drop U+0000, U+FFFD and control characters; every whitespace character becomes a space;
//   2. a space before and after every CJK ideograph;
//   3. split on whitespace; per word: lower-case, Unicode NFD, drop combining marks (Mn);
//   4. split on punctuation (Unicode P* and the ASCII symbol ranges 33-47, 58-64, 91-96, 123-126);
//   5. WordPiece: greedy longest match first, continuations prefixed "##"; a word of more than 100 characters, or
//      one with no full match, becomes [UNK].
// Input is UTF-8; invalid bytes decode to U+FFFD (and so are dropped): no input crashes it.
// Thread-safe: encode() is const and shares nothing mutable, so one tokenizer serves all threads.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/vocab.h"

namespace nopad {

class WordPieceTokenizer {
 public:
  explicit WordPieceTokenizer(const Vocab& vocab, bool lower_case = true);
  ~WordPieceTokenizer();
  WordPieceTokenizer(WordPieceTokenizer&&) noexcept;
  WordPieceTokenizer& operator=(WordPieceTokenizer&&) noexcept;

  // Appends the token ids of `text` to `out`.
  void encode(std::string_view text, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode(std::string_view text) const;
  // The word pieces as strings (vocabulary entries, "##" continuations included).
  std::vector<std::string> pieces(std::string_view text) const;
  // The words after basic tokenisation (steps 1-4), before WordPiece.
  std::vector<std::string> basic_tokens(std::string_view text) const;

  const Vocab& vocab() const { return *vocab_; }

 private:
  struct Impl;
  const Vocab* vocab_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nopad
