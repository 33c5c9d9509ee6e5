// nopad tokenize: one line of token ids (or word pieces with --pieces, or the words before WordPiece with --words)
// per input line, stdin -> stdout, tokens separated by single spaces. Input that is not UTF-8 is refused at its first
// bad byte, as nopad prepare refuses it (the lines before are printed).
#include <charconv>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "core/utf8.h"
#include "data/text_input.h"
#include "data/tokenizer.h"
#include "data/tokenizer_files.h"

namespace {

struct TokenizeOptions {
  std::string vocab;
  std::string lower_case = "auto";
  bool pieces = false;
  bool words = false;
};

void setup(CLI::App& sub) {
  auto opt = std::make_shared<TokenizeOptions>();
  sub.add_option("--vocab", opt->vocab, "WordPiece vocabulary (BERT vocab.txt)")->required()->check(CLI::ExistingFile);
  sub.add_option("--do-lower-case", opt->lower_case,
                 "casing: auto (follow the vocabulary, as nopad prepare does), true or false")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  sub.add_flag("--pieces", opt->pieces, "print word pieces instead of ids");
  sub.add_flag("--words", opt->words, "print the basic tokens (lower-cased, split, before WordPiece) instead of ids");
  sub.callback([opt] {
    const nopad::Vocab vocab = nopad::Vocab::load(opt->vocab);
    const nopad::WordPieceTokenizer tok(vocab, nopad::resolve_lower_case(opt->lower_case, vocab, "--do-lower-case"));
    std::ios::sync_with_stdio(false);
    std::string line, out;
    std::vector<int32_t> ids;
    uint64_t line_no = 0, line_offset = 0;  // of the line, in the bytes of standard input
    while (std::getline(std::cin, line)) {
      ++line_no;
      // Refused as nopad prepare refuses it: the tokenizer would drop the bytes silently.
      if (const size_t bad = nopad::find_invalid_utf8(line); bad != std::string::npos) {
        std::cout.flush();
        nopad::fail("input ", nopad::kStdinName, " is not UTF-8 text: invalid byte 0x", std::hex,
                    static_cast<int>(static_cast<unsigned char>(line[bad])), std::dec, " on line ", line_no,
                    " at byte offset ", line_offset + bad, " (convert it to UTF-8, e.g. with iconv -f LATIN1 -t UTF-8)");
      }
      line_offset += line.size() + 1;
      out.clear();
      if (opt->words) {
        for (const std::string& w : tok.basic_tokens(line)) {
          if (!out.empty()) out += ' ';
          out += w;
        }
        out += '\n';
        std::cout << out;
        continue;
      }
      ids.clear();
      tok.encode(line, ids);
      for (int32_t id : ids) {
        if (!out.empty()) out += ' ';
        if (opt->pieces) {
          out += vocab.token(id);
        } else {
          char buf[16];
          out.append(buf, static_cast<size_t>(std::to_chars(buf, buf + sizeof buf, id).ptr - buf));
        }
      }
      out += '\n';
      std::cout << out;
    }
    std::cout.flush();
  });
}

NOPAD_REGISTER_COMMAND("tokenize", "WordPiece-tokenize text from stdin, one line of ids per line", 10, setup);

}  // namespace
