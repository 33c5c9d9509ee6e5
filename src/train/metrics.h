// RUN_DIR/metrics.jsonl: one JSON object per line (training steps and evaluations), appended and flushed line by
// line, fsynced when a checkpoint is written so that the log is at least as durable as the checkpoint.
// On resume the lines describing steps after the resumed step are dropped (the file is rewritten atomically), so
// the log reads as one uninterrupted run.
//
// With an EventWriter (log.tensorboard), every line is also written as one TensorBoard event at the line's step
// (tensorboard_scalars() says which fields become which tags), flushed and synced with the line. Opening the log
// writes a SessionLog START at keep_through_step + 1 first: TensorBoard then drops the points that earlier event
// files hold for the steps metrics.jsonl dropped, so both read as the same single run.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io.h"
#include "train/tfevents.h"

namespace nopad {

// The TensorBoard scalars of one metrics.jsonl record: "train/<key>" for a training line, "eval/<key>" for an eval
// line ({"eval": true}), one per numeric field (booleans as 0 / 1) in key order, with lr named
// learning_rate and the eval line's eval_loss named loss. Left out: step (the event's step), samples and
// eval_samples (counts that a float32 would round past 2^24), and null fields (values that were not finite).
std::vector<EventScalar> tensorboard_scalars(const nlohmann::json& record);

class MetricsLog {
 public:
  // Opens `path` for appending after dropping every line whose "step" is greater than keep_through_step (and lines
  // that are not JSON objects, such as a half-written last line). `events`, when given, receives every record too.
  MetricsLog(const fs::path& path, int64_t keep_through_step, std::unique_ptr<EventWriter> events = nullptr);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void write(const nlohmann::json& record);  // one compact line, flushed (and its event)
  void sync();                               // fsync (both files)
  const EventWriter* events() const { return events_.get(); }

 private:
  fs::path path_;
  std::FILE* file_ = nullptr;
  std::unique_ptr<EventWriter> events_;
};

}  // namespace nopad
