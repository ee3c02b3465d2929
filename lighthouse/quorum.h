// The quorum decision: a pure function of (one job's membership, options, now) that says whether a
// quorum can be issued now, which groups it holds, and why (ARCHITECTURE.md rules 1-5), plus the
// recovery plan of rule 7. The lighthouse core keeps its per-group state in these structs and
// hands them here by pointer, so a decision copies nothing; tests build them by hand.
// Thread-safety: pure functions over const data; safe from any thread.
#pragma once

#include <lightkeeper/clock.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lighthouse/lighthouse_core.h"

namespace lk::lighthouse {

// What a group is doing apart from heartbeat freshness. Only kActive groups can be healthy.
enum class GroupMode : uint8_t {
  kActive,
  kDraining,  // an admin asked it to leave; not a candidate any more
  kLeft,      // it left (its incarnation is retired)
  kEvicted,   // its progress stalled (rule 8); it comes back by asking again
};

// One node agent of a group's current incarnation.
struct AgentStatus {
  TimePoint last_seen{};  // last heartbeat, ask or commit
  uint32_t step = 0;      // last step it reported
  uint32_t ask_step = 0;  // the step of its ask in the pending round (when asked)
  bool seen = false;      // heard from at least once in this incarnation
  bool asked = false;     // asked to join the pending round
  bool waiting = false;   // its ask is still held by the shell (not yet answered or timed out)
  bool ask_has_state = true;
  bool ask_shrink_only = false;
  // Its last ask (kept across rounds, and from the quorum record after a restart) said its
  // node's trainers average across group sizes.
  bool ask_mixed_group_sizes = false;
  // ask_mixed_group_sizes holds what this agent said (an ask of this incarnation, or the quorum
  // record); false until then, when its default means nothing.
  bool said_shape = false;
  std::string address;  // its shard server
  std::string phase;    // free text from heartbeats ("train", "heal", ...)
};

// One replica group's current incarnation, as the decision sees it.
struct GroupStatus {
  std::string group_id;
  std::string incarnation;
  std::vector<AgentStatus> agents;  // index node_rank; size = nodes
  GroupMode mode = GroupMode::kActive;
  uint32_t asked = 0;                  // agents with asked == true
  std::optional<TimePoint> first_ask;  // earliest ask of this group in the pending round
  uint32_t step = 0;                   // highest step this incarnation reported (progress)
  bool diverged = false;               // its state hash disagreed with the majority (rule 7)
  uint32_t group_size = 0;             // trainers, from its last ask (0: not known)
  // Refused for its size (QuorumDecision::refused) until it asks again: not counted as a
  // healthy group, so that it holds up no majority while it goes away.
  bool size_refused = false;
};

// Rule 1, freshness only: every agent heard within heartbeat_timeout. The instant
// last_seen + heartbeat_timeout is already too late.
bool IsAlive(const GroupStatus& group, Millis heartbeat_timeout, TimePoint now);
// When IsAlive turns false, or nullopt when some agent was never heard.
std::optional<TimePoint> AliveUntil(const GroupStatus& group, Millis heartbeat_timeout);
// Rule 1: alive and active (not left, evicted or draining).
bool IsHealthy(const GroupStatus& group, const CoreOptions& options, TimePoint now);
// Every agent asked (the core rejects asks whose steps disagree, so they share one step).
bool IsParticipant(const GroupStatus& group);
// For a participant: the step, whether every agent has state, whether any asked shrink_only.
// The step its asking agents with state asked with (those without state heal anyway).
uint32_t AskStep(const GroupStatus& group);
bool AskHasState(const GroupStatus& group);
// Whether any of its agents asked with state.
bool AnyAskHasState(const GroupStatus& group);
bool AskShrinkOnly(const GroupStatus& group);
// Every agent of the group said its shape (its trainers per group and whether they mix) in an
// ask of this incarnation, or the quorum record kept it across a lighthouse restart. A group that
// has not (new, or collected and back before all its agents asked) takes no part in the size
// rule: it neither mixes nor refuses to.
bool SaidShape(const GroupStatus& group);
// Every agent's last ask said its trainers average across group sizes (mixed_group_sizes).
bool MixesGroupSizes(const GroupStatus& group);

struct JobMembership {
  std::span<const MemberData> previous;        // last issued quorum, sorted by group_id
  std::span<const GroupStatus* const> groups;  // every tracked group, sorted by group_id
};

struct QuorumDecision {
  bool issue = false;
  bool fast_path = false;                   // rule 4
  bool catch_up = false;                    // ComputeCatchUp's quorum
  std::vector<const GroupStatus*> members;  // when issue: sorted by group_id
  uint32_t held_back = 0;                   // joiners held back by shrink_only (rule 3)
  // When waiting on join_timeout: the instant the decision changes unless an input comes first.
  std::optional<TimePoint> wake_at;
  std::string reason;
  // Participants kept out because their trainer count differs from the quorum's (`group_size`):
  // until groups of different sizes can share one quorum, mixing them would break every
  // member's cross-group collective. The core refuses their asks (GROUP_SIZE_MISMATCH). Set
  // when this decision issues, or while a running quorum's size is known; a first quorum's
  // other-size participants otherwise wait, outside the decision.
  std::vector<const GroupStatus*> refused;
  uint32_t group_size = 0;  // the quorum's trainers per group (0: none known, or they differ)
  // Every group that decides the quorum's shape averages across sizes (mixed_group_sizes): no
  // size rule, and `refused` holds only groups that cannot mix in a quorum of several sizes.
  bool mixed_sizes = false;
};

// The trainers per group a quorum of these candidates has: the size of the previous quorum's
// members among them when any reported one, else the size most of them share (a tie goes to
// the size more of the `healthy` groups have, then to the first group's by group_id); 0 when
// no candidate reported a size.
uint32_t QuorumGroupSize(std::span<const GroupStatus* const> candidates,
                         const std::vector<bool>& candidate_is_prev,
                         std::span<const GroupStatus* const> healthy = {});

// Rules 2-5. Candidates are healthy participants of the quorum's size (that of the live previous
// members, else QuorumGroupSize); those of another size are `refused` and count as neither
// candidates nor healthy groups. A quorum whose shaping groups (the live previous members, else
// every candidate) all set mixed_group_sizes has no size rule (`mixed_sizes`): only a group that
// cannot mix is refused, when the healthy groups that can have a size other than its own. Fast path
// (rule 4): a previous quorum exists and every member of it (same incarnation) is a healthy
// participant. Otherwise (rule 5): at least min_replicas candidates, more than half of the healthy
// groups, and every healthy group asked or join_timeout passed since the first ask of the round.
// Two refinements, both about joiners:
//  - while previous members are still healthy, more than half of them must be candidates (joiners
//    asking between two outer steps cannot outvote a live quorum; they wait for its next ask);
//  - the join_timeout clock then starts at the first ask of a previous member, not of a joiner.
QuorumDecision ComputeQuorum(const JobMembership& membership, const CoreOptions& options,
                             TimePoint now);

// After the job's groups finished at `finished_step` (they left, so no regular quorum of
// min_replicas may ever form again), a healthy participant that asks from behind that step
// would wait forever. Once the round has given the regular decision join_timeout since the
// group's first ask (so that returning groups still form a regular quorum together), every such
// group goes into a catch-up quorum of its own, whatever min_replicas says: its plan restores
// the newest checkpoint (PlanRecovery prefers a checkpoint newer than every member's state),
// and the core refuses its commits. Call it only when ComputeQuorum did not issue.
QuorumDecision ComputeCatchUp(const JobMembership& membership, const CoreOptions& options,
                              TimePoint now, uint32_t finished_step);

// Rule 7, decided once per issue. members[i].heal is set here; sources are the members that do
// not heal.
struct RecoveryPlan {
  std::vector<MemberData> members;  // sorted by group_id; index = replica_rank
  std::shared_ptr<const std::vector<MemberData>> shared;  // a copy of members for answers
  uint32_t max_step = 0;
  std::optional<CheckpointData> restore;  // no live state: every member restores this
  bool initial = false;                   // no state, no checkpoint: take rank 0's weights
  bool group_sizes_differ = false;        // the members' group_size values are not all equal
};

// Live state = members with has_state and not diverged. With live state: max_step is their
// highest step; a member heals unless it is live at max_step. Without, or when the newest
// checkpoint is newer than every live member's step (the groups that held the committed state
// are gone, e.g. they finished): every member restores the newest checkpoint, so no committed
// step is trained again. Without either, rank 0 keeps its initial weights and the others heal
// from it. `diverged` is parallel to `members` (empty means none diverged).
RecoveryPlan PlanRecovery(std::vector<MemberData> members, const std::vector<bool>& diverged,
                          const std::optional<CheckpointData>& newest_checkpoint);

// Rebuilds a plan from members whose heal flags were already decided (after Load).
RecoveryPlan PlanFromIssued(std::vector<MemberData> members,
                            const std::optional<CheckpointData>& newest_checkpoint);

// The answer for one member. source_ranks lists every donor (non-healing member), rotated by the
// healer's index among the healers, so that each healer starts with a different donor.
// members_shared is always set; members only with inline_members.
QuorumAnswer AnswerFor(const RecoveryPlan& plan, uint32_t quorum_id, uint32_t replica_rank,
                       std::string reason, bool inline_members = true);

// "1 joiner", "2 joiners".
std::string Plural(size_t n, const char* word);

}  // namespace lk::lighthouse
