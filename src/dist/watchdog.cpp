// Watchdog (watchdog.h): one thread that wakes every ~1/10 of the timeout (at most every second) and compares the
// time since the last kick with the timeout.
#include "dist/watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "core/error.h"

namespace nopad::dist {

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

Watchdog::Watchdog(double timeout_s, std::string who, std::function<void(double)> on_expire)
    : timeout_s_(timeout_s), who_(std::move(who)), on_expire_(std::move(on_expire)), last_kick_ns_(now_ns()) {
  NOPAD_CHECK(timeout_s > 0, "watchdog timeout must be positive, got ", timeout_s);
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::kick() { last_kick_ns_.store(now_ns()); }

void Watchdog::run() {
  const auto period = std::chrono::duration<double>(std::min(1.0, timeout_s_ / 10));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, period, [this] { return stop_; });
    if (stop_) return;
    const double idle = static_cast<double>(now_ns() - last_kick_ns_.load()) * 1e-9;
    if (idle < timeout_s_) continue;
    fired_.store(true);
    if (on_expire_) {
      on_expire_(idle);
      return;
    }
    std::fprintf(stderr,
                 "%s: no progress for %.0f s (limit %.0f s): a peer rank died or hangs in a collective, or a device "
                 "stopped; ending this process so the launcher ends the job. Check the other ranks' logs\n",
                 who_.c_str(), idle, timeout_s_);
    std::fflush(stderr);
    std::_Exit(75);
  }
}

}  // namespace nopad::dist
