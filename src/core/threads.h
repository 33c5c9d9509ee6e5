// Minimal parallel loops over an index range. Work is handed out in fixed-size chunks through an atomic counter, so
// which thread runs an index varies but what is computed for it must not: callers write results by index, which
// keeps every parallel stage deterministic whatever the thread count.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace nopad {

inline int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

// Calls fn(i) for every i in [0, n) on up to `threads` threads (<= 0 means all cores). The first exception thrown
// by any call is rethrown on the caller's thread after all threads stop.
template <class Fn>
void parallel_for(size_t n, int threads, Fn&& fn, size_t chunk = 1) {
  if (threads <= 0) threads = hardware_threads();
  chunk = std::max<size_t>(chunk, 1);
  const size_t workers = std::min<size_t>(static_cast<size_t>(threads), (n + chunk - 1) / chunk);
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const size_t begin = next.fetch_add(chunk);
      if (begin >= n) break;
      const size_t end = std::min(n, begin + chunk);
      try {
        for (size_t i = begin; i < end; ++i) fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        stop = true;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace nopad
