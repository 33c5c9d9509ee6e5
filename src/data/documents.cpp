#include "data/documents.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace nopad {

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// Abbreviations after which a '.' does not end a sentence (compared lower-cased, without the final '.').
constexpr std::array<std::string_view, 64> kAbbreviations = {
    "mr",   "mrs",  "ms",   "dr",   "prof", "sr",   "jr",   "st",   "mt",   "ft",   "gen",  "gov",  "lt",
    "col",  "capt", "sgt",  "rev",  "hon",  "pres", "sen",  "rep",  "vs",   "etc",  "e.g",  "i.e",  "cf",
    "al",   "approx", "ca", "inc",  "ltd",  "co",   "corp", "bros", "no",   "nos",  "vol",  "vols", "pp",
    "p",    "fig",  "figs", "ed",   "eds",  "jan",  "feb",  "mar",  "apr",  "jun",  "jul",  "aug",  "sep",
    "sept", "oct",  "nov",  "dec",  "u.s",  "u.k",  "a.d",  "b.c",  "ph.d", "op",   "est",  "dept"};

bool is_abbreviation(std::string_view word) {
  if (word.size() > 8) return false;
  char lower[8];
  for (size_t i = 0; i < word.size(); ++i) {
    const char c = word[i];
    lower[i] = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  }
  const std::string_view w(lower, word.size());
  return std::find(kAbbreviations.begin(), kAbbreviations.end(), w) != kAbbreviations.end();
}

bool is_upper_ascii(unsigned char c) { return c >= 'A' && c <= 'Z'; }
bool is_lower_ascii(unsigned char c) { return c >= 'a' && c <= 'z'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_closing(unsigned char c) { return c == '"' || c == '\'' || c == ')' || c == ']'; }
bool is_opening(unsigned char c) { return c == '"' || c == '\'' || c == '(' || c == '['; }

// Could the text at `s` start a new sentence? Upper case, digit, opening quote/bracket, or any non-ASCII
// character (capitalised accented letters, other scripts): the splitter errs towards splitting there.
bool starts_sentence(std::string_view s) {
  if (s.empty()) return false;
  const auto c = static_cast<unsigned char>(s[0]);
  if (is_upper_ascii(c) || is_digit(c) || is_opening(c)) return true;
  return c >= 0x80;
}

}  // namespace

bool looks_like_wikiextractor(std::string_view text) {
  size_t pos = 0;
  // Only the first few lines decide: WikiExtractor files start with a <doc> line (after optional blank lines).
  for (int line = 0; line < 16 && pos < text.size(); ++line) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view l = trim(text.substr(pos, end - pos));
    if (!l.empty()) return starts_with(l, "<doc ") || l == "<doc>";
    pos = end + 1;
  }
  return false;
}

void split_sentences(std::string_view p, std::vector<std::string_view>& out) {
  p = trim(p);
  size_t start = 0;
  const size_t n = p.size();
  for (size_t i = 0; i < n; ++i) {
    const char c = p[i];
    if (c != '.' && c != '!' && c != '?') continue;
    // Extend over repeated terminators ("?!", "...") and closing quotes/brackets.
    size_t end = i + 1;
    while (end < n && (p[end] == '.' || p[end] == '!' || p[end] == '?')) ++end;
    while (end < n && is_closing(static_cast<unsigned char>(p[end]))) ++end;
    if (end >= n || !is_space(p[end])) {
      i = end - 1;
      continue;
    }
    size_t next = end;
    while (next < n && is_space(p[next])) ++next;
    if (next >= n || !starts_sentence(p.substr(next))) {
      i = end - 1;
      continue;
    }
    if (c == '.' && end - i == 1) {
      // The word before the period: abbreviation or initial?
      size_t w = i;
      while (w > start && !is_space(p[w - 1]) && !is_opening(static_cast<unsigned char>(p[w - 1]))) --w;
      const std::string_view word = p.substr(w, i - w);
      if (word.empty()) {
        i = end - 1;
        continue;
      }
      if (word.size() == 1 && (is_upper_ascii(static_cast<unsigned char>(word[0])) ||
                               is_lower_ascii(static_cast<unsigned char>(word[0])))) {
        i = end - 1;
        continue;  // an initial ("J. Smith") or an enumerator ("a. first")
      }
      if (is_abbreviation(word)) {
        i = end - 1;
        continue;
      }
    }
    const std::string_view sentence = trim(p.substr(start, end - start));
    if (!sentence.empty()) out.push_back(sentence);
    start = next;
    i = next - 1;
  }
  const std::string_view rest = trim(p.substr(std::min(start, n)));
  if (!rest.empty()) out.push_back(rest);
}

std::vector<std::string_view> split_sentences(std::string_view paragraph) {
  std::vector<std::string_view> out;
  split_sentences(paragraph, out);
  return out;
}

bool looks_like_json_lines(std::string_view text) {
  if (starts_with(text, "\xEF\xBB\xBF")) text.remove_prefix(3);  // a UTF-8 byte-order mark
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view l = trim(text.substr(pos, end - pos));
    if (!l.empty()) return l.front() == '{' && nlohmann::json::parse(l, nullptr, false).is_object();
    pos = end + 1;
  }
  return false;
}

std::string json_field_names(std::string_view json_object_line) {
  const nlohmann::json record = nlohmann::json::parse(json_object_line, nullptr, false);
  if (!record.is_object() || record.empty()) return "none";
  std::string out;
  size_t n = 0;
  for (auto it = record.begin(); it != record.end(); ++it, ++n) {
    if (n == 8) return out + ", ...";
    out += (n ? ", \"" : "\"") + it.key() + "\"";
  }
  return out;
}

std::vector<TextDocument> split_json_lines(std::string_view text, std::string_view text_field, std::string_view name,
                                           std::string& decoded) {
  NOPAD_CHECK(decoded.empty(), "split_json_lines needs an empty buffer for the decoded texts");
  const std::string field(text_field);
  // First every record's text into `decoded` (one buffer, so that views into it stay valid once it stops growing),
  // then the paragraphs and sentences.
  std::vector<std::pair<size_t, size_t>> records;  // [begin, end) of each record's text in `decoded`
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = trim(text.substr(pos, end - pos));
    pos = end + 1;
    ++line_no;
    if (line.empty()) continue;
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      // nlohmann's message says "parse error at line 1, column N: what"; the line is ours, the rest is its.
      std::string what = e.what();
      const size_t at = what.find("column ");
      if (at != std::string::npos) what = what.substr(at);
      fail("input ", name, " line ", line_no, " is not valid JSON (", what,
           "): each line of a JSON-lines file must be one JSON object");
    } catch (const nlohmann::json::out_of_range& e) {
      // A number beyond double's range (1e999) is valid JSON that nlohmann refuses with out_of_range.406.
      std::string what = e.what();
      const size_t at = what.find("] ");
      if (at != std::string::npos) what = what.substr(at + 2);
      fail("input ", name, " line ", line_no, " holds a number too large to read (", what,
           "): write it as a string, or leave the field out of the records");
    }
    NOPAD_CHECK(record.is_object(), "input ", name, " line ", line_no, " is a JSON ", record.type_name(),
                ", not an object: each line of a JSON-lines file must be one record {\"", field, "\": \"...\", ...}");
    const auto it = record.find(field);
    if (it == record.end())
      fail("input ", name, " line ", line_no, " has no field \"", field, "\" (its fields: ", json_field_names(line),
           "): name the field that holds the text with --text-field NAME");
    NOPAD_CHECK(it->is_string(), "input ", name, " line ", line_no, ": field \"", field, "\" is a JSON ",
                it->type_name(), ", not a string: name a field that holds the text with --text-field NAME");
    const std::string& s = it->get_ref<const std::string&>();
    records.emplace_back(decoded.size(), decoded.size() + s.size());
    decoded += s;
    decoded += '\n';
  }
  std::vector<TextDocument> docs;
  const std::string_view all(decoded);
  for (const auto& [begin, end] : records) {
    TextDocument doc;
    size_t p = begin;
    while (p < end) {
      size_t e = all.find('\n', p);
      if (e == std::string_view::npos || e > end) e = end;
      const std::string_view paragraph = trim(all.substr(p, e - p));
      if (!paragraph.empty()) split_sentences(paragraph, doc.sentences);
      p = e + 1;
    }
    if (!doc.sentences.empty()) docs.push_back(std::move(doc));
  }
  return docs;
}

std::vector<TextDocument> split_documents(std::string_view text, TextFormat format) {
  NOPAD_CHECK(format != TextFormat::kJsonLines && (format != TextFormat::kAuto || !looks_like_json_lines(text)),
              "JSON lines are read with split_json_lines, which decodes their texts");
  if (format == TextFormat::kAuto)
    format = looks_like_wikiextractor(text) ? TextFormat::kWikiExtractor : TextFormat::kSentenceLines;
  std::vector<TextDocument> docs;
  TextDocument current;
  bool in_doc = false, expect_title = false;
  auto flush = [&] {
    if (!current.sentences.empty()) docs.push_back(std::move(current));
    current = TextDocument{};
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = trim(text.substr(pos, end - pos));
    pos = end + 1;
    if (format == TextFormat::kWikiExtractor) {
      if (starts_with(line, "<doc ") || line == "<doc>") {
        flush();
        in_doc = true;
        expect_title = true;
        continue;
      }
      if (line == "</doc>") {
        flush();
        in_doc = false;
        continue;
      }
      if (line.empty()) continue;
      if (expect_title) {
        expect_title = false;
        continue;
      }
      (void)in_doc;  // text outside <doc> tags is kept as its own document
      split_sentences(line, current.sentences);
    } else {
      if (line.empty()) {
        flush();
        continue;
      }
      current.sentences.push_back(line);
    }
  }
  flush();
  return docs;
}

}  // namespace nopad
