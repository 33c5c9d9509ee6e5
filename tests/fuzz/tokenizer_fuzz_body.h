// Fuzz body of the tokenizer (data/tokenizer.h) on arbitrary bytes, with BERT's uncased vocabulary, lower-casing on
// and off. Its contract is that no input fails: every id lies in the vocabulary, pieces() names the ids encode()
// gives, and tokenising the basic tokens again (joined by spaces) gives the same ids, which compares the ASCII fast
// path with the general one.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"
#include "data/vocab.h"
#include "fuzz_common.h"

#ifndef NOPAD_SOURCE_DIR
#error "NOPAD_SOURCE_DIR must name the source tree (the vocabulary is data/vocab/bert-uncased-vocab.txt)"
#endif

namespace nopad::fuzz {

inline void tokenizer_fuzz_one(const uint8_t* data, size_t size) {
  static const Vocab vocab = Vocab::load(NOPAD_SOURCE_DIR "/data/vocab/bert-uncased-vocab.txt");
  static const WordPieceTokenizer lower(vocab, true), cased(vocab, false);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const WordPieceTokenizer* tok : {&lower, &cased}) {
    const std::vector<int32_t> ids = tok->encode(text);
    for (const int32_t id : ids) require(id >= 0 && id < vocab.size(), "token id inside the vocabulary");
    const std::vector<std::string> pieces = tok->pieces(text);
    require(pieces.size() == ids.size(), "one piece per id");
    for (size_t i = 0; i < ids.size(); ++i) require(vocab.find(pieces[i]) == ids[i], "each piece is its id's token");
    std::string joined;
    for (const std::string& word : tok->basic_tokens(text)) {
      require(!word.empty(), "no empty basic token");
      joined += word;
      joined += ' ';
    }
    require(tok->encode(joined) == ids, "the basic tokens tokenise to the same ids");
  }
}

}  // namespace nopad::fuzz
