#include "common/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <ctime>
#include <mutex>

namespace lk {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_prefix_mu;
std::string g_prefix;

char LevelChar(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarn: return 'W';
    case LogLevel::kError: return 'E';
  }
  return '?';
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

bool ParseLogLevel(std::string_view name, LogLevel* out) {
  if (name == "debug") *out = LogLevel::kDebug;
  else if (name == "info") *out = LogLevel::kInfo;
  else if (name == "warn") *out = LogLevel::kWarn;
  else if (name == "error") *out = LogLevel::kError;
  else return false;
  return true;
}

void SetLogPrefix(std::string prefix) {
  std::lock_guard<std::mutex> lock(g_prefix_mu);
  g_prefix = std::move(prefix);
}

void WriteLogLine(LogLevel level, std::string_view line) {
  auto now = std::chrono::system_clock::now();
  auto secs = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() %
            1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  std::string prefix;
  {
    std::lock_guard<std::mutex> lock(g_prefix_mu);
    prefix = g_prefix;
  }
  std::string out = fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z {} {}{}{}\n",
                                tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                                tm.tm_min, tm.tm_sec, ms, LevelChar(level), prefix,
                                prefix.empty() ? "" : " ", line);
  // One write per line keeps lines whole when several threads or processes share stderr.
  size_t off = 0;
  while (off < out.size()) {
    ssize_t n = ::write(STDERR_FILENO, out.data() + off, out.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
}

bool LineLimiter::Allow(Clock::time_point now, uint64_t* dropped) {
  std::lock_guard lock(mu_);
  if (any_ && now - last_ < every_) {
    ++dropped_;
    return false;
  }
  any_ = true;
  last_ = now;
  *dropped = dropped_;
  dropped_ = 0;
  return true;
}

size_t Utf8SequenceBytes(std::string_view s) {
  if (s.empty()) return 0;
  auto b = [&s](size_t i) { return static_cast<unsigned char>(s[i]); };
  auto cont = [&](size_t i) { return i < s.size() && (b(i) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if (c == 0xE0 && b(1) < 0xA0) return 0;  // overlong
    if (c == 0xED && b(1) > 0x9F) return 0;  // a surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if (c == 0xF0 && b(1) < 0x90) return 0;  // overlong
    if (c == 0xF4 && b(1) > 0x8F) return 0;  // past U+10FFFF
    return 4;
  }
  return 0;
}

std::string OneLine(std::string_view text, size_t bytes_max) {
  std::string out;
  while (!text.empty()) {
    size_t n = Utf8SequenceBytes(text);
    std::string_view piece = n == 0 ? std::string_view("?") : text.substr(0, n);
    if (n == 1 && std::iscntrl(static_cast<unsigned char>(text[0]))) piece = " ";
    if (out.size() + piece.size() > bytes_max) break;
    out += piece;
    text.remove_prefix(std::max<size_t>(n, 1));
  }
  return out;
}

std::string Q(std::string_view value) {
  // Control bytes (a percent-decoded path may hold any) are escaped too: a raw CR or NUL would
  // split one event into two lines, or make grep take the log for a binary file. So are bytes
  // outside valid UTF-8 (a refusal's protobuf body is logged with it), which make log readers
  // stop or guess.
  auto control = [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; };
  bool plain = !value.empty();
  for (std::string_view rest = value; !rest.empty();) {
    const char c = rest[0];
    const size_t n = Utf8SequenceBytes(rest);
    if (n == 0 || c == ' ' || c == '"' || c == '=' || c == '\\' || control(c)) {
      plain = false;
      break;
    }
    rest.remove_prefix(n);
  }
  if (plain) return std::string(value);
  std::string out = "\"";
  for (std::string_view rest = value; !rest.empty();) {
    const char c = rest[0];
    const size_t n = Utf8SequenceBytes(rest);
    rest.remove_prefix(n == 0 ? 1 : n);
    if (n > 1) {
      out.append(rest.data() - n, n);
    } else if (n == 0) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (control(c)) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

}  // namespace lk
