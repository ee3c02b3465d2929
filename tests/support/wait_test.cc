// WaitUntil: true as soon as the predicate holds, false (and a message) once the deadline passed,
// with the predicate tried once more at the deadline. ThreadAsleep: true for a thread that waits
// on something that has not come, false for one that runs or keeps waking up.
#include "tests/support/wait.h"

#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "tests/support/thread_state.h"

namespace lk::test {
namespace {

using namespace std::chrono_literals;

TEST_CASE("WaitUntil returns once the predicate holds, and gives up at the deadline") {
  int calls = 0;
  CHECK(WaitUntil([&] { return ++calls == 3; }, 10s, "the third call"));
  CHECK(calls == 3);

  std::atomic<bool> set{false};
  std::thread setter([&] { set = true; });
  CHECK(WaitUntil([&] { return set.load(); }, 10s, "another thread's flag"));
  setter.join();

  calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(WaitUntil([&] { return ++calls < 0; }, 30ms, "nothing (this wait gives up)", 10ms));
  CHECK(std::chrono::steady_clock::now() - t0 >= 30ms);
  CHECK(calls >= 2);  // the first try and the one at the deadline at least
}

TEST_CASE("ThreadAsleep tells a thread blocked in a wait from one that runs or keeps waking") {
  const pid_t pid = ::getpid();
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<pid_t> waiter{0};
  std::thread blocked([&] {
    waiter = CurrentTid();
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return release; });
  });
  REQUIRE(WaitUntil([&] { return waiter.load() != 0; }, 10s, "the waiter's tid"));
  CHECK(WaitUntil([&] { return ThreadAsleep(pid, waiter.load()); }, 10s, "the waiter asleep"));
  CHECK(WaitUntil([&] { return ThreadAsleep(pid, waiter.load(), SYS_futex); }, 10s,
                  "the waiter asleep in futex"));
  CHECK_FALSE(ThreadAsleep(pid, waiter.load(), SYS_clock_nanosleep));  // another call
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  blocked.join();
  CHECK_FALSE(ThreadAsleep(pid, waiter.load()));  // gone

  // A thread that sleeps 1 ms at a time is in a system call at almost every look, but it is
  // switched in every millisecond: it is not waiting on anything.
  std::atomic<bool> stop{false};
  std::atomic<pid_t> napper{0};
  std::thread naps([&] {
    napper = CurrentTid();
    while (!stop) std::this_thread::sleep_for(1ms);
  });
  REQUIRE(WaitUntil([&] { return napper.load() != 0; }, 10s, "the napper's tid"));
  for (int i = 0; i < 5; ++i) CHECK_FALSE(ThreadAsleep(pid, napper.load(), std::nullopt, 50ms));
  stop = true;
  naps.join();
  CHECK_FALSE(ThreadAsleep(pid, CurrentTid()));  // this thread is running
}

}  // namespace
}  // namespace lk::test
