// metrics.jsonl writer (see metrics.h).
#include "train/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "core/error.h"

namespace nopad {

MetricsLog::MetricsLog(const fs::path& path, int64_t keep_through_step) : path_(path) {
  std::error_code ec;
  if (fs::exists(path, ec)) {
    std::istringstream in(read_file(path));
    std::string kept, line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object() || !j.contains("step") || !j.at("step").is_number()) continue;
      if (j.at("step").get<int64_t>() > keep_through_step) continue;
      kept += line + "\n";
    }
    write_file_atomic(path, kept);
  }
  file_ = std::fopen(path.c_str(), "a");
  NOPAD_CHECK(file_, "cannot open ", path.string(), " for appending: ", std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  NOPAD_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
              "cannot write to ", path_.string(), ": ", std::strerror(errno));
}

void MetricsLog::sync() {
  std::fflush(file_);
  ::fsync(::fileno(file_));
}

}  // namespace nopad
