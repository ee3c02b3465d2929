// Status and Result<T>: the value every expected failure travels as (peer down, timeout, bad
// input, disk full). Programmer errors are not Statuses; they are LK_CHECK failures.
// Thread-safety: plain values, safe to copy across threads.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "common/check.h"

namespace lk {

enum class Code {
  kOk = 0,
  kInvalidArgument,   // bad input from a caller: 400
  kUnauthenticated,   // missing or wrong token: 401
  kPermissionDenied,  // right token, wrong job: 403
  kNotFound,          // unknown job, key, file: 404
  kConflict,          // stale incarnation, disagreeing agents: 409
  kTooLarge,          // body over its limit: 413
  kDeadlineExceeded,  // a wait ran out: 504
  kUnavailable,       // peer down, shutting down: 503
  kAborted,           // an operation cut short by a failure notice
  kDataLoss,          // checksum mismatch, truncated file
  kResourceExhausted, // disk full, too many connections
  kInternal,          // a bug or an unexpected library failure: 500
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Returns this status with `context` put in front of the message, so errors read from the
  // outermost operation inward: "load state: open /x: No such file".
  Status WithContext(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

template <typename... Args>
Status Error(Code code, fmt::format_string<Args...> f, Args&&... args) {
  return Status(code, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status InvalidArgument(fmt::format_string<Args...> f, Args&&... args) {
  return Status(Code::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...));
}

// Result<T> holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    LK_CHECK(!std::get<Status>(v_).ok()) << "Result built from an OK status";
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    LK_CHECK(ok()) << "value() on error: " << status().ToString();
    return std::get<T>(v_);
  }
  const T& value() const& {
    LK_CHECK(ok()) << "value() on error: " << status().ToString();
    return std::get<T>(v_);
  }
  T&& value() && {
    LK_CHECK(ok()) << "value() on error: " << status().ToString();
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace lk

#define LK_CONCAT_INNER(a, b) a##b
#define LK_CONCAT(a, b) LK_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when it is not OK.
#define LK_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    ::lk::Status lk_status_ = (expr);            \
    if (!lk_status_.ok()) return lk_status_;     \
  } while (0)

// Declares `lhs` from a Result, or returns its status from the enclosing function.
#define LK_ASSIGN_OR_RETURN(lhs, expr) \
  LK_ASSIGN_OR_RETURN_IMPL(LK_CONCAT(lk_result_, __LINE__), lhs, expr)
#define LK_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
