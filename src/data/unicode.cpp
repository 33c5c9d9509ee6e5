// Lenient UTF-8 decoding and lookups into the generated Unicode tables (see unicode.h for the contracts).
#include "data/unicode.h"

#include <algorithm>

namespace nopad::unicode {

namespace {
#include "data/unicode_tables.inc"

// Hangul syllable decomposition constants (Unicode chapter 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kTCount = 28, kNCount = 21 * 28, kSCount = 19 * 21 * 28;

}  // namespace

size_t decode_utf8(const unsigned char* s, size_t n, size_t i, uint32_t& cp) {
  const uint32_t b0 = s[i];
  if (b0 < 0x80) {
    cp = b0;
    return i + 1;
  }
  // Lead byte -> number of continuation bytes and the allowed range of the first one (which excludes overlong
  // forms, surrogates and values above U+10FFFF).
  int extra;
  uint32_t lo = 0x80, hi = 0xBF;
  if (b0 < 0xC2) {
    cp = kReplacement;  // stray continuation byte, or overlong lead C0/C1
    return i + 1;
  } else if (b0 < 0xE0) {
    extra = 1;
  } else if (b0 < 0xF0) {
    extra = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 < 0xF5) {
    extra = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    cp = kReplacement;
    return i + 1;
  }
  uint32_t value = b0 & (0x3F >> extra);
  size_t j = i + 1;
  for (int k = 0; k < extra; ++k, ++j) {
    if (j >= n) {
      cp = kReplacement;
      return j;
    }
    const uint32_t b = s[j];
    if (b < lo || b > hi) {
      cp = kReplacement;  // resume at the offending byte: it may start the next character
      return j;
    }
    lo = 0x80;
    hi = 0xBF;
    value = (value << 6) | (b & 0x3F);
  }
  cp = value;
  return j;
}

uint8_t flags(uint32_t cp) {
  if (cp >= 0x110000) return 0;
  return kFlagStage2[(static_cast<uint32_t>(kFlagStage1[cp >> kFlagBlockShift]) << kFlagBlockShift) |
                     (cp & ((1u << kFlagBlockShift) - 1))];
}

void append_lower_nfd(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const MapEntry* end = kMapIndex + std::size(kMapIndex);
  const MapEntry* it = std::lower_bound(kMapIndex, end, cp, [](const MapEntry& e, uint32_t c) { return e.cp < c; });
  if (it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  out.insert(out.end(), kMapPool + it->offset, kMapPool + it->offset + it->len);
}

int combining_class(uint32_t cp) {
  const CccRange* end = kCombiningClass + std::size(kCombiningClass);
  const CccRange* it =
      std::lower_bound(kCombiningClass, end, cp, [](const CccRange& r, uint32_t c) { return r.last < c; });
  return (it != end && it->first <= cp) ? it->ccc : 0;
}

void canonical_reorder(std::vector<uint32_t>& cps) {
  size_t i = 0;
  while (i < cps.size()) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + static_cast<std::ptrdiff_t>(i), cps.begin() + static_cast<std::ptrdiff_t>(j),
                     [](uint32_t a, uint32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
}

const char* version() { return NOPAD_UNICODE_VERSION; }

}  // namespace nopad::unicode
