// ThreadAsleep: whether a thread (of this process or a child) is blocked in a system call and
// stays there, read from /proc. With WaitUntil it orders a test's event after another thread has
// reached a wait ("member 0 is blocked in its collective, now abort it"; "the trainer is sleeping
// out an inner step, now kill it") instead of sleeping a guessed time and hoping it got there.
// Header-only and free of doctest, like wait.h, so unit tests in any folder and test helper
// binaries can use it. Linux only (/proc/PID/task/TID/{status,syscall}).
// Thread-safety: the functions only read /proc; call them from any thread.
#pragma once

#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

namespace lk::test {

// The calling thread's kernel id (the main thread's equals the process id).
inline pid_t CurrentTid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// One look at a thread: its scheduler state letter ('R', 'S', 'D', ...), the system call it is
// in (nullopt when it runs in user space or is not in one), and how many times it was switched
// out so far. nullopt when the thread does not exist (any more).
struct ThreadLook {
  char state = '?';
  std::optional<long> syscall_nr;
  uint64_t switches = 0;
};

inline std::optional<ThreadLook> LookAtThread(pid_t pid, pid_t tid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid);
  ThreadLook look;
  std::ifstream status(dir + "/status");
  if (!status) return std::nullopt;
  for (std::string line; std::getline(status, line);) {
    auto value = [&](const char* key) -> const char* {
      const std::string k(key);
      return line.compare(0, k.size(), k) == 0 ? line.c_str() + k.size() : nullptr;
    };
    if (const char* v = value("State:")) {
      while (*v == ' ' || *v == '\t') ++v;
      look.state = *v;
    } else if (const char* v = value("voluntary_ctxt_switches:")) {
      look.switches += std::strtoull(v, nullptr, 10);
    } else if (const char* v = value("nonvoluntary_ctxt_switches:")) {
      look.switches += std::strtoull(v, nullptr, 10);
    }
  }
  // "running", "-1 ..." (blocked outside a system call) or "NR args...".
  std::ifstream sc(dir + "/syscall");
  std::string first;
  if (sc >> first && first != "running") {
    char* end = nullptr;
    long nr = std::strtol(first.c_str(), &end, 10);
    if (end != first.c_str() && *end == '\0' && nr >= 0) look.syscall_nr = nr;
  }
  return look;
}

// True when thread `tid` of process `pid` is asleep in a system call (`syscall_nr`, or any when
// that is nullopt) and stays asleep in it, never switched in, for `settle`. The settle tells a
// thread that waits on something that has not come (a peer that never joins, a timer) from one
// that only passes through a short wait (a mutex taken in passing, one hop of an exchange that
// is progressing): a thread woken in between is switched in, which changes its switch count.
inline bool ThreadAsleep(pid_t pid, pid_t tid, std::optional<long> syscall_nr = std::nullopt,
                         std::chrono::milliseconds settle = std::chrono::milliseconds(20)) {
  auto asleep = [&](const std::optional<ThreadLook>& l) {
    return l && (l->state == 'S' || l->state == 'D') && l->syscall_nr &&
           (!syscall_nr || *l->syscall_nr == *syscall_nr);
  };
  const auto before = LookAtThread(pid, tid);
  if (!asleep(before)) return false;
  std::this_thread::sleep_for(settle);
  const auto after = LookAtThread(pid, tid);
  return asleep(after) && after->syscall_nr == before->syscall_nr &&
         after->switches == before->switches;
}

}  // namespace lk::test
