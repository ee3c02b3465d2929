// One event per line: `TIME LEVEL event key=value key=value`. Only shells log; pure cores return
// reasons that shells put into events. Values with spaces or quotes are quoted by Q().
// Thread-safety: every line is written with one write(2), so lines from threads never interleave.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

namespace lk {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warn", "error"; false when the name is unknown.
bool ParseLogLevel(std::string_view name, LogLevel* out);
// Adds `name=value` to every line this process writes (e.g. the process role).
void SetLogPrefix(std::string prefix);
void WriteLogLine(LogLevel level, std::string_view line);

// Quotes a value for a key=value field when it needs it. Control bytes and bytes that are not
// part of valid UTF-8 (a peer's binary body quoted in a refusal) are written as \xNN, so every
// line is printable UTF-8.
std::string Q(std::string_view value);
// The length of the valid UTF-8 sequence at the start of `s` (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), or 0 when it starts with none (or `s` is empty).
size_t Utf8SequenceBytes(std::string_view s);
// `text` as one line of valid UTF-8 of at most `bytes_max` bytes, for a field that a peer checks
// for size (an event's detail): control bytes and invalid UTF-8 become spaces and '?', and the
// cut never splits a character.
std::string OneLine(std::string_view text, size_t bytes_max);

// At most one line per `every` from a source that a peer can set off at will (a library's own
// complaint about each bad request), so that a stranger cannot flood the log; the line that is
// written says how many were dropped since the last one.
// Thread-safety: safe to call from any thread.
class LineLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LineLimiter(std::chrono::milliseconds every) : every_(every) {}
  // True when a line may be written at `now`; *dropped then gets the lines refused since the
  // last one written.
  bool Allow(Clock::time_point now, uint64_t* dropped);

 private:
  const std::chrono::milliseconds every_;
  std::mutex mu_;
  bool any_ = false;
  Clock::time_point last_;
  uint64_t dropped_ = 0;
};

template <typename... Args>
void Log(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < GetLogLevel()) return;
  WriteLogLine(level, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace lk

#define LK_LOG_DEBUG(...) ::lk::Log(::lk::LogLevel::kDebug, __VA_ARGS__)
#define LK_LOG_INFO(...) ::lk::Log(::lk::LogLevel::kInfo, __VA_ARGS__)
#define LK_LOG_WARN(...) ::lk::Log(::lk::LogLevel::kWarn, __VA_ARGS__)
#define LK_LOG_ERROR(...) ::lk::Log(::lk::LogLevel::kError, __VA_ARGS__)
