#include <lightkeeper/status.h>

#include <cstdio>
#include <cstdlib>
#include <iterator>

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

std::string_view ReasonName(Reason reason) {
  static constexpr std::string_view kNames[kReasonCount] = {
      "UNSPECIFIED", "BAD_REQUEST", "TOKEN_MISSING", "TOKEN_INVALID", "ROLE_FORBIDS",
      "ADMIN_DISABLED", "UNKNOWN_JOB", "UNKNOWN_GROUP", "STALE_INCARNATION",
      "UNKNOWN_INCARNATION", "INCARNATION_REPLACED", "GROUP_LEFT", "GROUP_DRAINING",
      "GROUP_EVICTED", "GROUP_UNHEALTHY", "NODES_CHANGED", "STEP_DISAGREEMENT", "WRONG_QUORUM",
      "NOT_A_MEMBER", "WRONG_STEP", "CHECKPOINT_NOT_COMMITTED", "CHECKPOINT_LOCATION_INVALID",
      "JOBS_MAX", "GROUPS_MAX", "KV_KEYS_MAX", "BODY_TOO_LARGE", "BUFFER_BUDGET",
      "QUORUM_NOT_ISSUED", "EPOCH_SUPERSEDED", "EPOCH_NOT_YET", "WAIT_TIMEOUT", "SHUTTING_DOWN",
      "REQUEST_SUPERSEDED", "JOB_FORGOTTEN", "NO_ENDPOINT", "METHOD_NOT_ALLOWED",
      "KEY_NOT_FOUND", "INTERNAL", "NOT_ON_THIS_LISTENER", "PEER_UID_MISMATCH",
      "NO_PEER_CREDENTIALS", "WORKERS_BUSY", "AGENT_EXITING", "JOB_FINISHED",
      "GROUP_SIZE_MISMATCH", "GROUP_FINISHED", "LIGHTHOUSE_UNREACHABLE",
      "NOT_IN_ROUND", "ROUND_MISMATCH", "ROUND_FAILED"};
  auto i = static_cast<size_t>(reason);
  return i < std::size(kNames) ? kNames[i] : "UNSPECIFIED";
}

Reason DefaultReason(Code code) {
  switch (code) {
    case Code::kInvalidArgument: return Reason::kBadRequest;
    case Code::kTooLarge: return Reason::kBodyTooLarge;
    case Code::kDeadlineExceeded: return Reason::kWaitTimeout;
    case Code::kInternal:
    case Code::kDataLoss: return Reason::kInternal;
    default: return Reason::kUnspecified;
  }
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return fmt::format("{}: {}", CodeName(code_), message_);
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, fmt::format("{}: {}", context, message_), reason_);
}

Status Status::WithReason(Reason reason) const {
  if (ok()) return *this;
  return Status(code_, message_, reason);
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
