// The backend factories behind CommManager::Create. Internal to replica_agent/comm.
// Thread-safety: see comm.h.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "replica_agent/comm/comm.h"

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

}  // namespace lk::comm
