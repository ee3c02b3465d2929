// The pure decisions of the DiLoCo outer step (diloco/diloco.h is the shell that runs them):
// how named tensors are cut into this trainer's shard, what to do with a poll answer, where a
// heal looks for state and in which order, what the inner optimizer must do after a join, and
// when to save. No I/O, no clock, no threads: time comes in as durations, and every decision
// comes back with a reason for the shell's log line.
// Thread-safety: plain functions and values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <lightkeeper/clock.h>
#include <lightkeeper/diloco.h>

namespace lk::diloco {

// One tensor's part of this trainer's shard: rows [row_begin, row_end) of tensor `spec`, which
// sit at [full_offset, full_offset + count) of the flat buffer and at [shard_offset, ...) of
// the shard.
struct ShardPiece {
  size_t spec = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  size_t full_offset = 0;
  size_t shard_offset = 0;
  size_t count = 0;
  bool operator==(const ShardPiece&) const = default;
};

// The shard of one trainer of a group: every tensor split by rows of its first dimension with
// the checkpoint library's even split (the first rows % ranks ranks one row more); a scalar
// belongs to rank 0, as the checkpoint writer stores it.
struct ShardLayout {
  std::vector<ShardPiece> pieces;  // in tensor order; tensors with no rows here have none
  size_t total = 0;                // elements of the flat buffer
  size_t shard_numel = 0;          // elements of the shard

  // Copies this trainer's shard out of the full buffer.
  void Take(std::span<const float> full, std::span<float> shard) const;
  // Writes the shard into its places in a full buffer (the rest is left as it is). Placing
  // every rank's shard into zeros and summing the buffers is an exact all-gather: x + 0 == x.
  void Place(std::span<const float> shard, std::span<float> full) const;
};
// `specs` must have passed ValidateSpecs.
ShardLayout MakeShardLayout(const std::vector<TensorSpec>& specs, uint32_t ranks, uint32_t rank);

// What the poll answered, as far as the decision goes.
struct PollView {
  uint32_t quorum_id = 0;
  bool drain = false;
  bool checkpoint_now = false;
};

// This trainer's side of the decision.
struct LocalView {
  uint32_t ready_quorum_id = 0;  // joined: communicators built, state synced (0: none yet)
  uint32_t bad_quorum_id = 0;    // failed in this quorum: wait for the next one (0: none)
  Millis bad_for{0};             // since the failure in bad_quorum_id
  bool drain_noticed = false;    // a drain notice arrived before the poll answered it
  Millis drain_wait_for{0};      // since the first poll that did not answer that drain
  bool has_state = false;        // holds outer state for its step
  bool can_save = false;         // a checkpoint directory is set
  Millis stuck_timeout{0};
};

enum class PollAction {
  kDrain,          // leave without saving
  kDrainSave,      // save a durable checkpoint, register it, then leave
  kWaitForDrain,   // a drain was noticed but the agent's answer is not there yet: poll again
  kWaitNewQuorum,  // this quorum failed for us: poll again until a newer one
  kGiveUp,         // waited past stuck_timeout: fail the trainer
  kJoin,           // a quorum this trainer has not joined: reconfigure, heal, sync
  kStep,           // the joined quorum: run the cross-group allreduce and commit
};

struct PollDecision {
  PollAction action = PollAction::kStep;
  std::string reason;
};
PollDecision DecidePoll(const PollView& poll, const LocalView& local);

// Where a heal looks for this trainer's shard, in order, before the slot state sync (which
// takes the state of the quorum's donor over the communicator, and always comes last).
enum class HealSourceKind { kPeers, kDurable };
struct HealSource {
  HealSourceKind kind = HealSourceKind::kPeers;
  std::vector<std::string> peers;  // kPeers: agents' shard servers (HOST:PORT)
  uint32_t step = 0;               // kPeers: the step to fetch
  std::string location;            // kDurable: a checkpoint directory or root
  bool operator==(const HealSource&) const = default;
};
// The live peers first (never at the first start, where there is nothing to fetch: everyone
// takes replica_rank 0's initial weights through the slot sync), then the durable checkpoint
// the lighthouse named. Empty when the plan does not ask this group to heal.
std::vector<HealSource> PlanHeal(bool heal, bool initial, const std::vector<std::string>& peers,
                                 uint32_t max_step, const std::string& restore_location);

// What the inner optimizer does after the group joined a quorum. `received`: some trainer of
// the group took state from elsewhere (then every trainer loads it); `restored_inner`: how many
// trainers of the group took it from a durable checkpoint that had the inner state and kept it
// (no later slot sync replaced it). The inner state is resumed only when all of them did:
// anything else mixes a restored optimizer with weights from another step.
InnerAction DecideInner(bool received, uint32_t restored_inner, uint32_t group_size);

// A durable save after the commit of `step`.
bool SaveAfterCommit(uint32_t step, uint32_t ckpt_every);
// The final save at Finish: the run's result, unless the last commit just saved it.
bool SaveAtFinish(bool can_save, bool has_state, uint32_t step, uint32_t ckpt_every);

// The stuck timeout in effect: options.stuck_timeout, or op_timeout + 60 s when it is 0.
Millis EffectiveStuckTimeout(Millis stuck_timeout, Millis op_timeout);

}  // namespace lk::diloco
