// The C++ half of the Python package's Manager: one trainer's Session with its agent, and the
// cross-group communicators of its slot (Gloo for host buffers, NCCL for device buffers when the
// build has it), built lazily for the quorum of the last poll. It knows no Python and no torch:
// buffers arrive as (address, element count, dtype), so one build serves any PyTorch.
//
// Failure notices are handled here, on the session's own thread, without the GIL: a lost
// quorum aborts the communicators of that quorum (a blocked allreduce returns kAborted at once)
// and a drain aborts them all and is remembered for the trainer to read.
//
// Thread-safety: the calls other than the notice accessors come from one thread at a time (the
// trainer's); the notice accessors may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "replica_agent/client/session.h"
#include "replica_agent/client/session_store.h"
#include "replica_agent/comm/comm.h"

namespace lk::python {

struct ManagerOptions {
  std::string socket;         // the agent's Unix socket; empty: $LK_AGENT_SOCKET
  uint32_t group_rank = 0;
  uint32_t group_size = 1;
  Millis init_timeout{30'000};  // communicator rendezvous + connect
  Millis op_timeout{120'000};   // one collective; the cross-group one waits for the slowest group
  std::string bind_host = "127.0.0.1";  // Gloo: the address peers connect to

  Status Validate() const;
};

// What the notice thread has seen since the Manager was created.
struct NoticeRecord {
  uint32_t lost_quorum_id = 0;  // the newest quorum a "lost" notice named (0: none)
  bool drain = false;
  bool checkpoint_now = false;
  std::string reason;
};

class NativeManager {
 public:
  static Result<std::unique_ptr<NativeManager>> Create(ManagerOptions options);
  ~NativeManager();

  // The agent's answer for outer step `step` (blocks until the quorum is known).
  Result<client::PollResult> Poll(uint32_t step, Millis timeout);
  Status Commit(uint32_t step, bool ok, const std::string& state_hash);
  Status Finish();
  Status SetPeerWait(bool waiting);
  Status RegisterCheckpoint(uint32_t step, const std::string& location,
                            const std::string& manifest_digest);
  // The lighthouse KV scoped to `quorum_id`, on a connection of its own (a waiting GET never
  // holds up a poll or a commit).
  Status KvPut(uint32_t quorum_id, const std::string& key, const std::string& value);
  Result<std::string> KvGet(uint32_t quorum_id, const std::string& key, Millis timeout);

  // In place over the slot's communicator for the quorum of the last poll, rebuilt first when
  // that quorum is new. `device` < 0: host memory (Gloo); otherwise a CUDA device (NCCL).
  // kAborted when a failure notice or a drain cut it short.
  Status AllReduce(uintptr_t data, size_t count, comm::DType dtype, comm::ReduceOp op, int device);
  // Aborts every communicator (any thread).
  void Abort(const std::string& reason);

  NoticeRecord notices() const;
  uint32_t quorum_id() const { return quorum_.quorum_id; }
  uint32_t group_rank() const { return options_.group_rank; }
  uint32_t group_size() const { return options_.group_size; }
  const std::string& socket() const { return options_.socket; }

 private:
  // Shared with the notice callback, which may run after the NativeManager is gone (the
  // session detaches its thread), so it never points into the NativeManager itself.
  struct Sink {
    mutable std::mutex mu;
    std::map<comm::Backend, comm::CommManager*> comms;  // cleared before they go away
    NoticeRecord record;
  };

  explicit NativeManager(ManagerOptions options);
  Result<comm::CommManager*> CommFor(comm::Backend backend, int device);

  ManagerOptions options_;
  std::shared_ptr<Sink> sink_;
  std::unique_ptr<client::Session> session_;
  std::unique_ptr<client::SessionKvStore> kv_;
  // The communicator's rendezvous keys, under a prefix per backend so that they never meet the
  // keys of the other backend or of the trainer's own stores in one quorum.
  std::map<comm::Backend, std::unique_ptr<comm::RendezvousStore>> stores_;
  std::map<comm::Backend, std::unique_ptr<comm::CommManager>> comms_;
  std::map<comm::Backend, int> comm_device_;
  client::PollResult quorum_;  // the last poll's answer
  bool polled_ = false;
};

}  // namespace lk::python
