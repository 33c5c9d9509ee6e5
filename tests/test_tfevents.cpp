// TensorBoard event files (train/tfevents.h) and their fan-out from metrics.jsonl (train/metrics.h): the TFRecord
// framing field by field, the Event messages byte for byte against what TensorBoard's own Python protobuf classes and
// RecordWriter produce for the same content (the expected bytes below were made with tensorboard 2.21), a written file
// read back record by record with core/protowire.h, the name order of files written in one second, and the scalars
// and SessionLog START that a MetricsLog writes.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/crc32.h"
#include "core/protowire.h"
#include "test_util.h"
#include "train/metrics.h"
#include "train/tfevents.h"

namespace nopad {
namespace {

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    out += digits[static_cast<unsigned char>(c) >> 4];
    out += digits[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

uint64_t le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(p[i]);
  return v;
}
uint32_t le32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(p[i]);
  return v;
}

// The payloads of a file of TFRecords, each record's CRCs checked.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_GE(file.size() - at, 16u) << "a truncated record at byte " << at;
    if (file.size() - at < 16) break;
    const uint64_t n = le64(file.data() + at);
    EXPECT_EQ(le32(file.data() + at + 8), crc32c_mask(crc32c(file.data() + at, 8))) << "length CRC at byte " << at;
    EXPECT_LE(n, file.size() - at - 16);
    if (n > file.size() - at - 16) break;
    const std::string payload = file.substr(at + 12, n);
    EXPECT_EQ(le32(file.data() + at + 12 + n), crc32c_mask(crc32c(payload.data(), payload.size())))
        << "data CRC at byte " << at;
    out.push_back(payload);
    at += 16 + n;
  }
  return out;
}

// An Event read back: the fields nopad writes.
struct ReadEvent {
  double wall_time = -1;
  int64_t step = 0;
  std::string file_version;
  bool has_session_log = false;
  uint64_t session_status = 0;
  std::vector<std::pair<std::string, float>> values;
};

ReadEvent parse_event(const std::string& payload) {
  static const std::string where = "test event";
  ReadEvent e;
  WireCursor c(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &where);
  WireField f;
  while (next_wire_field(c, f, "Event")) {
    if (f.number == 1 && f.wire == 1) {
      std::memcpy(&e.wall_time, &f.value, 8);
    } else if (f.number == 2 && f.wire == 0) {
      e.step = static_cast<int64_t>(f.value);
    } else if (f.number == 3 && f.wire == 2) {
      e.file_version.assign(reinterpret_cast<const char*>(f.data), f.size);
    } else if (f.number == 7 && f.wire == 2) {
      e.has_session_log = true;
      WireCursor log(f.data, f.size, &where);
      WireField g;
      while (next_wire_field(log, g, "SessionLog"))
        if (g.number == 1 && g.wire == 0) e.session_status = g.value;
    } else if (f.number == 5 && f.wire == 2) {
      WireCursor summary(f.data, f.size, &where);
      WireField v;
      while (next_wire_field(summary, v, "Summary")) {
        EXPECT_TRUE(v.number == 1 && v.wire == 2) << "Summary field " << v.number;
        WireCursor value(v.data, v.size, &where);
        WireField g;
        std::pair<std::string, float> tv{"", NAN};
        while (next_wire_field(value, g, "Summary.Value")) {
          if (g.number == 1 && g.wire == 2) tv.first.assign(reinterpret_cast<const char*>(g.data), g.size);
          if (g.number == 2 && g.wire == 5) {
            const uint32_t bits = static_cast<uint32_t>(g.value);
            std::memcpy(&tv.second, &bits, 4);
          }
        }
        e.values.push_back(tv);
      }
    } else {
      ADD_FAILURE() << "unexpected Event field " << f.number << " wire type " << f.wire;
    }
  }
  return e;
}

TEST(TfEvents, RecordFramingFieldByField) {
  static const char kBytes[] = "an Event's bytes \x01\x02\x00 and more";
  const std::string payload_all(kBytes, sizeof kBytes - 1);  // with its NUL byte
  const std::string r = tfrecord_frame(payload_all);
  ASSERT_EQ(r.size(), 8 + 4 + payload_all.size() + 4);
  EXPECT_EQ(le64(r.data()), payload_all.size());
  EXPECT_EQ(le32(r.data() + 8), crc32c_mask(crc32c(r.data(), 8)));
  EXPECT_EQ(r.substr(12, payload_all.size()), payload_all);
  EXPECT_EQ(le32(r.data() + 12 + payload_all.size()), crc32c_mask(crc32c(payload_all.data(), payload_all.size())));
  // TensorBoard's RecordWriter around "hello".
  EXPECT_EQ(hex(tfrecord_frame("hello")), "0500000000000000eab2043e68656c6c6fbb1f1c19");
  // An empty payload still has both checksums.
  EXPECT_EQ(tfrecord_frame("").size(), 16u);
}

TEST(TfEvents, EventBytesEqualProtobufs) {
  const double t = 1700000000.25;
  // event_pb2.Event(wall_time=t, file_version="brain.Event:2").SerializeToString()
  EXPECT_EQ(hex(event_file_version(t)), "0900001040fc54d9411a0d627261696e2e4576656e743a32");
  // Event(wall_time=t, step=7, session_log=SessionLog(status=START))
  EXPECT_EQ(hex(event_session_start(t, 7)), "0900001040fc54d94110073a020801");
  // Event(wall_time=t, step=300, summary: train/loss 7.5, eval/mlm_accuracy 0.125)
  EXPECT_EQ(hex(event_scalars(t, 300, {{"train/loss", 7.5f}, {"eval/mlm_accuracy", 0.125f}})),
            "0900001040fc54d94110ac022a2d0a110a0a747261696e2f6c6f7373150000f0400a180a116576616c2f6d6c6d5f61636375726163"
            "79150000003e");
  // And read back with nopad's protobuf reader.
  const ReadEvent e = parse_event(event_scalars(t, 123456789012LL, {{"train/x", -2.5e-7f}}));
  EXPECT_EQ(e.wall_time, t);
  EXPECT_EQ(e.step, 123456789012LL);
  ASSERT_EQ(e.values.size(), 1u);
  EXPECT_EQ(e.values[0].first, "train/x");
  EXPECT_EQ(e.values[0].second, -2.5e-7f);
}

TEST(TfEvents, WriterFileReadsBackAndNamesSortInWriteOrder) {
  test::TempDir dir("tfevents");
  const fs::path tb = dir / "sub/tensorboard";  // created
  fs::path first, second;
  {
    EventWriter w(tb);
    first = w.path();
    w.write_session_start(1, 1000.5);
    w.write_scalars(3, {{"train/loss", 9.25f}, {"train/learning_rate", 1e-4f}}, 1001.0);
    w.sync();
  }
  {
    EventWriter w(tb);  // the same second, the same process: still a later name
    second = w.path();
  }
  EXPECT_NE(first.filename().string().find("tfevents"), std::string::npos);
  EXPECT_EQ(first.filename().string().rfind("events.out.tfevents.", 0), 0u);
  EXPECT_EQ(first.extension(), ".nopad");
  EXPECT_LT(first.filename().string(), second.filename().string());

  const std::vector<std::string> records = read_records(read_file(first));
  ASSERT_EQ(records.size(), 3u);
  const ReadEvent v = parse_event(records[0]);
  EXPECT_EQ(v.file_version, "brain.Event:2");
  EXPECT_GT(v.wall_time, 1.6e9);  // now, in Unix seconds
  const ReadEvent s = parse_event(records[1]);
  EXPECT_TRUE(s.has_session_log);
  EXPECT_EQ(s.session_status, 1u);  // START
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.wall_time, 1000.5);
  const ReadEvent x = parse_event(records[2]);
  EXPECT_EQ(x.step, 3);
  ASSERT_EQ(x.values.size(), 2u);
  EXPECT_EQ(x.values[0], (std::pair<std::string, float>{"train/loss", 9.25f}));
  EXPECT_EQ(x.values[1], (std::pair<std::string, float>{"train/learning_rate", 1e-4f}));
  EXPECT_EQ(read_records(read_file(second)).size(), 1u);

  // --overwrite's clean-up takes nopad's event files only.
  write_file_atomic(tb / "events.out.tfevents.1.other-host.tf", "another writer's");
  write_file_atomic(tb / "notes.txt", "kept");
  remove_nopad_event_files(tb);
  EXPECT_FALSE(fs::exists(first));
  EXPECT_FALSE(fs::exists(second));
  EXPECT_TRUE(fs::exists(tb / "events.out.tfevents.1.other-host.tf"));
  EXPECT_TRUE(fs::exists(tb / "notes.txt"));
  remove_nopad_event_files(dir / "missing");  // no folder: nothing to do
}

TEST(TfEvents, AnUnwritableFolderIsOneClearError) {
  test::TempDir dir("tfevents-bad");
  write_file_atomic(dir / "file", "x");
  NOPAD_EXPECT_ERROR_HAS(EventWriter w(dir / "file" / "tb"), "log.tensorboard_dir");
}

TEST(TfEvents, ScalarsOfMetricsLines) {
  const nlohmann::json train = {{"step", 5},          {"samples", 80},      {"loss", 10.5},
                                {"mlm_loss", nullptr}, {"lr", 0.002},       {"grad_norm", 1.25},
                                {"seq_per_s", 300.0},  {"skipped", true},   {"elapsed_s", 2.0}};
  std::vector<std::pair<std::string, float>> got;
  for (const EventScalar& s : tensorboard_scalars(train)) got.emplace_back(s.tag, s.value);
  const std::vector<std::pair<std::string, float>> want = {
      {"train/elapsed_s", 2.0f}, {"train/grad_norm", 1.25f}, {"train/loss", 10.5f},  // in key order: lr after loss
      {"train/learning_rate", 0.002f}, {"train/seq_per_s", 300.0f}, {"train/skipped", 1.0f}};
  EXPECT_EQ(got, want);

  const nlohmann::json eval = {{"eval", true},         {"step", 8},         {"samples", 128},
                               {"mlm_accuracy", 0.25}, {"nsp_accuracy", 0.5}, {"eval_loss", 11.0},
                               {"mlm_loss", 10.25},    {"nsp_loss", 0.75},   {"eval_samples", 32}};
  got.clear();
  for (const EventScalar& s : tensorboard_scalars(eval)) got.emplace_back(s.tag, s.value);
  const std::vector<std::pair<std::string, float>> want_eval = {
      {"eval/loss", 11.0f}, {"eval/mlm_accuracy", 0.25f}, {"eval/mlm_loss", 10.25f}, {"eval/nsp_accuracy", 0.5f},
      {"eval/nsp_loss", 0.75f}};
  EXPECT_EQ(got, want_eval);
  EXPECT_TRUE(tensorboard_scalars({{"step", 1}, {"loss", 1e39}}).empty());  // beyond float32: not written
}

TEST(TfEvents, MetricsLogFansOutAndMarksTheResumedStep) {
  test::TempDir dir("tfevents-metrics");
  fs::path file;
  {
    MetricsLog log(dir / "metrics.jsonl", 6, std::make_unique<EventWriter>(dir / "tb"));
    ASSERT_NE(log.events(), nullptr);
    file = log.events()->path();
    log.write({{"step", 7}, {"samples", 112}, {"loss", 9.5}, {"grad_norm", nullptr}});
    log.write({{"eval", true}, {"step", 7}, {"samples", 112}, {"mlm_accuracy", 0.125}});
    log.write({{"note", "no step: no event"}});
    log.sync();
  }
  const std::vector<std::string> records = read_records(read_file(file));
  ASSERT_EQ(records.size(), 4u);  // file_version, START, two lines
  const ReadEvent start = parse_event(records[1]);
  EXPECT_TRUE(start.has_session_log);
  EXPECT_EQ(start.step, 7);  // TensorBoard keeps the steps before it: those metrics.jsonl kept (<= 6)
  const ReadEvent t = parse_event(records[2]), e = parse_event(records[3]);
  EXPECT_EQ(t.step, 7);
  EXPECT_EQ(t.values, (std::vector<std::pair<std::string, float>>{{"train/loss", 9.5f}}));
  EXPECT_EQ(e.step, 7);
  EXPECT_EQ(e.values, (std::vector<std::pair<std::string, float>>{{"eval/mlm_accuracy", 0.125f}}));
}

}  // namespace
}  // namespace nopad
