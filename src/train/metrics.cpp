// metrics.jsonl writer (see metrics.h).
#include "train/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/error.h"

namespace nopad {

std::vector<EventScalar> tensorboard_scalars(const nlohmann::json& record) {
  std::vector<EventScalar> out;
  if (!record.is_object()) return out;
  const bool eval = record.value("eval", false);
  for (const auto& [key, v] : record.items()) {
    if (key == "eval" || key == "step" || key == "samples" || key == "eval_samples") continue;
    if (!v.is_number() && !v.is_boolean()) continue;  // null: not finite when logged
    const float value = v.is_boolean() ? (v.get<bool>() ? 1.0f : 0.0f) : static_cast<float>(v.get<double>());
    if (!std::isfinite(value)) continue;  // beyond float32's range
    std::string name = key;
    if (key == "lr") name = "learning_rate";
    if (eval && key == "eval_loss") name = "loss";
    out.push_back({(eval ? "eval/" : "train/") + name, value});
  }
  return out;
}

MetricsLog::MetricsLog(const fs::path& path, int64_t keep_through_step, std::unique_ptr<EventWriter> events)
    : path_(path), events_(std::move(events)) {
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
  // TensorBoard keeps the points of earlier event files whose step is below this and drops the rest.
  if (events_) events_->write_session_start(keep_through_step + 1);
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  NOPAD_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
              "cannot write to ", path_.string(), ": ", std::strerror(errno));
  if (events_ && record.contains("step") && record.at("step").is_number_integer()) {
    const std::vector<EventScalar> scalars = tensorboard_scalars(record);
    if (!scalars.empty()) events_->write_scalars(record.at("step").get<int64_t>(), scalars);
  }
}

void MetricsLog::sync() {
  std::fflush(file_);
  ::fsync(::fileno(file_));
  if (events_) events_->sync();
}

}  // namespace nopad
