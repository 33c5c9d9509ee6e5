// BERT's uncased WordPiece tokenizer (contract in tokenizer.h).
// Layout of the work: one pass over the bytes finds whitespace-separated words (dropping control characters and
// isolating CJK ideographs); each word is normalised (lower case, NFD, no Mn), split on punctuation, and each piece
// goes through greedy longest-match WordPiece. Words that are plain ASCII with nothing dropped (nearly all English)
// take a fast path that never decodes UTF-8 and never allocates; vocabulary lookups use open-addressing tables
// built once, keyed by FNV-1a hashes that are computed incrementally over each candidate prefix.
#include "data/tokenizer.h"

#include <cstring>

#include "core/error.h"
#include "data/unicode.h"

namespace nopad {

namespace {

constexpr uint64_t kFnvBasis = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;
constexpr size_t kMaxWordChars = 100;  // BERT's max_input_chars_per_word

inline uint64_t fnv_step(uint64_t h, unsigned char b) { return (h ^ b) * kFnvPrime; }

// Open-addressing hash table from byte strings (stored in one shared pool) to token ids.
class TokenTable {
 public:
  void build(const std::vector<std::pair<std::string_view, int32_t>>& entries) {
    size_t cap = 16;
    while (cap < entries.size() * 2 + 1) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    for (const auto& [key, id] : entries) {
      uint64_t h = kFnvBasis;
      for (unsigned char c : key) h = fnv_step(h, c);
      size_t i = index(h);
      while (slots_[i].id >= 0) i = (i + 1) & mask_;
      slots_[i] = Slot{h, key.data(), static_cast<uint32_t>(key.size()), id};
      if (key.size() > max_len_) max_len_ = key.size();
    }
  }
  // Id of the key with FNV-1a hash h and bytes [p, p+len), or -1.
  int32_t find(uint64_t h, const char* p, size_t len) const {
    for (size_t i = index(h);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.hash == h && s.len == len && std::memcmp(s.key, p, len) == 0) return s.id;
    }
  }
  size_t max_len() const { return max_len_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    const char* key = nullptr;
    uint32_t len = 0;
    int32_t id = -1;
  };
  size_t index(uint64_t h) const { return static_cast<size_t>(h ^ (h >> 29)) & mask_; }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t max_len_ = 0;
};

// ASCII byte classes for the fast path.
enum AsciiClass : uint8_t { kWord = 0, kSpace = 1, kDrop = 2, kPunct = 3 };

// Per-call working memory, reused across the words of one call.
struct Scratch {
  std::vector<uint32_t> cps, norm;
  std::string piece;
  std::vector<uint32_t> bounds;  // byte offset of each code point of `piece`, plus the end
  std::vector<uint64_t> prefix_hash;
};

}  // namespace

struct WordPieceTokenizer::Impl {
  bool lower = true;
  int32_t unk = -1;
  TokenTable whole;         // every vocabulary entry
  TokenTable continuation;  // entries "##x", keyed by "x"
  uint8_t ascii_class[128];
  char ascii_lower[128];

  Impl(const Vocab& vocab, bool lower_case) : lower(lower_case), unk(vocab.special().unk) {
    std::vector<std::pair<std::string_view, int32_t>> all, cont;
    all.reserve(static_cast<size_t>(vocab.size()));
    for (int32_t id = 0; id < vocab.size(); ++id) {
      const std::string_view t = vocab.token(id);
      all.emplace_back(t, id);
      if (t.size() > 2 && t.starts_with("##")) cont.emplace_back(t.substr(2), id);
    }
    whole.build(all);
    continuation.build(cont);
    for (uint32_t c = 0; c < 128; ++c) {
      const uint8_t f = unicode::flags(c);
      ascii_class[c] = (f & unicode::kSpace) ? kSpace : (f & unicode::kDrop) ? kDrop : (f & unicode::kPunct) ? kPunct
                                                                                                           : kWord;
      ascii_lower[c] = static_cast<char>((lower && c >= 'A' && c <= 'Z') ? c + 32 : c);
    }
  }

  bool is_punct(uint32_t cp) const {
    return cp < 128 ? ascii_class[cp] == kPunct : (unicode::flags(cp) & unicode::kPunct) != 0;
  }

  // WordPiece of one basic token: UTF-8 bytes `w`, `ncp` code points, bounds[k] = byte offset of code point k
  // (bounds == nullptr: one byte per code point). Appends ids, or a single [UNK].
  void wordpiece(std::string_view w, const uint32_t* bounds, size_t ncp, Scratch& sc,
                 std::vector<int32_t>& out) const {
    if (ncp == 0) return;
    if (ncp > kMaxWordChars) {
      out.push_back(unk);
      return;
    }
    auto at = [&](size_t k) -> size_t { return bounds ? bounds[k] : k; };
    const size_t mark = out.size();
    std::vector<uint64_t>& hs = sc.prefix_hash;
    if (hs.size() < ncp + 1) hs.resize(ncp + 1);
    size_t start = 0;
    while (start < ncp) {
      const TokenTable& table = start == 0 ? whole : continuation;
      const size_t begin = at(start), limit = table.max_len();
      // Hash every prefix that could still be a vocabulary entry, then try them longest first.
      uint64_t h = kFnvBasis;
      size_t last = start;
      for (size_t k = start + 1; k <= ncp && at(k) - begin <= limit; ++k) {
        for (size_t b = at(k - 1); b < at(k); ++b) h = fnv_step(h, static_cast<unsigned char>(w[b]));
        hs[k] = h;
        last = k;
      }
      int32_t id = -1;
      size_t end = last;
      for (; end > start; --end) {
        id = table.find(hs[end], w.data() + begin, at(end) - begin);
        if (id >= 0) break;
      }
      if (id < 0) {
        out.resize(mark);
        out.push_back(unk);
        return;
      }
      out.push_back(id);
      start = end;
    }
  }

  // Steps 1-4 over `text`; calls emit(utf8, bounds or nullptr, ncp) for every basic token.
  template <class Emit>
  void basic(std::string_view text, Scratch& sc, Emit&& emit) const {
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    size_t word_begin = 0;
    bool in_word = false, simple = true;  // simple: ASCII only, nothing dropped inside
    auto flush = [&](size_t word_end) {
      if (in_word) {
        if (simple) {
          ascii_word(s, word_begin, word_end, sc, emit);
        } else {
          general_word(s, word_begin, word_end, sc, emit);
        }
      }
      in_word = false;
      simple = true;
    };
    size_t i = 0;
    while (i < n) {
      const unsigned char b = s[i];
      if (b < 0x80) {
        switch (ascii_class[b]) {
          case kSpace:
            flush(i);
            break;
          case kDrop:
            if (in_word) simple = false;
            break;
          default:
            if (!in_word) {
              in_word = true;
              word_begin = i;
            }
        }
        ++i;
        continue;
      }
      uint32_t cp;
      const size_t next = unicode::decode_utf8(s, n, i, cp);
      const uint8_t f = unicode::flags(cp);
      if (f & unicode::kDrop) {
        if (in_word) simple = false;
      } else if (f & unicode::kSpace) {
        flush(i);
      } else if (unicode::is_cjk(cp)) {
        flush(i);
        in_word = true;
        simple = false;
        word_begin = i;
        flush(next);
      } else {
        if (!in_word) {
          in_word = true;
          word_begin = i;
        }
        simple = false;
      }
      i = next;
    }
    flush(n);
  }

  template <class Emit>
  void ascii_word(const unsigned char* s, size_t begin, size_t end, Scratch& sc, Emit& emit) const {
    std::string& piece = sc.piece;
    piece.clear();
    for (size_t p = begin; p < end; ++p) {
      const unsigned char c = s[p];
      if (ascii_class[c] == kPunct) {
        if (!piece.empty()) {
          emit(std::string_view(piece), nullptr, piece.size());
          piece.clear();
        }
        emit(std::string_view(reinterpret_cast<const char*>(s + p), 1), nullptr, 1);
      } else {
        piece += ascii_lower[c];
      }
    }
    if (!piece.empty()) emit(std::string_view(piece), nullptr, piece.size());
  }

  // Python's final-sigma context: a cased letter before (skipping case-ignorable ones) and none after.
  static bool final_sigma(const std::vector<uint32_t>& w, size_t i) {
    size_t j = i;
    while (j > 0 && (unicode::flags(w[j - 1]) & unicode::kIgnorable)) --j;
    if (j == 0 || !(unicode::flags(w[j - 1]) & unicode::kCased)) return false;
    j = i + 1;
    while (j < w.size() && (unicode::flags(w[j]) & unicode::kIgnorable)) ++j;
    return j == w.size() || !(unicode::flags(w[j]) & unicode::kCased);
  }

  template <class Emit>
  void general_word(const unsigned char* s, size_t begin, size_t end, Scratch& sc, Emit& emit) const {
    std::vector<uint32_t>& cps = sc.cps;
    cps.clear();
    for (size_t i = begin; i < end;) {
      uint32_t cp;
      i = unicode::decode_utf8(s, end, i, cp);
      if (!(unicode::flags(cp) & unicode::kDrop)) cps.push_back(cp);
    }
    std::vector<uint32_t>* word = &cps;
    if (lower) {
      std::vector<uint32_t>& norm = sc.norm;
      norm.clear();
      for (size_t k = 0; k < cps.size(); ++k) {
        const uint32_t cp = cps[k];
        if (cp < 128) {
          norm.push_back(static_cast<unsigned char>(ascii_lower[cp]));
        } else if (cp == 0x3A3) {  // capital sigma: its lower case depends on the context
          norm.push_back(final_sigma(cps, k) ? 0x3C2 : 0x3C3);
        } else if (unicode::flags(cp) & unicode::kMapped) {
          unicode::append_lower_nfd(cp, norm);
        } else {
          norm.push_back(cp);
        }
      }
      bool any_mn = false, any_reorder = false;
      for (uint32_t cp : norm) {
        if (cp < 128) continue;
        const uint8_t f = unicode::flags(cp);
        any_mn |= (f & unicode::kMn) != 0;
        any_reorder |= (f & unicode::kReorder) != 0;
      }
      // Marks are only dropped after reordering, because a mark of class 0 separates reordering runs.
      if (any_reorder) unicode::canonical_reorder(norm);
      if (any_mn) std::erase_if(norm, [](uint32_t cp) { return cp >= 128 && (unicode::flags(cp) & unicode::kMn); });
      word = &norm;
    }
    std::string& piece = sc.piece;
    std::vector<uint32_t>& bounds = sc.bounds;
    piece.clear();
    bounds.clear();
    auto emit_piece = [&] {
      if (bounds.empty()) return;
      const size_t ncp = bounds.size();
      bounds.push_back(static_cast<uint32_t>(piece.size()));
      emit(std::string_view(piece), bounds.data(), ncp);
      piece.clear();
      bounds.clear();
    };
    for (uint32_t cp : *word) {
      if (is_punct(cp)) {
        emit_piece();
        bounds.push_back(0);
        unicode::append_utf8(cp, piece);
        emit_piece();
      } else {
        bounds.push_back(static_cast<uint32_t>(piece.size()));
        unicode::append_utf8(cp, piece);
      }
    }
    emit_piece();
  }
};

WordPieceTokenizer::WordPieceTokenizer(const Vocab& vocab, bool lower_case)
    : vocab_(&vocab), impl_(std::make_unique<Impl>(vocab, lower_case)) {
  NOPAD_CHECK(impl_->unk >= 0, "vocabulary ", vocab.origin(), " has no [UNK] token, which WordPiece needs");
}

WordPieceTokenizer::~WordPieceTokenizer() = default;
WordPieceTokenizer::WordPieceTokenizer(WordPieceTokenizer&&) noexcept = default;
WordPieceTokenizer& WordPieceTokenizer::operator=(WordPieceTokenizer&&) noexcept = default;

void WordPieceTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  Scratch sc;
  impl_->basic(text, sc, [&](std::string_view w, const uint32_t* bounds, size_t ncp) {
    impl_->wordpiece(w, bounds, ncp, sc, out);
  });
}

std::vector<int32_t> WordPieceTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode(text, out);
  return out;
}

std::vector<std::string> WordPieceTokenizer::pieces(std::string_view text) const {
  std::vector<std::string> out;
  for (int32_t id : encode(text)) out.push_back(vocab_->token(id));
  return out;
}

std::vector<std::string> WordPieceTokenizer::basic_tokens(std::string_view text) const {
  std::vector<std::string> out;
  Scratch sc;
  impl_->basic(text, sc, [&](std::string_view w, const uint32_t*, size_t) { out.emplace_back(w); });
  return out;
}

}  // namespace nopad
