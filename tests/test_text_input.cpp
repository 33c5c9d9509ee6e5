// nopad prepare's inputs (data/text_input.h, split_json_lines in data/documents.h): gzip, xz and zstd round trips
// of real text over several members/streams/frames (compressed here with the libraries' own encoders), truncated
// and corrupt streams named as such, standard input, the refusals of binary data, known binary formats, JSON read
// as text and invalid UTF-8, and JSON-lines records split into documents.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "core/io.h"
#include "data/documents.h"
#include "data/prepare.h"
#include "data/text_input.h"
#include "test_util.h"

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
namespace {

namespace fs = std::filesystem;

std::vector<std::string> S(const std::vector<std::string_view>& v) { return {v.begin(), v.end()}; }

// Three pieces of real text: two slices of the wiki sample around 1.3 MB of one repeated line, which compresses far
// beyond the decoders' first output guess (4x), so their output has to grow.
std::vector<std::string> text_pieces() {
  const std::string wiki = read_file(test::wiki_sample_dir() / "wiki_00");
  std::string repeated;
  while (repeated.size() < 1300000) repeated += "The same sentence again, to compress well.\n";
  const size_t a = wiki.find('\n', 150000) + 1, b = wiki.find('\n', a + 120000) + 1;  // whole lines
  return {wiki.substr(0, a), repeated, wiki.substr(a, b - a)};
}

std::string joined(const std::vector<std::string>& pieces) {
  std::string all;
  for (const auto& p : pieces) all += p;
  return all;
}

#if NOPAD_HAVE_ZLIB
std::string gzip_member(const std::string& text) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, text.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  zs.avail_in = static_cast<uInt>(text.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}
#endif

#if NOPAD_HAVE_LZMA
std::string xz_stream(const std::string& text) {
  std::string out(lzma_stream_buffer_bound(text.size()), '\0');
  size_t pos = 0;
  EXPECT_EQ(lzma_easy_buffer_encode(1, LZMA_CHECK_CRC64, nullptr, reinterpret_cast<const uint8_t*>(text.data()),
                                    text.size(), reinterpret_cast<uint8_t*>(out.data()), &pos, out.size()),
            LZMA_OK);
  out.resize(pos);
  return out;
}
#endif

#if NOPAD_HAVE_ZSTD
std::string zstd_frame(const std::string& text) {  // with a content checksum, as the zstd command writes by default
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
  std::string out(ZSTD_compressBound(text.size()), '\0');
  const size_t n = ZSTD_compress2(cctx, out.data(), out.size(), text.data(), text.size());
  EXPECT_FALSE(ZSTD_isError(n)) << ZSTD_getErrorName(n);
  ZSTD_freeCCtx(cctx);
  out.resize(n);
  return out;
}
#endif

// Writes `bytes` to dir/name and reads it back as an input.
TextInput read_back(const test::TempDir& dir, const std::string& name, const std::string& bytes) {
  write_file_atomic(dir / name, bytes);
  return read_text_input(dir / name);
}

// A compressed file of the three pieces (one member/stream/frame each, with `separator` between the second and
// third) reads back as the joined text, named and with its compression noted; cut short anywhere it is
// "truncated"; a flipped byte in its first piece is "corrupt".
void check_round_trip(Compression c, const std::vector<std::string>& members, const std::string& separator) {
  const std::vector<std::string> pieces = text_pieces();
  const std::string text = joined(pieces);
  const std::string file = members[0] + members[1] + separator + members[2];
  test::TempDir dir("textin");
  const std::string name = std::string("sample.") + compression_name(c);
  const TextInput in = read_back(dir, name, file);
  EXPECT_EQ(in.compression, c);
  EXPECT_EQ(in.stored_bytes, file.size());
  EXPECT_EQ(in.name, (dir / name).string());
  ASSERT_EQ(in.text.size(), text.size());
  EXPECT_TRUE(in.text == text) << compression_name(c) << " round trip differs";
  EXPECT_EQ(detect_text_format(in, TextFormat::kAuto), TextFormat::kWikiExtractor);

  for (const size_t cut : {size_t{8}, members[0].size() / 2, members[0].size() + members[1].size() / 2,
                           file.size() - 1}) {
    const std::string error = test::error_of([&] { read_back(dir, "cut." + name, file.substr(0, cut)); });
    EXPECT_NE(error.find((dir / ("cut." + name)).string()), std::string::npos) << error;
    EXPECT_NE(error.find(std::string("ends before the end of its ") + compression_name(c) +
                         " stream: the file is truncated"),
              std::string::npos)
        << compression_name(c) << " cut at " << cut << " of " << file.size() << ": " << error;
  }
  std::string bad = file;
  bad[members[0].size() / 2] = static_cast<char>(bad[members[0].size() / 2] ^ 0x55);
  const std::string error = test::error_of([&] { read_back(dir, "bad." + name, bad); });
  EXPECT_NE(error.find((dir / ("bad." + name)).string() + " is corrupt"), std::string::npos)
      << compression_name(c) << ": " << error;
}

TEST(TextInput, GzipMembersRoundTrip) {
#if NOPAD_HAVE_ZLIB
  std::vector<std::string> members;
  for (const auto& p : text_pieces()) members.push_back(gzip_member(p));
  check_round_trip(Compression::kGzip, members, "");
  // A damaged CRC-32 trailer, and bytes after the last member that are not a member, are errors too.
  test::TempDir dir("gzcrc");
  std::string crc = members[0];
  crc[crc.size() - 6] = static_cast<char>(crc[crc.size() - 6] ^ 1);
  NOPAD_EXPECT_ERROR_HAS(read_back(dir, "crc.gz", crc), "incorrect data check");
  NOPAD_EXPECT_ERROR_HAS(read_back(dir, "tail.gz", members[0] + "trailing junk"),
                         "that are not another gzip member: the file is damaged");
#else
  test::TempDir dir("nozlib");
  NOPAD_EXPECT_ERROR_HAS(read_back(dir, "a.gz", std::string("\x1f\x8b\x08\0\0\0\0\0\0\x03", 10)),
                         "install the Debian package zlib1g-dev and rebuild nopad");
#endif
}

TEST(TextInput, XzStreamsRoundTrip) {
#if NOPAD_HAVE_LZMA
  std::vector<std::string> streams;
  for (const auto& p : text_pieces()) streams.push_back(xz_stream(p));
  // Four zero bytes between streams: the stream padding `xz` allows.
  check_round_trip(Compression::kXz, streams, std::string(4, '\0'));
#else
  test::TempDir dir("nolzma");
  NOPAD_EXPECT_ERROR_HAS(read_back(dir, "a.xz", std::string("\xFD" "7zXZ\0\0\0", 8)),
                         "install the Debian package liblzma-dev and rebuild nopad");
#endif
}

TEST(TextInput, ZstdFramesRoundTrip) {
#if NOPAD_HAVE_ZSTD
  std::vector<std::string> frames;
  for (const auto& p : text_pieces()) frames.push_back(zstd_frame(p));
  // A skippable frame (magic 0x184D2A50, 4 bytes of content) between frames gives no text.
  check_round_trip(Compression::kZstd, frames, std::string("\x50\x2A\x4D\x18\x04\0\0\0abcd", 12));
#else
  test::TempDir dir("nozstd");
  NOPAD_EXPECT_ERROR_HAS(read_back(dir, "a.zst", std::string("\x28\xB5\x2F\xFD\0\0\0\0", 8)),
                         "install the Debian package libzstd-dev and rebuild nopad");
#endif
}

TEST(TextInput, CompressionIsFoundByMagicNotByName) {
  test::TempDir dir("magic");
  const std::string text = "One sentence.\nAnother one.\n";
  TextInput in = read_back(dir, "looks-compressed.gz", text);
  EXPECT_EQ(in.compression, Compression::kNone);
  EXPECT_EQ(in.text, text);
#if NOPAD_HAVE_ZLIB
  in = read_back(dir, "plain-name.txt", gzip_member(text));
  EXPECT_EQ(in.compression, Compression::kGzip);
  EXPECT_EQ(in.text, text);
#endif
}

// Standard input ("-"): read to its end, decompressed like a file, named <stdin>.
TEST(TextInput, StandardInput) {
  test::TempDir dir("stdin");
  const std::string text = "Read from a pipe. Twice split.\n";
#if NOPAD_HAVE_ZLIB
  write_file_atomic(dir / "in", gzip_member(text));
#else
  write_file_atomic(dir / "in", text);
#endif
  const int saved = ::dup(STDIN_FILENO);
  ASSERT_GE(saved, 0);
  const int fd = ::open((dir / "in").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::dup2(fd, STDIN_FILENO), STDIN_FILENO);
  ::close(fd);
  const std::string error = test::error_of([&] {
    const TextInput in = read_text_input("-");
    EXPECT_EQ(in.name, "<stdin>");
    EXPECT_EQ(in.text, text);
  });
  ::dup2(saved, STDIN_FILENO);
  ::close(saved);
  EXPECT_EQ(error, "(no error)");
  // "-" passes through expand_inputs once; twice is an error.
  EXPECT_EQ(expand_inputs({"-"}), (std::vector<fs::path>{"-"}));
  NOPAD_EXPECT_ERROR_HAS(expand_inputs({"-", "-"}), "standard input can be read only once");
}

TextInput text_input(const std::string& text, Compression c = Compression::kNone) {
  TextInput in;
  in.name = "in.txt";
  in.text = text;
  in.compression = c;
  return in;
}

std::string format_error(const std::string& text, TextFormat requested = TextFormat::kAuto) {
  return test::error_of([&] { detect_text_format(text_input(text), requested); });
}

TEST(TextInput, RefusesBinaryData) {
  std::string nul = "Some text first.\n";
  nul += std::string("\0\x01\x02", 3) + "more";
  std::string e = format_error(nul);
  EXPECT_NE(e.find("input in.txt is a binary file, not text: it holds a NUL byte at byte offset 17"),
            std::string::npos)
      << e;
  std::string controls;
  for (int i = 0; i < 400; ++i) controls += (i % 3 == 0) ? "\x01\x02\x1b" : "word ";
  e = format_error(controls);
  EXPECT_NE(e.find("is a binary file, not text"), std::string::npos) << e;
  EXPECT_NE(e.find("are control characters"), std::string::npos) << e;
  // A NUL after the first 8 KiB is not looked for; text with a few control bytes is text.
  std::string late(9000, 'a');
  late += std::string(1, '\0');
  EXPECT_EQ(detect_text_format(text_input(late), TextFormat::kAuto), TextFormat::kSentenceLines);
  EXPECT_EQ(detect_text_format(text_input("Page one.\fPage two.\x1b[0m\n"), TextFormat::kAuto),
            TextFormat::kSentenceLines);
  NOPAD_EXPECT_ERROR_HAS(detect_text_format(text_input(std::string("\xFF\xFEH\0i\0", 6)), TextFormat::kAuto),
                         "UTF-16");
}

TEST(TextInput, RefusesKnownBinaryFormatsSayingWhatToDo) {
  std::string e = format_error(std::string("PAR1\x15\x04\x15\0\0\0", 10));
  EXPECT_NE(e.find("input in.txt is a Parquet file, which nopad does not read"), std::string::npos) << e;
  EXPECT_NE(e.find("datasets.Dataset.from_parquet"), std::string::npos) << e;
  EXPECT_NE(e.find("--format jsonl --text-field NAME"), std::string::npos) << e;
  e = format_error("BZh91AY&SY\x12\x34junk");
  EXPECT_NE(e.find("is bzip2-compressed, not text"), std::string::npos) << e;
  EXPECT_NE(e.find("bzcat FILE | nopad prepare --input -"), std::string::npos) << e;
  e = format_error(std::string("PK\x03\x04\x14\0\0\0", 8));
  EXPECT_NE(e.find("is a zip archive, not text: unpack it"), std::string::npos) << e;
  e = format_error("7z\xBC\xAF\x27\x1C\0\x04");
  EXPECT_NE(e.find("is a 7z archive"), std::string::npos) << e;
  std::string tar(512, '\0');
  tar.replace(0, 7, "wiki_00");
  tar.replace(257, 6, std::string("ustar\0", 6));
  e = format_error(tar);
  EXPECT_NE(e.find("is a tar archive, not text: unpack it (tar -xf FILE"), std::string::npos) << e;
#if NOPAD_HAVE_ZLIB
  // The check runs on the decompressed bytes: a gzip'd Parquet file is a Parquet file.
  test::TempDir dir("pqgz");
  const TextInput in = read_back(dir, "data.parquet.gz", gzip_member(std::string("PAR1\x15\x04\x15\0", 8)));
  NOPAD_EXPECT_ERROR_HAS(detect_text_format(in, TextFormat::kAuto), "is a Parquet file");
#endif
}

TEST(TextInput, InvalidUtf8NamesLineAndOffset) {
  const std::string text = "First line.\nSecond caf\xe9 line.\n";
  std::string e = format_error(text);
  EXPECT_NE(e.find("input in.txt is not UTF-8 text: invalid byte 0xe9 on line 2 at byte offset 22 ("),
            std::string::npos)
      << e;
  e = test::error_of([&] { detect_text_format(text_input(text, Compression::kXz), TextFormat::kAuto); });
  EXPECT_NE(e.find("on line 2 at byte offset 22 of its decompressed text"), std::string::npos) << e;
}

TEST(TextInput, JsonLinesDetection) {
  const std::string jsonl = "\n{\"id\": 1, \"text\": \"A b.\"}\n{\"id\": 2, \"text\": \"C d.\"}\n";
  EXPECT_TRUE(looks_like_json_lines(jsonl));
  EXPECT_EQ(detect_text_format(text_input(jsonl), TextFormat::kAuto), TextFormat::kJsonLines);
  EXPECT_EQ(detect_text_format(text_input(jsonl), TextFormat::kJsonLines), TextFormat::kJsonLines);
  // Given as plain text, it is refused, naming the flags and the record's fields.
  std::string e = format_error(jsonl, TextFormat::kSentenceLines);
  EXPECT_NE(e.find("input in.txt is JSON lines (line 2 is a JSON object with the fields \"id\", \"text\"), which "
                   "--format lines would train on as text: read it with --format jsonl --text-field NAME"),
            std::string::npos)
      << e;
  e = format_error(jsonl, TextFormat::kWikiExtractor);
  EXPECT_NE(e.find("--format wiki would train on as text"), std::string::npos) << e;
  // split_documents never reads JSON lines as text either.
  NOPAD_EXPECT_ERROR_HAS(split_documents(jsonl, TextFormat::kAuto), "split_json_lines");
  // A JSON document (an array, or pretty-printed) is not JSON lines.
  for (const std::string doc : {"[{\"text\": \"A.\"}, {\"text\": \"B.\"}]\n", "{\n  \"text\": \"A.\"\n}\n",
                                "[\n {\"text\": \"A.\"}\n]\n"}) {
    e = format_error(doc);
    EXPECT_NE(e.find("input in.txt is JSON but not JSON lines (line 1"), std::string::npos) << doc << ": " << e;
    EXPECT_NE(e.find("jq -c"), std::string::npos) << e;
  }
  NOPAD_EXPECT_ERROR_HAS(detect_text_format(text_input("[{\"text\": \"A.\"}]\n"), TextFormat::kJsonLines),
                         "is a JSON array, not JSON lines");
  // Text that merely starts with a bracket is text.
  EXPECT_EQ(detect_text_format(text_input("[1] A reference.\n{\\bf Bold} text.\n"), TextFormat::kAuto),
            TextFormat::kSentenceLines);
  EXPECT_EQ(detect_text_format(text_input("<doc id=\"1\">\nT\n\nA b.\n</doc>\n"), TextFormat::kAuto),
            TextFormat::kWikiExtractor);
}

TEST(Documents, JsonLinesRecordsAreDocuments) {
  const std::string jsonl =
      "{\"id\": 1, \"title\": \"A\", \"text\": \"First para. Second sentence.\\n\\n  Another para.\\n\"}\n"
      "\n"
      "{\"title\": \"Empty\", \"text\": \"\"}\r\n"
      "{\"text\": \"Caf\\u00e9 \\\"au lait\\\" here. Mr. Smith left.\", \"extra\": [1, 2]}\n"
      "   \n";
  std::string decoded = "";
  const auto docs = split_json_lines(jsonl, "text", "in.jsonl", decoded);
  ASSERT_EQ(docs.size(), 2u);  // the empty record is dropped
  EXPECT_EQ(S(docs[0].sentences), (std::vector<std::string>{"First para.", "Second sentence.", "Another para."}));
  EXPECT_EQ(S(docs[1].sentences), (std::vector<std::string>{"Caf\xc3\xa9 \"au lait\" here.", "Mr. Smith left."}));
  // The same text as a WikiExtractor document splits the same way.
  const auto wiki = split_documents("<doc id=\"1\">\nA\n\nFirst para. Second sentence.\n\nAnother para.\n</doc>\n",
                                    TextFormat::kWikiExtractor);
  ASSERT_EQ(wiki.size(), 1u);
  EXPECT_EQ(S(wiki[0].sentences), S(docs[0].sentences));
  // Another field by name.
  std::string titles;
  const auto by_title = split_json_lines(jsonl.substr(0, jsonl.find('\n') + 1), "title", "in.jsonl", titles);
  ASSERT_EQ(by_title.size(), 1u);
  EXPECT_EQ(S(by_title[0].sentences), (std::vector<std::string>{"A"}));
}

TEST(Documents, JsonLinesErrorsNameTheLine) {
  auto error = [](const std::string& text, const std::string& field = "text") {
    return test::error_of([&] {
      std::string decoded;
      split_json_lines(text, field, "in.jsonl", decoded);
    });
  };
  const std::string good = "{\"text\": \"Fine.\"}\n\n";
  std::string e = error(good + "{\"id\": 7, \"body\": \"x\"}\n");
  EXPECT_NE(e.find("input in.jsonl line 3 has no field \"text\" (its fields: \"body\", \"id\"): name the field that "
                   "holds the text with --text-field NAME"),
            std::string::npos)
      << e;
  e = error(good + "[1, 2]\n");
  EXPECT_NE(e.find("input in.jsonl line 3 is a JSON array, not an object"), std::string::npos) << e;
  e = error(good + "{\"text\": 12}\n");
  EXPECT_NE(e.find("input in.jsonl line 3: field \"text\" is a JSON number, not a string"), std::string::npos) << e;
  e = error(good + "{\"text\": \"unterminated}\n");
  EXPECT_NE(e.find("input in.jsonl line 3 is not valid JSON (column"), std::string::npos) << e;
  // Valid JSON, but a number beyond double's range: an error naming the line, not an internal error.
  e = error(good + "{\"text\": \"Big.\", \"n\": 1e999}\n");
  EXPECT_NE(e.find("input in.jsonl line 3 holds a number too large to read (number overflow parsing '1e999')"),
            std::string::npos)
      << e;
  // A nested field is not a path: "meta" holds an object, "meta.text" is no key.
  const std::string nested = "{\"meta\": {\"text\": \"Inner.\"}}\n";
  e = error(nested, "meta");
  EXPECT_NE(e.find("input in.jsonl line 1: field \"meta\" is a JSON object, not a string"), std::string::npos) << e;
  e = error(nested, "meta.text");
  EXPECT_NE(e.find("line 1 has no field \"meta.text\" (its fields: \"meta\")"), std::string::npos) << e;
}

}  // namespace
}  // namespace nopad
