// LighthouseCore::Impl helpers: admission of incarnations, contact, losses, timeouts, deadlines.
// The decision and issue path live in lighthouse_core_issue.cc; the public methods in
// lighthouse_core.cc.
#include "lighthouse/lighthouse_core_state.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"

namespace lk::lighthouse {

using internal::DeadlineKind;

Status CoreOptions::Validate() const {
  if (min_replicas == 0) return InvalidArgument("min_replicas must be at least 1");
  if (join_timeout.count() < 0) return InvalidArgument("join_timeout must not be negative");
  if (heartbeat_timeout.count() <= 0) return InvalidArgument("heartbeat_timeout must be positive");
  if (progress_timeout.count() < 0) return InvalidArgument("progress_timeout must not be negative");
  if (checkpoints_per_job_max == 0) return InvalidArgument("checkpoints_per_job_max must be >= 1");
  if (groups_per_job_max == 0 || nodes_max == 0 || text_bytes_max == 0 || jobs_max == 0) {
    return InvalidArgument(
        "jobs_max, groups_per_job_max, nodes_max and text_bytes_max must be >= 1");
  }
  if (group_grace.count() < 0) return InvalidArgument("group_grace must not be negative");
  return Status::Ok();
}

namespace {

Status CheckText(const char* what, const std::string& value, uint32_t max, bool required) {
  if (required && value.empty()) return InvalidArgument("missing {}", what);
  if (value.size() > max) return InvalidArgument("{} longer than {} bytes", what, max);
  return Status::Ok();
}

}  // namespace

Status LighthouseCore::Impl::CheckIds(const std::string& job, const std::string& group_id,
                                      const std::string& incarnation) const {
  LK_RETURN_IF_ERROR(CheckText("job", job, options.text_bytes_max, true));
  LK_RETURN_IF_ERROR(CheckText("group_id", group_id, options.text_bytes_max, true));
  return CheckText("incarnation", incarnation, options.text_bytes_max, true);
}

Status LighthouseCore::Impl::CheckAgent(const std::string& job, const std::string& group_id,
                                        const std::string& incarnation, uint32_t node_rank,
                                        uint32_t nodes, const std::string& address,
                                        const std::string& phase) const {
  LK_RETURN_IF_ERROR(CheckIds(job, group_id, incarnation));
  LK_RETURN_IF_ERROR(CheckText("address", address, options.text_bytes_max, false));
  LK_RETURN_IF_ERROR(CheckText("phase", phase, options.text_bytes_max, false));
  if (nodes == 0 || nodes > options.nodes_max) {
    return InvalidArgument("nodes={} out of range 1..{}", nodes, options.nodes_max);
  }
  if (node_rank >= nodes) return InvalidArgument("node_rank={} >= nodes={}", node_rank, nodes);
  return Status::Ok();
}

bool LighthouseCore::Impl::IsDeadLife(const Job& job, const Group* g,
                                      const std::string& incarnation, uint32_t generation) const {
  // A generation this job handed out before belongs to a life the lighthouse knows: if that
  // life is not the current one, it is over, however long ago it was retired.
  if (generation > 0 && generation <= job.generation_last &&
      (g == nullptr || g->status.incarnation != incarnation)) {
    return true;
  }
  if (g == nullptr) return false;
  return std::any_of(g->retired.begin(), g->retired.end(), [&](const GroupRecordData::Retired& r) {
    return r.incarnation == incarnation;
  });
}

Status LighthouseCore::Impl::CheckIncarnation(const std::string& job, const std::string& group_id,
                                              const std::string& incarnation, uint32_t nodes,
                                              uint32_t generation) const {
  auto j = jobs.find(job);
  if (j == jobs.end()) {
    if (jobs.size() >= options.jobs_max) {
      return Refuse(Code::kResourceExhausted, Reason::kJobsMax,
                    "the lighthouse already holds {} jobs (--jobs-max)", jobs.size());
    }
    return Status::Ok();
  }
  auto it = j->second.groups.find(group_id);
  const Group* g = it == j->second.groups.end() ? nullptr : &it->second;
  if (IsDeadLife(j->second, g, incarnation, generation)) {
    return Refuse(Code::kConflict, Reason::kStaleIncarnation,
                  "stale incarnation {} of group {} (current {})", incarnation, group_id,
                  g == nullptr ? "none" : g->status.incarnation);
  }
  if (g == nullptr) {
    if (j->second.groups.size() >= options.groups_per_job_max) {
      return Refuse(Code::kResourceExhausted, Reason::kGroupsMax, "job {} already tracks {} groups",
                    job, j->second.groups.size());
    }
    return Status::Ok();
  }
  if (g->status.incarnation == incarnation) {
    if (g->status.mode == GroupMode::kLeft) {
      return Refuse(Code::kConflict, LeftReason(*g), "incarnation {} of group {} left ({})",
                    incarnation, group_id, g->reason);
    }
    if (g->status.agents.size() != nodes) {
      return Refuse(Code::kInvalidArgument, Reason::kNodesChanged,
                    "nodes changed within incarnation {} of group {}: {} -> {}", incarnation,
                    group_id, g->status.agents.size(), nodes);
    }
  }
  return Status::Ok();  // the current incarnation, or a new one that replaces it
}

Result<LighthouseCore::Impl::Group*> LighthouseCore::Impl::FindCurrent(
    const std::string& job, const std::string& group_id, const std::string& incarnation,
    uint32_t generation) {
  auto j = jobs.find(job);
  if (j == jobs.end()) return Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", job);
  auto it = j->second.groups.find(group_id);
  if (it == j->second.groups.end()) {
    if (IsDeadLife(j->second, nullptr, incarnation, generation)) {
      return Refuse(Code::kConflict, Reason::kStaleIncarnation,
                    "stale incarnation {} (generation {}) of group {}", incarnation, generation,
                    group_id);
    }
    return Refuse(Code::kNotFound, Reason::kUnknownGroup, "unknown group {} in job {}", group_id,
                  job);
  }
  Group& g = it->second;
  if (g.status.incarnation != incarnation) {
    if (IsDeadLife(j->second, &g, incarnation, generation)) {
      return Refuse(Code::kConflict, Reason::kStaleIncarnation,
                    "stale incarnation {} of group {} (current {})", incarnation, group_id,
                    g.status.incarnation);
    }
    return Refuse(Code::kConflict, Reason::kUnknownIncarnation,
                  "unknown incarnation {} of group {} (current {}): it never heartbeated",
                  incarnation, group_id, g.status.incarnation);
  }
  return &g;
}

void LighthouseCore::Impl::AddGroupOrder(Job& job, const Group& g) {
  auto pos = std::lower_bound(
      job.order.begin(), job.order.end(), g.status.group_id,
      [](const GroupStatus* s, const std::string& id) { return s->group_id < id; });
  job.order.insert(pos, &g.status);
}

LighthouseCore::Impl::Group& LighthouseCore::Impl::Admit(const std::string& job_name,
                                                         const std::string& group_id,
                                                         const std::string& incarnation,
                                                         uint32_t nodes, TimePoint now,
                                                         Effects* fx) {
  auto [j, job_new] = jobs.try_emplace(job_name);
  Job& job = j->second;
  if (job_new) job.name = job_name;
  auto [it, group_new] = job.groups.try_emplace(group_id);
  Group& g = it->second;
  if (group_new) {
    g.job = &job;
    g.status.group_id = group_id;
    g.status.incarnation = incarnation;
    g.status.agents.resize(nodes);
    AddGroupOrder(job, g);
    ++group_count;
    NewGeneration(g, fx);
    fx->events.push_back(
        fmt::format("group_new job={} group={} incarnation={} nodes={} "
                    "generation={}",
                    Q(job_name), Q(group_id), Q(incarnation), nodes, g.generation));
  } else if (g.status.incarnation != incarnation) {
    ReplaceIncarnation(g, incarnation, nodes, now, fx);
  }
  // A life that never comes alive (a node of it never heartbeats) is collected in time too.
  RearmCollect(g, now);
  return g;
}

void LighthouseCore::Impl::NewGeneration(Group& g, Effects* fx) {
  Job& job = *g.job;
  LK_CHECK(job.generation_last < UINT32_MAX) << "generation overflow in job " << job.name;
  g.generation = ++job.generation_last;
  // Synced before the agent hears its generation (the shell syncs group records): a restart
  // never hands the same generation to another life.
  fx->persist_groups.push_back(GroupRecord(g));
  fx->persist_jobs.push_back(Record(job));
}

GroupRecordData LighthouseCore::Impl::GroupRecord(const Group& g) const {
  GroupRecordData r;
  r.job = g.job->name;
  r.group_id = g.status.group_id;
  r.incarnation = g.status.incarnation;
  r.generation = g.generation;
  r.nodes = static_cast<uint32_t>(g.status.agents.size());
  r.left = g.status.mode == GroupMode::kLeft;
  if (r.left) r.reason = g.reason;
  r.retired = g.retired;
  return r;
}

void LighthouseCore::Impl::RearmCollect(Group& g, TimePoint now) {
  std::optional<TimePoint> at;
  if (options.group_grace.count() > 0 && (g.status.mode == GroupMode::kLeft || !g.alive)) {
    at = g.collect_deadline ? *g.collect_deadline : now + options.group_grace;
  }
  SetDeadline(g.collect_deadline, at, DeadlineKind::kCollect, &g);
}

void LighthouseCore::Impl::Collect(Group& g, TimePoint now, Effects* fx) {
  if (g.status.mode != GroupMode::kLeft && IsAlive(g.status, options.heartbeat_timeout, now)) {
    return;  // it came back: Touch cleared the deadline, so this cannot happen
  }
  Job& job = *g.job;
  const std::string id = g.status.group_id;
  fx->events.push_back(
      fmt::format("group_collected job={} group={} incarnation={} "
                  "generation={} reason={}",
                  Q(job.name), Q(id), Q(g.status.incarnation), g.generation,
                  Q(g.reason.empty() ? "unheard" : g.reason)));
  LoseMember(g, "collected", now, fx);
  // A node of a group that never came back alive may still wait in a round: it is answered.
  ClearAsks(g,
            Refuse(Code::kUnavailable, Reason::kGroupUnhealthy, "group {} collected: {}", id,
                   g.reason.empty() ? "unheard" : g.reason),
            now, fx);
  DropDeadlines(g);
  SetDeadline(g.collect_deadline, std::nullopt, DeadlineKind::kCollect, &g);
  std::erase(job.order, &g.status);
  fx->drop_groups.push_back({job.name, id});
  if (job.tokens.erase(id) > 0) fx->persist_jobs.push_back(Record(job));
  job.groups.erase(id);
  --group_count;
}

void LighthouseCore::Impl::ReplaceIncarnation(Group& g, const std::string& incarnation,
                                              uint32_t nodes, TimePoint now, Effects* fx) {
  const std::string old = g.status.incarnation;
  fx->events.push_back(fmt::format("incarnation_replaced job={} group={} old={} new={}",
                                   Q(g.job->name), Q(g.status.group_id), Q(old), Q(incarnation)));
  LoseMember(g, "incarnation_replaced", now, fx);
  ClearAsks(
      g,
      Refuse(Code::kConflict, Reason::kIncarnationReplaced,
             "incarnation {} of group {} replaced by {}", old, g.status.group_id, incarnation),
      now, fx);
  DropDeadlines(g);
  SetDeadline(g.collect_deadline, std::nullopt, DeadlineKind::kCollect, &g);
  g.retired.push_back({old, g.generation});
  while (g.retired.size() > std::max<uint32_t>(1, options.retired_incarnations_max)) {
    g.retired.erase(g.retired.begin());
  }
  GroupStatus fresh;
  fresh.group_id = g.status.group_id;
  fresh.incarnation = incarnation;
  fresh.agents.resize(nodes);
  g.status = std::move(fresh);
  g.reason.clear();
  g.alive = g.in_quorum = g.lost = g.committed = false;
  g.hash_step = 0;
  g.state_hash.clear();
  g.divergences = g.diverged_step = 0;  // the new life's state is not the old one's
  NewGeneration(g, fx);
}

void LighthouseCore::Impl::Touch(Group& g, uint32_t node_rank, uint32_t step,
                                 const std::string& address, const std::string& phase,
                                 TimePoint now, Effects* fx) {
  AgentStatus& a = g.status.agents[node_rank];
  a.last_seen = now;
  a.seen = true;
  a.step = step;
  if (!address.empty() && a.address != address) a.address = address;
  bool waits_changed = false;
  if (!phase.empty() && a.phase != phase) {
    // Leaving a wait on peers restarts the progress clock, like leaving a quorum round: time
    // spent blocked in a collective on someone else is no stall of this group's own.
    if (a.phase == kPhasePeerWait) g.progress_mark = now;
    a.phase = phase;
    waits_changed = true;
  }
  // A member that moved past others may have ended their excuse (rule 8).
  if (AdvanceStep(g, step, now)) waits_changed = true;
  if (waits_changed) RefreshWaits(*g.job, now);
  RearmHeartbeat(g, now);
  if (g.alive || !IsAlive(g.status, options.heartbeat_timeout, now)) return;
  g.alive = true;
  RearmCollect(g, now);
  if (g.reason.rfind("heartbeat_timeout", 0) == 0) g.lapsed_from = g.reason;
  if (g.status.mode != GroupMode::kLeft) g.reason.clear();
  fx->events.push_back(fmt::format("group_healthy job={} group={} incarnation={}", Q(g.job->name),
                                   Q(g.status.group_id), Q(g.status.incarnation)));
}

bool LighthouseCore::Impl::AdvanceStep(Group& g, uint32_t step, TimePoint now) {
  if (step <= g.status.step) return false;
  g.status.step = step;
  g.progress_mark = now;
  RearmProgress(g);
  return true;
}

void LighthouseCore::Impl::LoseMember(Group& g, const std::string& reason, TimePoint now,
                                      Effects* fx) {
  if (!g.in_quorum || g.lost) return;
  Job& job = *g.job;
  g.lost = true;
  job.lost = true;
  job.force_new = true;
  job.notices.push_back({job.quorum_id, g.status.group_id, g.status.incarnation, reason});
  fx->watch_wakeups.insert(job.name);
  // The agents act on the loss at once (their trainers abort the step): a restart must not
  // forget it and hand the same id out again as if nothing had happened.
  fx->persist_jobs.push_back(Record(job));
  fx->events.push_back(fmt::format(
      "member_lost job={} quorum_id={} group={} incarnation={} "
      "reason={}",
      Q(job.name), job.quorum_id, Q(g.status.group_id), Q(g.status.incarnation), Q(reason)));
  RearmProgress(g);
  RefreshWaits(job, now);
}

Reason LighthouseCore::Impl::LeftReason(const Group& g) {
  return g.reason == kLeaveFinished ? Reason::kGroupFinished : Reason::kGroupLeft;
}

void LighthouseCore::Impl::LoseQuorum(Job& job, Effects* fx) {
  job.force_new = true;
  if (job.lost) return;
  job.lost = true;
  fx->watch_wakeups.insert(job.name);
}

void LighthouseCore::Impl::ClearAsks(Group& g, const Status& why, TimePoint now, Effects* fx) {
  if (IsParticipant(g.status)) g.progress_mark = now;
  for (uint32_t rank = 0; rank < g.status.agents.size(); ++rank) {
    AgentStatus& a = g.status.agents[rank];
    if (a.waiting) {
      fx->rejections.push_back(
          {AgentKey{g.job->name, g.status.group_id, g.status.incarnation, rank}, why});
    }
    a.asked = a.waiting = false;
  }
  g.status.asked = 0;
  g.status.first_ask.reset();
  RearmProgress(g);
}

void LighthouseCore::Impl::ApplyTimeouts(TimePoint now, Effects* fx) {
  if (deadlines.empty() || std::get<0>(*deadlines.begin()) > now) return;
  struct Due {
    std::string job, group;
    DeadlineKind kind;
    void* who;
    auto Key() const { return std::tie(job, group, kind); }
  };
  std::vector<Due> due;
  while (!deadlines.empty() && std::get<0>(*deadlines.begin()) <= now) {
    auto [at, kind, who] = *deadlines.begin();
    deadlines.erase(deadlines.begin());
    if (kind == DeadlineKind::kJoin) {
      Job* job = static_cast<Job*>(who);
      job->join_deadline.reset();
      due.push_back({job->name, "", kind, who});
    } else {
      Group* g = static_cast<Group*>(who);
      (kind == DeadlineKind::kHeartbeat  ? g->heartbeat_deadline
       : kind == DeadlineKind::kProgress ? g->progress_deadline
                                         : g->collect_deadline)
          .reset();
      due.push_back({g->job->name, g->status.group_id, kind, who});
    }
  }
  // Deterministic order whatever the pointers: by job, group, kind.
  std::sort(due.begin(), due.end(), [](const Due& a, const Due& b) { return a.Key() < b.Key(); });
  std::map<std::string, Job*> touched;
  for (const Due& d : due) {
    if (d.kind == DeadlineKind::kJoin) {
      touched[d.job] = static_cast<Job*>(d.who);
      continue;
    }
    Group* g = static_cast<Group*>(d.who);
    touched[d.job] = g->job;
    if (d.kind == DeadlineKind::kHeartbeat) {
      Expire(*g, now, fx);
    } else if (d.kind == DeadlineKind::kProgress) {
      Evict(*g, now, fx);
    } else {
      Collect(*g, now, fx);
    }
  }
  for (auto& [name, job] : touched) Evaluate(*job, now, fx);
}

void LighthouseCore::Impl::Expire(Group& g, TimePoint now, Effects* fx) {
  if (IsAlive(g.status, options.heartbeat_timeout, now)) {  // cannot happen: deadlines are exact
    RearmHeartbeat(g, now);
    return;
  }
  uint32_t node = 0;
  for (uint32_t r = 1; r < g.status.agents.size(); ++r) {
    if (g.status.agents[r].last_seen < g.status.agents[node].last_seen) node = r;
  }
  g.alive = false;
  g.reason = fmt::format("heartbeat_timeout node={} age={}ms", node,
                         ToMillis(now - g.status.agents[node].last_seen));
  fx->events.push_back(fmt::format("group_unhealthy job={} group={} incarnation={} reason={}",
                                   Q(g.job->name), Q(g.status.group_id), Q(g.status.incarnation),
                                   Q(g.reason)));
  LoseMember(g, "heartbeat_timeout", now, fx);
  ClearAsks(g,
            Refuse(Code::kUnavailable, Reason::kGroupUnhealthy, "group {} unhealthy: {}",
                   g.status.group_id, g.reason),
            now, fx);
  RearmCollect(g, now);
}

void LighthouseCore::Impl::Evict(Group& g, TimePoint now, Effects* fx) {
  RearmProgress(g);  // recomputes from the state; still due means still stalled
  if (!g.progress_deadline || *g.progress_deadline > now) return;
  SetDeadline(g.progress_deadline, std::nullopt, DeadlineKind::kProgress, &g);
  g.status.mode = GroupMode::kEvicted;
  g.reason = "progress_stalled";
  fx->events.push_back(fmt::format(
      "group_evicted job={} group={} incarnation={} step={} stalled_ms={} reason=progress_stalled",
      Q(g.job->name), Q(g.status.group_id), Q(g.status.incarnation), g.status.step,
      ToMillis(now - g.progress_mark)));
  LoseMember(g, "progress_stalled", now, fx);
  ClearAsks(g,
            Refuse(Code::kAborted, Reason::kGroupEvicted, "group {} evicted: progress_stalled",
                   g.status.group_id),
            now, fx);
}

void LighthouseCore::Impl::EvictStateLost(Group& g, TimePoint now, Effects* fx) {
  g.status.mode = GroupMode::kEvicted;
  g.reason = "state_lost";
  fx->events.push_back(fmt::format(
      "group_evicted job={} group={} incarnation={} step={} reason=state_lost", Q(g.job->name),
      Q(g.status.group_id), Q(g.status.incarnation), g.status.step));
  LoseMember(g, "state_lost", now, fx);
  ClearAsks(g,
            Refuse(Code::kAborted, Reason::kGroupEvicted,
                   "group {} evicted: state_lost: its nodes hold shards of different steps, and "
                   "no other member and no checkpoint holds the rest; a new life starts afresh",
                   g.status.group_id),
            now, fx);
}

void LighthouseCore::Impl::SetDeadline(std::optional<TimePoint>& slot, std::optional<TimePoint> at,
                                       DeadlineKind kind, void* who) {
  if (slot == at) return;
  if (slot) deadlines.erase({*slot, kind, who});
  slot = at;
  if (at) deadlines.insert({*at, kind, who});
}

void LighthouseCore::Impl::RearmHeartbeat(Group& g, TimePoint now) {
  std::optional<TimePoint> at;
  if (g.status.mode != GroupMode::kLeft) at = AliveUntil(g.status, options.heartbeat_timeout);
  if (at && *at <= now) at.reset();  // another agent is silent: the group expired already
  SetDeadline(g.heartbeat_deadline, at, DeadlineKind::kHeartbeat, &g);
}

bool internal::WaitingOnPeers(const GroupStatus& g) {
  if (g.agents.empty()) return false;
  for (const auto& a : g.agents) {
    if (a.phase != kPhasePeerWait) return false;
  }
  return true;
}

void LighthouseCore::Impl::RearmProgress(Group& g) {
  std::optional<TimePoint> at;
  if (options.progress_timeout.count() > 0 && g.in_quorum && !g.lost &&
      g.status.mode == GroupMode::kActive && !IsParticipant(g.status) && !g.wait_excused) {
    at = g.progress_mark + options.progress_timeout;
  }
  SetDeadline(g.progress_deadline, at, DeadlineKind::kProgress, &g);
}

void LighthouseCore::Impl::RefreshWaits(Job& job, TimePoint now) {
  if (options.progress_timeout.count() == 0) return;  // rule 8 is off: nothing reads excuses
  // A member has another at its step or behind unless it alone holds the lowest step of the
  // quorum: only the lowest step matters, and how many members hold it.
  uint32_t lowest = UINT32_MAX;
  size_t at_lowest = 0;
  for (const auto& [id, g] : job.groups) {
    if (!g.in_quorum || g.lost) continue;
    if (g.status.step < lowest) {
      lowest = g.status.step;
      at_lowest = 0;
    }
    if (g.status.step == lowest) ++at_lowest;
  }
  for (auto& [id, g] : job.groups) {
    const bool member = g.in_quorum && !g.lost;
    const bool excused =
        member && (g.status.step > lowest || at_lowest >= 2) && internal::WaitingOnPeers(g.status);
    if (g.wait_excused == excused) continue;
    if (member && g.wait_excused) g.progress_mark = now;
    g.wait_excused = excused;
    RearmProgress(g);
  }
}

void LighthouseCore::Impl::DropDeadlines(Group& g) {
  SetDeadline(g.heartbeat_deadline, std::nullopt, DeadlineKind::kHeartbeat, &g);
  SetDeadline(g.progress_deadline, std::nullopt, DeadlineKind::kProgress, &g);
}

}  // namespace lk::lighthouse
