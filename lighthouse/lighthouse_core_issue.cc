// LighthouseCore::Impl: running the decision for a job, issuing a quorum (rule 6 ids, rule 7
// plan, answers to every waiting agent of every member), divergence, persisted records.
#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "lighthouse/divergence.h"
#include "lighthouse/lighthouse_core_state.h"

namespace lk::lighthouse {

using internal::DeadlineKind;

void LighthouseCore::Impl::Evaluate(Job& job, TimePoint now, Effects* fx) {
  // An issue consumes the asks of its members, so a second pass can only issue for groups that
  // were held back and are now allowed in; the bound is a guard against a broken invariant.
  for (int pass = 0;; ++pass) {
    LK_CHECK(pass < 4) << "job " << job.name << " issued " << pass << " quorums for one input";
    JobMembership m{job.plan.members, job.order};
    QuorumDecision d = ComputeQuorum(m, options, now);
    for (const GroupStatus* s : d.refused) RefuseSize(job.groups.at(s->group_id), d, now, fx);
    if (!d.issue && job.finished_step > 0) {
      QuorumDecision c = ComputeCatchUp(m, options, now, job.finished_step);
      if (c.issue) {
        d = std::move(c);
      } else if (c.wake_at && (!d.wake_at || *c.wake_at < *d.wake_at)) {
        d.wake_at = c.wake_at;
      }
    }
    if (d.issue && !d.members.empty() && !NewestCheckpoint(job) &&
        std::all_of(d.members.begin(), d.members.end(), [](const GroupStatus* s) {
          return !AskHasState(*s) && AnyAskHasState(*s);
        })) {
      for (const GroupStatus* s : d.members) EvictStateLost(job.groups.at(s->group_id), now, fx);
      continue;
    }
    if (d.issue) {
      Issue(job, d, now, fx);
      continue;
    }
    SetDeadline(job.join_deadline, d.wake_at, DeadlineKind::kJoin, &job);
    if (pass == 0 && d.reason != job.last_decision) {
      fx->events.push_back(fmt::format("quorum_wait job={} quorum_id={} reason={}", Q(job.name),
                                       job.quorum_id, Q(d.reason)));
      job.last_decision = std::move(d.reason);
    }
    return;
  }
}

void LighthouseCore::Impl::RefuseSize(Group& g, const QuorumDecision& d, TimePoint now,
                                      Effects* fx) {
  const std::string why =
      d.mixed_sizes
          ? fmt::format(
                "group {} has {} trainers and cannot average across group sizes, but the "
                "quorum's groups have other sizes (use the DiLoCo library, which sets "
                "mixed_group_sizes, in every group, or give every group the same --group-size)",
                g.status.group_id, g.status.group_size)
          : fmt::format(
                "group {} has {} trainers but the quorum's groups have {}: groups of different "
                "sizes share a quorum only when all of them average across sizes (the DiLoCo "
                "library does); start it with --group-size {}",
                g.status.group_id, g.status.group_size, d.group_size, d.group_size);
  g.status.size_refused = true;
  g.reason = why;
  fx->events.push_back(
      fmt::format("group_refused job={} group={} incarnation={} group_size={} quorum_group_size={} "
                  "code=GROUP_SIZE_MISMATCH",
                  Q(g.job->name), Q(g.status.group_id), Q(g.status.incarnation),
                  g.status.group_size, d.group_size));
  ClearAsks(g, Refuse(Code::kConflict, Reason::kGroupSizeMismatch, "{}", why), now, fx);
}

namespace {

// The answer's reason, with why this member heals when its state diverged (the trainer logs it).
std::string ReasonFor(const internal::Group& g, const std::string& reason) {
  if (!g.status.diverged) return reason;
  return fmt::format(
      "{}; this group's state diverged from the quorum's at step {}: it heals "
      "from the reference state",
      reason, g.diverged_step);
}

}  // namespace

void LighthouseCore::Impl::Issue(Job& job, const QuorumDecision& d, TimePoint now, Effects* fx) {
  std::vector<MemberData> members;
  std::vector<bool> diverged;
  std::vector<Group*> groups;
  members.reserve(d.members.size());
  for (const GroupStatus* s : d.members) {
    Group& g = job.groups.at(s->group_id);
    MemberData m;
    m.group_id = s->group_id;
    m.incarnation = s->incarnation;
    m.step = AskStep(*s);
    m.has_state = AskHasState(*s);
    m.partial = !m.has_state && AnyAskHasState(*s);
    m.group_size = s->group_size;
    m.mixed_group_sizes = MixesGroupSizes(*s);
    m.addresses.reserve(s->agents.size());
    for (const AgentStatus& a : s->agents) m.addresses.push_back(a.address);
    members.push_back(std::move(m));
    diverged.push_back(s->diverged);
    groups.push_back(&g);
  }

  // Rule 6: a new id when the member list changed or the last quorum failed or lost a member.
  const std::vector<MemberData>& old = job.plan.members;
  bool changed = job.quorum_id == 0 || job.force_new || old.size() != members.size();
  for (size_t i = 0; !changed && i < members.size(); ++i) {
    changed =
        old[i].group_id != members[i].group_id || old[i].incarnation != members[i].incarnation;
  }
  if (changed) {
    LK_CHECK(std::max(job.quorum_id, job.id_floor) < UINT32_MAX)
        << "quorum_id overflow in job " << job.name;
    job.quorum_id = std::max(job.quorum_id, job.id_floor) + 1;
    ++job.quorum_changes;
    job.notices.clear();
    job.lost = false;
    job.force_new = false;
    fx->watch_wakeups.insert(job.name);
  }
  for (const MemberData& m : old) {
    auto it = job.groups.find(m.group_id);
    if (it == job.groups.end() || it->second.status.incarnation != m.incarnation) continue;
    it->second.in_quorum = it->second.lost = false;
    RearmProgress(it->second);
  }
  job.plan = PlanRecovery(std::move(members), diverged, NewestCheckpoint(job));
  if (changed) job.quorum_start_step = job.plan.max_step;
  // A regular quorum means the job trains on (e.g. its groups came back for more steps); a
  // later finish marks it again.
  job.catch_up = d.catch_up;
  if (!d.catch_up) job.finished_step = 0;

  uint32_t healing = 0;
  for (uint32_t rank = 0; rank < groups.size(); ++rank) {
    Group& g = *groups[rank];
    if (job.plan.members[rank].heal) ++healing;
    g.in_quorum = true;
    g.lost = false;
    g.committed = false;
    AdvanceStep(g, job.plan.members[rank].step, now);
    g.progress_mark = now;
    for (uint32_t node = 0; node < g.status.agents.size(); ++node) {
      AgentStatus& a = g.status.agents[node];
      if (a.waiting) {
        fx->answers.push_back({AgentKey{job.name, g.status.group_id, g.status.incarnation, node},
                               AnswerFor(job.plan, job.quorum_id, rank, ReasonFor(g, d.reason),
                                         options.answer_members_inline)});
        fx->answers.back().second.generation = g.generation;
        if (g.status.diverged) fx->answers.back().second.diverged_step = g.diverged_step;
      }
      a.asked = a.waiting = false;
    }
    g.status.asked = 0;
    g.status.first_ask.reset();
    RearmProgress(g);
  }
  RefreshWaits(job, now);
  fx->persist_jobs.push_back(Record(job));
  fx->issued.push_back({job.name, job.quorum_id, changed, static_cast<uint32_t>(groups.size())});
  // No live member holds the committed state and the newest durable checkpoint is older: the
  // run goes on, but the steps between are trained again. Said loudly, once per such quorum,
  // so that whoever watches the log learns that checkpoints are too far apart.
  if (job.plan.restore && job.plan.restore->step < job.committed_step) {
    fx->events.push_back(fmt::format(
        "recovery_behind_committed job={} quorum_id={} committed_step={} restore_step={} "
        "lost_steps={} location={}",
        Q(job.name), job.quorum_id, job.committed_step, job.plan.restore->step,
        job.committed_step - job.plan.restore->step, Q(job.plan.restore->location)));
  }
  // Neither a live member nor a checkpoint holds the committed state whole (the only copy of a
  // shard went with a group that died, the rest sits in a partial member): the run goes on from
  // what is left, and the steps after it are trained again. Said once per quorum id.
  if (changed && !job.plan.restore && !d.catch_up && job.plan.max_step < job.committed_step) {
    fx->events.push_back(fmt::format(
        "state_lost job={} quorum_id={} committed_step={} max_step={} lost_steps={} reason={}",
        Q(job.name), job.quorum_id, job.committed_step, job.plan.max_step,
        job.committed_step - job.plan.max_step,
        Q("no live member or checkpoint holds the committed state: register checkpoints "
          "(--ckpt-dir) so that a restore can bring it back")));
  }
  fx->events.push_back(fmt::format(
      "quorum_issued job={} quorum_id={} changed={} members={} healing={} max_step={}{}{}{} "
      "reason={}",
      Q(job.name), job.quorum_id, changed, groups.size(), healing, job.plan.max_step,
      job.plan.restore ? " restore_step=" + std::to_string(job.plan.restore->step) : "",
      job.plan.initial ? " initial=true" : "", d.catch_up ? " catch_up=true" : "", Q(d.reason)));
  // A catch-up quorum without a checkpoint of the final step cannot bring its members there:
  // they go on from their own step and their commits are refused (JOB_FINISHED).
  if (d.catch_up && job.plan.max_step < job.committed_step) {
    fx->events.push_back(fmt::format(
        "catch_up_behind job={} quorum_id={} committed_step={} max_step={} reason={}", Q(job.name),
        job.quorum_id, job.committed_step, job.plan.max_step,
        Q("no checkpoint of the final step is registered: register checkpoints (--ckpt-dir) "
          "so that groups behind a finished job can restore it")));
  }
  job.last_decision = d.reason;
}

// Rule 7's divergence check, at every commit that carries a state hash: the hashes the
// quorum's current members committed for `step` (diverged/divergence.h decides). A member off
// the reference is flagged at once and the next quorum gets a new id, so that it joins again
// and heals from a member on the reference (PlanRecovery: a diverged member is no donor); the
// flag stays until a later commit of it agrees, which is when it has healed.
void LighthouseCore::Impl::CheckDivergence(Job& job, uint32_t step, Effects* fx) {
  std::vector<std::string> hashes;
  std::vector<Group*> groups;
  for (const MemberData& m : job.plan.members) {
    auto it = job.groups.find(m.group_id);
    Group* g = it == job.groups.end() || it->second.status.incarnation != m.incarnation
                   ? nullptr
                   : &it->second;
    groups.push_back(g);
    hashes.push_back(g != nullptr && g->hash_step == step ? g->state_hash : std::string());
  }
  const DivergenceVerdict v = JudgeStateHashes(hashes);
  if (v.rule == ReferenceRule::kNone) return;  // a tie with hashes still to come: wait
  for (size_t rank = 0; rank < groups.size(); ++rank) {
    Group* g = groups[rank];
    if (g == nullptr || hashes[rank].empty()) continue;
    if (v.off[rank] && !g->status.diverged) {
      g->status.diverged = true;
      ++g->divergences;
      g->diverged_step = step;
      job.force_new = true;
      fx->divergences.push_back(job.name);
      fx->events.push_back(fmt::format(
          "diverged job={} quorum_id={} group={} incarnation={} step={} hash={} majority={} "
          "rule={} reference_replica_rank={} replica_rank={}",
          Q(job.name), job.quorum_id, Q(g->status.group_id), Q(g->status.incarnation), step,
          Q(g->state_hash), Q(v.reference), RuleName(v.rule), v.reference_rank, rank));
    } else if (!v.off[rank] && g->status.diverged && step > g->diverged_step) {
      g->status.diverged = false;
      fx->events.push_back(fmt::format(
          "diverged_healed job={} group={} incarnation={} step={} hash={} diverged_step={}",
          Q(job.name), Q(g->status.group_id), Q(g->status.incarnation), step, Q(g->state_hash),
          g->diverged_step));
    }
  }
}

JobRecordData LighthouseCore::Impl::Record(const Job& job) const {
  JobRecordData r;
  r.job = job.name;
  r.quorum_id = job.quorum_id;
  r.members = job.plan.members;
  r.committed_step = job.committed_step;
  r.quorum_changes = job.quorum_changes;
  r.generation_last = job.generation_last;
  r.finished_step = job.finished_step;
  r.catch_up = job.catch_up;
  r.lost = job.lost;
  r.force_new = job.force_new;
  for (const auto& [id, t] : job.tokens) r.tokens.push_back(t);
  for (const auto& [id, l] : job.lives) r.lives.push_back(l);
  return r;
}

std::optional<CheckpointData> LighthouseCore::Impl::NewestCheckpoint(const Job& job) const {
  if (job.checkpoints.empty()) return std::nullopt;
  return job.checkpoints.front();
}

}  // namespace lk::lighthouse
