// Reading `nopad prepare`'s inputs: files or standard input, decompressed in memory (zlib, liblzma, libzstd when the
// build found them), then checked and their format settled. See text_input.h for the contract.
#include "data/text_input.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io.h"
#include "core/utf8.h"

#if NOPAD_HAVE_ZLIB
#include <zlib.h>
#endif
#if NOPAD_HAVE_LZMA
#include <lzma.h>
#endif
#if NOPAD_HAVE_ZSTD
#include <zstd.h>
#endif

namespace nopad {

namespace fs = std::filesystem;

namespace {

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// The conversion the Parquet refusal names (docs/data-format.md has the same line and a pyarrow-only one).
constexpr const char* kParquetConversion =
    "python3 -c 'import sys, datasets; datasets.Dataset.from_parquet(sys.argv[1]).to_json(sys.stdout.buffer)' "
    "FILE.parquet | nopad prepare --input - --format jsonl --text-field NAME ...";

// Decompressed texts are usually 3-10x their compressed size: start at 4x and double.
[[maybe_unused]] size_t initial_output_size(size_t compressed) {
  return std::max<size_t>(size_t{1} << 16, 4 * compressed);
}

[[noreturn, maybe_unused]] void truncated(std::string_view name, const char* format) {
  fail("input ", name, " ends before the end of its ", format,
       " stream: the file is truncated (copy or download it again)");
}

[[noreturn, maybe_unused]] void missing_library(Compression c, std::string_view name) {
  const char* lib = c == Compression::kGzip ? "zlib" : c == Compression::kXz ? "liblzma" : "libzstd";
  const char* pkg = c == Compression::kGzip ? "zlib1g-dev" : c == Compression::kXz ? "liblzma-dev" : "libzstd-dev";
  const char* cat = c == Compression::kGzip ? "zcat" : c == Compression::kXz ? "xzcat" : "zstdcat";
  fail("input ", name, " is ", compression_name(c), "-compressed, but this nopad was built without ", lib,
       ": install the Debian package ", pkg, " and rebuild nopad (bash scripts/setup.sh), or decompress it on the "
       "way in (", cat, " FILE | nopad prepare --input - ...)");
}

#if NOPAD_HAVE_ZLIB
// Every gzip member, one after the other (as `zcat` reads a file made by `cat a.gz b.gz`).
std::string gunzip(std::string_view in, std::string_view name) {
  z_stream zs{};
  NOPAD_CHECK(inflateInit2(&zs, 16 + MAX_WBITS) == Z_OK, "zlib could not start a gzip decoder for input ", name);
  struct End {
    z_stream* zs;
    ~End() { inflateEnd(zs); }
  } end{&zs};
  constexpr size_t kChunk = size_t{1} << 30;  // zlib counts in 32-bit integers
  const auto* base = reinterpret_cast<const Bytef*>(in.data());
  std::string out(initial_output_size(in.size()), '\0');
  size_t in_pos = 0, out_pos = 0;
  for (;;) {
    if (out_pos == out.size()) out.resize(2 * out.size());
    zs.next_in = const_cast<Bytef*>(base + in_pos);
    zs.avail_in = static_cast<uInt>(std::min(in.size() - in_pos, kChunk));
    zs.next_out = reinterpret_cast<Bytef*>(out.data() + out_pos);
    zs.avail_out = static_cast<uInt>(std::min(out.size() - out_pos, kChunk));
    const uInt avail_in = zs.avail_in, avail_out = zs.avail_out;
    const int rc = inflate(&zs, Z_NO_FLUSH);
    in_pos += avail_in - zs.avail_in;
    out_pos += avail_out - zs.avail_out;
    if (rc == Z_STREAM_END) {
      if (in_pos == in.size()) break;
      // Another member must follow; anything else is damage, not something to skip silently.
      NOPAD_CHECK(detect_compression(in.substr(in_pos)) == Compression::kGzip, "input ", name, " holds ",
                  in.size() - in_pos, " bytes after the end of its gzip data (at byte ", in_pos,
                  ") that are not another gzip member: the file is damaged");
      inflateReset(&zs);
      continue;
    }
    if (rc == Z_OK) continue;
    if (rc == Z_BUF_ERROR && in_pos == in.size()) truncated(name, "gzip");
    if (rc == Z_BUF_ERROR && avail_in > 0 && avail_out > 0)
      fail("input ", name, " is corrupt: its gzip decoder stopped at compressed byte ", in_pos);
    if (rc == Z_BUF_ERROR) continue;
    NOPAD_CHECK(rc != Z_MEM_ERROR, "out of memory decompressing input ", name);
    fail("input ", name, " is corrupt: gzip data error at compressed byte ", in_pos, " (",
         zs.msg ? zs.msg : "invalid data", ")");
  }
  out.resize(out_pos);
  return out;
}
#endif

#if NOPAD_HAVE_LZMA
// Every xz stream, one after the other (LZMA_CONCATENATED also takes the stream padding `xz` allows between them).
std::string unxz(std::string_view in, std::string_view name) {
  lzma_stream s = LZMA_STREAM_INIT;
  NOPAD_CHECK(lzma_stream_decoder(&s, UINT64_MAX, LZMA_CONCATENATED) == LZMA_OK,
              "liblzma could not start an xz decoder for input ", name);
  struct End {
    lzma_stream* s;
    ~End() { lzma_end(s); }
  } end{&s};
  std::string out(initial_output_size(in.size()), '\0');
  s.next_in = reinterpret_cast<const uint8_t*>(in.data());
  s.avail_in = in.size();
  size_t out_pos = 0;
  for (;;) {
    if (out_pos == out.size()) out.resize(2 * out.size());
    s.next_out = reinterpret_cast<uint8_t*>(out.data() + out_pos);
    s.avail_out = out.size() - out_pos;
    const size_t avail_out = s.avail_out;
    // All input is given at once, so LZMA_FINISH once it is consumed: a stream cut short then reports an error.
    const lzma_ret rc = lzma_code(&s, s.avail_in == 0 ? LZMA_FINISH : LZMA_RUN);
    out_pos += avail_out - s.avail_out;
    if (rc == LZMA_STREAM_END) break;
    if (rc == LZMA_OK) continue;
    if (rc == LZMA_BUF_ERROR && s.avail_in == 0) truncated(name, "xz");
    if (rc == LZMA_BUF_ERROR) continue;
    NOPAD_CHECK(rc != LZMA_MEM_ERROR, "out of memory decompressing input ", name);
    const char* what = rc == LZMA_DATA_ERROR     ? "compressed data is corrupt or fails its integrity check"
                       : rc == LZMA_FORMAT_ERROR ? "data that is not in the xz format"
                       : rc == LZMA_OPTIONS_ERROR ? "unsupported xz options"
                                                  : "xz decoder error";
    fail("input ", name, " is corrupt: ", what, " at compressed byte ", s.total_in);
  }
  out.resize(out_pos);
  return out;
}
#endif

#if NOPAD_HAVE_ZSTD
// Every zstd frame, one after the other (skippable frames give no text).
std::string unzstd(std::string_view in, std::string_view name) {
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  NOPAD_CHECK(dctx != nullptr, "libzstd could not start a decoder for input ", name);
  struct End {
    ZSTD_DCtx* d;
    ~End() { ZSTD_freeDCtx(d); }
  } end{dctx};
  std::string out(initial_output_size(in.size()), '\0');
  ZSTD_inBuffer ib{in.data(), in.size(), 0};
  size_t out_pos = 0, rc = 0;
  bool out_full = false;
  // Call again while input remains, or while the last call filled the output (the decoder may hold more).
  while (ib.pos < ib.size || out_full) {
    if (out_pos == out.size()) out.resize(2 * out.size());
    ZSTD_outBuffer ob{out.data() + out_pos, out.size() - out_pos, 0};
    rc = ZSTD_decompressStream(dctx, &ob, &ib);
    if (ZSTD_isError(rc))
      fail("input ", name, " is corrupt: zstd error at compressed byte ", ib.pos, " (", ZSTD_getErrorName(rc), ")");
    out_pos += ob.pos;
    out_full = ob.pos == ob.size;
  }
  if (rc != 0) truncated(name, "zstd");  // 0: the last frame is complete and flushed
  out.resize(out_pos);
  return out;
}
#endif

// All of a file descriptor's bytes (standard input, a pipe).
std::string read_all(int fd, std::string_view name) {
  std::string data;
  size_t size = 0;
  data.resize(size_t{1} << 20);
  for (;;) {
    if (size == data.size()) data.resize(2 * data.size());
    const ssize_t got = ::read(fd, data.data() + size, data.size() - size);
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("error reading input ", name, ": ", std::strerror(errno));
    }
    size += static_cast<size_t>(got);
  }
  data.resize(size);
  return data;
}

// 1-based line of byte `offset` of `text`.
size_t line_of(std::string_view text, size_t offset) {
  return 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + static_cast<ptrdiff_t>(offset), '\n'));
}

// The formats people hand to a text reader by mistake, by their magic numbers: what they are and what to do.
void refuse_known_binary(std::string_view t, std::string_view name) {
  auto refuse = [&](const char* what, const char* todo) { fail("input ", name, " is ", what, ", not text: ", todo); };
  if (starts_with(t, "PAR1"))
    fail("input ", name,
         " is a Parquet file, which nopad does not read (docs/data-format.md says why): convert it to JSON lines, "
         "e.g. ",
         kParquetConversion);
  if (t.size() >= 10 && starts_with(t, "BZh") && t[3] >= '1' && t[3] <= '9' &&
      (t.substr(4, 6) == "\x31\x41\x59\x26\x53\x59" || t.substr(4, 6) == "\x17\x72\x45\x38\x50\x90"))
    refuse("bzip2-compressed",
           "decompress it on the way in (bzcat FILE | nopad prepare --input - ...) or recompress it with gzip, xz "
           "or zstd, which nopad reads");
  if (starts_with(t, "PK\x03\x04") || starts_with(t, "PK\x05\x06"))
    refuse("a zip archive", "unpack it (unzip FILE -d DIR) and give the folder to --input");
  if (starts_with(t, "7z\xBC\xAF\x27\x1C"))
    refuse("a 7z archive", "unpack it (7z x FILE -oDIR) and give the folder to --input");
  if (t.size() >= 262 && t.substr(257, 5) == "ustar")
    refuse("a tar archive", "unpack it (tar -xf FILE -C DIR) and give the folder to --input");
  const Compression inner = detect_compression(t);
  if (inner != Compression::kNone)
    fail("input ", name, " holds ", compression_name(inner),
         "-compressed data inside its compression: decompress the outer layer and give nopad that file");
}

// Binary data: a NUL byte, or more than 1 in 10 control bytes, in the first 8 KiB (the window git uses). Runs before
// the UTF-8 check so that a binary file is called binary rather than "not UTF-8".
void refuse_binary(std::string_view t, std::string_view name) {
  if (starts_with(t, "\xFF\xFE") || starts_with(t, "\xFE\xFF"))
    fail("input ", name, " is UTF-16 or UTF-32 text (it starts with a byte-order mark): convert it to UTF-8, e.g. "
         "iconv -f UTF-16 -t UTF-8 FILE > FILE.txt");
  const std::string_view head = t.substr(0, 8192);
  const size_t nul = head.find('\0');
  if (nul != std::string_view::npos)
    fail("input ", name, " is a binary file, not text: it holds a NUL byte at byte offset ", nul,
         " (nopad prepare reads UTF-8 text, plain or gzip/xz/zstd-compressed; UTF-16 text converts with iconv -f "
         "UTF-16 -t UTF-8)");
  size_t control = 0;
  for (const char ch : head) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\t' && c != '\n' && c != '\r' && c != '\f' && c != '\v') || c == 0x7f) ++control;
  }
  if (control * 10 > head.size())
    fail("input ", name, " is a binary file, not text: ", control, " of its first ", head.size(),
         " bytes are control characters (nopad prepare reads UTF-8 text, plain or gzip/xz/zstd-compressed)");
}

// The first non-blank line, trimmed, and its 1-based number; empty when there is none.
std::string_view first_line(std::string_view t, size_t* line_no) {
  if (starts_with(t, "\xEF\xBB\xBF")) t.remove_prefix(3);  // a UTF-8 byte-order mark
  size_t pos = 0, line = 1;
  while (pos < t.size()) {
    size_t end = t.find('\n', pos);
    if (end == std::string_view::npos) end = t.size();
    std::string_view l = t.substr(pos, end - pos);
    const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; };
    while (!l.empty() && blank(l.front())) l.remove_prefix(1);
    while (!l.empty() && blank(l.back())) l.remove_suffix(1);
    if (!l.empty()) {
      *line_no = line;
      return l;
    }
    pos = end + 1;
    ++line;
  }
  return {};
}

}  // namespace

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kGzip: return "gzip";
    case Compression::kXz: return "xz";
    case Compression::kZstd: return "zstd";
    case Compression::kNone: break;
  }
  return "none";
}

Compression detect_compression(std::string_view b) {
  if (starts_with(b, "\x1f\x8b")) return Compression::kGzip;
  if (starts_with(b, std::string_view("\xFD" "7zXZ\0", 6))) return Compression::kXz;
  if (starts_with(b, "\x28\xB5\x2F\xFD")) return Compression::kZstd;
  // A zstd skippable frame (magic 0x184D2A50..5F, little-endian) may come first.
  if (b.size() >= 4 && (static_cast<unsigned char>(b[0]) & 0xF0) == 0x50 && b.substr(1, 3) == "\x2A\x4D\x18")
    return Compression::kZstd;
  return Compression::kNone;
}

std::string decompress(std::string_view bytes, Compression c, std::string_view name) {
  switch (c) {
    case Compression::kGzip:
#if NOPAD_HAVE_ZLIB
      return gunzip(bytes, name);
#else
      missing_library(c, name);
#endif
    case Compression::kXz:
#if NOPAD_HAVE_LZMA
      return unxz(bytes, name);
#else
      missing_library(c, name);
#endif
    case Compression::kZstd:
#if NOPAD_HAVE_ZSTD
      return unzstd(bytes, name);
#else
      missing_library(c, name);
#endif
    case Compression::kNone: break;
  }
  return std::string(bytes);
}

TextInput read_text_input(const fs::path& path) {
  TextInput in;
  std::string bytes;
  std::error_code ec;
  if (path == "-") {
    in.name = kStdinName;
    bytes = read_all(STDIN_FILENO, in.name);
  } else {
    in.name = path.string();
    if (fs::is_regular_file(path, ec) || fs::is_directory(path, ec)) {
      bytes = read_file(path);  // a folder: read_file's error says so
    } else {
      // A named pipe or a process substitution (<(zcat FILE)): read to its end.
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) fail("cannot open input ", in.name, ": ", std::strerror(errno));
      try {
        bytes = read_all(fd, in.name);
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
    }
  }
  in.stored_bytes = bytes.size();
  in.compression = detect_compression(bytes);
  if (in.compression == Compression::kNone) {
    in.text = std::move(bytes);
  } else {
    in.text = decompress(bytes, in.compression, in.name);
  }
  return in;
}

TextFormat detect_text_format(const TextInput& input, TextFormat requested) {
  const std::string_view t = input.text, name = input.name;
  refuse_known_binary(t, name);
  refuse_binary(t, name);
  const size_t bad = find_invalid_utf8(t);
  if (bad != std::string_view::npos)
    fail("input ", name, " is not UTF-8 text: invalid byte 0x", std::hex,
         static_cast<int>(static_cast<unsigned char>(t[bad])), std::dec, " on line ", line_of(t, bad),
         " at byte offset ", bad, input.compression != Compression::kNone ? " of its decompressed text" : "",
         " (convert it to UTF-8, e.g. with iconv -f LATIN1 -t UTF-8)");

  // JSON: the first non-blank line decides. A JSON object there means JSON lines; an array, or a line that starts
  // like JSON but does not parse, means a JSON document (or a broken first record), which nothing here reads as text.
  size_t line_no = 0;
  const std::string_view first = first_line(t, &line_no);
  nlohmann::json record;
  bool object = false, json_like = false;
  if (!first.empty() && (first.front() == '{' || first.front() == '[')) {
    record = nlohmann::json::parse(first, nullptr, /*allow_exceptions=*/false);
    object = record.is_object();
    json_like = object || record.is_array() || first == "{" || first == "[" || starts_with(first, "{\"") ||
                starts_with(first, "[{");
  }
  if (object && requested != TextFormat::kAuto && requested != TextFormat::kJsonLines)
    fail("input ", name, " is JSON lines (line ", line_no, " is a JSON object with the fields ",
         json_field_names(first), "), which --format ", requested == TextFormat::kWikiExtractor ? "wiki" : "lines",
         " would train on as text: read it with --format jsonl --text-field NAME, NAME being the field that holds "
         "the text");
  if (json_like && !object && requested != TextFormat::kJsonLines)
    fail("input ", name, " is JSON but not JSON lines (line ", line_no,
         " is not one complete JSON object): write one record per line (a JSON array converts with jq -c '.[]' "
         "FILE > FILE.jsonl) and read it with --format jsonl --text-field NAME");
  if (requested == TextFormat::kAuto) {
    if (object) return TextFormat::kJsonLines;
    return looks_like_wikiextractor(t) ? TextFormat::kWikiExtractor : TextFormat::kSentenceLines;
  }
  if (requested == TextFormat::kJsonLines && record.is_array())
    fail("input ", name, " is a JSON array, not JSON lines (one object per line): convert it with jq -c '.[]' FILE "
         "> FILE.jsonl");
  return requested;
}

}  // namespace nopad
