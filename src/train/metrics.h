// RUN_DIR/metrics.jsonl: one JSON object per line (training steps and evaluations), appended and flushed line by
// line, fsynced when a checkpoint is written so that the log is at least as durable as the checkpoint.
// On resume the lines describing steps after the resumed step are dropped (the file is rewritten atomically), so
// the log reads as one uninterrupted run.
#pragma once
#include <cstdint>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/io.h"

namespace nopad {

class MetricsLog {
 public:
  // Opens `path` for appending after dropping every line whose "step" is greater than keep_through_step (and lines
  // that are not JSON objects, such as a half-written last line).
  MetricsLog(const fs::path& path, int64_t keep_through_step);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void write(const nlohmann::json& record);  // one compact line, flushed
  void sync();                               // fsync

 private:
  fs::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace nopad
