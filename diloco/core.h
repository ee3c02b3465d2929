// The pure decisions of the DiLoCo outer step (diloco/diloco.h is the shell that runs them):
// how named tensors are cut into this trainer's shard, what to do with a poll answer, what the
// protocol remembers between turns (the quorums joined, failed and reported, the conflict
// streak, the group's agreed drain flag, the poll answers held for a later turn) and how each
// event changes it, where a heal looks for state and in which order, what the inner optimizer
// must do after a join, and when to save. No I/O, no clock reads, no threads: time comes in as
// values, and every decision comes back with a reason for the shell's log line.
// Thread-safety: plain functions and values.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/clock.h>
#include <lightkeeper/diloco.h>
#include <lightkeeper/status.h>

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
  // Tensor `spec`'s piece, or null when this trainer holds none of its rows.
  const ShardPiece* PieceOf(size_t spec) const;
};
// `specs` must have passed ValidateSpecs. Rows by ShardRows (diloco.h).
ShardLayout MakeShardLayout(const std::vector<TensorSpec>& specs, uint32_t ranks, uint32_t rank,
                            ShardRule rule = ShardRule::kEven);

// Every trainer's rows of every tensor of a group: table[rank][spec] (a scalar is one row).
using RowTable = std::vector<std::vector<RowRange>>;
// The table of `rule` for a group of `ranks`.
RowTable RuleTable(const std::vector<TensorSpec>& specs, uint32_t ranks, ShardRule rule);
// This trainer's shard when it holds rows[spec] of every tensor (one range per spec; the
// ranges must be within the tensors' rows).
ShardLayout MakeShardLayout(const std::vector<TensorSpec>& specs,
                            const std::vector<RowRange>& rows);
// Whether one trainer's rows are within each tensor's: the reason names the tensor and rows.
Status CheckRowsWithin(const std::vector<TensorSpec>& specs, const std::vector<RowRange>& rows);
// Whether the group's trainers' rows tile every tensor: each row held by exactly one trainer.
// The reason names the tensor, the rows and the group ranks (an overlap, or rows nobody holds).
Status CheckTiling(const std::vector<TensorSpec>& specs, const RowTable& table);
// Which rule a group's table is, if any ("even", "chunk"), else "explicit".
std::string_view TableKind(const std::vector<TensorSpec>& specs, const RowTable& table);
// The group's table in floats for one in-group sum: each trainer writes its own rows at its
// rank's place (zeros elsewhere), every number as two exact 24-bit limbs; the sum is the table.
inline constexpr size_t kRowTableFloatsPerRange = 4;
void EncodeRows(const std::vector<RowRange>& rows, uint32_t rank, std::span<float> out);
RowTable DecodeRowTable(std::span<const float> summed, uint32_t ranks, size_t specs);

// Moving a sharded group's rows from one layout (a RowTable) to another, inside the group: the
// rows that one trainer holds under `from` and another under `to` travel in one in-group sum of a
// buffer of `moved` elements (the same length in every trainer), which the holder under `from`
// fills at `send` and everybody else leaves at -0.0 (x + -0.0 == x for every x, signed zeros
// too); the holder under `to` takes them from `receive`. Rows a trainer holds under both go by
// `local`. Every trainer of the group computes the same `moved`; 0 means no sum at all.
struct RelayoutPlan {
  struct Copy {
    size_t from = 0;  // offset in the source (a shard in `from`'s layout, or the moved buffer)
    size_t to = 0;    // offset in the destination (the moved buffer, or `to`'s shard)
    size_t count = 0;
    bool operator==(const Copy&) const = default;
  };
  std::vector<Copy> local;    // source shard -> destination shard
  std::vector<Copy> send;     // source shard -> moved buffer
  std::vector<Copy> receive;  // moved buffer -> destination shard
  size_t moved = 0;
  size_t from_numel = 0;  // this trainer's shard in `from`'s layout
  size_t to_numel = 0;    // ... and in `to`'s

  // Runs the plan with `sum` as the group's in-place sum (a no-op when moved == 0).
  template <typename Sum>
  Status Apply(std::span<const float> src, std::span<float> dst, Sum&& sum) const {
    for (const Copy& c : local) std::copy_n(src.data() + c.from, c.count, dst.data() + c.to);
    if (moved == 0) return Status::Ok();
    std::vector<float> buf(moved, -0.0f);
    for (const Copy& c : send) std::copy_n(src.data() + c.from, c.count, buf.data() + c.to);
    LK_RETURN_IF_ERROR(sum(std::span<float>(buf)));
    for (const Copy& c : receive) std::copy_n(buf.data() + c.from, c.count, dst.data() + c.to);
    return Status::Ok();
  }
};
// `specs` must have passed ValidateSpecs, and both tables CheckTiling.
RelayoutPlan PlanRelayout(const std::vector<TensorSpec>& specs, uint32_t rank,
                          const RowTable& from, const RowTable& to);
// The same between two rules' tables.
RelayoutPlan PlanRelayout(const std::vector<TensorSpec>& specs, uint32_t ranks, uint32_t rank,
                          ShardRule from, ShardRule to);

// The hash of the global weights that the members of a quorum compare at every commit
// (SyncResult::global_hash), computed without gathering them: the sum modulo 2^64 of one XXH3
// per row of every tensor (one mixed hash per element where rows are shorter than
// kRowHashMinElems), each seeded by the tensor's name and the row's (element's) index. Any
// split of the rows gives the same total: each trainer sums its own rows (`shard` in
// `layout`), and the group adds its trainers' sums, so groups of any size and layout,
// sharded or not, compare the same number.
inline constexpr size_t kRowHashMinElems = 16;
uint64_t RowHashSum(const std::vector<TensorSpec>& specs, const ShardLayout& layout,
                    std::span<const float> shard);

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
  // kWaitForDrain, kWaitNewQuorum: how long the shell waits before it polls again (the agent
  // answers the drain within a poll or two; a new quorum takes the lighthouse a round).
  Millis repoll_after{0};
};
PollDecision DecidePoll(const PollView& poll, const LocalView& local);

// What the outer step's protocol remembers between turns, calls and quorums. The shell keeps
// one, reads it freely and changes it only through the On* functions below, which say what to
// do next; everything else it holds (the weights, the communicators) is the shell's.
struct ProtocolState {
  // Fixed when the Diloco is made.
  bool can_save = false;  // a checkpoint directory is set
  Millis stuck_timeout{0};
  uint32_t ready_quorum_id = 0;  // joined: communicators built, state synced (0: none yet)
  uint32_t bad_quorum_id = 0;    // failed for this trainer: wait for a newer one (0: none)
  TimePoint bad_since{};
  uint32_t reported_quorum_id = 0;  // the last quorum the lighthouse was told failed this trainer
  // A conflict (the groups' configurations disagree: another outer_compress or outer_fragments,
  // a size that cannot mix) repeats on every new quorum until a group is restarted with other
  // flags. conflict_seen marks the attempt that just failed with one; the failure of its quorum
  // then backs off, doubling over consecutive conflicts (conflict_streak; a commit ends it).
  bool conflict_seen = false;
  uint32_t conflict_streak = 0;
  // When the first poll after a drain notice did not answer the drain (never cleared: a drain
  // that was noticed is not taken back).
  std::optional<TimePoint> drain_wait_since;
  // Whether a trainer of the group had noticed a drain when the group agreed on the last landed
  // step: with overlap the branch after it (the next exchange from the thread, or a poll that
  // would answer the drain) is taken on this, the same in every trainer, rather than on each
  // trainer's own notice, which arrives at different instants.
  bool drain_agreed = false;
  // The last quorum whose heal a join acted on (OnJoinAnswer).
  uint32_t heal_seen_quorum_id = 0;
};

// A poll answer, with this trainer's own view now (`drain_noticed`: a drain notice arrived;
// `has_state`: it holds outer state for its step).
PollDecision OnPoll(ProtocolState& s, const PollView& poll, bool drain_noticed, bool has_state,
                    TimePoint now);
// This trainer joined `quorum_id`: the next answers of it are steps.
void OnJoined(ProtocolState& s, uint32_t quorum_id);
// An attempt failed with `code` (a join, or an exchange whose group agreed it failed): a
// conflict counts toward the backoff of the quorum's failure that follows.
void OnAttemptFailed(ProtocolState& s, Code code);

// What the shell does when a quorum failed this trainer.
struct QuorumFailedDecision {
  bool report = false;  // tell the lighthouse (through the agent), so the next round has a new id
  Millis backoff{0};    // a conflict: wait this long (a drain ends the wait) before polling again
  uint32_t conflict_attempts = 0;  // consecutive conflicts, this one included (for the log)
  bool operator==(const QuorumFailedDecision&) const = default;
};
constexpr Millis kConflictBackoffMin{100};
constexpr Millis kConflictBackoffMax{10'000};
// `want_report`: false when the failure was a drain aborting the attempt on purpose (the next
// poll answers it), which is no failure to report.
QuorumFailedDecision OnQuorumFailed(ProtocolState& s, uint32_t quorum_id, bool want_report,
                                    TimePoint now);
// Whether to tell the lighthouse that `quorum_id` failed: once per quorum, whoever asks.
bool OnReport(ProtocolState& s, uint32_t quorum_id);
// An outer step was committed: a conflict streak is over.
void OnCommitted(ProtocolState& s);
// The group agreed on the outcome of a landing (`drain`: some trainer had noticed a drain by
// then); a failed agreement passes false.
void OnLandingAgreed(ProtocolState& s, bool drain);

// A join acts on an answer of `quorum_id` (`heals`: the answer carries a heal). The agent hands a
// quorum's heal to the first answer of that quorum only, so when the session was polled before
// (the Python Manager's poll for its process group, a C caller's own poll) that answer had it
// and this one has not; the session keeps the last answer that carried a heal, of quorum
// `earlier_heal_quorum_id`. True when the join takes that heal: same quorum, and no join
// acted on a heal of it yet (once per quorum, like the agent's own answer).
bool OnJoinAnswer(ProtocolState& s, uint32_t quorum_id, bool heals,
                  std::optional<uint32_t> earlier_heal_quorum_id);

// Whether a join that failed in this trainer is reported before the group agrees on it. The
// group's other trainers may still wait in their own rendezvous for the quorum, which no notice
// ends when the failure is this trainer's alone (a refused connection): the report makes the
// lighthouse replace the quorum, and its lost notice ends their wait instead of init_timeout.
// Not during a drain (the failure is the drain's), nor about a quorum a notice already called
// lost (the lighthouse knows), nor in a group of one (nobody waits).
bool ReportJoinBeforeAgreement(bool join_ok, uint32_t group_size, bool drain_noticed,
                               uint32_t lost_quorum_id, uint32_t quorum_id);

// With overlap, after landing step s: whether the poll for step s+1's quorum runs on the
// exchange's thread (the caller goes back to its inner steps) rather than on this one. Only
// after a commit on the joined quorum, with no quorum joined but not stepped on (its exchange
// needs no poll), and when the group agreed there was no drain (one trainer polling here for a
// drain would leave while the others gather the stand-in with it).
bool PollNextOnThread(const ProtocolState& s, bool landed, bool joined_unstepped);

// Where the next turn's poll answer comes from.
enum class TurnFrom {
  kJoinedUnstepped,  // the quorum the last call joined: step on it without polling again
  kCarried,          // an answer the in-flight thread got and did not act on: decide on it
  kPoll,             // ask the agent
};
// The poll answers the protocol holds for a later turn, of the shell's answer type. The agent
// answers one poll per step: a second poll at the same step would tell it the step failed
// (the carried answer), and a healed trainer's next poll, at its new step before any commit,
// would ask for a new round while the others wait for it in the joined quorum's exchange.
template <typename Answer>
struct HeldPolls {
  // The answer of the quorum joined by the last call, which returned to the caller for the
  // inner steps before that quorum's exchange.
  std::optional<Answer> joined_unstepped;
  // An answer the in-flight exchange's thread received and did not act on.
  std::optional<Answer> carried;

  // Takes the answer the next turn acts on into *out (none for kPoll). The joined quorum goes
  // first unless a drain was noticed (then a poll must answer the drain); it is dropped either
  // way, as it is good for one turn only.
  TurnFrom Take(bool drain_noticed, Answer* out) {
    TurnFrom from = TurnFrom::kPoll;
    if (joined_unstepped && !drain_noticed) {
      *out = std::move(*joined_unstepped);
      from = TurnFrom::kJoinedUnstepped;
    } else if (carried) {
      *out = std::move(*carried);
      from = TurnFrom::kCarried;
    }
    joined_unstepped.reset();
    if (from == TurnFrom::kCarried) carried.reset();
    return from;
  }
};
// The decision on a turn that steps on the quorum joined in the last call.
PollDecision JoinedUnsteppedDecision();

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
