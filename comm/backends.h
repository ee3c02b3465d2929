// The backend factories behind CommManager::Create. Internal to comm/.
// Thread-safety: see comm.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/comm.h"

namespace lk::comm {

Result<std::unique_ptr<CommManager>> CreateGlooCommManager(RendezvousStore* store,
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

}  // namespace lk::comm
