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
  std::erase_if(list, [&](const CheckpointData& x) {
    return x.step == c.step && x.location == c.location;
  });
  list.insert(std::lower_bound(list.begin(), list.end(), c, Newer), c);
  std::vector<CheckpointData> dropped;
  while (list.size() > max) {
    dropped.push_back(std::move(list.back()));
    list.pop_back();
  }
  return dropped;
}

}  // namespace

Status LighthouseCore::Drain(const std::string& job, const std::string& group_id, TimePoint now,
                             Effects* fx) {
  Impl& s = *impl_;
  auto j = s.jobs.find(job);
  if (j == s.jobs.end()) return Error(Code::kNotFound, "unknown job {}", job);
  auto it = j->second.groups.find(group_id);
  if (it == j->second.groups.end()) {
    return Error(Code::kNotFound, "unknown group {} in job {}", group_id, job);
  }
  Impl::Group& g = it->second;
  if (g.status.mode == GroupMode::kLeft) {
    return Error(Code::kConflict, "group {} already left ({})", group_id, g.reason);
  }
  if (g.status.mode == GroupMode::kDraining) return Status::Ok();
  s.ApplyTimeouts(now, fx);
  g.status.mode = GroupMode::kDraining;
  g.reason = "drained by admin";
  fx->events.push_back(fmt::format("group_drain job={} group={} incarnation={} in_quorum={}",
                                   Q(job), Q(group_id), Q(g.status.incarnation), g.in_quorum));
  s.ClearAsks(g, Error(Code::kConflict, "group {} is draining", group_id), now, fx);
  s.Evaluate(j->second, now, fx);
  return Status::Ok();
}

Status LighthouseCore::Forget(const std::string& job, Effects* fx) {
  Impl& s = *impl_;
  auto j = s.jobs.find(job);
  if (j == s.jobs.end()) return Error(Code::kNotFound, "unknown job {}", job);
  Impl::Job& state = j->second;
  for (auto& [id, g] : state.groups) {
    s.ClearAsks(g, Error(Code::kUnavailable, "job {} forgotten", job), TimePoint{}, fx);
    s.DropDeadlines(g);
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
  auto [j, created] = s.jobs.try_emplace(ckpt.job);
  if (created) j->second.name = ckpt.job;
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

Status LighthouseCore::Load(std::vector<JobRecordData> jobs, std::vector<CheckpointData> checkpoints,
                            TimePoint now) {
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
        return Error(Code::kDataLoss, "job {}: members not sorted by group_id or unnamed",
                     rec.job);
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
    for (const MemberData& m : rec.members) {
      Impl::Group& g = job.groups[m.group_id];
      g.job = &job;
      g.status.group_id = m.group_id;
      g.status.incarnation = m.incarnation;
      g.status.agents.resize(std::max<size_t>(1, m.addresses.size()));
      for (size_t r = 0; r < g.status.agents.size(); ++r) {
        AgentStatus& a = g.status.agents[r];
        a.seen = true;
        a.last_seen = now;  // loaded members count as heard now (fast path after a restart)
        a.step = m.step;
        if (r < m.addresses.size()) a.address = m.addresses[r];
      }
      g.status.step = m.step;
      g.alive = true;
      g.in_quorum = true;
      g.progress_mark = now;
      s.AddGroupOrder(job, g);
      ++s.group_count;
      s.RearmHeartbeat(g, TimePoint::min());
      s.RearmProgress(g);
    }
    job.plan = PlanFromIssued(std::move(rec.members), s.NewestCheckpoint(job));
    job.last_decision = "loaded";
  }
  impl_ = std::move(next);
  return Status::Ok();
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
    v.checkpoints = job.checkpoints;
    v.last_decision = job.last_decision;
    for (const auto& [id, g] : job.groups) {
      GroupView gv;
      gv.group_id = id;
      gv.incarnation = g.status.incarnation;
      gv.nodes = static_cast<uint32_t>(g.status.agents.size());
      gv.step = g.status.step;
      gv.healthy = IsHealthy(g.status, s.options, now);
      gv.participant = IsParticipant(g.status);
      gv.in_quorum = g.in_quorum && !g.lost;
      gv.draining = g.status.mode == GroupMode::kDraining;
      gv.diverged = g.status.diverged;
      gv.reason = g.reason;
      TimePoint oldest = now;
      for (const AgentStatus& a : g.status.agents) {
        if (a.seen) oldest = std::min(oldest, a.last_seen);
        if (gv.phase.empty()) gv.phase = a.phase;
      }
      gv.heartbeat_age = std::chrono::duration_cast<Millis>(now - oldest);
      switch (g.status.mode) {
        case GroupMode::kLeft: gv.state = "left"; break;
        case GroupMode::kEvicted: gv.state = "evicted"; break;
        case GroupMode::kDraining: gv.state = "draining"; break;
        case GroupMode::kActive:
          gv.state = g.status.asked > 0 ? "waiting" : gv.in_quorum ? "member" : "joining";
          break;
      }
      v.groups.push_back(std::move(gv));
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace lk::lighthouse
