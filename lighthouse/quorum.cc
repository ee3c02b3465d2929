#include "lighthouse/quorum.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

namespace lk::lighthouse {

std::optional<TimePoint> AliveUntil(const GroupStatus& group, Millis heartbeat_timeout) {
  if (group.agents.empty()) return std::nullopt;
  TimePoint oldest = TimePoint::max();
  for (const AgentStatus& a : group.agents) {
    if (!a.seen) return std::nullopt;
    oldest = std::min(oldest, a.last_seen);
  }
  return oldest + heartbeat_timeout;
}

bool IsAlive(const GroupStatus& group, Millis heartbeat_timeout, TimePoint now) {
  std::optional<TimePoint> until = AliveUntil(group, heartbeat_timeout);
  return until && now < *until;
}

bool IsHealthy(const GroupStatus& group, const CoreOptions& options, TimePoint now) {
  return group.mode == GroupMode::kActive && IsAlive(group, options.heartbeat_timeout, now);
}

bool IsParticipant(const GroupStatus& group) {
  return group.mode == GroupMode::kActive && !group.agents.empty() &&
         group.asked == group.agents.size();
}

uint32_t AskStep(const GroupStatus& group) {
  // The step of the agents that hold state (they agree: OnJoin refuses otherwise); a node
  // without state may ask with another step, and makes the whole group heal (AskHasState).
  std::optional<uint32_t> with_state, any;
  for (const AgentStatus& a : group.agents) {
    if (!a.asked) continue;
    any = std::min(any.value_or(a.ask_step), a.ask_step);
    if (a.ask_has_state) with_state = std::min(with_state.value_or(a.ask_step), a.ask_step);
  }
  if (with_state) return *with_state;
  if (any) return *any;
  return group.agents.empty() ? 0 : group.agents.front().ask_step;
}

bool AskHasState(const GroupStatus& group) {
  for (const AgentStatus& a : group.agents) {
    if (a.asked && !a.ask_has_state) return false;
  }
  return true;
}

bool AnyAskHasState(const GroupStatus& group) {
  return std::any_of(group.agents.begin(), group.agents.end(),
                     [](const AgentStatus& a) { return a.asked && a.ask_has_state; });
}

bool AskShrinkOnly(const GroupStatus& group) {
  for (const AgentStatus& a : group.agents) {
    if (a.asked && a.ask_shrink_only) return true;
  }
  return false;
}

bool SaidShape(const GroupStatus& group) {
  return !group.agents.empty() && std::all_of(group.agents.begin(), group.agents.end(),
                                              [](const AgentStatus& a) { return a.said_shape; });
}

bool MixesGroupSizes(const GroupStatus& group) {
  return std::all_of(group.agents.begin(), group.agents.end(),
                     [](const AgentStatus& a) { return a.ask_mixed_group_sizes; });
}

std::string Plural(size_t n, const char* word) {
  return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s");
}

namespace {

QuorumDecision Wait(std::string reason, std::optional<TimePoint> wake_at = std::nullopt) {
  QuorumDecision d;
  d.reason = std::move(reason);
  d.wake_at = wake_at;
  return d;
}

std::string HeldBackSuffix(uint32_t held_back) {
  if (held_back == 0) return "";
  return fmt::format("; shrink_only: {} held back", Plural(held_back, "joiner"));
}

// The members into the plan, with the copy every answer shares and whether their sizes differ
// (decided once per issue, not once per answer).
void Share(std::vector<MemberData> members, RecoveryPlan* plan) {
  plan->members = std::move(members);
  plan->shared = std::make_shared<const std::vector<MemberData>>(plan->members);
  plan->group_sizes_differ = std::adjacent_find(plan->members.begin(), plan->members.end(),
                                                [](const MemberData& a, const MemberData& b) {
                                                  return a.group_size != b.group_size;
                                                }) != plan->members.end();
}

}  // namespace

uint32_t QuorumGroupSize(std::span<const GroupStatus* const> candidates,
                         const std::vector<bool>& candidate_is_prev,
                         std::span<const GroupStatus* const> healthy) {
  std::map<uint32_t, std::pair<size_t, size_t>> count;  // size -> (candidates, healthy groups)
  for (size_t i = 0; i < candidates.size(); ++i) {
    const uint32_t size = candidates[i]->group_size;
    if (size == 0) continue;
    if (candidate_is_prev[i]) return size;  // the running quorum's size stays
    ++count[size].first;
  }
  for (const GroupStatus* g : healthy) {
    if (auto it = count.find(g->group_size); it != count.end()) ++it->second.second;
  }
  uint32_t best = 0;
  std::pair<size_t, size_t> best_count{0, 0};
  for (const GroupStatus* g : candidates) {  // group_id order: the first of a full tie wins
    if (g->group_size != 0 && count[g->group_size] > best_count) {
      best = g->group_size;
      best_count = count[best];
    }
  }
  return best;
}

namespace {

// What one merge walk over a job's (sorted) groups and previous members finds: the healthy
// groups, the participants among them (the candidates), and the clocks of rule 5.
struct Round {
  size_t healthy = 0, prev_healthy = 0, prev_participants = 0;
  std::optional<TimePoint> clock_all, clock_prev;  // first ask of any group / previous member
  std::vector<const GroupStatus*> candidates;
  std::vector<bool> candidate_is_prev;
  std::vector<const GroupStatus*> healthy_groups;
  // Over the live previous members that said their shape (asking now or not): the trainers per
  // group of the first, and whether all of them mix. A live previous member that never said it
  // (collected and back, its agents not asked yet) neither mixes nor refuses to: it is counted
  // apart, and while it is there no refusal is final.
  uint32_t prev_size = 0;
  bool prev_said = false, prev_all_mixed = true, prev_unsaid = false;
};

Round WalkGroups(const JobMembership& m, const CoreOptions& options, TimePoint now) {
  Round r;
  size_t pi = 0;
  for (const GroupStatus* g : m.groups) {
    while (pi < m.previous.size() && m.previous[pi].group_id < g->group_id) ++pi;
    bool is_prev = pi < m.previous.size() && m.previous[pi].group_id == g->group_id &&
                   m.previous[pi].incarnation == g->incarnation;
    if (!IsHealthy(*g, options, now) || g->size_refused) continue;
    ++r.healthy;
    r.healthy_groups.push_back(g);
    if (is_prev) ++r.prev_healthy;
    if (is_prev && SaidShape(*g)) {
      if (r.prev_size == 0) r.prev_size = g->group_size;
      r.prev_said = true;
      r.prev_all_mixed = r.prev_all_mixed && MixesGroupSizes(*g);
    }
    if (is_prev && !SaidShape(*g)) r.prev_unsaid = true;
    if (g->first_ask) {
      if (!r.clock_all || *g->first_ask < *r.clock_all) r.clock_all = g->first_ask;
      if (is_prev && (!r.clock_prev || *g->first_ask < *r.clock_prev)) r.clock_prev = g->first_ask;
    }
    if (!IsParticipant(*g)) continue;
    r.candidates.push_back(g);
    r.candidate_is_prev.push_back(is_prev);
    if (is_prev) ++r.prev_participants;
  }
  return r;
}

// The group-size policy's verdict on one round.
struct SizeVerdict {
  bool mixed_sizes = false;
  uint32_t group_size = 0;
  std::vector<const GroupStatus*> refused;
  // Whether the refusals stand even when the decision waits (see ApplyGroupSizePolicy).
  bool settled = false;
};

// The group-size policy, a step of its own before the rules: decides the quorum's shape, and
// takes the participants it refuses out of the round, so that they count as neither candidates
// nor healthy groups from here on.
SizeVerdict ApplyGroupSizePolicy(Round* r) {
  // A quorum mixes group sizes when every group that decides its shape can: the live previous
  // members that said theirs, else (a first quorum, or one whose members are all gone or silent)
  // every candidate.
  SizeVerdict v;
  v.mixed_sizes = r->prev_said
                      ? r->prev_all_mixed
                      : !r->candidates.empty() &&
                            std::all_of(r->candidates.begin(), r->candidates.end(),
                                        [](const GroupStatus* g) { return MixesGroupSizes(*g); });
  // In a mixed quorum a group that cannot mix is kept only while every other member has its
  // size (then the quorum is uniform and its trainers' plain exchange works); otherwise it is
  // refused. Elsewhere one trainer count per quorum: participants of another size are refused.
  std::set<uint32_t> sizes;  // mixed: the sizes of the healthy groups that can mix
  if (v.mixed_sizes) {
    for (const GroupStatus* g : r->healthy_groups) {
      if (MixesGroupSizes(*g) && g->group_size != 0) sizes.insert(g->group_size);
    }
  } else {
    v.group_size = r->prev_size != 0
                       ? r->prev_size
                       : QuorumGroupSize(r->candidates, r->candidate_is_prev, r->healthy_groups);
  }
  auto refuse = [&](const GroupStatus* g) {
    if (!v.mixed_sizes) return g->group_size != 0 && g->group_size != v.group_size;
    if (MixesGroupSizes(*g)) return false;
    if (g->group_size == 0 || (!sizes.empty() && *sizes.begin() != g->group_size) ||
        sizes.size() > 1) {
      return true;
    }
    sizes.insert(g->group_size);
    return false;
  };
  if (v.mixed_sizes || v.group_size != 0) {
    size_t kept = 0;
    for (size_t i = 0; i < r->candidates.size(); ++i) {
      const GroupStatus* g = r->candidates[i];
      if (refuse(g)) {
        v.refused.push_back(g);
        --r->healthy;
        if (r->candidate_is_prev[i]) --r->prev_healthy, --r->prev_participants;
        continue;
      }
      r->candidates[kept] = g;
      r->candidate_is_prev[kept] = r->candidate_is_prev[i];
      ++kept;
    }
    r->candidates.resize(kept);
    r->candidate_is_prev.resize(kept);
  }
  // The others are refused when a quorum of this size issues, or at once while a running
  // quorum's shape is known. Before that they wait, kept out of this decision only: the size of
  // a first quorum may still turn as more groups ask (refusing on a tie would let two sizes
  // refuse each other forever). A mixed rule is known only once every live previous member has
  // said it mixes: a silent one may still say it does not, and a one-size rule it would bring
  // could keep a group the mixed rule refuses. A one-size rule that a previous member said is
  // final whatever the silent ones say.
  v.settled = v.mixed_sizes ? r->prev_said && !r->prev_unsaid : r->prev_size != 0;
  if (v.mixed_sizes && sizes.size() == 1) v.group_size = *sizes.begin();
  return v;
}

}  // namespace

QuorumDecision ComputeQuorum(const JobMembership& m, const CoreOptions& options, TimePoint now) {
  Round r = WalkGroups(m, options, now);
  SizeVerdict sizes = ApplyGroupSizePolicy(&r);
  QuorumDecision d;
  d.mixed_sizes = sizes.mixed_sizes;
  d.group_size = sizes.group_size;
  d.refused = sizes.refused;
  auto wait = [&sizes](std::string reason, std::optional<TimePoint> wake_at = std::nullopt) {
    QuorumDecision w = Wait(std::move(reason), wake_at);
    if (sizes.settled) w.refused = sizes.refused;
    w.group_size = sizes.group_size;
    w.mixed_sizes = sizes.mixed_sizes;
    return w;
  };
  const size_t healthy = r.healthy;

  // Rule 3: with shrink_only, groups outside the previous quorum wait.
  const bool any_shrink = std::any_of(r.candidates.begin(), r.candidates.end(),
                                      [](const GroupStatus* g) { return AskShrinkOnly(*g); });
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    if (any_shrink && !r.candidate_is_prev[i]) {
      ++d.held_back;
    } else {
      d.members.push_back(r.candidates[i]);
    }
  }
  const size_t n = d.members.size();
  const size_t joiners = n - r.prev_participants;
  const std::string min_reason =
      fmt::format("wait: min_replicas={} but {}", options.min_replicas, Plural(n, "candidate"));

  // Rule 4: every previous member is back as a healthy participant.
  if (!m.previous.empty() && r.prev_participants == m.previous.size()) {
    if (n < options.min_replicas) return wait(min_reason + HeldBackSuffix(d.held_back));
    d.issue = true;
    d.fast_path = true;
    d.reason = fmt::format("fast_path: all {} previous members rejoined", m.previous.size());
    if (joiners > 0) d.reason += fmt::format(", {} came in", Plural(joiners, "joiner"));
    d.reason += HeldBackSuffix(d.held_back);
    return d;
  }

  // Rule 5.
  if (r.candidates.empty()) {
    return wait(
        fmt::format("wait: no healthy participants among {}", Plural(healthy, "healthy group")));
  }
  if (n == 0) {
    return wait(fmt::format("wait: shrink_only holds back all {}", Plural(d.held_back, "joiner")));
  }
  if (n < options.min_replicas) return wait(min_reason + HeldBackSuffix(d.held_back));
  if (n * 2 <= healthy) {
    return wait(fmt::format("wait: {} of {} healthy groups asked, a majority needs {}", n, healthy,
                            healthy / 2 + 1));
  }
  if (r.prev_healthy > 0 && r.prev_participants * 2 <= r.prev_healthy) {
    return wait(fmt::format(
        "wait: {} of {} live previous members asked, joiners wait for the quorum's next step",
        r.prev_participants, r.prev_healthy));
  }
  if (r.candidates.size() == healthy) {
    d.issue = true;
    d.reason =
        fmt::format("all {} asked", Plural(healthy, "healthy group")) + HeldBackSuffix(d.held_back);
    return d;
  }
  std::optional<TimePoint> clock = r.prev_healthy > 0 ? r.clock_prev : r.clock_all;
  LK_CHECK(clock.has_value()) << "a candidate without a first ask";
  TimePoint deadline = *clock + options.join_timeout;
  if (now >= deadline) {
    d.issue = true;
    d.reason = fmt::format("join_timeout: {} of {} healthy groups asked within {}ms",
                           r.candidates.size(), healthy, options.join_timeout.count()) +
               HeldBackSuffix(d.held_back);
    return d;
  }
  return wait(
      fmt::format("wait: {} of {} healthy groups asked, join_timeout in {}ms", r.candidates.size(),
                  healthy, std::chrono::ceil<Millis>(deadline - now).count()),
      deadline);
}

QuorumDecision ComputeCatchUp(const JobMembership& m, const CoreOptions& options, TimePoint now,
                              uint32_t finished_step) {
  QuorumDecision d;
  if (finished_step == 0) return d;
  std::optional<TimePoint> wake_at;
  for (const GroupStatus* g : m.groups) {
    if (!IsHealthy(*g, options, now) || !IsParticipant(*g) || AskStep(*g) >= finished_step) {
      continue;
    }
    LK_CHECK(g->first_ask.has_value()) << "a participant without a first ask";
    const TimePoint ready = *g->first_ask + options.join_timeout;
    if (now >= ready) {
      d.members.push_back(g);
    } else if (!wake_at || ready < *wake_at) {
      wake_at = ready;
    }
  }
  if (d.members.empty()) {
    d.wake_at = wake_at;
    return d;
  }
  d.issue = true;
  d.catch_up = true;
  d.reason = fmt::format(
      "catch_up: the job finished at step {}; {} behind it restore the newest checkpoint",
      finished_step, Plural(d.members.size(), "group"));
  return d;
}

RecoveryPlan PlanRecovery(std::vector<MemberData> members, const std::vector<bool>& diverged,
                          const std::optional<CheckpointData>& newest_checkpoint) {
  RecoveryPlan plan;
  auto live = [&](size_t i) {
    return members[i].has_state && !(i < diverged.size() && diverged[i]);
  };
  bool any_live = false;
  for (size_t i = 0; i < members.size(); ++i) {
    if (!live(i)) continue;
    plan.max_step = any_live ? std::max(plan.max_step, members[i].step) : members[i].step;
    any_live = true;
  }
  if (any_live && newest_checkpoint && newest_checkpoint->step > plan.max_step) {
    any_live = false;  // the checkpoint is ahead of every live member: restore it
  }
  if (any_live) {
    for (size_t i = 0; i < members.size(); ++i) {
      members[i].heal = !(live(i) && members[i].step == plan.max_step);
    }
  } else if (newest_checkpoint) {
    plan.restore = newest_checkpoint;
    plan.max_step = newest_checkpoint->step;
    for (MemberData& member : members) member.heal = true;
  } else {
    // No live member and no checkpoint: the one whose state goes furthest gives its weights (a
    // diverged member's state is still the only trained state there is; a fresh one has none),
    // the first on a tie, as the trainers' own state sync picks its donor (diloco/outer.cc
    // PlanStateSync). The first member alone, whatever it held, left a fresh member at step 0
    // answered without a heal beside a max_step above it, and its commits were refused for good.
    // A partial member (its nodes' shards from different steps) gives nothing while a whole one
    // is there: as a donor it handed each slot whatever that slot held, a model of two steps.
    // Its shards that are ahead are then lost with the only copy that was left of the rest.
    auto rank_of = [&](size_t i) {
      return std::make_tuple(!members[i].partial, members[i].has_state, members[i].step);
    };
    size_t source = 0;
    for (size_t i = 1; i < members.size(); ++i) {
      if (rank_of(i) > rank_of(source)) source = i;
    }
    for (size_t i = 0; i < members.size(); ++i) members[i].heal = i != source;
    // Every member takes the source's state at the source's step: a healer's own step above it
    // (a partial member's) is state that no longer exists whole.
    plan.max_step = members[source].step;
    // Trained state is no first start: the others heal from it as from any donor (and a plan
    // rebuilt after a restart, PlanFromIssued, reads it the same way).
    plan.initial = !members[source].has_state;
  }
  Share(std::move(members), &plan);
  return plan;
}

RecoveryPlan PlanFromIssued(std::vector<MemberData> members,
                            const std::optional<CheckpointData>& newest_checkpoint) {
  RecoveryPlan plan;
  bool any_live = false, any_donor = false;
  for (const MemberData& member : members) {
    if (member.heal) continue;
    any_donor = true;
    any_live = any_live || member.has_state;
    plan.max_step = std::max(plan.max_step, member.step);
  }
  if (!any_live && any_donor) {
    plan.initial = true;
  } else if (!any_donor && newest_checkpoint) {
    plan.restore = newest_checkpoint;
    plan.max_step = newest_checkpoint->step;
  }
  Share(std::move(members), &plan);
  return plan;
}

QuorumAnswer AnswerFor(const RecoveryPlan& plan, uint32_t quorum_id, uint32_t replica_rank,
                       std::string reason, bool inline_members) {
  LK_CHECK(replica_rank < plan.members.size()) << "rank " << replica_rank;
  QuorumAnswer a;
  a.quorum_id = quorum_id;
  a.members_shared = plan.shared;
  a.group_sizes_differ = plan.group_sizes_differ;
  if (inline_members) a.members = plan.members;
  a.replica_rank = replica_rank;
  a.max_step = plan.max_step;
  a.heal = plan.members[replica_rank].heal;
  a.initial = plan.initial;
  a.reason = std::move(reason);
  if (!a.heal) return a;
  if (plan.restore) a.restore_checkpoint = plan.restore;
  std::vector<uint32_t> donors;
  size_t healer_index = 0;
  for (uint32_t i = 0; i < plan.members.size(); ++i) {
    if (!plan.members[i].heal) {
      donors.push_back(i);
    } else if (i < replica_rank) {
      ++healer_index;
    }
  }
  for (size_t k = 0; k < donors.size(); ++k) {
    a.source_ranks.push_back(donors[(k + healer_index) % donors.size()]);
  }
  return a;
}

}  // namespace lk::lighthouse
