#include "data/documents.h"

#include <algorithm>
#include <array>
#include <cstring>

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

std::vector<TextDocument> split_documents(std::string_view text, TextFormat format) {
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
