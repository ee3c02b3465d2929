// WaitUntil: true as soon as the predicate holds, false (and a message) once the deadline passed,
// with the predicate tried once more at the deadline.
#include "tests/support/wait.h"

#include <doctest/doctest.h>

#include <atomic>
#include <thread>

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

}  // namespace
}  // namespace lk::test
