// Progress reporting for long work. On a terminal: one live line (bar, done/total, rate, ETA) redrawn at most ten
// times a second. Not on a terminal (logs, CI): a plain line every `interval_s` seconds and one at the end.
// add() is thread-safe and cheap (one atomic add; drawing happens only when the rate limit allows).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace nopad {

class Progress {
 public:
  // total = 0: unknown total (no bar, no ETA). unit names what is counted ("MB", "docs", "seqs").
  Progress(std::string label, double total, std::string unit, bool enabled = true, double interval_s = 10.0);
  ~Progress();
  void add(double amount);
  void finish();  // prints the final line once

  static bool stderr_is_terminal();

 private:
  void draw(bool final_line);
  std::string label_, unit_;
  double total_;
  bool enabled_, tty_;
  double interval_s_;
  std::atomic<uint64_t> done_micro_{0};  // amount * 1e6, to add doubles atomically
  std::atomic<int64_t> next_draw_ns_{0};
  std::chrono::steady_clock::time_point start_;
  std::mutex draw_mutex_;
  bool finished_ = false;
};

std::string format_duration(double seconds);

}  // namespace nopad
