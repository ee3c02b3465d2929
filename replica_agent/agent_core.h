// The agent's core: every decision of a node agent as a pure function of (state, input, now)
// that returns the effects the shell must apply, in order. It reads no clock (every input
// carries `now`), does no I/O, starts no threads and holds no wire messages, so that table tests
// and the seeded simulation drive it directly; the shell (agent.cc and its neighbours) does the
// I/O: the trainers' socket, the poll board's shared memory, the lighthouse calls, pid watching
// and timers. It links lk_base only (replica_agent/CMakeLists.txt), so the build keeps Asio,
// protobuf and locks out.
//
// The ask state. The eight cooperating flags the agent grew (ask_needed, ask_ahead, ask_behind,
// behind_call, continued_step, ahead, ahead_step, handed) are one explicit state, Ask, and the
// board's own state (what is published, what trainers took):
//   kIdle        nothing asked, nothing fetched; the trainers' quorum is `quorum`
//   kForTrainers an ask for `step` whose answer goes to the waiting polls
//   kAhead       an ask for `step` made after the node committed the step before, before the
//                trainers poll it; its answer is kept as kFetched
//   kBehind      an ask for the step the trainers went on from without a round (a heartbeat
//                said round_pending); its answer is no trainer's, it only lets a group that
//                waits in that round in (or ends the trainers' quorum)
//   kContinued   the lighthouse was away at the trainers' boundary: they went on with their
//                quorum from `step` without a round, until the node commits or asks again
//   kFetched     a quorum fetched ahead for the trainers' poll of `step`
// A behind ask runs on a call of its own, which the shell cancels on kCancelBehindAsk (any newer
// ask supersedes it).
//
// The poll board. The core decides what goes up (kPublishBoard) and when it comes down
// (kWithdrawBoard); the shell reads what trainers did (Taken, the commits in their slots, their
// peer waits) and feeds it in as OnBoardLook before every other input, as SyncBoard did. A
// withdraw races with a take: the shell applies kWithdrawBoard and, when a trainer took the
// answer first, feeds that take (OnBoardLook) at once; the core keeps the withdrawn answer until
// then, so that the take stands for the node (its quorum becomes the trainers').
//
// Thread-safety: none; the shell calls it from one strand.
#pragma once

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/log.h"

namespace lk::agent {

// The node's phase as heartbeats report it. The lighthouse reads the names (its rule 8 knows
// peer_wait), so PhaseName's words are the wire's.
enum class Phase : uint8_t { kStarting, kQuorum, kTraining, kDraining, kPeerWait };
std::string_view PhaseName(Phase p);  // "starting", "quorum", "training", "draining", "peer_wait"

// Why a trainer's notice wait returned. The words are the wire's (TrainerNoticeResponse.reason);
// a drain's notice carries the drain's own reason instead (NoticeAnswer::reason).
enum class NoticeReason : uint8_t { kTimeout, kQuorumLost, kAgentExiting, kDrain };
std::string_view NoticeReasonName(NoticeReason r);  // "", "quorum_lost", "agent_exiting", "drain"

// Why the node left; the leave's reason on the wire.
enum class LeaveReason : uint8_t {
  kFinished,           // every local trainer said goodbye
  kDrained,            // the lighthouse said drain
  kSignal,             // a signal: the reason given with it (DrainInput::text)
  kEvicted,            // the lighthouse evicted the group (progress stalled)
  kReplaced,           // a newer incarnation of the group exists
  kTrainerCrashed,     // a trainer exited outside a drain
  kGroupSizeMismatch,  // the lighthouse refused the group's size
  kJobFinished,        // a commit was refused because the job finished
  kNoTrainers,         // no trainer said hello within hello_timeout
};
std::string_view LeaveReasonName(LeaveReason r);

struct CoreOptions {
  std::string group_id, incarnation;
  uint32_t node_rank = 0;
  uint32_t nodes = 1;
  bool ask_ahead = true;
  bool board = false;  // the shell made a poll board (trainers may take answers from it)
  // How long the agent waits for its first trainer's hello before it leaves with no_trainers
  // and exits non-zero; zero waits for ever. A group whose trainers failed at start otherwise
  // heartbeats as healthy, never asks, and holds the other groups' first quorum.
  Millis hello_timeout{600'000};
  // The board holds this many slots (poll_board.h kMaxSlots).
  uint32_t board_slots = 256;
};

// A quorum as the node holds it: what the trainers' answers carry. The member list and the
// group sizes stay with the shell (by quorum_id): the core never decides on them.
struct Quorum {
  uint32_t quorum_id = 0;
  uint32_t replica_rank = 0;
  uint32_t replica_world_size = 0;
  uint32_t max_step = 0;
  bool heal = false;
  bool initial = false;
  bool restore_checkpoint = false;        // the plan restores a checkpoint (the shell has which)
  std::vector<std::string> heal_sources;  // this node's donors' addresses
  std::string reason;
  uint32_t diverged_step = 0;
};

// What a trainer's poll is answered with (TrainerPollResponse without the member list).
struct PollAnswer {
  bool drain = false;
  bool checkpoint_now = false;
  uint32_t quorum_id = 0;
  uint32_t replica_rank = 0;
  uint32_t replica_world_size = 0;
  uint32_t max_step = 0;
  bool reconfigure = false;
  bool heal = false;
  bool initial = false;
  bool restore_checkpoint = false;
  std::vector<std::string> heal_sources;
  std::string reason;
  bool operator==(const PollAnswer&) const = default;
};

// What a notice wait returns with.
struct NoticeAnswer {
  uint32_t quorum_id = 0;
  bool lost = false;
  bool drain = false;
  bool checkpoint_now = false;
  NoticeReason why = NoticeReason::kTimeout;
  std::string reason;  // the wire's word: NoticeReasonName, or the drain's reason
};

struct BoardTicket {
  uint32_t gen = 0;
  uint32_t step = 0;
  bool operator==(const BoardTicket&) const = default;
};

// The answer the core puts on the board (poll_board.h Answer).
struct BoardAnswer {
  uint32_t step = 0;
  uint32_t quorum_id = 0;
  uint32_t replica_rank = 0;
  uint32_t replica_world_size = 0;
  uint32_t max_step = 0;
  std::string reason;
};

// One thing the shell does, in the order given.
struct Effect {
  enum class Kind : uint8_t {
    kAnswerPoll,       // rank: send `answer` to its waiting poll (keep it for a resumed one)
    kRefusePoll,       // rank: answer its waiting poll with `status`
    kAsk,              // the ask state changed: the quorum thread sends PendingAsk() (an ask
                       // for `step`, serial `id`; the same serial again: the ask in flight
                       // now answers the trainers, and one held back may go; `quorum_id`:
                       // the one the trainers were last handed, 0 if none)
    kCancelBehindAsk,  // cancel the call of a behind ask in flight
    kQueueCommit,      // a commit or failure report for the outbox (step, quorum_id, ...)
    kPublishBoard,     // put `board_answer` on the board
    kWithdrawBoard,    // take the board's answer down (then feed a take that came first)
    kTakeFor,          // take the board's READY answer for `step` for a socket poll
    kSetConsumed,      // rank's slot consumed the board answer `gen`
    kCloseBoard,       // trainers go through the socket from now on
    kAnswerNotice,     // waiter `id` gets `notice`
    kSignalTrainers,   // SIGTERM to every live local trainer the shell holds a pidfd of
    kLeave,            // deliver the leave with `text` (then, after a checkpoint drain, exit)
    kWaitTrainers,     // wait for the trainers to exit (up to drain_timeout), then feed
                       // OnTrainersGone
    kExit,             // stop: `code` is the process's exit code
    kLog,              // `text`: one log line, "event key=value ..."
    kWatchPid,         // watch `rank`'s process `id` (a pidfd): its exit is OnTrainerExited
  };
  Kind kind = Kind::kLog;
  uint32_t rank = 0;
  uint32_t step = 0;
  uint32_t quorum_id = 0;
  uint64_t id = 0;
  uint32_t gen = 0;
  int code = 0;
  bool failed = false;
  bool fresh = false;
  LogLevel level = LogLevel::kInfo;  // kLog
  bool checkpoint = false;  // kLeave: a checkpoint drain (the trainers saved and exited first)
  // kAnswerPoll, kRefusePoll: the poll being fed (OnPoll), not the rank's waiting one.
  bool incoming = false;
  // kQueueCommit: `text` is the trainers' hashes joined by ';' (the shell hashes the list),
  // not the node's hash itself.
  bool hash_list = false;
  uint32_t group_size = 0;
  bool mixed_group_sizes = false;
  uint64_t tokens = 0;
  std::string text;  // kLog: the line; kLeave: the reason; kQueueCommit: the state hash
  Status status;
  PollAnswer answer;
  NoticeAnswer notice;
  BoardAnswer board_answer;
  enum class AskKind : uint8_t { kForTrainers, kAhead, kBehind } ask_kind = AskKind::kForTrainers;
};
using Effects = std::vector<Effect>;

struct Ask {
  enum class Kind : uint8_t { kIdle, kForTrainers, kAhead, kBehind, kContinued, kFetched };
  Kind kind = Kind::kIdle;
  uint32_t step = 0;
  std::optional<Quorum> fetched;  // kFetched only
  // Counts the asks started: an answer names the ask it answers, so that one that was
  // superseded (a newer ask, for any step) is told apart.
  uint64_t serial = 0;
  // Moves to `k` (the serial stays: only a new ask counts).
  void Set(Kind k, uint32_t at = 0, std::optional<Quorum> q = std::nullopt) {
    kind = k;
    step = at;
    fetched = std::move(q);
  }
  // An ask (kForTrainers, kAhead, kBehind) is on its way to the lighthouse.
  bool asking() const {
    return kind == Kind::kForTrainers || kind == Kind::kAhead || kind == Kind::kBehind;
  }
};

struct TrainerState {
  uint32_t group_rank = 0;
  int pid = 0;
  bool waiting = false;  // a poll waits for its answer
  std::optional<uint32_t> polled_step;
  std::optional<std::pair<uint32_t, PollAnswer>> sent;  // the answer to its poll of `first`
  uint32_t seen_quorum_id = 0;
  uint32_t heal_answered_quorum_id = 0;
  std::optional<uint32_t> committed_step;
  std::string state_hash;
  uint64_t tokens = 0;
  bool finished = false;
  bool exited = false;
  bool peer_wait = false;        // said over the socket
  bool board_peer_wait = false;  // said on the board
  bool mixed_group_sizes = false;
  std::optional<uint32_t> slot;
  uint32_t board_commit_seen = 0;
};

struct BoardState {
  // The answer up, and the quorum it stands for: kept after a withdraw until the shell says
  // whether a trainer took it first.
  std::optional<BoardAnswer> published;
  std::optional<Quorum> published_quorum;
  std::optional<BoardTicket> handed;  // the last answer trainers took that the core applied
  bool withdrawn = false;  // `published` was withdrawn; the next look tells if it was taken
  bool closed = false;
  uint32_t next_slot = 0;
};

// Where a drain is: a plain drain leaves first and then waits for the trainers; a checkpoint
// drain waits for them (they save) and then leaves.
enum class DrainStage : uint8_t {
  kNone,
  kLeaving,
  kWaitingAfterLeave,
  kWaiting,
  kLeavingAfterWait,
  kExited
};

struct AgentState {
  std::map<uint32_t, TrainerState> trainers;
  uint32_t group_size = 0;
  std::optional<Quorum> quorum;  // the one the trainers were last handed
  std::set<uint32_t> lost_quorums;
  Ask ask;
  BoardState board;
  Phase phase = Phase::kStarting;
  bool had_state = false;  // a trainer committed or healed in this life
  uint32_t committed_step = 0;
  bool draining = false;
  bool left_heard = false;  // a refusal saying this life ended, heard while draining, was logged
  bool checkpoint_now = false;
  std::string drain_reason;
  std::optional<Status> refusal;  // the lighthouse refused the group for good
  bool signalled = false;
  int exit_code = -1;
  bool told_continuing = false;  // this outage said lighthouse_unreachable continuing
  bool said_hello = false;       // some trainer said hello (or polled) in this life
  // Another node of the group asked for a later step (STEP_DISAGREEMENT): this node's trainers
  // hold no state the group shares, so it asks without state until they heal or commit.
  bool without_state = false;
  DrainStage drain_stage = DrainStage::kNone;
  TimePoint started{};
  std::map<uint64_t, uint32_t> notice_waiters;  // id -> quorum_id
};

// What the shell read off the board (before any other input).
struct BoardLook {
  std::optional<BoardTicket> taken;
  struct SlotLook {
    std::optional<uint32_t> commit_step;
    std::string state_hash;
    uint64_t tokens = 0;
    bool peer_wait = false;
  };
  std::map<uint32_t, SlotLook> slots;  // by group_rank
};

struct PollInput {
  uint32_t group_rank = 0, group_size = 0, step = 0;
  int pid = 0;
  bool mixed_group_sizes = false;
  bool resumed = false;
  std::optional<BoardTicket> board_ready;  // the board's READY answer, if any
  uint32_t board_consumed = 0;             // the gen this trainer's slot consumed last
};

struct CommitInput {
  uint32_t group_rank = 0, step = 0, quorum_id = 0;
  bool failed = false;
  std::string state_hash;
  uint64_t tokens = 0;
};

// The lighthouse's answer to a heartbeat, as far as the agent decides on it.
struct HeartbeatAnswer {
  bool ok = true;
  Status error;                   // when !ok
  bool names_this_group = false;  // a notice names this group's life (evicted, replaced, left)
  // This heartbeat ended a heartbeat_timeout of the group (the lighthouse's reason for it):
  // the quorum went on without the group, which asks again as a joiner. A notice of that
  // timeout is no eviction either (it does not set names_this_group).
  std::string revived_from;
  bool drain = false;
  bool round_pending = false;
};

// How an ask ended.
struct AskResult {
  uint64_t serial = 0;  // Ask::serial of the ask this answers (Effect::id of its kAsk)
  uint32_t step = 0;
  Effect::AskKind kind = Effect::AskKind::kForTrainers;
  Status status;  // ok: `quorum` is the answer
  Quorum quorum;
};

struct LossInput {
  uint32_t quorum_id = 0;
  bool names_this_group = false;  // a notice names this group's life
  bool evicted = false;           // ... with reason progress_stalled
  std::string who;                // "group:reason,..." for the log
};

class AgentCore {
 public:
  AgentCore(CoreOptions options, TimePoint now);

  // ---- the trainers (the Unix socket, and the board through OnBoardLook) ----
  Status OnHello(uint32_t group_rank, uint32_t group_size, int pid, Effects* fx);
  // The poll waits (no effect for it), or is answered or refused by an effect.
  void OnPoll(const PollInput& in, TimePoint now, Effects* fx);
  // A superseded poll: its responder was answered by the shell with a conflict (the next poll
  // of the same rank). Returns the committed step to answer with.
  Result<uint32_t> OnCommit(const CommitInput& in, Effects* fx);
  Status OnGoodbye(uint32_t group_rank, Effects* fx);
  Status OnPhase(uint32_t group_rank, bool peer_wait);
  void OnNoticeWait(uint64_t id, uint32_t quorum_id, Effects* fx);
  void OnNoticeTimeout(uint64_t id, Effects* fx);
  void OnBoardLook(const BoardLook& look, Effects* fx);
  void OnTrainerExited(uint32_t group_rank, int pid, Effects* fx);

  // ---- the lighthouse ----
  void OnHeartbeat(const HeartbeatAnswer& in, Effects* fx);
  void OnAskResult(const AskResult& in, Effects* fx);
  void OnQuorumLost(const LossInput& in, Effects* fx);
  // A commit the lighthouse refused because the job finished.
  void OnJobFinished(Effects* fx);
  // The lighthouse refused a call with GROUP_FINISHED: another node of this group left it
  // because its trainers ended at the final step. This node's trainers committed that step
  // too (the group commits in lockstep) and are ending: the node drains as finished and the
  // agent exits 0, where a GROUP_LEFT would fail the group.
  void OnGroupFinished(const std::string& detail, Effects* fx);
  // A refusal saying this group left, heard while this node drains: true when it is taken as
  // such (see the definition).
  bool LeftWhileDraining(const Status& st, Effects* fx);

  // ---- life ----
  void OnDrain(LeaveReason why, const std::string& text, bool checkpoint, Effects* fx);
  void OnSignalArrived() { s_.signalled = true; }
  // The agent stops: every notice wait is answered (agent_exiting).
  void OnStopping(Effects* fx) { AnswerNotices(true, fx); }
  // The trainers exited after a drain (all_exited), or drain_timeout passed.
  void OnTrainersGone(bool all_exited, Effects* fx);
  void OnLeaveDone(Effects* fx);
  // Timers: the hello bound.
  void OnTick(TimePoint now, Effects* fx);

  // ---- reads ----
  const AgentState& state() const { return s_; }
  Phase ReportedPhase() const;
  // The quorum the watch follows: the one fetched ahead if any, else the trainers'.
  std::optional<uint32_t> WatchTarget() const;
  // Whether an ask ahead may go now (the node's commit reached the lighthouse first).
  bool AskMayGo(bool commit_pending) const {
    return s_.ask.asking() && !s_.draining && (s_.ask.kind != Ask::Kind::kAhead || !commit_pending);
  }
  uint32_t ExpectedLocalTrainers() const;
  // The ask to send now (kAsk, with `id` its serial), if AskMayGo.
  std::optional<Effect> PendingAsk(bool commit_pending) const;

 private:
  Status Register(uint32_t group_rank, uint32_t size, int pid, Effects* fx);
  PollAnswer AnswerFor(TrainerState& t, bool fresh_answer);
  void AnswerPolls(bool fresh_answer, Effects* fx);
  void AnswerNotices(bool force, Effects* fx);
  void StartAsk(uint32_t step, Ask::Kind kind, Effects* fx);
  void AskAhead(uint32_t step, Effects* fx);
  void Withdraw(Effects* fx);
  void ApplyTaken(BoardTicket taken, Effects* fx);
  void PublishAhead(Effects* fx);
  Status Commit(TrainerState& t, uint32_t step, bool failed, const std::string& hash,
                uint64_t tokens, Effects* fx);
  void Fail(LeaveReason why, const std::string& detail, Effects* fx);
  void Exit(Effects* fx);
  Effect AskEffect() const;

  CoreOptions o_;
  AgentState s_;
};

}  // namespace lk::agent
