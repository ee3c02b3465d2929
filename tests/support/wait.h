// WaitUntil: orders a test's events by waiting for a condition with a deadline, never by
// sleeping a guessed time. A sleep that "gives the process time" to reach a state is flaky on a
// loaded machine and slow on an idle one; a wait for the state is neither. Header-only and free
// of doctest, so unit tests in any folder can use it: `REQUIRE(WaitUntil(...))`.
// Thread-safety: none needed; the predicate runs on the calling thread.
#pragma once

#include <chrono>
#include <cstdio>
#include <string_view>
#include <thread>

namespace lk::test {

// Calls `predicate` until it returns true (then returns true) or `deadline` has passed since the
// call (then prints "WaitUntil: gave up after N ms waiting for WHAT" to stderr and returns
// false). The predicate is tried once more at the deadline, so a condition that becomes true
// during the last pause is not missed. Between tries it pauses `every` (a poll, not an order).
template <class Predicate>
bool WaitUntil(Predicate&& predicate, std::chrono::milliseconds deadline, std::string_view what,
               std::chrono::milliseconds every = std::chrono::milliseconds(5)) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (true) {
    const bool last = std::chrono::steady_clock::now() >= until;
    if (predicate()) return true;
    if (last) break;
    std::this_thread::sleep_for(every);
  }
  std::fprintf(stderr, "WaitUntil: gave up after %lld ms waiting for %.*s\n",
               static_cast<long long>(deadline.count()), static_cast<int>(what.size()),
               what.data());
  return false;
}

}  // namespace lk::test
