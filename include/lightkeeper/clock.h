// Clock: the one way code reads time, so that cores and tests can move time by hand.
// SystemClock wraps steady_clock; ManualClock only moves when told.
// Thread-safety: SystemClock is safe from any thread; ManualClock is safe too (atomic), but a
// test that moves it from one thread while another reads it gets no ordering beyond that.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace lk {

using Duration = std::chrono::nanoseconds;
using TimePoint = std::chrono::steady_clock::time_point;
using Millis = std::chrono::milliseconds;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;
};

class SystemClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  static SystemClock& Get() {
    static SystemClock clock;
    return clock;
  }
};

class ManualClock final : public Clock {
 public:
  explicit ManualClock(TimePoint start = TimePoint{} + std::chrono::hours(1)) : ns_(Ticks(start)) {}
  TimePoint Now() const override { return TimePoint(Duration(ns_.load())); }
  void Advance(Duration d) { ns_ += d.count(); }
  void Set(TimePoint t) { ns_ = Ticks(t); }

 private:
  static int64_t Ticks(TimePoint t) { return t.time_since_epoch().count(); }
  std::atomic<int64_t> ns_;
};

inline int64_t ToMillis(Duration d) {
  return std::chrono::duration_cast<Millis>(d).count();
}

}  // namespace lk
