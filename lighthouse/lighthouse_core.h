// The lighthouse core: a pure state machine over every job's membership. It implements the
// quorum rules of ARCHITECTURE.md (1-8) and returns, for every input, the effects the shell must
// apply in order: first persist (synced), then answer waiters and wake watchers. It reads no
// clock (every input carries `now`), does no I/O and starts no threads, so tests drive it with a
// manual clock and a seeded simulation.
// Thread-safety: none; the shell calls it from one strand.
#pragma once

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace lk::lighthouse {

// The heartbeat phase an agent reports while every trainer of its node is blocked in the
// cross-group collective, waiting on the other groups: rule 8 does not count that time as a
// stall of this group (in lockstep training the healthy groups wait on a hung one exactly as
// long as it has hung).
inline constexpr const char* kPhasePeerWait = "peer_wait";
// The leave reason of an agent whose trainer exited outside a drain: counted as a crash.
inline constexpr const char* kLeaveTrainerCrashed = "trainer_crashed";
// The leave reason of an agent whose trainers all ended at the final step. A group's nodes
// leave one by one: the others hear GROUP_FINISHED, not GROUP_LEFT, and finish rather than fail.
inline constexpr const char* kLeaveFinished = "finished";

struct CoreOptions {
  // Fewest groups a quorum may have (rule 4 and 5).
  uint32_t min_replicas = 1;
  // After the first group asks, how long to wait for the other healthy groups (rule 5).
  Millis join_timeout{2'000};
  // A group whose agents have not all heartbeated within this is unhealthy (rule 1).
  Millis heartbeat_timeout{3'000};
  // A quorum member whose step does not advance for this long, while it is not waiting in a
  // quorum round, is failed (rule 8). Zero disables the rule.
  Millis progress_timeout{0};
  // Retired incarnations remembered per group (persisted), so that a stale agent gets a clear
  // 409 STALE_INCARNATION by name; older lives are still refused by their generation.
  uint32_t retired_incarnations_max = 16;
  // Jobs the core holds at most; a heartbeat or ask that would create one more is refused
  // (kResourceExhausted, JOBS_MAX). Existing jobs are unaffected.
  uint32_t jobs_max = 1024;
  // A group that left, or whose heartbeats stopped, is forgotten this long after (its record
  // deleted; the job's generation counter keeps its lives refused). Zero keeps groups forever.
  Millis group_grace{600'000};
  // Checkpoints remembered per job in the registry (newest kept).
  uint32_t checkpoints_per_job_max = 64;
  // Bounds on what one request can make the core hold (kInvalidArgument / kResourceExhausted).
  uint32_t groups_per_job_max = 4096;
  uint32_t nodes_max = 1024;      // agents per group
  uint32_t text_bytes_max = 256;  // ids, addresses, phases, reasons, hashes, locations
  // Every answer carries the member list in QuorumAnswer::members (true) or only in
  // QuorumAnswer::members_shared (false). With n members an issue answers n groups, so inline
  // lists cost O(n^2) copies: ~0.2 s at 1,024 groups, against ~1 ms shared.
  bool answer_members_inline = true;

  // kInvalidArgument when an option is out of range (min_replicas 0, a timeout <= 0, ...).
  Status Validate() const;
};

// One member of a quorum, as persisted and as answered.
struct MemberData {
  std::string group_id;
  std::string incarnation;
  uint32_t step = 0;
  std::vector<std::string> addresses;  // index node_rank; shard server of each agent
  bool heal = false;
  bool has_state = true;
  // Some of its agents asked with state and some without (a node whose answer was lost while
  // its peer nodes' trainers healed): its trainers' shards are from different steps, so it is no
  // donor of any state, trained or first. Not persisted: it only shapes the plan it is made for.
  bool partial = false;
  uint32_t group_size = 0;         // trainers in the group when the quorum formed (0: not known)
  bool mixed_group_sizes = false;  // it could average across group sizes then
};

struct CheckpointData {
  std::string job;
  uint32_t step = 0;
  std::string location;
  std::string manifest_digest;
  std::string group_id;
  uint32_t created_unix_s = 0;
};

// A group's contribution to a job: the tokens (samples) it reported with its commits.
struct GroupTokensData {
  std::string group_id;
  uint32_t step = 0;    // the last step it committed tokens for
  uint64_t tokens = 0;  // at that step
  uint64_t total = 0;   // over every step it committed (saturating)
  bool operator==(const GroupTokensData&) const = default;
};

// The lives of one group across its incarnations, kept with the job (not the group record,
// which is collected group_grace after a life ends): a group requeued by Slurm may wait in the
// queue for hours, and its crash count must still be there when it crashes again.
inline constexpr size_t kCrashedLivesKept = 16;
struct GroupLivesData {
  std::string group_id;
  // Incarnations that ended in a crash of their trainers (each counted once, whether the agent's
  // leave said so or the launcher reported it), and requeues Slurm refused.
  uint32_t crashes = 0;
  uint32_t requeue_refusals = 0;
  // The incarnations whose crash was counted, newest last, at most kCrashedLivesKept: a second
  // report of one crash (the agent's leave, then the launcher's) counts nothing.
  std::vector<std::string> crashed_incarnations;
  std::string last_event;  // "requeue_refused: <detail>", the last event reported
  bool operator==(const GroupLivesData&) const = default;
};

// What the shell persists per job (RocksDB value); enough to resume after kill -9.
struct JobRecordData {
  std::string job;
  uint32_t quorum_id = 0;           // the last issued quorum id (never reused)
  std::vector<MemberData> members;  // the last quorum, sorted by group_id
  uint32_t committed_step = 0;
  uint32_t quorum_changes = 0;
  // Ids up to this one may have been handed out (the store's synced reservation); after a
  // restart new ids start above it. 0: none beyond quorum_id.
  uint32_t quorum_id_reserved = 0;
  // The last incarnation generation handed out in this job.
  uint32_t generation_last = 0;
  // The step at which a group finished (left with reason "finished" at the committed step); 0
  // while none has since the last regular quorum.
  uint32_t finished_step = 0;
  bool catch_up = false;  // the last quorum is a catch-up quorum (it commits nothing)
  // The last quorum lost a member or failed a step (its members were told to abort), and so
  // its id is never issued again (force_new also after a divergence). Kept across restarts, so
  // that a restarted lighthouse does not hand out again a quorum its agents already count lost.
  bool lost = false;
  bool force_new = false;
  // Each group's contribution, sorted by group_id (written with every commit, unsynced like
  // the step it goes with).
  std::vector<GroupTokensData> tokens;
  // Each group's crashes and refused requeues, sorted by group_id; kept while the job lives.
  std::vector<GroupLivesData> lives;
};

// What the shell persists per group (RocksDB value): the current incarnation with its
// generation and the recent retired ones, so that a replaced life stays dead after a restart.
struct GroupRecordData {
  std::string job, group_id, incarnation;
  uint32_t generation = 0;
  uint32_t nodes = 1;
  bool left = false;
  std::string reason;
  struct Retired {
    std::string incarnation;
    uint32_t generation = 0;
    bool operator==(const Retired&) const = default;
  };
  std::vector<Retired> retired;  // oldest first
};

struct HeartbeatInput {
  std::string job, group_id, incarnation;
  uint32_t node_rank = 0, nodes = 1, step = 0;
  std::string phase, address;
  uint32_t generation = 0;  // what the agent was told (HeartbeatResult::generation); 0: nothing
};

struct JoinInput {
  std::string job, group_id, incarnation;
  uint32_t node_rank = 0, nodes = 1, step = 0;
  bool shrink_only = false;
  bool has_state = true;
  std::string address;
  uint32_t generation = 0;  // as in HeartbeatInput
  // Trainers in the whole group; 0: not known. A group whose size differs from the quorum's
  // is refused (GROUP_SIZE_MISMATCH), unless every member sets mixed_group_sizes.
  uint32_t group_size = 0;
  // Every trainer of the group averages across groups of other sizes (see ComputeQuorum).
  bool mixed_group_sizes = false;
  // The quorum the agent's trainers were last handed (0: none, or an agent that does not say).
  uint32_t on_quorum_id = 0;
};

struct CommitInput {
  std::string job, group_id, incarnation;
  uint32_t node_rank = 0, quorum_id = 0, step = 0;
  bool ok = true;
  std::string state_hash;
  uint64_t tokens = 0;  // the group's tokens in this outer step; 0: not reported
};

// An event a group's launcher (the Slurm batch script, the agent after its leave) reports about
// one of its lives: POST /v1/event.
enum class GroupEventKind { kTrainerCrashed, kRequeueRefused };
// "trainer_crashed", "requeue_refused": the names on the wire.
std::string_view GroupEventName(GroupEventKind kind);
std::optional<GroupEventKind> ParseGroupEvent(std::string_view name);

struct GroupEventInput {
  std::string job, group_id, incarnation;
  GroupEventKind kind = GroupEventKind::kTrainerCrashed;
  std::string detail;  // one line for the log and /status (bounded by text_bytes_max)
};

struct FailureNoticeData {
  uint32_t quorum_id = 0;
  std::string group_id, incarnation, reason;
};

// A quorum as answered to one member.
struct QuorumAnswer {
  uint32_t quorum_id = 0;
  std::vector<MemberData> members;  // sorted by group_id; index = replica_rank
  // The same list, shared by every answer of one issue (always set by the core).
  std::shared_ptr<const std::vector<MemberData>> members_shared;
  uint32_t replica_rank = 0;
  uint32_t max_step = 0;
  bool heal = false;
  std::vector<uint32_t> source_ranks;                // live donors for this member when it heals
  std::optional<CheckpointData> restore_checkpoint;  // no live state anywhere: restore this
  bool initial = false;                              // first start: take replica_rank 0's weights
  std::string reason;
  uint32_t generation = 0;  // the answered member's incarnation generation
  // The members' group sizes are not all equal: the answer then lists them (group_sizes).
  bool group_sizes_differ = false;
  // This member heals because its committed state was found off the quorum's reference at
  // this step (rule 7's divergence check); 0: not so.
  uint32_t diverged_step = 0;
};

// Identifies one waiting agent (a pending POST /v1/quorum).
struct AgentKey {
  std::string job, group_id, incarnation;
  uint32_t node_rank = 0;
  auto operator<=>(const AgentKey&) const = default;
};

struct Effects {
  // Persist these (synced) before anything below reaches anyone.
  std::vector<JobRecordData> persist_jobs;
  std::vector<CheckpointData> persist_checkpoints;
  // Checkpoints pushed out of the bounded registry: delete them from the store.
  std::vector<CheckpointData> drop_checkpoints;
  std::vector<std::string> forget_jobs;  // delete all persisted state of these jobs
  // Group records to write, and groups collected after their grace period (job, group_id).
  std::vector<GroupRecordData> persist_groups;
  std::vector<std::pair<std::string, std::string>> drop_groups;
  // Answer these waiting agents.
  std::vector<std::pair<AgentKey, QuorumAnswer>> answers;
  // Waiting agents to answer with an error (their incarnation was replaced, they left, ...).
  std::vector<std::pair<AgentKey, Status>> rejections;
  // Jobs whose current quorum lost a member or was replaced: wake their watchers.
  std::set<std::string> watch_wakeups;
  // One line per decision or state change, "event key=value ..." with a reason.
  std::vector<std::string> events;
  // Quorums issued by this input (for metrics): job, quorum_id, whether membership changed.
  struct Issued {
    std::string job;
    uint32_t quorum_id;
    bool changed;
    uint32_t members;
  };
  std::vector<Issued> issued;
  // One entry (the job) per group newly found off its quorum's reference state (for metrics).
  std::vector<std::string> divergences;
};

struct HeartbeatResult {
  uint32_t quorum_id = 0;
  bool drain = false;
  std::vector<FailureNoticeData> notices;
  uint32_t committed_step = 0;
  uint32_t generation = 0;   // of the heartbeating incarnation: the agent sends it back
  std::string revived_from;  // this heartbeat ended a heartbeat_timeout: the reason it had
};

struct GroupView {
  std::string group_id, incarnation, phase, state, reason;
  uint32_t nodes = 1, step = 0, generation = 0;
  uint32_t group_size = 0;         // trainers, from its last ask (0: not known)
  bool mixed_group_sizes = false;  // its last ask could average across group sizes
  // Its contribution: the tokens of its last committed step (tokens_step), their share of all
  // the tokens the job's groups committed for that step, and its total over the job.
  uint64_t tokens = 0, tokens_total = 0;
  uint32_t tokens_step = 0;
  double share = 0;
  bool healthy = false, participant = false, in_quorum = false, draining = false, diverged = false;
  // Times its committed state was found off the quorum's reference (this incarnation), and the
  // step of the last time (0: never). `diverged` stays true until a commit agrees again.
  uint32_t divergences = 0, diverged_step = 0;
  Millis heartbeat_age{0};  // oldest agent's
  // Over all its lives in this job (GroupLivesData).
  uint32_t crashes = 0, requeue_refusals = 0;
  std::string last_event;
  std::string gateway;  // the site of the gateway its last heartbeat came through
};

struct JobView {
  std::string job;
  uint32_t quorum_id = 0;
  std::vector<MemberData> members;
  uint32_t committed_step = 0;
  uint32_t quorum_changes = 0;
  uint32_t finished_step = 0;               // as in JobRecordData
  std::vector<GroupView> groups;            // sorted by group_id
  std::vector<CheckpointData> checkpoints;  // newest first
  std::string last_decision;
};

struct WatchResult {
  uint32_t quorum_id = 0;
  bool lost = false;  // the asked quorum lost a member, or a newer quorum exists
  std::vector<FailureNoticeData> notices;
};

class LighthouseCore {
 public:
  explicit LighthouseCore(CoreOptions options);

  // Restores persisted state at start. Loaded members count as having heartbeated at `now`, so
  // that they can rejoin on the fast path before the heartbeat timeout; other loaded groups
  // are unheard until their agents heartbeat, and are collected after the grace period if they
  // do not. kDataLoss when the records contradict themselves.
  Status Load(std::vector<JobRecordData> jobs, std::vector<CheckpointData> checkpoints,
              TimePoint now, std::vector<GroupRecordData> groups = {});

  // Errors (each with its Reason, each changing nothing): kInvalidArgument (missing
  // job/group/incarnation, node_rank >= nodes; NODES_CHANGED within one incarnation),
  // kConflict (STALE_INCARNATION: a retired incarnation, or an unknown one carrying a
  // generation this job handed out before; GROUP_LEFT), kResourceExhausted (JOBS_MAX,
  // GROUPS_MAX). An incarnation never heard of, without a generation, is a new life of the
  // group: it replaces the current one and gets the next generation.
  Result<HeartbeatResult> OnHeartbeat(const HeartbeatInput& in, TimePoint now, Effects* fx);
  // After an accepted heartbeat: the site of the lk_gateway it came through, as the shell
  // checked the gateway's credential ("" for directly). Shown in the view only (GroupView::
  // gateway); not persisted, decides nothing. A group or incarnation it does not hold is ignored.
  void NoteGateway(const std::string& job, const std::string& group_id,
                   const std::string& incarnation, const std::string& site);

  // Records the ask. When the quorum can be issued now, fx->answers holds an answer for every
  // waiting agent of every member (including this one); otherwise the caller keeps the agent
  // waiting. A member re-asking with the step it had in the current quorum (a retry after a
  // timeout or a lighthouse restart) is answered at once with the current quorum.
  // Errors: as OnHeartbeat, plus kConflict when the agents of one group that hold state ask
  // with different steps (the reason names both steps). An agent without state is taken at any
  // step: the group then heals as a whole (event steps_disagree).
  // With evaluate=false the ask is only recorded: the caller runs EvaluateJob later, once for
  // a burst of asks (at 1,024 groups one decision per ask made a round O(n^2)).
  Status OnJoin(const JoinInput& in, TimePoint now, Effects* fx, bool evaluate = true);
  // Runs the quorum decision of `job` (no-op for an unknown job).
  void EvaluateJob(const std::string& job, TimePoint now, Effects* fx);

  // The waiting agent gave up (its request deadline passed); it stays a participant of the
  // round until the group leaves or is unhealthy, so a retry rejoins the same round.
  void OnJoinTimeout(const AgentKey& key);

  // Only the current incarnation leaves: a retired one (or an unknown one with an old
  // generation) is STALE_INCARNATION, one never heard of is UNKNOWN_INCARNATION, and neither
  // touches the live incarnation. A leave with reason "finished" (the agent's leave after all
  // its trainers finished) at the job's committed step marks the job finished at that step:
  // groups still behind it then catch up alone (see ComputeCatchUp in quorum.h).
  Status OnLeave(const std::string& job, const std::string& group_id,
                 const std::string& incarnation, const std::string& reason, TimePoint now,
                 Effects* fx, uint32_t generation = 0);

  // Records an event about a life of a group of a known job: a crash is counted once per
  // incarnation (a leave with reason "trainer_crashed" counts it too), a refused requeue every
  // time. Any incarnation may report (a life may crash before its agent is heard of). Returns
  // the group's counts after the event. Errors: kInvalidArgument (ids, detail longer than
  // text_bytes_max), kNotFound (UNKNOWN_JOB), kResourceExhausted (GROUPS_MAX).
  Result<GroupLivesData> OnGroupEvent(const GroupEventInput& in, TimePoint now, Effects* fx);

  // Accepted only from the current incarnation of a member of the current quorum, naming that
  // quorum, and (when ok) for the step after the quorum's start, max_step + 1, or a later step
  // the members went on to on that quorum without the lighthouse (a late report, delivered
  // when it is back, also after a restart): at most one past the step the group or the job is
  // known to have reached, so that such steps are taken in order, one at a time. Errors:
  // kNotFound (UNKNOWN_JOB, UNKNOWN_GROUP), kConflict (STALE_INCARNATION,
  // UNKNOWN_INCARNATION, GROUP_LEFT, WRONG_QUORUM, NOT_A_MEMBER, WRONG_STEP, JOB_FINISHED: a
  // successful commit in a catch-up quorum, which only lets groups behind a finished job
  // restore its final step and may be smaller than min_replicas).
  Result<bool /*diverged*/> OnCommit(const CommitInput& in, TimePoint now, Effects* fx);

  // Accepted only for a known job, at a step it committed, with a location the restore path
  // reads: an absolute path without "." or ".." parts or control characters. Errors: kNotFound
  // (UNKNOWN_JOB, UNKNOWN_GROUP), kConflict (CHECKPOINT_NOT_COMMITTED), kInvalidArgument
  // (CHECKPOINT_LOCATION_INVALID, BAD_REQUEST).
  Status OnRegisterCheckpoint(const CheckpointData& ckpt, Effects* fx);
  // Newest first.
  std::vector<CheckpointData> Checkpoints(const std::string& job) const;

  // Admin: ask a group to leave (heartbeats answer drain=true; it is no longer a candidate).
  Status Drain(const std::string& job, const std::string& group_id, TimePoint now, Effects* fx);
  // Admin: drop a job and everything known about it.
  Status Forget(const std::string& job, Effects* fx);

  // Applies timeouts (heartbeat, join, progress) and issues quorums that became ready.
  void Tick(TimePoint now, Effects* fx);
  // The earliest time at which Tick could change anything; nullopt when nothing is pending.
  std::optional<TimePoint> NextDeadline() const;

  // Answers at once whether quorum `quorum_id` of `job` has lost a member (or is superseded).
  Result<WatchResult> Watch(const std::string& job, uint32_t quorum_id) const;

  bool HasJob(const std::string& job) const;
  // The job's committed step (0 for an unknown job): cheap, unlike View, for commit answers.
  uint32_t CommittedStep(const std::string& job) const;
  std::vector<JobView> View(TimePoint now) const;
  size_t GroupCount() const;
  size_t JobCount() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace lk::lighthouse
