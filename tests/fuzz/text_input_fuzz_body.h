// Fuzz body of prepare's text reader (data/text_input.h, data/documents.h): the bytes are an input file (plain, or
// gzip/xz/zstd by its magic bytes), read and decompressed, its format settled for each --format prepare takes, and
// split into documents and sentences as prepare does. Every document must hold a sentence, and every sentence must
// be a view inside the text it was split from.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "data/documents.h"
#include "data/text_input.h"
#include "fuzz_common.h"

namespace nopad::fuzz {

inline void check_documents(const std::vector<TextDocument>& docs, std::string_view text) {
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  for (const TextDocument& d : docs) {
    require(!d.sentences.empty(), "no empty document is kept");
    for (const std::string_view s : d.sentences)
      require(s.empty() || (s.data() >= begin && s.data() + s.size() <= end), "a sentence lies inside its text");
  }
}

inline void text_input_fuzz_one(const uint8_t* data, size_t size) {
  const std::filesystem::path file = scratch_dir() / "input";  // no extension: compression is told by magic bytes
  write_bytes(file, data, size);
  TextInput in;
  try {
    in = read_text_input(file);
  } catch (const Error&) {
    return;
  }
  require(in.stored_bytes == size, "every byte of the file is read");
  require(in.compression == detect_compression(std::string_view(reinterpret_cast<const char*>(data), size)),
          "the compression is the one the magic bytes name");
  for (const TextFormat requested :
       {TextFormat::kAuto, TextFormat::kWikiExtractor, TextFormat::kSentenceLines, TextFormat::kJsonLines}) {
    try {
      const TextFormat format = detect_text_format(in, requested);
      require(format != TextFormat::kAuto, "a settled format");
      require(requested == TextFormat::kAuto || format == requested, "the requested format is kept");
      if (format == TextFormat::kJsonLines) {
        std::string decoded;
        const std::vector<TextDocument> docs = split_json_lines(in.text, "text", in.name, decoded);
        check_documents(docs, decoded);
      } else {
        check_documents(split_documents(in.text, format), in.text);
      }
    } catch (const Error&) {
    }
  }
}

}  // namespace nopad::fuzz
