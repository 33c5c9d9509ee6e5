// The text inputs of `nopad prepare` as a user holds them: a file or standard input ("-"), plain or compressed
// (gzip, xz, zstd: recognised by their magic bytes, never by the file name), in any of the text formats of
// data/documents.h.
//
// Contract:
//  * read_text_input() returns the whole decoded text in memory, or throws a nopad::Error naming the input; a
//    truncated or corrupt compressed stream is an error, never a partial text. Several gzip members, concatenated xz
//    streams and several zstd frames are read as one text, as `zcat`, `xzcat` and `zstdcat` do.
//  * detect_text_format() settles the format of one decoded input and refuses what prepare must not train on:
//    known binary formats (Parquet, bzip2, zip, 7z, tar) with a message saying how to turn them into text, other
//    binary data (NUL bytes, or many control bytes near the start), invalid UTF-8 (with line and byte offset), and
//    JSON given as plain text (`--format lines`/`wiki`) or as a JSON document rather than JSON lines.
//    With kAuto, JSON lines are accepted (docs/data-format.md, "Format detection", says why).
#pragma once
#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>

#include "data/documents.h"

namespace nopad {

enum class Compression { kNone, kGzip, kXz, kZstd };

// "gzip", "xz", "zstd", or "none".
const char* compression_name(Compression c);

// The compression `bytes` start with (by magic number), kNone when none of the three.
Compression detect_compression(std::string_view bytes);

// The name standard input has in messages and in dataset.json.
inline constexpr std::string_view kStdinName = "<stdin>";

struct TextInput {
  std::string name;                          // the path as given, or "<stdin>"
  std::string text;                          // the decoded bytes (after decompression)
  Compression compression = Compression::kNone;
  size_t stored_bytes = 0;                   // bytes read from the file or stream (before decompression)
};

// Decompresses `bytes` (compressed as `c`, not kNone); `name` is used in errors. Throws when the stream is truncated
// or corrupt, or when this build lacks the library (the message names the Debian package to install).
std::string decompress(std::string_view bytes, Compression c, std::string_view name);

// Reads `path` ("-": standard input, read to its end) and decompresses it when it is compressed.
TextInput read_text_input(const std::filesystem::path& path);

// The format to read `input` as, given the requested one (kAuto: detected). Throws, naming the input and the flag or
// command to use, for anything that is not UTF-8 text in the requested format (see the contract above).
TextFormat detect_text_format(const TextInput& input, TextFormat requested);

}  // namespace nopad
