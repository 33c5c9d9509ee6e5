#include "data/vocab.h"

#include "core/crc32.h"
#include "core/error.h"
#include "core/io.h"

namespace nopad {

Vocab Vocab::load(const std::filesystem::path& path) {
  const std::string text = read_file(path);
  NOPAD_CHECK(!text.empty(), "vocabulary ", path.string(), " is empty: expected one WordPiece token per line");
  std::vector<std::string> tokens;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    tokens.emplace_back(line);
    start = end + 1;
  }
  return from_tokens(std::move(tokens), path.string());
}

Vocab Vocab::from_tokens(std::vector<std::string> tokens, const std::string& origin) {
  Vocab v;
  v.origin_ = origin;
  v.tokens_ = std::move(tokens);
  NOPAD_CHECK(!v.tokens_.empty(), "vocabulary ", origin, " has no tokens");
  v.index_.reserve(v.tokens_.size() * 2);
  uint32_t crc = 0;
  for (size_t i = 0; i < v.tokens_.size(); ++i) {
    const std::string& t = v.tokens_[i];
    NOPAD_CHECK(!t.empty(), "vocabulary ", origin, " line ", i + 1, " is empty: every line must hold one token");
    const auto [it, inserted] = v.index_.emplace(std::string_view(t), static_cast<int32_t>(i));
    NOPAD_CHECK(inserted, "vocabulary ", origin, " line ", i + 1, " repeats token '", t, "' (first on line ",
                it->second + 1, ")");
    crc = crc32(t.data(), t.size(), crc);
    crc = crc32("\n", 1, crc);
  }
  v.checksum_ = crc;
  auto need = [&](const char* name) {
    const int32_t id = v.find(name);
    NOPAD_CHECK(id >= 0, "vocabulary ", origin, " has no ", name,
                " token: BERT pre-training needs [PAD], [UNK], [CLS], [SEP] and [MASK] (use BERT's vocab.txt)");
    return id;
  };
  v.special_.pad = need("[PAD]");
  v.special_.unk = need("[UNK]");
  v.special_.cls = need("[CLS]");
  v.special_.sep = need("[SEP]");
  v.special_.mask = need("[MASK]");
  return v;
}

int32_t Vocab::find(std::string_view token) const {
  const auto it = index_.find(token);
  return it == index_.end() ? -1 : it->second;
}

}  // namespace nopad
