// UTF-8 validation for text inputs: finds the first byte that is not part of a well-formed UTF-8 sequence
// (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF), so that bad input is reported with its offset.
#pragma once
#include <cstddef>
#include <string_view>

namespace nopad {

// Offset of the first invalid byte, or std::string_view::npos when `text` is valid UTF-8.
size_t find_invalid_utf8(std::string_view text);

}  // namespace nopad
