// MLPerf ":::MLLOG" lines (see mllog.h).
#include "train/mllog.h"

#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/error.h"

namespace nopad {

MlLog::~MlLog() {
  if (file_) std::fclose(file_);
}

std::string MlLog::format(int64_t time_ms, std::string_view event_type, std::string_view key,
                          const nlohmann::json& value, const nlohmann::json& metadata) {
  nlohmann::ordered_json j;
  j["namespace"] = "";
  j["time_ms"] = time_ms;
  j["event_type"] = event_type;
  j["key"] = key;
  j["value"] = value;
  j["metadata"] = metadata;
  return ":::MLLOG " + j.dump();
}

void MlLog::open(const std::filesystem::path& path, bool to_stdout) {
  if (!enabled_) return;
  file_ = std::fopen(path.c_str(), "a");
  NOPAD_CHECK(file_ != nullptr, "cannot open the MLPerf log ", path.string(), " for appending: ", std::strerror(errno));
  to_stdout_ = to_stdout;
  opened_ = true;
  for (const std::string& line : pending_) emit(line);
  pending_.clear();
  pending_.shrink_to_fit();
}

void MlLog::log(std::string_view event_type, std::string_view key, const nlohmann::json& value,
                nlohmann::json metadata, const std::source_location& where) {
  if (!enabled_) return;
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  std::string file = where.file_name();
  // Repository-relative: from the last "/src/" or "/tests/" of the compiler's path.
  size_t at = file.rfind("/src/");
  if (const size_t t = file.rfind("/tests/"); t != std::string::npos && (at == std::string::npos || t > at)) at = t;
  if (at != std::string::npos) file = file.substr(at + 1);
  metadata["file"] = file;
  metadata["lineno"] = where.line();
  std::string line = format(now_ms, event_type, key, value, metadata);
  if (opened_) {
    emit(line);
  } else {
    pending_.push_back(std::move(line));
  }
}

void MlLog::emit(const std::string& line) {
  if (file_) {
    std::fputs(line.c_str(), file_);
    std::fputc('\n', file_);
    std::fflush(file_);
  }
  if (to_stdout_) {
    std::fputs(line.c_str(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
}

void MlLog::point(std::string_view key, const nlohmann::json& value, nlohmann::json metadata,
                  std::source_location where) {
  log("POINT_IN_TIME", key, value, std::move(metadata), where);
}
void MlLog::start(std::string_view key, const nlohmann::json& value, nlohmann::json metadata,
                  std::source_location where) {
  log("INTERVAL_START", key, value, std::move(metadata), where);
}
void MlLog::end(std::string_view key, const nlohmann::json& value, nlohmann::json metadata,
                std::source_location where) {
  log("INTERVAL_END", key, value, std::move(metadata), where);
}

}  // namespace nopad
