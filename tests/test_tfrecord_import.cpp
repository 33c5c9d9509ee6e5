// TFRecord import: pre-training records that TensorFlow itself wrote (tests/data/tfrecord, made by
// scripts/make_tf_fixtures.py in create_pretraining_data.py's layout) read back as the instances they were made
// from (expected.json); damaged framing, compressed files and records that are wrong in one way each give one error
// naming the file, the record and the feature.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/crc32.h"
#include "core/error.h"
#include "core/io.h"
#include "data/tfrecord_import.h"
#include "test_util.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

fs::path fixture(const std::string& name) { return test::source_dir() / "tests/data/tfrecord" / name; }

const InstanceRules kBertRules{30522, 101, 102};

using test::error_of;

TEST(TfRecordImport, ReadsTheInstancesTensorFlowWrote) {
  TfRecordSummary s;
  const std::vector<Instance> got = read_tfrecord_file(fixture("sample.tfrecord"), kBertRules, &s);
  const nlohmann::json want = nlohmann::json::parse(read_file(fixture("expected.json")));
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(s.num_records, want.size());
  uint64_t tokens = 0, masked = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].tokens, want[i]["tokens"].get<std::vector<int32_t>>());
    EXPECT_EQ(got[i].a_length, want[i]["a_length"].get<int32_t>());
    EXPECT_EQ(got[i].mlm_positions, want[i]["mlm_positions"].get<std::vector<int32_t>>());
    EXPECT_EQ(got[i].mlm_labels, want[i]["mlm_labels"].get<std::vector<int32_t>>());
    EXPECT_EQ(got[i].nsp_label, want[i]["nsp_label"].get<int32_t>());
    tokens += got[i].tokens.size();
    masked += got[i].mlm_positions.size();
  }
  EXPECT_EQ(s.num_tokens, tokens);
  EXPECT_EQ(s.num_masked, masked);
}

TEST(TfRecordImport, RecordsWrongInOneWayAreClearErrors) {
  const std::string hint = " (is this a BERT pre-training TFRecord written by create_pretraining_data.py?)";
  auto place = [](const std::string& file, const std::string& feature) {
    return "TFRecord file " + fixture(file).string() + ", feature '" + feature + "', record 1: ";
  };
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(fixture("bad-missing-feature.tfrecord"), kBertRules),
                         place("bad-missing-feature.tfrecord", "segment_ids") + "missing" + hint);
  NOPAD_EXPECT_ERROR_HAS(
      read_tfrecord_file(fixture("bad-float-ids.tfrecord"), kBertRules),
      place("bad-float-ids.tfrecord", "input_ids") + "stored as a float_list, expected an int64_list");
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(fixture("bad-weights.tfrecord"), kBertRules),
                         place("bad-weights.tfrecord", "masked_lm_weights") + "weight 0 at entry ");
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(fixture("bad-segments.tfrecord"), kBertRules),
                         place("bad-segments.tfrecord", "segment_ids") + "no segment-B tokens");
  // Token ids beyond a smaller vocabulary: the wrong --vocab.
  NOPAD_EXPECT_ERROR_HAS(
      read_tfrecord_file(fixture("sample.tfrecord"), InstanceRules{1000, 101, 102}),
      "TFRecord file " + fixture("sample.tfrecord").string() + ", feature 'input_ids', record 0: token id ");
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(fixture("sample.tfrecord"), InstanceRules{30522, 2, 3}), "not [CLS] (2)");
}

TEST(TfRecordImport, DamagedOrCompressedFilesAreClearErrors) {
  test::TempDir dir("tfrecord");
  const std::string good = read_file(fixture("sample.tfrecord"));
  uint64_t first_len;
  std::memcpy(&first_len, good.data(), 8);
  const size_t second = 12 + first_len + 4;  // byte offset of record 1
  auto with = [&](const std::string& bytes) {
    const fs::path p = dir / "x.tfrecord";
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
    return p;
  };
  const std::string f = (dir / "x.tfrecord").string();

  std::string b = good;
  b[20] ^= 0x01;  // inside record 0's Example
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(with(b), kBertRules),
                         "TFRecord file " + f + ": record 0 at byte 0 does not match its checksum");
  b = good;
  b[second + 1] ^= 0x01;  // record 1's length
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(with(b), kBertRules), "TFRecord file " + f + ": record 1 at byte " +
                                                                      std::to_string(second) +
                                                                      ": the length does not match its checksum");
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(with(good.substr(0, good.size() - 3)), kBertRules), " is truncated (");
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(with(good.substr(0, second + 5)), kBertRules),
                         "truncated record header at byte " + std::to_string(second));
  // A record whose framing is right but whose payload is not an Example: length-delimited field overrunning it.
  std::string payload = "\x0a\x7f";  // field 1, 127 bytes announced, none there
  std::string rec(8, '\0');
  const uint64_t len = payload.size();
  std::memcpy(rec.data(), &len, 8);
  const uint32_t len_crc = crc32c_mask(crc32c(rec.data(), 8));
  const uint32_t data_crc = crc32c_mask(crc32c(payload.data(), payload.size()));
  rec.append(reinterpret_cast<const char*>(&len_crc), 4)
      .append(payload)
      .append(reinterpret_cast<const char*>(&data_crc), 4);
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(with(rec), kBertRules),
                         "TFRecord file " + f + ", record 0: truncated or corrupt");

  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(fixture("sample.tfrecord.gz"), kBertRules), "is GZIP-compressed");
  NOPAD_EXPECT_ERROR_HAS(read_tfrecord_file(fixture("expected.json"), kBertRules),
                         "the length does not match its checksum");
  EXPECT_TRUE(read_tfrecord_file(with(""), kBertRules).empty());
}

}  // namespace
}  // namespace nopad
