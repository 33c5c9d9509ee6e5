// Shard format: ShardWriter/ShardReader round trips on random instances (2- and 4-byte tokens), rejection of damaged
// files with a nopad::Error that says where (truncation, a flipped byte in each section, bad magic, wrong version,
// wrong vocabulary), no file after a failed write, and a deterministic fuzz loop over ~3000 mutated shards.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/crc32.h"
#include "core/error.h"
#include "core/io.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "data/stats.h"
#include "fuzz/shard_fuzz_body.h"
#include "test_util.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::path(testing::TempDir()) / ("nopad_shard_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<Instance> random_instances(uint64_t seed, int count, int32_t vocab_size) {
  Rng rng(seed);
  std::vector<Instance> out;
  for (int i = 0; i < count; ++i) {
    Instance in;
    const int len = static_cast<int>(rng.uniform_int(2, i % 7 == 0 ? 600 : 64));
    in.tokens.resize(static_cast<size_t>(len));
    for (auto& t : in.tokens) t = static_cast<int32_t>(rng.uniform_int(0, vocab_size - 1));
    in.tokens[0] = vocab_size - 1;  // the largest id must survive the narrowing to token_bytes
    in.a_length = static_cast<int32_t>(rng.uniform_int(2, len));
    for (int p = 0; p < len; ++p)
      if (rng.uniform() < 0.15) {
        in.mlm_positions.push_back(p);
        in.mlm_labels.push_back(static_cast<int32_t>(rng.uniform_int(0, vocab_size - 1)));
      }
    in.nsp_label = static_cast<int32_t>(rng.uniform_int(0, 1));
    out.push_back(std::move(in));
  }
  return out;
}

void write_shard(const fs::path& path, const std::vector<Instance>& insts, int32_t vocab_size, uint32_t checksum) {
  ShardWriter w(path, vocab_size, checksum);
  for (const auto& in : insts) w.add(in);
  const uint64_t written = w.finish();
  EXPECT_EQ(written, fs::file_size(path));
}

std::string slurp(const fs::path& p) { return read_file(p); }
void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The message of the nopad::Error thrown by opening `path`, or "" when it opens.
std::string open_error(const fs::path& path, ShardReader::Options options = {}) {
  try {
    ShardReader r(path, options);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

ShardFileHeader header_of(const std::string& bytes) {
  ShardFileHeader h;
  std::memcpy(&h, bytes.data(), sizeof h);
  return h;
}
ShardSectionEntry entry_of(const std::string& bytes, int s) {
  ShardSectionEntry e;
  std::memcpy(&e, bytes.data() + sizeof(ShardFileHeader) + s * sizeof e, sizeof e);
  return e;
}
// Stores `h` with a correct header CRC, so that later checks (not the CRC) must catch the change.
void put_header(std::string& bytes, ShardFileHeader h) {
  h.header_crc = 0;
  h.header_crc = crc32(&h, sizeof h);
  std::memcpy(bytes.data(), &h, sizeof h);
}

TEST(ShardFormat, RoundTripsTwoAndFourByteTokens) {
  const fs::path dir = fresh_dir("roundtrip");
  for (const int32_t vocab_size : {30522, 100000}) {
    SCOPED_TRACE(vocab_size);
    const auto insts = random_instances(static_cast<uint64_t>(vocab_size), 300, vocab_size);
    const fs::path path = dir / ("v" + std::to_string(vocab_size) + ".nopad");
    write_shard(path, insts, vocab_size, 0xC0FFEEu);
    const ShardReader r(path, ShardReader::Options{true, 0xC0FFEE});
    r.validate_samples();
    EXPECT_EQ(r.header().token_bytes, vocab_size > 65536 ? 4u : 2u);
    EXPECT_EQ(r.header().vocab_size, static_cast<uint32_t>(vocab_size));
    ASSERT_EQ(r.num_seqs(), insts.size());
    uint64_t tokens = 0, masked = 0;
    uint32_t longest = 0;
    for (size_t i = 0; i < insts.size(); ++i) {
      const Instance got = r.sample(i).to_instance();
      EXPECT_EQ(got.tokens, insts[i].tokens) << i;
      EXPECT_EQ(got.a_length, insts[i].a_length) << i;
      EXPECT_EQ(got.nsp_label, insts[i].nsp_label) << i;
      EXPECT_EQ(got.mlm_positions, insts[i].mlm_positions) << i;
      EXPECT_EQ(got.mlm_labels, insts[i].mlm_labels) << i;
      EXPECT_EQ(r.length(i), insts[i].tokens.size());
      tokens += insts[i].tokens.size();
      masked += insts[i].mlm_positions.size();
      longest = std::max<uint32_t>(longest, static_cast<uint32_t>(insts[i].tokens.size()));
    }
    EXPECT_EQ(r.header().num_tokens, tokens);
    EXPECT_EQ(r.header().num_masked, masked);
    EXPECT_EQ(r.header().max_seq_length, longest);
    EXPECT_EQ(fs::file_size(path) % 64, 0u);
  }
  EXPECT_EQ(list_shards(dir).size(), 2u);
  fs::remove_all(dir);
}

class ShardCorruption : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_dir("corrupt");
    good_ = dir_ / "good.nopad";
    write_shard(good_, random_instances(7, 50, 30522), 30522, 1234);
    bytes_ = slurp(good_);
    ASSERT_EQ(open_error(good_), "");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string error_of(const std::string& bytes, ShardReader::Options options = {}) {
    const fs::path p = dir_ / "bad.nopad";
    spit(p, bytes);
    return open_error(p, options);
  }
  fs::path dir_, good_;
  std::string bytes_;
};

TEST_F(ShardCorruption, TruncatedFileIsRejected) {
  const ShardSectionEntry last = entry_of(bytes_, kShardNumSections - 1);
  for (const size_t size : {size_t{0}, size_t{100}, size_t{127}, size_t{200}, size_t{sizeof(ShardFileHeader) + 224},
                            static_cast<size_t>(last.offset + last.size_bytes - 1)}) {
    const std::string msg = error_of(bytes_.substr(0, size));
    EXPECT_NE(msg, "") << "truncation to " << size << " bytes was not detected";
    EXPECT_NE(msg.find("bad.nopad"), std::string::npos) << msg;
  }
}

TEST_F(ShardCorruption, FlippedByteInEverySectionNamesTheSection) {
  for (int s = 0; s < static_cast<int>(kShardNumSections); ++s) {
    const ShardSectionEntry e = entry_of(bytes_, s);
    ASSERT_GT(e.size_bytes, 0u) << "test data should fill every section";
    std::string bad = bytes_;
    bad[e.offset + e.size_bytes / 2] ^= 0x10;
    const std::string msg = error_of(bad);
    EXPECT_NE(msg.find("checksum mismatch in section " + std::to_string(e.id)), std::string::npos) << msg;
  }
  // A flipped header byte fails the header checksum.
  std::string bad = bytes_;
  bad[offsetof(ShardFileHeader, num_tokens)] ^= 0x01;
  EXPECT_NE(error_of(bad).find("header checksum"), std::string::npos) << error_of(bad);
}

TEST_F(ShardCorruption, BadMagicWrongVersionAndWrongVocabulary) {
  std::string bad = bytes_;
  bad[0] = 'X';
  EXPECT_NE(error_of(bad).find("not a nopad shard"), std::string::npos) << error_of(bad);

  ShardFileHeader h = header_of(bytes_);
  h.version = kShardVersion + 1;
  bad = bytes_;
  put_header(bad, h);
  EXPECT_NE(error_of(bad).find("format version " + std::to_string(kShardVersion + 1)), std::string::npos)
      << error_of(bad);

  EXPECT_NE(error_of(bytes_, ShardReader::Options{true, 4321}).find("another vocabulary"), std::string::npos);
  EXPECT_EQ(error_of(bytes_, ShardReader::Options{true, 1234}), "");
}

TEST_F(ShardCorruption, InconsistentHeaderCountsAreRejected) {
  // Header counts that disagree with the section table, with a valid header CRC.
  for (const auto field : {offsetof(ShardFileHeader, num_seqs), offsetof(ShardFileHeader, num_tokens),
                           offsetof(ShardFileHeader, num_masked)}) {
    std::string bad = bytes_;
    ShardFileHeader h = header_of(bad);
    uint64_t v;
    std::memcpy(&v, reinterpret_cast<char*>(&h) + field, 8);
    v += 1;
    std::memcpy(reinterpret_cast<char*>(&h) + field, &v, 8);
    put_header(bad, h);
    EXPECT_NE(error_of(bad), "") << "field at offset " << field;
  }
}

// Header fields that later code sizes tables from are bounded by the reader, with a valid header CRC: before, `nopad
// stats` sized its length histogram from max_seq_length (0xFFFFFFFF + 1 wrapped to 0 and crashed; 2^31 took 17 GB).
TEST_F(ShardCorruption, HeaderFieldsAreBoundedBeforeUse) {
  const ShardFileHeader good = header_of(bytes_);
  ASSERT_GT(good.max_seq_length, 64u);
  struct Case {
    size_t field;
    uint32_t value;
  };
  for (const Case c : {Case{offsetof(ShardFileHeader, max_seq_length), 0xFFFFFFFFu},
                       Case{offsetof(ShardFileHeader, max_seq_length), 1u << 31},
                       Case{offsetof(ShardFileHeader, max_seq_length), 65536},
                       Case{offsetof(ShardFileHeader, max_seq_length), good.max_seq_length + 1},
                       Case{offsetof(ShardFileHeader, vocab_size), 0},
                       Case{offsetof(ShardFileHeader, vocab_size), 65537},  // with 2-byte token ids
                       Case{offsetof(ShardFileHeader, vocab_size), 0xFFFFFFFFu}}) {
    std::string bad = bytes_;
    ShardFileHeader h = good;
    std::memcpy(reinterpret_cast<char*>(&h) + c.field, &c.value, 4);
    put_header(bad, h);
    const std::string field = c.field == offsetof(ShardFileHeader, vocab_size) ? "vocab_size" : "max_seq_length";
    SCOPED_TRACE(field + " = " + std::to_string(c.value));
    const std::string msg = error_of(bad);
    EXPECT_NE(msg.find("bad.nopad"), std::string::npos) << msg;
    EXPECT_NE(msg.find("header field " + field + " is " + std::to_string(c.value)), std::string::npos) << msg;
    // What nopad stats does, through a dataset folder.
    const fs::path folder = dir_ / "folder";
    fs::create_directories(folder);
    spit(folder / "shard_00000.nopad", bad);
    NOPAD_EXPECT_ERROR_HAS(compute_stats(Dataset(folder)), "header field " + field);
    fs::remove_all(folder);
  }
  // The length histogram spans the longest sample, whatever the header says (it must say the truth now).
  const fs::path folder = dir_ / "folder";
  fs::create_directories(folder);
  spit(folder / "shard_00000.nopad", bytes_);
  const DatasetStats st = compute_stats(Dataset(folder));
  EXPECT_EQ(st.length_counts.size(), good.max_seq_length + 1u);
  EXPECT_EQ(st.max_length, good.max_seq_length);
}

// A token id or masked label outside the vocabulary, with the section checksum repaired: named by shard and sample
// when the shard is opened (before, it reached the model: "token id 30522 at row 17 outside vocab", or nothing on a
// GPU).
TEST_F(ShardCorruption, TokenIdsOutsideTheVocabularyNameShardAndSample) {
  const ShardReader good(good_);
  const uint64_t sample = 7;
  for (const int s : {4, 6}) {  // tokens, masked labels
    std::string bad = bytes_;
    ShardSectionEntry e = entry_of(bad, s);
    const uint64_t index = s == 4 ? good.sample(sample).length / 2 : 0;
    const uint64_t offset = s == 4 ? (static_cast<const uint16_t*>(good.sample(sample).tokens) -
                                      static_cast<const uint16_t*>(good.sample(0).tokens))
                                   : (static_cast<const uint16_t*>(good.sample(sample).mlm_labels) -
                                      static_cast<const uint16_t*>(good.sample(0).mlm_labels));
    ASSERT_GT(good.sample(sample).num_masked, 0u);
    const uint16_t id = 30522;  // the vocabulary's size: one past its last id
    std::memcpy(bad.data() + e.offset + 2 * (offset + index), &id, 2);
    e.crc32 = crc32(bad.data() + e.offset, e.size_bytes);
    std::memcpy(bad.data() + sizeof(ShardFileHeader) + s * sizeof e, &e, sizeof e);
    const std::string msg = error_of(bad);
    const std::string what = s == 4 ? "token id 30522" : "masked label 30522";
    EXPECT_NE(msg.find("bad.nopad, sample 7: " + what + " (entry " + std::to_string(index) + " of the sample)"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("vocabulary of 30522 tokens"), std::string::npos) << msg;
  }
}

TEST(ShardWriterFailure, NoFileWithoutFinishOrAfterAnError) {
  const fs::path dir = fresh_dir("failed_write");
  const auto insts = random_instances(3, 10, 30522);
  {
    ShardWriter w(dir / "abandoned.nopad", 30522, 0);
    for (const auto& in : insts) w.add(in);
    // Destroyed without finish(), e.g. by an exception in the producer.
  }
  try {
    ShardWriter w(dir / "invalid.nopad", 30522, 0);
    w.add(insts[0]);
    Instance bad = insts[1];
    bad.tokens[1] = 30522;  // outside the vocabulary
    w.add(bad);
    w.finish();
    FAIL() << "an out-of-vocabulary token was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid.nopad"), std::string::npos) << e.what();
  }
  EXPECT_THROW(
      {
        ShardWriter w(dir / "missing_folder" / "x.nopad", 30522, 0);
        w.add(insts[0]);
        w.finish();
      },
      std::exception);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::recursive_directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 0u) << "a failed write left a file behind";
  fs::remove_all(dir);
}

// Deterministic version of the libFuzzer target: mutated valid shards must be rejected with nopad::Error or read
// safely, never crash or throw anything else.
TEST(ShardFuzz, MutatedShardsOnlyThrowNopadError) {
  const fs::path dir = fresh_dir("fuzz");
  const fs::path src = dir / "src.nopad";
  write_shard(src, random_instances(99, 12, 70000), 70000, 77);  // 4-byte tokens
  const std::string good = slurp(src);
  const fs::path scratch = dir / "scratch.nopad";
  ASSERT_EQ(fuzz::shard_fuzz_one(reinterpret_cast<const uint8_t*>(good.data()), good.size(), scratch), 2);

  Rng rng(2024);
  const uint64_t interesting[] = {0,          1,          2,          63,         64,          65535,
                                  65536,      0x7FFFFFFF, 0xFFFFFFFF, 1ull << 32, 1ull << 61,  1ull << 62,
                                  1ull << 63, ~0ull,      ~0ull - 7,  good.size(), good.size() - 1};
  auto random_value = [&]() -> uint64_t {
    return rng.uniform() < 0.6 ? interesting[rng.uniform_int(0, std::size(interesting) - 1)] : rng.next_u64();
  };
  int accepted = 0;
  const int kIterations = 3000;
  for (int it = 0; it < kIterations; ++it) {
    std::string bytes = good;
    switch (it % 6) {
      case 0: {  // random byte flips anywhere
        const int flips = static_cast<int>(rng.uniform_int(1, 8));
        for (int k = 0; k < flips; ++k)
          bytes[rng.uniform_int(0, bytes.size() - 1)] ^= static_cast<char>(1 << rng.uniform_int(0, 7));
        break;
      }
      case 1:  // truncation
        bytes.resize(rng.uniform_int(0, bytes.size() - 1));
        break;
      case 2: {  // a random header field value, with the header CRC fixed so the deeper checks run
        const size_t field = rng.uniform_int(8, sizeof(ShardFileHeader) - 5);
        const uint64_t v = random_value();
        const size_t width = rng.uniform() < 0.5 ? 4 : 8;
        std::memcpy(bytes.data() + field, &v, std::min(width, sizeof(ShardFileHeader) - 4 - field));
        put_header(bytes, header_of(bytes));
        break;
      }
      case 3: {  // a random section-table value (the table has no checksum of its own)
        const size_t field = sizeof(ShardFileHeader) + rng.uniform_int(0, kShardNumSections * 32 - 8);
        const uint64_t v = random_value();
        std::memcpy(bytes.data() + field, &v, rng.uniform() < 0.5 ? 4 : 8);
        break;
      }
      case 4: {  // index damage with the section checksum repaired, so that only the index checks stand guard
        const int s = static_cast<int>(rng.uniform_int(0, 3));  // offsets, a-lengths, NSP labels
        ShardSectionEntry e = entry_of(bytes, s);
        const size_t at = e.offset + rng.uniform_int(0, e.size_bytes - 1);
        const uint64_t v = random_value();
        std::memcpy(bytes.data() + at, &v, std::min<size_t>(e.elem_bytes, e.offset + e.size_bytes - at));
        e.crc32 = crc32(bytes.data() + e.offset, e.size_bytes);
        std::memcpy(bytes.data() + sizeof(ShardFileHeader) + s * sizeof e, &e, sizeof e);
        break;
      }
      default: {  // payload damage (tokens, positions, labels) with the checksum repaired
        const int s = static_cast<int>(rng.uniform_int(4, 6));
        ShardSectionEntry e = entry_of(bytes, s);
        if (e.size_bytes == 0) break;
        for (int k = 0; k < 4; ++k) bytes[e.offset + rng.uniform_int(0, e.size_bytes - 1)] = static_cast<char>(rng.next_u64());
        e.crc32 = crc32(bytes.data() + e.offset, e.size_bytes);
        std::memcpy(bytes.data() + sizeof(ShardFileHeader) + s * sizeof e, &e, sizeof e);
        break;
      }
    }
    try {
      accepted += fuzz::shard_fuzz_one(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), scratch);
    } catch (const Error&) {
      FAIL() << "nopad::Error escaped the fuzz body";
    } catch (const std::exception& e) {
      FAIL() << "mutation " << it << " threw a non-nopad exception: " << e.what();
    }
  }
  // Most mutations are rejected, but not all (e.g. flips in alignment padding are harmless).
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, 2 * kIterations);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nopad
