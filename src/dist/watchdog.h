// A progress watchdog for data-parallel jobs: collectives (MPI on the host, NCCL on GPUs) wait without end when a
// peer rank hangs, so a job whose ranks stop making progress must end itself with a message rather than sit on its
// GPUs. The trainer kicks the watchdog at every step, eval batch and checkpoint; a background thread checks.
//
// Contract: Watchdog(timeout_s, ...) starts the thread (timeout_s > 0). If kick() is not called for timeout_s seconds,
// on_expire(seconds since the last kick) runs once, on the watchdog thread. The default action prints "<who>: no
// progress for N s (limit L s) ..." to stderr and ends the process with exit status 75 (std::_Exit: no destructors, since the
// main thread is stuck inside a collective); the launcher (mpirun, srun, torchrun) then ends the other ranks. The
// destructor stops the thread without firing.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace nopad::dist {

class Watchdog {
 public:
  Watchdog(double timeout_s, std::string who, std::function<void(double)> on_expire = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void kick();  // progress was made
  bool fired() const { return fired_.load(); }

 private:
  void run();
  double timeout_s_;
  std::string who_;
  std::function<void(double)> on_expire_;
  std::atomic<int64_t> last_kick_ns_;
  std::atomic<bool> fired_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace nopad::dist
