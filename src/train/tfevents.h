// TensorBoard event files, written without TensorFlow or a protobuf library.
//
// An event file is a sequence of TFRecords: uint64 little-endian length, masked CRC-32C of those 8 bytes, the
// payload, masked CRC-32C of the payload. Each payload is a serialised `Event` (TensorFlow/TensorBoard's
// event.proto): wall_time (double, field 1), step (int64, field 2) and one of file_version (string, field 3),
// summary (field 5: Summary { repeated Value value = 1 { string tag = 1; float simple_value = 2 } }) or session_log
// (field 7: SessionLog { enum status = 1, START = 1 }). The first record of a file is file_version "brain.Event:2",
// which makes TensorBoard's readers honour SessionLog START: on reading one, they drop every point seen so far whose
// step is >= the START's step (a restarted job's orphaned steps).
//
// Contract: EventWriter creates its folder and a new file in it, named events.out.tfevents.<unix seconds>.<host>.
// <pid>.nopad, whose seconds are later than those of every event file already there, so that the lexicographic
// order in which TensorBoard reads a folder's files is the order they were written in. Every record is flushed as
// it is written (a reader sees whole records; a crash can cut only the last one, which readers skip); sync()
// fsyncs. Errors name the file and what to do.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "core/io.h"

namespace nopad {

struct EventScalar {
  std::string tag;  // e.g. "train/loss"
  float value = 0;
};

// One TFRecord around `payload`.
std::string tfrecord_frame(std::string_view payload);

// Serialised Event messages (the payloads).
std::string event_file_version(double wall_time_s);                   // file_version "brain.Event:2", step 0
std::string event_session_start(double wall_time_s, int64_t step);    // session_log { status: START }
std::string event_scalars(double wall_time_s, int64_t step, const std::vector<EventScalar>& values);

// Seconds since the Unix epoch, as Event.wall_time holds them.
double unix_time_s();

// Deletes the event files nopad wrote into `dir` (names containing ".tfevents." and ending in ".nopad"); other
// files, and other writers' event files, are left alone. A missing folder is not an error.
void remove_nopad_event_files(const fs::path& dir);

class EventWriter {
 public:
  explicit EventWriter(const fs::path& dir);  // creates dir and the file; writes the file_version record
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  const fs::path& path() const { return path_; }
  void write_scalars(int64_t step, const std::vector<EventScalar>& values, double wall_time_s = unix_time_s());
  void write_session_start(int64_t step, double wall_time_s = unix_time_s());
  void sync();  // fsync

 private:
  void write_record(std::string_view payload);
  fs::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace nopad
