// Text input of `nopad prepare`: files -> documents -> sentences.
//
// Two input formats, detected per file:
//  * WikiExtractor output: `<doc id=... url=... title=...>`, the title line, paragraphs one per line, `</doc>`.
//    The title line is dropped (it is a heading, not running text); each paragraph is split into sentences.
//  * One sentence per line, a blank line between documents (the format the MLPerf pipeline feeds to
//    create_pretraining_data.py, and Google BERT's sample_text.txt). Lines are taken as sentences unchanged.
//
// The sentence splitter is rule-based (see split_sentences); docs/data-format.md lists where it differs from the
// NLTK punkt model the MLPerf pipeline uses.
#pragma once
#include <cstddef>
#include <string_view>
#include <vector>

namespace nopad {

enum class TextFormat { kAuto, kWikiExtractor, kSentenceLines };

// A document as spans into the text it was read from: each sentence is a view, in order.
struct TextDocument {
  std::vector<std::string_view> sentences;
};

// True when the text looks like WikiExtractor output (a line starting with "<doc ").
bool looks_like_wikiextractor(std::string_view text);

// Splits a whole file's text into documents (views into `text`, which must outlive them). Empty documents are kept
// out. kAuto picks the format with looks_like_wikiextractor.
std::vector<TextDocument> split_documents(std::string_view text, TextFormat format);

// Splits one paragraph into sentences (views into `paragraph`, trimmed of surrounding spaces). A sentence ends at
// '.', '!' or '?' (with any closing quotes or brackets after it) followed by whitespace and then an upper-case
// letter, a digit or an opening quote/bracket -- unless the word before the '.' is a known abbreviation, a single
// letter (an initial such as "J. R. R."), or the '.' belongs to an ellipsis followed by lower case.
std::vector<std::string_view> split_sentences(std::string_view paragraph);
void split_sentences(std::string_view paragraph, std::vector<std::string_view>& out);

}  // namespace nopad
