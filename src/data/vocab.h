// The WordPiece vocabulary: one token per line, id = line number (0-based), as BERT's vocab.txt.
// Loading checks that the special tokens BERT needs are present; checksum() identifies the vocabulary inside shards
// so that data built with one vocabulary is never silently trained with another.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace nopad {

struct SpecialIds {
  int32_t pad = -1, unk = -1, cls = -1, sep = -1, mask = -1;
};

class Vocab {
 public:
  // Throws nopad::Error naming the file for: unreadable, empty, an empty or duplicated token line,
  // or a missing [PAD]/[UNK]/[CLS]/[SEP]/[MASK].
  static Vocab load(const std::filesystem::path& path);
  static Vocab from_tokens(std::vector<std::string> tokens, const std::string& origin = "<memory>");

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  // Id of an exact token string, or -1.
  int32_t find(std::string_view token) const;
  const std::string& token(int32_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  const std::vector<std::string>& tokens() const { return tokens_; }
  const SpecialIds& special() const { return special_; }
  bool is_special(int32_t id) const {
    return id == special_.pad || id == special_.unk || id == special_.cls || id == special_.sep || id == special_.mask;
  }
  // CRC-32 of the tokens, each followed by '\n' (the canonical vocab.txt bytes, whatever line endings the file had).
  uint32_t checksum() const { return checksum_; }
  const std::string& origin() const { return origin_; }

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string_view, int32_t> index_;
  SpecialIds special_;
  uint32_t checksum_ = 0;
  std::string origin_;
};

}  // namespace nopad
