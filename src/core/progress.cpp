#include "core/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace nopad {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s / 60) % 60);
  else if (s >= 60)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%llds", s);
  return buf;
}

bool Progress::stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

Progress::Progress(std::string label, double total, std::string unit, bool enabled, double interval_s)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      enabled_(enabled),
      tty_(stderr_is_terminal()),
      interval_s_(tty_ ? 0.1 : interval_s),
      start_(std::chrono::steady_clock::now()) {
  next_draw_ns_ = static_cast<int64_t>(interval_s_ * 1e9);
}

Progress::~Progress() { finish(); }

void Progress::add(double amount) {
  done_micro_.fetch_add(static_cast<uint64_t>(amount * 1e6), std::memory_order_relaxed);
  if (!enabled_) return;
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start_).count();
  int64_t due = next_draw_ns_.load(std::memory_order_relaxed);
  if (now_ns < due) return;
  if (!next_draw_ns_.compare_exchange_strong(due, now_ns + static_cast<int64_t>(interval_s_ * 1e9))) return;
  draw(false);
}

void Progress::finish() {
  if (!enabled_) return;
  {
    std::lock_guard<std::mutex> lock(draw_mutex_);
    if (finished_) return;
  }
  draw(true);
  std::lock_guard<std::mutex> lock(draw_mutex_);
  finished_ = true;
}

void Progress::draw(bool final_line) {
  std::lock_guard<std::mutex> lock(draw_mutex_);
  if (finished_) return;
  const double done = static_cast<double>(done_micro_.load()) * 1e-6;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? done / elapsed : 0.0;
  char line[256];
  if (total_ > 0) {
    const double frac = std::min(1.0, done / total_);
    const int width = 24;
    const int filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    const double eta = rate > 0 ? (total_ - done) / rate : NAN;
    std::snprintf(line, sizeof line, "%s [%s] %5.1f%% %.1f/%.1f %s, %.1f %s/s, %s %s", label_.c_str(), bar.c_str(),
                  100.0 * frac, done, total_, unit_.c_str(), rate, unit_.c_str(), final_line ? "took" : "ETA",
                  format_duration(final_line ? elapsed : eta).c_str());
  } else {
    std::snprintf(line, sizeof line, "%s %.1f %s, %.1f %s/s, %s", label_.c_str(), done, unit_.c_str(), rate,
                  unit_.c_str(), format_duration(elapsed).c_str());
  }
  if (tty_)
    std::fprintf(stderr, "\r\033[K%s%s", line, final_line ? "\n" : "");
  else
    std::fprintf(stderr, "%s\n", line);
  std::fflush(stderr);
}

}  // namespace nopad
