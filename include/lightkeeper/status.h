// Status and Result<T>: the value every expected failure travels as (peer down, timeout, bad
// input, disk full). Programmer errors are not Statuses; they are LK_CHECK failures.
// Thread-safety: plain values, safe to copy across threads.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include <lightkeeper/api.h>
#include <lightkeeper/check.h>

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

LK_API std::string_view CodeName(Code code);

// Why a request was refused, for programs: clients branch on these, never on the message text.
// The numbers are those of ErrorResponse.Code in common/proto/lightkeeper.proto (a test checks
// that the two lists agree); the wire carries them by name in JSON and by number in protobuf.
enum class Reason : uint16_t {
  kUnspecified = 0,
  kBadRequest = 1,             // malformed body, missing or out-of-range field, bad name
  kTokenMissing = 2,           // no bearer token where auth is on
  kTokenInvalid = 3,           // a token no role knows, or a job token for another job
  kRoleForbids = 4,            // a known token whose role may not do this (read-only writes)
  kAdminDisabled = 5,          // an admin call on a lighthouse without an admin token
  kUnknownJob = 6,
  kUnknownGroup = 7,
  kStaleIncarnation = 8,       // an incarnation that was replaced: that life is over
  kUnknownIncarnation = 9,     // a leave or commit of an incarnation that never lived
  kIncarnationReplaced = 10,   // a waiting ask whose incarnation was replaced meanwhile
  kGroupLeft = 11,
  kGroupDraining = 12,
  kGroupEvicted = 13,          // progress stalled (rule 8)
  kGroupUnhealthy = 14,        // heartbeats stopped while the ask waited
  kNodesChanged = 15,          // another node count within one incarnation
  kStepDisagreement = 16,      // the agents of one group ask with different steps
  kWrongQuorum = 17,           // a commit for a quorum that is not the current one
  kNotAMember = 18,            // a commit from a group outside the quorum it names
  kWrongStep = 19,             // a commit for another step than the one after the ask
  kCheckpointNotCommitted = 20,  // a checkpoint at a step the job has not committed
  kCheckpointLocationInvalid = 21,
  kJobsMax = 22,               // a new job beyond --jobs-max
  kGroupsMax = 23,             // a new group beyond the per-job bound
  kKvKeysMax = 24,
  kBodyTooLarge = 25,
  kBufferBudget = 26,          // the server's request buffers are all in use: retry later
  kQuorumNotIssued = 27,
  kEpochSuperseded = 28,
  kEpochNotYet = 29,
  kWaitTimeout = 30,           // a long-poll ran out; ask again
  kShuttingDown = 31,
  kRequestSuperseded = 32,     // the same agent asked again
  kJobForgotten = 33,
  kNoEndpoint = 34,
  kMethodNotAllowed = 35,
  kKeyNotFound = 36,
  kInternal = 37,
  kNotOnThisListener = 38,     // the agent's --serve port has no such route (trainer API: socket)
  kPeerUidMismatch = 39,       // a Unix-socket peer of another uid than the agent's
  kNoPeerCredentials = 40,     // a trainer call without kernel peer credentials (not the socket)
  kWorkersBusy = 41,           // the agent's bounded worker queue is full: retry later
  kAgentExiting = 42,          // the agent is stopping: its queued calls are not run
  kJobFinished = 43,           // a commit in a catch-up quorum of a finished job
  kGroupSizeMismatch = 44,     // the group's trainer count differs from the quorum's
  kGroupFinished = 45,         // another node of the group left it finished: this node finishes
  kLighthouseUnreachable = 46,  // lk_gateway could not reach the lighthouse for this call
  kNotInRound = 47,            // a gateway asked for a round of the outer exchange it has no part in
  kRoundMismatch = 48,         // a contribution disagrees with its round (members, sites, size)
  kRoundFailed = 49,           // the round ended without a result (a member or gateway lost)
};
inline constexpr int kReasonCount = 50;

// "STALE_INCARNATION": the proto enum's name of the reason.
LK_API std::string_view ReasonName(Reason reason);
// The reason a refusal of `code` carries when none was set (kInvalidArgument: kBadRequest).
LK_API Reason DefaultReason(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Status(Code code, std::string message, Reason reason)
      : code_(code), reason_(reason), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // The reason code; kUnspecified unless the refusal set one.
  Reason reason() const { return reason_; }
  // This status with `reason` as its reason code.
  LK_API Status WithReason(Reason reason) const;
  LK_API std::string ToString() const;

  // Returns this status with `context` put in front of the message, so errors read from the
  // outermost operation inward: "load state: open /x: No such file".
  LK_API Status WithContext(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  Reason reason_ = Reason::kUnspecified;
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

// A refusal with its reason code: Refuse(Code::kConflict, Reason::kStaleIncarnation, "...").
template <typename... Args>
Status Refuse(Code code, Reason reason, fmt::format_string<Args...> f, Args&&... args) {
  return Status(code, fmt::format(f, std::forward<Args>(args)...), reason);
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
