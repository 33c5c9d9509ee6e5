// Text input of `nopad prepare`: files -> documents -> sentences.
//
// Three input formats, detected per file (data/text_input.h settles which, and refuses what is none of them):
//  * WikiExtractor output: `<doc id=... url=... title=...>`, the title line, paragraphs one per line, `</doc>`.
//    The title line is dropped (it is a heading, not running text); each paragraph is split into sentences.
//  * One sentence per line, a blank line between documents (the format the MLPerf pipeline feeds to
//    create_pretraining_data.py, and Google BERT's sample_text.txt). Lines are taken as sentences unchanged.
//  * JSON lines, one JSON object per line (Hugging Face datasets' Dataset.to_json): one document per record, its
//    text field split into paragraphs at newlines and each paragraph into sentences, as a WikiExtractor paragraph.
//
// The sentence splitter is rule-based (see split_sentences); docs/data-format.md lists where it differs from the
// NLTK punkt model the MLPerf pipeline uses.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace nopad {

enum class TextFormat { kAuto, kWikiExtractor, kSentenceLines, kJsonLines };

// A document as spans into the text it was read from: each sentence is a view, in order.
struct TextDocument {
  std::vector<std::string_view> sentences;
};

// True when the text looks like WikiExtractor output (a line starting with "<doc ").
bool looks_like_wikiextractor(std::string_view text);

// True when the first non-blank line of the text is a JSON object (JSON lines).
bool looks_like_json_lines(std::string_view text);

// The field names of a line holding a JSON object, for messages: `"id", "text"` (at most 8, then ", ..."), or
// "none".
std::string json_field_names(std::string_view json_object_line);

// Splits a whole file's text into documents (views into `text`, which must outlive them). Empty documents are kept
// out. kAuto picks the format with looks_like_wikiextractor. JSON lines need split_json_lines (their texts are
// decoded, not views): kJsonLines, or kAuto on text that looks_like_json_lines, is an Error.
std::vector<TextDocument> split_documents(std::string_view text, TextFormat format);

// Splits JSON lines into documents: one per record, from its string field `text_field` (a top-level key; a dotted
// name is not a path). The records' texts, JSON escapes decoded, are appended to `decoded` (empty on entry), which
// the returned views point into: it must outlive them and not change after. Blank lines are skipped. A line that is
// not a JSON object, lacks the field, or holds something other than a string in it is an Error naming `name` and
// the line.
std::vector<TextDocument> split_json_lines(std::string_view text, std::string_view text_field, std::string_view name,
                                           std::string& decoded);

// Splits one paragraph into sentences (views into `paragraph`, trimmed of surrounding spaces). A sentence ends at
// '.', '!' or '?' (with any closing quotes or brackets after it) followed by whitespace and then an upper-case
// letter, a digit or an opening quote/bracket -- unless the word before the '.' is a known abbreviation, a single
// letter (an initial such as "J. R. R."), or the '.' belongs to an ellipsis followed by lower case.
std::vector<std::string_view> split_sentences(std::string_view paragraph);
void split_sentences(std::string_view paragraph, std::vector<std::string_view>& out);

}  // namespace nopad
