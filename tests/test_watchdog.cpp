// The data-parallel progress watchdog (dist/watchdog.h): quiet while kicked, fires once after the timeout without
// kicks (with the idle time), and a destroyed watchdog never fires.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "dist/watchdog.h"

namespace nopad::dist {
namespace {

using namespace std::chrono_literals;

TEST(Watchdog, QuietWhileKickedThenFiresOnce) {
  std::atomic<int> fired{0};
  std::atomic<double> idle{0};
  Watchdog w(0.3, "rank 0 of 2", [&](double s) {
    idle = s;
    ++fired;
  });
  for (int i = 0; i < 12; ++i) {  // 0.6 s of progress: twice the timeout, never idle for long
    std::this_thread::sleep_for(50ms);
    w.kick();
  }
  EXPECT_EQ(fired.load(), 0);
  EXPECT_FALSE(w.fired());
  const auto stop = std::chrono::steady_clock::now();
  while (fired.load() == 0 && std::chrono::steady_clock::now() - stop < 3s) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(fired.load(), 1);
  EXPECT_TRUE(w.fired());
  EXPECT_GE(idle.load(), 0.3);
  EXPECT_LT(idle.load(), 1.5);  // checked every timeout / 10
  std::this_thread::sleep_for(400ms);
  EXPECT_EQ(fired.load(), 1);  // once only
}

TEST(Watchdog, DestroyedBeforeTheTimeoutNeverFires) {
  std::atomic<int> fired{0};
  {
    Watchdog w(0.2, "rank 1 of 2", [&](double) { ++fired; });
    std::this_thread::sleep_for(50ms);
  }
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(fired.load(), 0);
}

TEST(Watchdog, RejectsANonPositiveTimeout) {
  EXPECT_THROW(Watchdog(0.0, "rank 0"), nopad::Error);
}

}  // namespace
}  // namespace nopad::dist
