// TensorBoard event files (see tfevents.h).
#include "train/tfevents.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/crc32.h"
#include "core/error.h"

namespace nopad {
namespace {

// The few protobuf wire-format writes an Event needs (the reader is core/protowire.h). Fields are appended in
// field-number order, as protobuf's own serialisers do, so the bytes equal theirs for the same message.
class ProtoOut {
 public:
  void varint_field(uint32_t number, uint64_t v) {
    tag(number, 0);
    varint(v);
  }
  void fixed64_field(uint32_t number, const void* v8) {
    tag(number, 1);
    bytes_.append(static_cast<const char*>(v8), 8);
  }
  void fixed32_field(uint32_t number, const void* v4) {
    tag(number, 5);
    bytes_.append(static_cast<const char*>(v4), 4);
  }
  void bytes_field(uint32_t number, std::string_view s) {
    tag(number, 2);
    varint(s.size());
    bytes_.append(s);
  }
  const std::string& bytes() const { return bytes_; }

 private:
  void tag(uint32_t number, uint32_t wire) { varint(uint64_t{number} << 3 | wire); }
  void varint(uint64_t v) {
    while (v >= 0x80) {
      bytes_.push_back(static_cast<char>((v & 0x7F) | 0x80));
      v >>= 7;
    }
    bytes_.push_back(static_cast<char>(v));
  }
  std::string bytes_;
};

// event.proto field numbers.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5,
                   kEventSessionLog = 7;
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;
constexpr uint32_t kSessionLogStatus = 1, kSessionLogStart = 1;

// wall_time and step, the fields every Event starts with (proto3: a step of 0 is left out, as protobuf does).
ProtoOut event_head(double wall_time_s, int64_t step) {
  ProtoOut e;
  e.fixed64_field(kEventWallTime, &wall_time_s);
  if (step != 0) e.varint_field(kEventStep, static_cast<uint64_t>(step));
  return e;
}

void put_le64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
void put_le32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}

// The seconds field of an event file's name, or -1 for a name that is not events.out.tfevents.<digits>...
int64_t name_seconds(const std::string& name) {
  const std::string prefix = "events.out.tfevents.";
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  int64_t s = -1;
  for (size_t i = prefix.size(); i < name.size() && name[i] >= '0' && name[i] <= '9' && i < prefix.size() + 18; ++i)
    s = (s < 0 ? 0 : s * 10) + (name[i] - '0');
  return s;
}

}  // namespace

std::string tfrecord_frame(std::string_view payload) {
  std::string r(8 + 4 + payload.size() + 4, '\0');
  put_le64(r.data(), payload.size());
  put_le32(r.data() + 8, crc32c_mask(crc32c(r.data(), 8)));
  std::memcpy(r.data() + 12, payload.data(), payload.size());
  put_le32(r.data() + 12 + payload.size(), crc32c_mask(crc32c(payload.data(), payload.size())));
  return r;
}

std::string event_file_version(double wall_time_s) {
  ProtoOut e = event_head(wall_time_s, 0);
  e.bytes_field(kEventFileVersion, "brain.Event:2");
  return e.bytes();
}

std::string event_session_start(double wall_time_s, int64_t step) {
  ProtoOut log;
  log.varint_field(kSessionLogStatus, kSessionLogStart);
  ProtoOut e = event_head(wall_time_s, step);
  e.bytes_field(kEventSessionLog, log.bytes());
  return e.bytes();
}

std::string event_scalars(double wall_time_s, int64_t step, const std::vector<EventScalar>& values) {
  ProtoOut summary;
  for (const EventScalar& v : values) {
    ProtoOut value;
    value.bytes_field(kValueTag, v.tag);
    value.fixed32_field(kValueSimpleValue, &v.value);
    summary.bytes_field(kSummaryValue, value.bytes());
  }
  ProtoOut e = event_head(wall_time_s, step);
  e.bytes_field(kEventSummary, summary.bytes());
  return e.bytes();
}

double unix_time_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void remove_nopad_event_files(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string suffix = ".nopad";
    if (name.find(".tfevents.") != std::string::npos && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      fs::remove(entry.path(), ec);
      NOPAD_CHECK(!ec, "cannot delete the old TensorBoard event file ", entry.path().string(), ": ", ec.message());
    }
  }
}

EventWriter::EventWriter(const fs::path& dir) {
  try {
    ensure_writable_dir(dir);
  } catch (const Error& e) {
    fail("TensorBoard event files: ", e.what(), " (set log.tensorboard_dir to another folder, or log.tensorboard = "
         "false)");
  }
  // Later seconds than any event file there: TensorBoard reads a folder's files in name order, and a resumed run's
  // SessionLog START must come after the events it supersedes (two runs can start within one second).
  const double now = unix_time_s();
  int64_t seconds = static_cast<int64_t>(now);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t s = name_seconds(entry.path().filename().string());
    if (s >= seconds) seconds = s + 1;
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  for (char* c = host; *c; ++c)
    if (*c == '/') *c = '_';
  path_ = dir / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." + std::to_string(::getpid()) +
                 ".nopad");
  file_ = std::fopen(path_.c_str(), "wbx");  // x: never append to another writer's file
  NOPAD_CHECK(file_, "cannot create the TensorBoard event file ", path_.string(), ": ", std::strerror(errno),
              " (set log.tensorboard_dir to another folder, or log.tensorboard = false)");
  write_record(event_file_version(now));
}

EventWriter::~EventWriter() {
  if (file_) std::fclose(file_);
}

void EventWriter::write_record(std::string_view payload) {
  const std::string record = tfrecord_frame(payload);
  NOPAD_CHECK(std::fwrite(record.data(), 1, record.size(), file_) == record.size() && std::fflush(file_) == 0,
              "cannot write to the TensorBoard event file ", path_.string(), ": ", std::strerror(errno));
}

void EventWriter::write_scalars(int64_t step, const std::vector<EventScalar>& values, double wall_time_s) {
  write_record(event_scalars(wall_time_s, step, values));
}

void EventWriter::write_session_start(int64_t step, double wall_time_s) {
  write_record(event_session_start(wall_time_s, step));
}

void EventWriter::sync() {
  std::fflush(file_);
  ::fsync(::fileno(file_));
}

}  // namespace nopad
