#include "common/status.h"

#include <cstdio>
#include <cstdlib>

namespace lk {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kUnauthenticated: return "unauthenticated";
    case Code::kPermissionDenied: return "permission_denied";
    case Code::kNotFound: return "not_found";
    case Code::kConflict: return "conflict";
    case Code::kTooLarge: return "too_large";
    case Code::kDeadlineExceeded: return "deadline_exceeded";
    case Code::kUnavailable: return "unavailable";
    case Code::kAborted: return "aborted";
    case Code::kDataLoss: return "data_loss";
    case Code::kResourceExhausted: return "resource_exhausted";
    case Code::kInternal: return "internal";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return fmt::format("{}: {}", CodeName(code_), message_);
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, fmt::format("{}: {}", context, message_));
}

namespace internal {

CheckFailure::CheckFailure(const char* file, int line, const char* expr) {
  stream_ << "check_failed file=" << file << ":" << line << " expr=\"" << expr << "\" ";
}

CheckFailure::~CheckFailure() {
  std::string msg = stream_.str();
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal
}  // namespace lk
