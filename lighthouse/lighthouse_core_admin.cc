// LighthouseCore: admin inputs (drain, forget), the checkpoint registry, Load and View.
#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_state.h"

namespace lk::lighthouse {

namespace {

// Newest first: higher step, then later creation, then location (a total order).
bool Newer(const CheckpointData& a, const CheckpointData& b) {
  return std::tie(a.step, a.created_unix_s, a.location) >
         std::tie(b.step, b.created_unix_s, b.location);
}

// Inserts `c` (replacing an entry of the same step and location) and returns what falls out.
std::vector<CheckpointData> InsertCheckpoint(std::vector<CheckpointData>& list,
                                             const CheckpointData& c, uint32_t max) {
  std::erase_if(
      list, [&](const CheckpointData& x) { return x.step == c.step && x.location == c.location; });
  list.insert(std::lower_bound(list.begin(), list.end(), c, Newer), c);
  std::vector<CheckpointData> dropped;
  while (list.size() > max) {
    dropped.push_back(std::move(list.back()));
    list.pop_back();
  }
  return dropped;
}

// The forms the restore path reads (examples/diloco/state_io.cc, checkpoint/store.h): a local
// or shared-filesystem path, absolute because the groups that restore run elsewhere, naming a
// checkpoint root or one step-* directory. Relative parts could point it anywhere.
Status CheckLocation(const std::string& location) {
  auto invalid = [&](std::string_view why) {
    return Refuse(Code::kInvalidArgument, Reason::kCheckpointLocationInvalid,
                  "checkpoint location {} {}", Q(location.substr(0, 200)), why);
  };
  if (location.empty() || location[0] != '/') return invalid("is not an absolute path");
  for (unsigned char c : location) {
    if (c < 0x20 || c == 0x7f) return invalid("has a control character");
  }
  size_t start = 1;
  while (start <= location.size()) {
    size_t end = location.find('/', start);
    if (end == std::string::npos) end = location.size();
    std::string_view part(location.data() + start, end - start);
    if (part == "." || part == "..") return invalid("has a '.' or '..' part");
    start = end + 1;
  }
  return Status::Ok();
}

}  // namespace

Status LighthouseCore::Drain(const std::string& job, const std::string& group_id, TimePoint now,
                             Effects* fx) {
  Impl& s = *impl_;
  auto j = s.jobs.find(job);
  if (j == s.jobs.end()) return Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", job);
  auto it = j->second.groups.find(group_id);
  if (it == j->second.groups.end()) {
    return Refuse(Code::kNotFound, Reason::kUnknownGroup, "unknown group {} in job {}", group_id,
                  job);
  }
  Impl::Group& g = it->second;
  if (g.status.mode == GroupMode::kLeft) {
    return Refuse(Code::kConflict, Reason::kGroupLeft, "group {} already left ({})", group_id,
                  g.reason);
  }
  if (g.status.mode == GroupMode::kDraining) return Status::Ok();
  s.ApplyTimeouts(now, fx);
  g.status.mode = GroupMode::kDraining;
  g.reason = "drained by admin";
  fx->events.push_back(fmt::format("group_drain job={} group={} incarnation={} in_quorum={}",
                                   Q(job), Q(group_id), Q(g.status.incarnation), g.in_quorum));
  s.ClearAsks(g, Refuse(Code::kConflict, Reason::kGroupDraining, "group {} is draining", group_id),
              now, fx);
  s.Evaluate(j->second, now, fx);
  return Status::Ok();
}

Status LighthouseCore::Forget(const std::string& job, Effects* fx) {
  Impl& s = *impl_;
  auto j = s.jobs.find(job);
  if (j == s.jobs.end()) return Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", job);
  Impl::Job& state = j->second;
  for (auto& [id, g] : state.groups) {
    s.ClearAsks(g, Refuse(Code::kUnavailable, Reason::kJobForgotten, "job {} forgotten", job),
                TimePoint{}, fx);
    s.DropDeadlines(g);
    s.SetDeadline(g.collect_deadline, std::nullopt, internal::DeadlineKind::kCollect, &g);
  }
  s.SetDeadline(state.join_deadline, std::nullopt, internal::DeadlineKind::kJoin, &state);
  s.group_count -= state.groups.size();
  fx->events.push_back(fmt::format("job_forgotten job={} quorum_id={} groups={}", Q(job),
                                   state.quorum_id, state.groups.size()));
  s.jobs.erase(j);
  fx->forget_jobs.push_back(job);
  fx->watch_wakeups.insert(job);
  return Status::Ok();
}

Status LighthouseCore::OnRegisterCheckpoint(const CheckpointData& ckpt, Effects* fx) {
  Impl& s = *impl_;
  const uint32_t max = s.options.text_bytes_max;
  if (ckpt.job.empty() || ckpt.location.empty()) {
    return InvalidArgument("a checkpoint needs a job and a location");
  }
  if (ckpt.job.size() > max || ckpt.group_id.size() > max || ckpt.manifest_digest.size() > max ||
      ckpt.location.size() > 4 * max) {
    return InvalidArgument("checkpoint field too long");
  }
  LK_RETURN_IF_ERROR(CheckLocation(ckpt.location));
  // A registration never creates a job: the registry is the restore target of a job's groups,
  // and a job exists once one of them heartbeated.
  auto j = s.jobs.find(ckpt.job);
  if (j == s.jobs.end()) {
    return Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", ckpt.job);
  }
  if (!ckpt.group_id.empty() && !j->second.groups.count(ckpt.group_id)) {
    return Refuse(Code::kNotFound, Reason::kUnknownGroup, "unknown group {} in job {}",
                  ckpt.group_id, ckpt.job);
  }
  // The newest checkpoint is what a job without live state restores: one at a step nobody
  // committed would make every group train from a state that never existed.
  if (ckpt.step > j->second.committed_step) {
    return Refuse(Code::kConflict, Reason::kCheckpointNotCommitted,
                  "checkpoint at step {} but job {} has committed step {} only", ckpt.step,
                  ckpt.job, j->second.committed_step);
  }
  std::vector<CheckpointData> dropped =
      InsertCheckpoint(j->second.checkpoints, ckpt, s.options.checkpoints_per_job_max);
  fx->persist_checkpoints.push_back(ckpt);
  for (CheckpointData& d : dropped) fx->drop_checkpoints.push_back(std::move(d));
  fx->events.push_back(fmt::format("checkpoint_registered job={} step={} location={} group={}",
                                   Q(ckpt.job), ckpt.step, Q(ckpt.location), Q(ckpt.group_id)));
  return Status::Ok();
}

std::vector<CheckpointData> LighthouseCore::Checkpoints(const std::string& job) const {
  auto j = impl_->jobs.find(job);
  if (j == impl_->jobs.end()) return {};
  return j->second.checkpoints;
}

Status LighthouseCore::Load(std::vector<JobRecordData> jobs,
                            std::vector<CheckpointData> checkpoints, TimePoint now,
                            std::vector<GroupRecordData> groups) {
  if (!impl_->jobs.empty()) return InvalidArgument("Load needs a core without state");
  auto next = std::make_shared<Impl>(impl_->options);
  Impl& s = *next;
  for (CheckpointData& c : checkpoints) {
    if (c.job.empty()) return Error(Code::kDataLoss, "a checkpoint without a job");
    auto [j, created] = s.jobs.try_emplace(c.job);
    if (created) j->second.name = c.job;
    (void)InsertCheckpoint(j->second.checkpoints, c, s.options.checkpoints_per_job_max);
  }
  std::set<std::string> seen;
  for (JobRecordData& rec : jobs) {
    if (rec.job.empty() || !seen.insert(rec.job).second) {
      return Error(Code::kDataLoss, "job record with an empty or repeated name {}", Q(rec.job));
    }
    if (!rec.members.empty() && rec.quorum_id == 0) {
      return Error(Code::kDataLoss, "job {}: members without a quorum_id", rec.job);
    }
    for (size_t i = 0; i < rec.members.size(); ++i) {
      const MemberData& m = rec.members[i];
      if (m.group_id.empty() || m.incarnation.empty() ||
          (i > 0 && rec.members[i - 1].group_id >= m.group_id)) {
        return Error(Code::kDataLoss, "job {}: members not sorted by group_id or unnamed", rec.job);
      }
      if (m.addresses.size() > s.options.nodes_max) {
        return Error(Code::kDataLoss, "job {}: group {} with {} nodes", rec.job, m.group_id,
                     m.addresses.size());
      }
    }
    auto [j, created] = s.jobs.try_emplace(rec.job);
    Impl::Job& job = j->second;
    job.name = rec.job;
    job.quorum_id = rec.quorum_id;
    job.id_floor = std::max(rec.quorum_id, rec.quorum_id_reserved);
    job.committed_step = rec.committed_step;
    job.quorum_changes = rec.quorum_changes;
    job.generation_last = rec.generation_last;
    job.finished_step = rec.finished_step;
    job.catch_up = rec.catch_up;
    job.lost = rec.lost;
    job.force_new = rec.force_new || rec.lost;
    for (const GroupTokensData& t : rec.tokens) {
      if (t.group_id.empty() || !job.tokens.emplace(t.group_id, t).second) {
        return Error(Code::kDataLoss, "job {}: tokens of an unnamed or repeated group", rec.job);
      }
    }
    for (const GroupLivesData& l : rec.lives) {
      if (l.group_id.empty() || !job.lives.emplace(l.group_id, l).second) {
        return Error(Code::kDataLoss, "job {}: lives of an unnamed or repeated group", rec.job);
      }
    }
  }
  LK_RETURN_IF_ERROR(s.LoadGroups(std::move(groups), now));
  for (JobRecordData& rec : jobs) {
    Impl::Job& job = s.jobs.at(rec.job);
    for (const MemberData& m : rec.members) {
      if (auto known = job.groups.find(m.group_id); known != job.groups.end()) {
        // A group record is newer than the quorum record: a member replaced or gone since is
        // no member any more (the next issue leaves it out).
        Impl::Group& g = known->second;
        if (g.status.incarnation != m.incarnation || g.status.mode == GroupMode::kLeft) continue;
        s.LoadMember(g, m, now);
        continue;
      }
      Impl::Group& g = job.groups[m.group_id];
      g.job = &job;
      g.status.group_id = m.group_id;
      g.status.incarnation = m.incarnation;
      g.status.agents.resize(std::max<size_t>(1, m.addresses.size()));
      s.AddGroupOrder(job, g);
      ++s.group_count;
      s.LoadMember(g, m, now);
    }
    job.plan = PlanFromIssued(std::move(rec.members), s.NewestCheckpoint(job));
    job.quorum_start_step = job.plan.max_step;
    job.last_decision = "loaded";
  }
  impl_ = std::move(next);
  return Status::Ok();
}

Status LighthouseCore::Impl::LoadGroups(std::vector<GroupRecordData> records, TimePoint now) {
  for (GroupRecordData& r : records) {
    if (r.job.empty() || r.group_id.empty() || r.incarnation.empty() || r.nodes == 0 ||
        r.nodes > options.nodes_max) {
      return Error(Code::kDataLoss, "group record {}/{} is unnamed or has {} nodes", Q(r.job),
                   Q(r.group_id), r.nodes);
    }
    auto [j, created] = jobs.try_emplace(r.job);
    Job& job = j->second;
    if (created) job.name = r.job;
    auto [it, fresh] = job.groups.try_emplace(r.group_id);
    if (!fresh) return Error(Code::kDataLoss, "group record {}/{} repeated", r.job, r.group_id);
    Group& g = it->second;
    g.job = &job;
    g.status.group_id = r.group_id;
    g.status.incarnation = r.incarnation;
    g.status.agents.resize(r.nodes);
    g.generation = r.generation;
    g.retired = std::move(r.retired);
    while (g.retired.size() > std::max<uint32_t>(1, options.retired_incarnations_max)) {
      g.retired.erase(g.retired.begin());
    }
    // A generation above the job's counter can only come from a torn write; never hand it out
    // again.
    job.generation_last = std::max(job.generation_last, g.generation);
    for (const auto& old : g.retired) {
      job.generation_last = std::max(job.generation_last, old.generation);
    }
    if (r.left) {
      g.status.mode = GroupMode::kLeft;
      g.reason = r.reason.empty() ? "left" : r.reason;
    }
    AddGroupOrder(job, g);
    ++group_count;
    // Unheard until its agents heartbeat; collected after the grace period if they never do.
    RearmCollect(g, now);
  }
  return Status::Ok();
}

void LighthouseCore::Impl::LoadMember(Group& g, const MemberData& m, TimePoint now) {
  for (size_t r = 0; r < g.status.agents.size(); ++r) {
    AgentStatus& a = g.status.agents[r];
    a.seen = true;
    a.last_seen = now;  // loaded members count as heard now (fast path after a restart)
    a.step = m.step;
    if (r < m.addresses.size()) a.address = m.addresses[r];
  }
  g.status.step = m.step;
  // A loaded member keeps its size and whether it mixes until it asks again: without them the
  // first group to ask after a restart would set a one-size rule for a quorum of several.
  if (m.group_size != 0) g.status.group_size = m.group_size;
  for (AgentStatus& a : g.status.agents) {
    a.ask_mixed_group_sizes = m.mixed_group_sizes;
    a.said_shape = true;
  }
  g.alive = true;
  g.in_quorum = true;
  g.progress_mark = now;
  RearmHeartbeat(g, TimePoint::min());
  RearmProgress(g);
  RearmCollect(g, now);
}

std::vector<JobView> LighthouseCore::View(TimePoint now) const {
  const Impl& s = *impl_;
  std::vector<JobView> out;
  out.reserve(s.jobs.size());
  for (const auto& [name, job] : s.jobs) {
    JobView v;
    v.job = name;
    v.quorum_id = job.quorum_id;
    v.members = job.plan.members;
    v.committed_step = job.committed_step;
    v.quorum_changes = job.quorum_changes;
    v.finished_step = job.finished_step;
    v.checkpoints = job.checkpoints;
    v.last_decision = job.last_decision;
    for (const auto& [id, g] : job.groups) {
      GroupView gv;
      gv.group_id = id;
      gv.incarnation = g.status.incarnation;
      gv.nodes = static_cast<uint32_t>(g.status.agents.size());
      gv.step = g.status.step;
      gv.generation = g.generation;
      gv.healthy = IsHealthy(g.status, s.options, now);
      gv.participant = IsParticipant(g.status);
      gv.in_quorum = g.in_quorum && !g.lost;
      gv.draining = g.status.mode == GroupMode::kDraining;
      gv.diverged = g.status.diverged;
      gv.divergences = g.divergences;
      gv.diverged_step = g.diverged_step;
      gv.reason = g.reason;
      gv.group_size = g.status.group_size;
      gv.mixed_group_sizes = MixesGroupSizes(g.status);
      gv.gateway = g.gateway;
      if (auto t = job.tokens.find(id); t != job.tokens.end()) {
        gv.tokens = t->second.tokens;
        gv.tokens_step = t->second.step;
        gv.tokens_total = t->second.total;
        // The share of that step: its tokens over those of every group that committed it.
        double all = 0;
        for (const auto& [other, o] : job.tokens) {
          if (o.step == t->second.step) all += static_cast<double>(o.tokens);
        }
        gv.share = all > 0 ? static_cast<double>(gv.tokens) / all : 0;
      }
      if (auto l = job.lives.find(id); l != job.lives.end()) {
        gv.crashes = l->second.crashes;
        gv.requeue_refusals = l->second.requeue_refusals;
        gv.last_event = l->second.last_event;
      }
      TimePoint oldest = now;
      for (const AgentStatus& a : g.status.agents) {
        if (a.seen) oldest = std::min(oldest, a.last_seen);
        if (gv.phase.empty()) gv.phase = a.phase;
      }
      gv.heartbeat_age = std::chrono::duration_cast<Millis>(now - oldest);
      switch (g.status.mode) {
        case GroupMode::kLeft:
          gv.state = "left";
          break;
        case GroupMode::kEvicted:
          gv.state = "evicted";
          break;
        case GroupMode::kDraining:
          gv.state = "draining";
          break;
        case GroupMode::kActive:
          gv.state = g.status.size_refused ? "refused"
                     : g.status.asked > 0  ? "waiting"
                     : gv.in_quorum        ? "member"
                                           : "joining";
          break;
      }
      v.groups.push_back(std::move(gv));
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace lk::lighthouse
