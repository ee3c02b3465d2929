// The backend factories behind CommManager::Create. Internal to comm/.
// Thread-safety: see comm.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "comm/comm.h"
#include "common/log.h"

namespace lk::comm {

Result<std::unique_ptr<CommManager>> CreateGlooCommManager(RendezvousStore* store,
                                                           CommOptions options);
Result<std::unique_ptr<CommManager>> CreateGatewayCommManager(RendezvousStore* store,
                                                              CommOptions options);
// Defined only when the build found CUDA and NCCL (LK_NCCL_FOUND).
Result<std::unique_ptr<CommManager>> CreateNcclCommManager(RendezvousStore* store,
                                                           CommOptions options);

// Waits for `key` until `deadline`, asking the store in slices of at most `slice` so that
// `interrupted` (which returns non-OK once the attempt is aborted) is checked between them.
Result<std::string> WaitForKey(RendezvousStore* store, uint32_t quorum_id, const std::string& key,
                               TimePoint deadline, const std::function<Status()>& interrupted,
                               Millis slice = Millis(200));

// What AbortQuorum (for a quorum newer than the current communicator) and Close leave behind for
// the Reconfigures still to come. A notice can reach the trainer between its poll and the start
// of the rendezvous it polled for; aborting only the communicator that exists then would let that
// rendezvous wait out init_timeout for members that are not coming. Each backend keeps one,
// under its own mutex.
class PendingAborts {
 public:
  // Reconfigures of quorum_id or older fail at once from now on.
  void Quorum(uint32_t quorum_id, const std::string& reason) {
    if (closed_ || quorum_id <= upto_) return;
    upto_ = quorum_id;
    reason_ = reason;
  }
  // Every later Reconfigure fails at once.
  void All(const std::string& reason) {
    if (closed_) return;
    closed_ = true;
    reason_ = reason;
  }
  // The refusal for a Reconfigure of quorum_id, or nothing when it may go ahead.
  std::optional<Status> Refusal(uint32_t quorum_id) const {
    if (closed_) return Status(Code::kAborted, reason_);
    if (quorum_id <= upto_) {
      return Error(Code::kAborted, "quorum {} was aborted before its rendezvous: {}", quorum_id,
                   reason_);
    }
    return std::nullopt;
  }

 private:
  uint32_t upto_ = 0;
  bool closed_ = false;
  std::string reason_;
};

// The life of a communicator as every backend has it: its phase, its first failure, the quorum
// it was built for, and the aborts waiting for a quorum not reconfigured yet. Abort, AbortQuorum
// and Close (any thread) and the start of Reconfigure (BeginLocked) are the same for every
// backend; what failing does to the transport (wake the waits, reset the connections) is the
// backend's OnFailedLocked. The backends keep their other state under the same mu_.
class CommLifecycle {
 public:
  virtual ~CommLifecycle() = default;

 protected:
  enum class Phase { kNone, kInitializing, kReady, kFailed };

  CommLifecycle(const char* backend, uint32_t slot) : backend_(backend), slot_(slot) {}

  void AbortAll(const std::string& reason) {
    std::lock_guard lock(mu_);
    if (phase_ == Phase::kNone) return;
    FailLocked(Status(Code::kAborted, reason));  // the code already says "aborted"
  }
  void AbortUpTo(uint32_t quorum_id, const std::string& reason) {
    std::lock_guard lock(mu_);
    const bool started = phase_ != Phase::kNone;
    if (started && quorum_id_.load() > quorum_id) return;
    if (!started || quorum_id > quorum_id_.load()) pending_aborts_.Quorum(quorum_id, reason);
    FailLocked(Status(Code::kAborted, reason));
  }
  void CloseAll(const std::string& reason) {
    std::lock_guard lock(mu_);
    pending_aborts_.All(reason);
    FailLocked(Status(Code::kAborted, reason));
  }

  // Reconfigure's first step, under mu_: the answer when there is nothing to build (an aborted
  // quorum, the current one, an older one), or nothing once the current communicator is failed
  // as superseded and the new one is initializing.
  std::optional<Status> BeginLocked(uint32_t quorum_id) {
    if (auto refused = pending_aborts_.Refusal(quorum_id)) {
      LK_LOG_INFO("comm_refused backend={} slot={} quorum_id={} reason={}", backend_, slot_,
                  quorum_id, Q(refused->message()));
      return *refused;
    }
    const uint32_t current = quorum_id_.load();
    if (phase_ != Phase::kNone && quorum_id == current) {
      return phase_ == Phase::kFailed ? status_ : Status::Ok();
    }
    if (phase_ != Phase::kNone && quorum_id < current) {
      return InvalidArgument("quorum_id {} is older than the current {}", quorum_id, current);
    }
    FailLocked(Error(Code::kAborted, "superseded by quorum {}", quorum_id), LogLevel::kInfo);
    phase_ = Phase::kInitializing;
    status_ = Status::Ok();
    failed_ = false;
    quorum_id_ = quorum_id;
    return std::nullopt;
  }

  // First failure wins. `level`: a superseded or shut-down communicator is routine, a failure a
  // warning.
  void FailLocked(Status status, LogLevel level = LogLevel::kWarn) {
    if (phase_ == Phase::kFailed || phase_ == Phase::kNone) return;
    Log(level, "comm_failed backend={} slot={} quorum_id={}{} code={} reason={}", backend_, slot_,
        quorum_id_.load(), FailDetailLocked(), CodeName(status.code()), Q(status.message()));
    phase_ = Phase::kFailed;
    status_ = std::move(status);
    failed_ = true;
    OnFailedLocked();
  }
  Status Fail(Status status) {
    std::lock_guard lock(mu_);
    FailLocked(std::move(status));
    return status_;
  }
  // The failure that interrupted the attempt in progress, if any.
  Status Interrupted() const {
    std::lock_guard lock(mu_);
    return phase_ == Phase::kFailed ? status_ : Status::Ok();
  }

  // What failing does to the backend's transport (under mu_).
  virtual void OnFailedLocked() {}
  // More of the comm_failed line, " key=value ..." (under mu_).
  virtual std::string FailDetailLocked() const { return ""; }

  std::atomic<uint32_t> quorum_id_{0};
  std::atomic<bool> failed_{false};  // polled without the lock
  mutable std::mutex mu_;            // guards the lifecycle and the backend's shared state
  Phase phase_ = Phase::kNone;
  Status status_;  // why the communicator failed, when phase_ == kFailed
  PendingAborts pending_aborts_;

 private:
  const char* const backend_;
  const uint32_t slot_;
};

}  // namespace lk::comm
