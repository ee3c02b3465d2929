// Internal state of LighthouseCore (jobs, groups, deadlines) and the helpers that change it. Only
// lighthouse_core*.cc include this; the public interface is lighthouse_core.h.
// Thread-safety: none; owned by one LighthouseCore, which the shell calls from one strand.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "lighthouse/lighthouse_core.h"
#include "lighthouse/quorum.h"

namespace lk::lighthouse::internal {

// kCollect sorts last, so that a group's other timeouts due at the same instant run before it
// may be erased.
enum class DeadlineKind : uint8_t { kHeartbeat, kProgress, kJoin, kCollect };

struct Job;

// One group_id and its current incarnation. Kept small: the goal is < 2 KiB per tracked group.
struct Group {
  GroupStatus status;
  Job* job = nullptr;
  uint32_t generation = 0;  // of the current incarnation (0: loaded from an old record)
  std::vector<GroupRecordData::Retired> retired;  // earlier incarnations, oldest first (bounded)
  std::string reason;                             // why it left, was evicted, or is unhealthy
  // The heartbeat_timeout it came back from, until a heartbeat reports it (revived_from): an
  // ask or a commit may be what revives it, and its agent must hear of the lapse all the same.
  std::string lapsed_from;
  std::string gateway;  // the site of the lk_gateway its last heartbeat came through; not persisted
  bool alive = false;         // cached IsAlive, moved only by inputs and timeouts (for events)
  bool in_quorum = false;     // this incarnation is a member of the job's current quorum
  bool lost = false;          // ... and has been lost from it (notice given)
  bool committed = false;     // reported a commit (ok or not) in the current quorum
  TimePoint progress_mark{};  // when its step last advanced (or it joined the quorum)
  // Its wait on peers excuses it from rule 8 (RefreshWaits keeps this; RearmProgress reads it).
  bool wait_excused = false;
  uint32_t hash_step = 0;  // step of the last state_hash it reported
  std::string state_hash;
  // Rule 7's divergence check: its commits were found off the quorum's reference state this
  // many times (status.diverged says whether it still is), the last at diverged_step.
  uint32_t divergences = 0;
  uint32_t diverged_step = 0;
  std::optional<TimePoint> heartbeat_deadline, progress_deadline;
  // When the group is forgotten: set while it has left or its heartbeats stopped.
  std::optional<TimePoint> collect_deadline;
};

struct Job {
  std::string name;
  uint32_t quorum_id = 0;
  uint32_t id_floor = 0;  // a new id is above this too (the reservation loaded at start)
  uint32_t committed_step = 0;
  uint32_t quorum_changes = 0;
  uint32_t generation_last = 0;  // the last incarnation generation handed out (persisted)
  uint32_t finished_step = 0;    // JobRecordData::finished_step (persisted)
  bool catch_up = false;         // the current quorum is a catch-up quorum (persisted)
  RecoveryPlan plan;             // the current quorum; plan.members is what gets persisted
  // The step the current quorum_id was first handed out for (its first max_step); after a
  // restart, the loaded record's max_step, which is no earlier. Steps above it were reached on
  // this quorum, so a member's late commit of one of them is consistent with the record.
  uint32_t quorum_start_step = 0;
  bool force_new = false;  // a member was lost or reported a failed commit since the last issue
  bool lost = false;       // the current quorum lost a member
  std::vector<FailureNoticeData> notices;  // for the current quorum_id
  std::map<std::string, Group> groups;
  std::vector<const GroupStatus*> order;    // &groups[*].status, sorted by group_id
  std::vector<CheckpointData> checkpoints;  // newest first
  std::string last_decision;
  std::optional<TimePoint> join_deadline;
  // Each group's contribution, by group_id (kept across incarnations, dropped with the group).
  std::map<std::string, GroupTokensData> tokens;
  // Each group's lives (crashes, refused requeues), by group_id: kept while the job lives, also
  // after the group is collected.
  std::map<std::string, GroupLivesData> lives;
};

using Deadline = std::tuple<TimePoint, DeadlineKind, void*>;

// Every agent of the group reports kPhasePeerWait.
bool WaitingOnPeers(const GroupStatus& g);

}  // namespace lk::lighthouse::internal

namespace lk::lighthouse {

struct LighthouseCore::Impl {
  using Group = internal::Group;
  using Job = internal::Job;

  explicit Impl(CoreOptions o) : options(o) {}

  CoreOptions options;
  std::map<std::string, Job> jobs;
  std::set<internal::Deadline> deadlines;
  size_t group_count = 0;

  // Input checks that need no state: ids present and bounded, node_rank < nodes.
  Status CheckIds(const std::string& job, const std::string& group_id,
                  const std::string& incarnation) const;
  Status CheckAgent(const std::string& job, const std::string& group_id,
                    const std::string& incarnation, uint32_t node_rank, uint32_t nodes,
                    const std::string& address, const std::string& phase) const;
  // Stateful checks of a heartbeat or ask; changes nothing.
  Status CheckIncarnation(const std::string& job, const std::string& group_id,
                          const std::string& incarnation, uint32_t nodes,
                          uint32_t generation) const;
  // Looks up a group whose current incarnation is `incarnation` (commit, leave); the errors
  // name why not (UNKNOWN_JOB, UNKNOWN_GROUP, STALE_INCARNATION, UNKNOWN_INCARNATION).
  Result<Group*> FindCurrent(const std::string& job, const std::string& group_id,
                             const std::string& incarnation, uint32_t generation = 0);
  // Whether `incarnation` (with the generation its agent sent) is a life of this group that is
  // over: a retired one, or one carrying a generation this job handed out before.
  bool IsDeadLife(const Job& job, const Group* g, const std::string& incarnation,
                  uint32_t generation) const;

  // Creates the job and group as needed and replaces an older incarnation.
  Group& Admit(const std::string& job, const std::string& group_id, const std::string& incarnation,
               uint32_t nodes, TimePoint now, Effects* fx);
  void ReplaceIncarnation(Group& g, const std::string& incarnation, uint32_t nodes, TimePoint now,
                          Effects* fx);
  // Records contact from one agent; a group that comes alive again keeps the heartbeat_timeout
  // it lapsed from in lapsed_from, for its next heartbeat's answer.
  void Touch(Group& g, uint32_t node_rank, uint32_t step, const std::string& address,
             const std::string& phase, TimePoint now, Effects* fx);
  // Moves the group's step forward (never back) and restarts its progress clock; returns
  // whether it moved. Callers refresh the job's waits (RefreshWaits) once after their changes.
  bool AdvanceStep(Group& g, uint32_t step, TimePoint now);

  // The reason code of a refusal to a group that left: GROUP_FINISHED when its trainers ended
  // at the final step (its other nodes finish too), GROUP_LEFT otherwise.
  static Reason LeftReason(const Group& g);
  // Loss of a member of the current quorum: notice, watch wakeup, next quorum gets a new id.
  void LoseMember(Group& g, const std::string& reason, TimePoint now, Effects* fx);
  // Ends the job's current quorum for every member without naming one (a failed outer step, a
  // member that never took it): the next round takes a new id, and the watch says so at once.
  void LoseQuorum(Job& job, Effects* fx);
  // A partial group (its nodes' shards from different steps) in a quorum with no whole member
  // and no checkpoint: nothing can make its state whole, so its life ends (the agent leaves as
  // evicted) and the next life starts afresh, instead of the quorum hanging on two steps.
  void EvictStateLost(Group& g, TimePoint now, Effects* fx);
  // Forgets the group's asks; waiting agents get `why`. A member that stops waiting in a round
  // starts its progress clock (rule 8) afresh at `now`: time spent waiting is no stall.
  void ClearAsks(Group& g, const Status& why, TimePoint now, Effects* fx);

  void ApplyTimeouts(TimePoint now, Effects* fx);
  void Expire(Group& g, TimePoint now, Effects* fx);
  void Evict(Group& g, TimePoint now, Effects* fx);

  // Runs the decision for a job and issues when it says so.
  void Evaluate(Job& job, TimePoint now, Effects* fx);
  void Issue(Job& job, const QuorumDecision& d, TimePoint now, Effects* fx);
  // Keeps a participant of another size than the quorum's out: its asks are refused with
  // GROUP_SIZE_MISMATCH and /status shows why, until it asks again.
  void RefuseSize(Group& g, const QuorumDecision& d, TimePoint now, Effects* fx);
  void CheckDivergence(Job& job, uint32_t step, Effects* fx);
  JobRecordData Record(const Job& job) const;
  // Counts a crash of `incarnation` once; returns whether it was new.
  bool CountCrash(Job& job, const std::string& group_id, const std::string& incarnation);
  // Load's parts: the persisted groups (unheard, collection armed) and a loaded quorum member.
  Status LoadGroups(std::vector<GroupRecordData> records, TimePoint now);
  void LoadMember(Group& g, const MemberData& m, TimePoint now);
  GroupRecordData GroupRecord(const Group& g) const;
  // Hands the group's current incarnation the next generation and persists both records.
  void NewGeneration(Group& g, Effects* fx);
  // Arms (or, while the group lives, clears) its collection after the grace period.
  void RearmCollect(Group& g, TimePoint now);
  void Collect(Group& g, TimePoint now, Effects* fx);
  std::optional<CheckpointData> NewestCheckpoint(const Job& job) const;

  void SetDeadline(std::optional<TimePoint>& slot, std::optional<TimePoint> at,
                   internal::DeadlineKind kind, void* who);
  // Arms the group's expiry; none when it is already expired at `now` (processed before).
  void RearmHeartbeat(Group& g, TimePoint now);
  void RearmProgress(Group& g);
  // Recomputes which members' waits on peers excuse them from rule 8 after a member's phase,
  // step or membership changed. A wait excuses a member only while another member is at its
  // step or behind it: one whose every peer is past its step is not blocked by them (they
  // finished the collective it claims to be in), so its trainer hung inside the collective or
  // its report is stale. A member whose excuse ends starts its progress clock at `now`, as one
  // that leaves the wait does: the time it was excused was no stall of its own.
  void RefreshWaits(Job& job, TimePoint now);
  void DropDeadlines(Group& g);  // heartbeat and progress (collection stays armed)
  void AddGroupOrder(Job& job, const Group& g);
};

}  // namespace lk::lighthouse
