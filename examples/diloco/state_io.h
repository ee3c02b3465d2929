// Where a trainer's outer state (its shard of the global weights and of the outer momentum) goes
// and comes from: durable checkpoints, the live copy its agent serves to healing peers, a fetch
// from those peers, and a restore from a durable checkpoint. The trainer only sees this
// interface; MakeCheckpointStateIo implements it with the checkpoint library.
// Thread-safety: one caller (the trainer thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace lk::diloco {

// This trainer's shard of the outer state at a committed step.
struct OuterState {
  uint32_t step = 0;
  std::vector<float> global;    // shard of the global weights
  std::vector<float> momentum;  // the same shard of the outer Nesterov momentum
};

class StateIo {
 public:
  virtual ~StateIo() = default;
  // A durable, sharded checkpoint: the group's trainers save the same step together and the
  // last one to finish commits it. `attempt` tells retries of one step apart (the quorum_id).
  virtual Status SaveDurable(const OuterState& state, uint32_t attempt) = 0;
  // The live copy for peers (no-op without a live directory).
  virtual Status PublishLive(const OuterState& state) = 0;
  // This shard at `step` from the peer agents' shard servers (HOST:PORT).
  virtual Result<OuterState> FetchFromPeers(const std::vector<std::string>& peers,
                                            uint32_t step) = 0;
  // This shard from a durable checkpoint: a step-* directory or a root holding them.
  virtual Result<OuterState> Restore(const std::string& location) = 0;
};

struct StateIoOptions {
  std::string ckpt_dir;  // durable checkpoints of this group (shared by its trainers)
  std::string live_dir;  // node-local directory the agent serves (--serve-dir); empty: none
  uint32_t rank = 0;     // group_rank
  uint32_t ranks = 1;    // group_size
  size_t total = 0;      // elements of the full flat parameter vector
  uint32_t keep = 3;     // durable checkpoints kept
};

std::unique_ptr<StateIo> MakeCheckpointStateIo(StateIoOptions options);

}  // namespace lk::diloco
