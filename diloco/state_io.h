// Where a trainer's outer state (its shard of the global weights and of the outer momentum) and
// the inner optimizer's state go and come from: durable checkpoints, the live copy its agent
// serves to healing peers, a fetch from those peers, and a restore from a durable checkpoint.
// The Diloco shell only sees this interface; MakeCheckpointStateIo implements it with the
// checkpoint library. Tensors are named by the caller's TensorSpecs: the global weights under
// NAME, the outer momentum under "outer_momentum/NAME", the inner state under "inner/NAME"; a
// rank's extra state (opaque bytes of the trainer's) under "extra_state/rank-RRRRR".
// Thread-safety: one caller (the trainer thread).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/status.h>
#include "diloco/core.h"

namespace lk::diloco {

// This trainer's shard of the outer state at a committed step, in ShardLayout order.
struct OuterState {
  uint32_t step = 0;
  std::vector<float> global;    // shard of the global weights
  std::vector<float> momentum;  // the same shard of the outer momentum
};

struct RestoredOuter {
  OuterState state;
  // This trainer's shard of the inner state (the inner layout), when the checkpoint has all of
  // it; otherwise none and `inner_missing` says what was missing.
  std::optional<std::vector<float>> inner;
  std::string inner_missing;
  // This rank's extra state (DilocoOptions::extra_state_bytes_max), when the checkpoint holds
  // bytes saved by the same group_rank; none otherwise.
  std::optional<std::vector<uint8_t>> extra;
};

class StateIo {
 public:
  virtual ~StateIo() = default;
  // A durable, sharded checkpoint: the group's trainers save the same step together and the
  // last one to finish commits it. `attempt` tells retries of one step apart (the quorum_id).
  // `inner` is this trainer's shard of the inner state (empty span: none saved); `extra` this
  // rank's opaque extra state (empty: none saved), stored whole by this rank.
  virtual Status SaveDurable(const OuterState& state, std::span<const float> inner,
                             std::span<const uint8_t> extra, uint32_t attempt) = 0;
  // The live copy for peers (no-op without a live directory); no inner state.
  virtual Status PublishLive(const OuterState& state) = 0;
  // This shard at `step` from the peer agents' shard servers (HOST:PORT).
  virtual Result<OuterState> FetchFromPeers(const std::vector<std::string>& peers,
                                            uint32_t step) = 0;
  // This shard from a durable checkpoint: a step-* directory or a root holding them.
  virtual Result<RestoredOuter> Restore(const std::string& location) = 0;
  // Only this rank's extra state from the newest checkpoint of this group's own root
  // (StateIoOptions::ckpt_dir) that holds one, with that checkpoint's step; nullopt when there
  // is none (no root, no checkpoint, none saved by this rank). Reads that one tensor.
  struct RestoredExtra {
    uint32_t step = 0;
    std::vector<uint8_t> bytes;
  };
  virtual Result<std::optional<RestoredExtra>> RestoreOwnExtra() = 0;
};

struct StateIoOptions {
  std::string ckpt_dir;  // durable checkpoints of this group (shared by its trainers)
  std::string live_dir;  // node-local directory the agent serves (--serve-dir); empty: none
  uint32_t rank = 0;     // group_rank
  uint32_t ranks = 1;    // group_size
  std::vector<TensorSpec> params;
  std::vector<TensorSpec> inner_state;
  uint32_t keep = 3;  // durable checkpoints kept
  // This trainer's rows of each inner-state tensor (a sharded caller's; the outer state is
  // always the even split); empty: the even split. The checkpoint records each slice's rows,
  // so a checkpoint written under one layout restores under another.
  std::vector<RowRange> inner_rows;
};

std::unique_ptr<StateIo> MakeCheckpointStateIo(StateIoOptions options);

// The checkpoint names of the kinds of tensor. A rank's extra state is a U8 tensor of one
// dimension, "extra_state/rank-00003", written whole by that rank and restored whole by the rank
// of the same number only (whatever the group's size), so it never reshards.
std::string MomentumName(const std::string& param);
std::string InnerName(const std::string& inner);
std::string ExtraStateName(uint32_t rank);
inline constexpr std::string_view kExtraStatePrefix = "extra_state/";

}  // namespace lk::diloco
