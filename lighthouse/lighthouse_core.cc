// LighthouseCore: the public inputs (heartbeat, join, leave, commit, timeouts). Admin inputs,
// Load and View are in lighthouse_core_admin.cc; state helpers in lighthouse_core_state.cc.
//
// Every input first checks itself against the state without changing anything (an input that
// fails leaves the state and fx untouched), then applies the timeouts due at `now`, then itself.
// The checks cannot turn false through timeouts: those never retire incarnations, change node
// counts or drain groups; they only clear asks (fewer step conflicts) and issue quorums (which
// OnCommit checks again).
#include "lighthouse/lighthouse_core.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "lighthouse/lighthouse_core_state.h"

namespace lk::lighthouse {

LighthouseCore::LighthouseCore(CoreOptions options)
    : impl_(std::make_shared<Impl>(std::move(options))) {
  Status st = impl_->options.Validate();
  LK_CHECK(st.ok()) << st.ToString();
}

void LighthouseCore::NoteGateway(const std::string& job, const std::string& group_id,
                                 const std::string& incarnation, const std::string& site) {
  auto j = impl_->jobs.find(job);
  if (j == impl_->jobs.end()) return;
  auto it = j->second.groups.find(group_id);
  if (it == j->second.groups.end() || it->second.status.incarnation != incarnation) return;
  it->second.gateway = site;
}

Result<HeartbeatResult> LighthouseCore::OnHeartbeat(const HeartbeatInput& in, TimePoint now,
                                                    Effects* fx) {
  Impl& s = *impl_;
  LK_RETURN_IF_ERROR(s.CheckAgent(in.job, in.group_id, in.incarnation, in.node_rank, in.nodes,
                                  in.address, in.phase));
  LK_RETURN_IF_ERROR(
      s.CheckIncarnation(in.job, in.group_id, in.incarnation, in.nodes, in.generation));
  s.ApplyTimeouts(now, fx);
  const size_t events_before = fx->events.size();
  Impl::Group& g = s.Admit(in.job, in.group_id, in.incarnation, in.nodes, now, fx);
  s.Touch(g, in.node_rank, in.step, in.address, in.phase, now, fx);
  Impl::Job& job = *g.job;
  // A plain heartbeat (no event: nothing but freshness changed) cannot make a quorum ready.
  if (fx->events.size() != events_before) s.Evaluate(job, now, fx);
  HeartbeatResult r;
  r.quorum_id = job.quorum_id;
  r.drain = g.status.mode == GroupMode::kDraining;
  r.notices = job.notices;
  r.committed_step = job.committed_step;
  r.generation = g.generation;
  // The lapse this group came back from, once: told on the first heartbeat after the revival,
  // whether the heartbeat, an ask or a commit revived it.
  r.revived_from = std::move(g.lapsed_from);
  g.lapsed_from.clear();
  return r;
}

namespace {

// The refusal of the agent that asked with the earlier step (STEP_DISAGREEMENT): `node` asked
// with `step`, the refused `other_node` with `other_step`.
Status StepDisagreement(const std::string& group_id, uint32_t node, uint32_t step,
                        uint32_t other_node, uint32_t other_step) {
  return Refuse(Code::kConflict, Reason::kStepDisagreement,
                "agents of group {} disagree on the step: node {} asked with step {}, node {} "
                "with step {}",
                group_id, node, step, other_node, other_step);
}

}  // namespace

Status LighthouseCore::OnJoin(const JoinInput& in, TimePoint now, Effects* fx, bool evaluate) {
  Impl& s = *impl_;
  LK_RETURN_IF_ERROR(
      s.CheckAgent(in.job, in.group_id, in.incarnation, in.node_rank, in.nodes, in.address, ""));
  LK_RETURN_IF_ERROR(
      s.CheckIncarnation(in.job, in.group_id, in.incarnation, in.nodes, in.generation));
  Impl::Group* existing = nullptr;
  std::string disagreement;
  if (auto j = s.jobs.find(in.job); j != s.jobs.end()) {
    auto it = j->second.groups.find(in.group_id);
    if (it != j->second.groups.end() && it->second.status.incarnation == in.incarnation) {
      existing = &it->second;
    }
  }
  std::vector<uint32_t> stale_asks;  // agents of this group whose ask a later step supersedes
  if (existing != nullptr) {
    const GroupStatus& g = existing->status;
    if (g.mode == GroupMode::kDraining) {
      return Refuse(Code::kConflict, Reason::kGroupDraining,
                    "group {} is draining: leave instead of asking", in.group_id);
    }
    // Agents of one group must ask with one step. When two that hold state differ, the later
    // step stands: the earlier is a node whose trainers never received the answer the other
    // node's trainers healed or went on with (lost on the way, or cut by its deadline, and the
    // quorum lost before the retry), or an ask the trainers have left behind. The earlier one is
    // refused STEP_DISAGREEMENT (its held ask too, when the later one comes second); its agent
    // then asks without state. A node without state is taken whatever its step, and the group
    // heals as a whole (AskHasState). Refusing whichever came second, as before, held the group
    // out for good when the earlier node could not move on by itself.
    for (uint32_t r = 0; r < g.agents.size(); ++r) {
      const AgentStatus& other = g.agents[r];
      if (r == in.node_rank || !other.asked || other.ask_step == in.step) continue;
      if (other.ask_has_state && in.has_state) {
        if (in.step < other.ask_step) {
          return StepDisagreement(in.group_id, r, other.ask_step, in.node_rank, in.step);
        }
        stale_asks.push_back(r);
        continue;
      }
      disagreement = fmt::format(
          "steps_disagree job={} group={} incarnation={} node={} step={} other_node={} "
          "other_step={} action=heal",
          Q(in.job), Q(in.group_id), Q(in.incarnation), in.node_rank, in.step, r, other.ask_step);
      break;
    }
  }
  s.ApplyTimeouts(now, fx);
  const AgentKey key{in.job, in.group_id, in.incarnation, in.node_rank};

  // A retry (after a 504 or a lighthouse restart): answer at once with the current quorum,
  // unless that quorum was used (a commit), failed, or lost a member.
  if (existing != nullptr && existing->in_quorum && !existing->lost && !existing->job->force_new &&
      !existing->committed) {
    Impl::Group& g = *existing;
    Impl::Job& job = *g.job;
    const auto& members = job.plan.members;
    auto m = std::lower_bound(
        members.begin(), members.end(), in.group_id,
        [](const MemberData& d, const std::string& id) { return d.group_id < id; });
    LK_CHECK(m != members.end() && m->group_id == in.group_id) << "member not in plan";
    if (m->step == in.step) {
      s.Touch(g, in.node_rank, in.step, in.address, "", now, fx);
      const uint32_t rank = static_cast<uint32_t>(m - members.begin());
      fx->answers.push_back(
          {key, AnswerFor(job.plan, job.quorum_id, rank,
                          "retry: current quorum " + std::to_string(job.quorum_id),
                          s.options.answer_members_inline)});
      fx->answers.back().second.generation = g.generation;
      fx->events.push_back(fmt::format(
          "quorum_retry job={} quorum_id={} group={} incarnation={} node={} step={}", Q(in.job),
          job.quorum_id, Q(in.group_id), Q(in.incarnation), in.node_rank, in.step));
      return Status::Ok();
    }
  }

  // A member of the standing quorum asks again, not with the step it was taken at (a retry,
  // above) and either for a step the quorum does not lead past (an ask ahead, or the next
  // round after a commit, asks for the step after the quorum's) or while its trainers hold
  // another quorum: it never took this quorum's answer (lost on the way, or cut by its
  // deadline while the lighthouse was away, and it went on with its old quorum), so it will
  // never step on it. The others would wait in the quorum's step for it until their
  // communicators time out: the quorum is lost, as for a member that left, and the next one
  // takes everybody's new ask. No notice names the group: it did nothing wrong (its agent
  // counts a notice naming its own life as an eviction), as for a failed outer step.
  if (existing != nullptr && existing->in_quorum && !existing->lost && !existing->committed &&
      !existing->job->lost && !existing->job->force_new &&
      (in.step <= existing->job->plan.max_step ||
       (in.on_quorum_id != 0 && in.on_quorum_id != existing->job->quorum_id))) {
    Impl::Job& standing = *existing->job;
    s.LoseQuorum(standing, fx);
    fx->persist_jobs.push_back(s.Record(standing));
    fx->events.push_back(fmt::format(
        "quorum_abandoned job={} quorum_id={} group={} incarnation={} node={} step={} "
        "on_quorum_id={}",
        Q(in.job), standing.quorum_id, Q(in.group_id), Q(in.incarnation), in.node_rank, in.step,
        in.on_quorum_id));
  }
  Impl::Group& g = s.Admit(in.job, in.group_id, in.incarnation, in.nodes, now, fx);
  Impl::Job& job = *g.job;
  s.Touch(g, in.node_rank, in.step, in.address, "", now, fx);
  if (g.status.mode == GroupMode::kEvicted) {
    g.status.mode = GroupMode::kActive;
    g.reason.clear();
    fx->events.push_back(fmt::format("group_rejoin job={} group={} incarnation={} step={}",
                                     Q(in.job), Q(in.group_id), Q(in.incarnation), in.step));
  }
  AgentStatus& a = g.status.agents[in.node_rank];
  if (!a.asked) {
    a.asked = true;
    ++g.status.asked;
    if (!g.status.first_ask) g.status.first_ask = now;
  }
  a.ask_step = in.step;
  if (!disagreement.empty()) fx->events.push_back(std::move(disagreement));
  for (uint32_t r : stale_asks) {
    AgentStatus& other = g.status.agents[r];
    if (!other.asked || other.ask_step >= in.step) continue;
    fx->events.push_back(fmt::format(
        "ask_superseded job={} group={} incarnation={} node={} step={} by_node={} by_step={}",
        Q(in.job), Q(in.group_id), Q(in.incarnation), r, other.ask_step, in.node_rank, in.step));
    other.asked = false;
    --g.status.asked;
    if (other.waiting) {
      other.waiting = false;
      fx->rejections.push_back(
          {AgentKey{in.job, in.group_id, in.incarnation, r},
           StepDisagreement(in.group_id, in.node_rank, in.step, r, other.ask_step)});
    }
  }
  a.ask_has_state = in.has_state;
  a.ask_shrink_only = in.shrink_only;
  a.waiting = true;
  // A new ask is judged afresh: the quorum's size may have changed since a refusal.
  if (in.group_size != 0) g.status.group_size = in.group_size;
  a.ask_mixed_group_sizes = in.mixed_group_sizes;
  a.said_shape = true;
  if (g.status.size_refused) {
    g.status.size_refused = false;
    g.reason.clear();
  }
  s.RearmProgress(g);
  fx->events.push_back(fmt::format(
      "quorum_ask job={} group={} incarnation={} node={} step={} has_state={} shrink_only={} "
      "asked={}/{}",
      Q(in.job), Q(in.group_id), Q(in.incarnation), in.node_rank, in.step, in.has_state,
      in.shrink_only, g.status.asked, g.status.agents.size()));
  if (evaluate) s.Evaluate(job, now, fx);
  return Status::Ok();
}

void LighthouseCore::EvaluateJob(const std::string& job, TimePoint now, Effects* fx) {
  auto j = impl_->jobs.find(job);
  if (j == impl_->jobs.end()) return;
  impl_->ApplyTimeouts(now, fx);
  impl_->Evaluate(j->second, now, fx);
}

void LighthouseCore::OnJoinTimeout(const AgentKey& key) {
  auto j = impl_->jobs.find(key.job);
  if (j == impl_->jobs.end()) return;
  auto it = j->second.groups.find(key.group_id);
  if (it == j->second.groups.end()) return;
  GroupStatus& g = it->second.status;
  if (g.incarnation != key.incarnation || key.node_rank >= g.agents.size()) return;
  g.agents[key.node_rank].waiting = false;
}

Status LighthouseCore::OnLeave(const std::string& job, const std::string& group_id,
                               const std::string& incarnation, const std::string& reason,
                               TimePoint now, Effects* fx, uint32_t generation) {
  Impl& s = *impl_;
  LK_RETURN_IF_ERROR(s.CheckIds(job, group_id, incarnation));
  if (reason.size() > s.options.text_bytes_max) {
    return InvalidArgument("reason longer than {} bytes", s.options.text_bytes_max);
  }
  // Only the current incarnation can leave. An incarnation never heard of has not lived: its
  // leave says nothing about the live one, which stays (it leaves or expires on its own).
  LK_ASSIGN_OR_RETURN(Impl::Group * g, s.FindCurrent(job, group_id, incarnation, generation));
  if (g->status.mode == GroupMode::kLeft) return Status::Ok();  // a repeated leave
  s.ApplyTimeouts(now, fx);
  const std::string why = reason.empty() ? "unspecified" : reason;
  g->status.mode = GroupMode::kLeft;
  g->reason = why;
  g->alive = false;
  fx->events.push_back(fmt::format("group_left job={} group={} incarnation={} reason={}", Q(job),
                                   Q(group_id), Q(incarnation), Q(why)));
  Impl::Job& state = *g->job;
  // The agent's word that this life's trainers crashed counts toward the group's crash cap
  // (POST /v1/event of the same crash then counts nothing).
  if (why == kLeaveTrainerCrashed && s.CountCrash(state, group_id, incarnation)) {
    fx->persist_jobs.push_back(s.Record(state));
  }
  if (why == kLeaveFinished && state.committed_step > 0 && g->status.step >= state.committed_step &&
      state.finished_step != state.committed_step) {
    state.finished_step = state.committed_step;
    fx->events.push_back(fmt::format("job_finished job={} step={} group={}", Q(job),
                                     state.finished_step, Q(group_id)));
    fx->persist_jobs.push_back(s.Record(state));
  }
  s.LoseMember(*g, "left: " + why, now, fx);
  s.ClearAsks(*g, Refuse(Code::kConflict, Impl::LeftReason(*g), "group {} left: {}", group_id, why),
              now, fx);
  s.DropDeadlines(*g);
  s.RearmCollect(*g, now);
  // Persisted, so that the life that left stays left after a restart.
  fx->persist_groups.push_back(s.GroupRecord(*g));
  s.Evaluate(*g->job, now, fx);
  return Status::Ok();
}

Result<bool> LighthouseCore::OnCommit(const CommitInput& in, TimePoint now, Effects* fx) {
  Impl& s = *impl_;
  LK_RETURN_IF_ERROR(s.CheckIds(in.job, in.group_id, in.incarnation));
  if (in.state_hash.size() > s.options.text_bytes_max) {
    return InvalidArgument("state_hash longer than {} bytes", s.options.text_bytes_max);
  }
  LK_ASSIGN_OR_RETURN(Impl::Group * g, s.FindCurrent(in.job, in.group_id, in.incarnation));
  Impl::Job& job = *g->job;
  if (g->status.mode == GroupMode::kLeft) {
    return Refuse(Code::kConflict, Impl::LeftReason(*g), "incarnation {} of group {} left ({})",
                  in.incarnation, in.group_id, g->reason);
  }
  if (in.node_rank >= g->status.agents.size()) {
    return InvalidArgument("node_rank={} >= nodes={}", in.node_rank, g->status.agents.size());
  }
  if (in.quorum_id != job.quorum_id) {
    return Refuse(Code::kConflict, Reason::kWrongQuorum,
                  "commit for quorum {} but the current quorum is {}", in.quorum_id, job.quorum_id);
  }
  if (!g->in_quorum) {
    return Refuse(Code::kConflict, Reason::kNotAMember, "group {} is not a member of quorum {}",
                  in.group_id, job.quorum_id);
  }
  // Every member starts the quorum's outer step at max_step (the healers heal to it), so the
  // one step a successful commit can complete is max_step + 1. A failed commit moves no step.
  const uint64_t expected = uint64_t{job.plan.max_step} + 1;
  if (in.ok && job.catch_up) {
    return Refuse(Code::kConflict, Reason::kJobFinished,
                  "quorum {} is a catch-up quorum of a job that finished at step {}: it restores "
                  "the final step and commits nothing (restart every group to train further)",
                  job.quorum_id, job.finished_step);
  }
  // A step past max_step + 1 on the same quorum is one its members went on to without the
  // lighthouse (the agents keep their quorum while it is away, and deliver the commits they
  // kept when it is back). Each such commit is taken only one step past what is known to have
  // been reached: the group's step (its commits and heartbeats) or the job's committed step (a
  // restart loads the members at the quorum's start, and the steps after it were committed in
  // lockstep). A member can only have completed a step after the one before it; a jump says
  // nothing the lighthouse could trust.
  const uint64_t reached = std::max(g->status.step, job.committed_step);
  const bool continued = in.ok && in.step > expected && in.step <= reached + 1;
  // A step below max_step + 1 that this quorum reached (above its first max_step, up to the
  // job's committed step) is one this member kept while the lighthouse was away and delivers
  // after the quorum was handed out again for a later step (its next ask can overtake its kept
  // commits). It agrees with the record and is taken: it moves the group's progress and counts
  // its tokens once, never the job's step or a hash.
  const bool late = in.ok && in.step < expected && in.step > job.quorum_start_step &&
                    in.step <= job.committed_step;
  if (in.ok && in.step != expected && !continued && !late) {
    return Refuse(Code::kConflict, Reason::kWrongStep,
                  "commit of step {} in quorum {}, which started at step {}: only step {} can "
                  "be committed, or (going on without the lighthouse) the step after {}",
                  in.step, job.quorum_id, job.plan.max_step, expected, reached);
  }
  s.ApplyTimeouts(now, fx);
  // A timeout due at `now` may have issued a newer quorum: the commit then only moves steps.
  const bool current = in.quorum_id == job.quorum_id && g->in_quorum;
  // A late commit is of an earlier round of this id: the round handed out now is not used by
  // it, and a node of the group whose answer to this round was lost still retries into it (the
  // agents' simulation, seed 23931: counted as used, the retry asked anew and the group's other
  // node waited in the round for good).
  g->committed = g->committed || (current && !late);
  s.Touch(*g, in.node_rank, in.ok ? std::max(in.step, g->status.step) : g->status.step, "", "", now,
          fx);
  if (in.ok) {
    job.committed_step = std::max(job.committed_step, in.step);
  } else if (current) {
    // A failed outer step ends the quorum for every member: the others' step on it cannot
    // complete either (their average waits for this group), so they are told at once, as for a
    // lost member, instead of waiting in it until their communicator times out.
    s.LoseQuorum(job, fx);
  }
  // The group's contribution, once per step (every node of the group reports the same count).
  if (current && in.ok && in.tokens > 0) {
    GroupTokensData& t = job.tokens[in.group_id];
    if (t.group_id.empty() || in.step > t.step) {
      t.group_id = in.group_id;
      t.step = in.step;
      t.tokens = in.tokens;
      t.total = t.total > UINT64_MAX - in.tokens ? UINT64_MAX : t.total + in.tokens;
    }
  }
  fx->events.push_back(fmt::format(
      "commit job={} quorum_id={} group={} incarnation={} node={} step={} ok={} committed_step={} "
      "tokens={} continued={} late={}",
      Q(in.job), job.quorum_id, Q(in.group_id), Q(in.incarnation), in.node_rank, in.step, in.ok,
      job.committed_step, in.tokens, continued, late));
  if (current && in.ok && !late && !in.state_hash.empty()) {
    g->hash_step = in.step;
    g->state_hash = in.state_hash;
    s.CheckDivergence(job, in.step, fx);
  }
  fx->persist_jobs.push_back(s.Record(job));
  return g->status.diverged;
}

void LighthouseCore::Tick(TimePoint now, Effects* fx) { impl_->ApplyTimeouts(now, fx); }

std::optional<TimePoint> LighthouseCore::NextDeadline() const {
  if (impl_->deadlines.empty()) return std::nullopt;
  return std::get<0>(*impl_->deadlines.begin());
}

Result<WatchResult> LighthouseCore::Watch(const std::string& job, uint32_t quorum_id) const {
  auto j = impl_->jobs.find(job);
  if (j == impl_->jobs.end()) {
    return Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", job);
  }
  const Impl::Job& state = j->second;
  if (quorum_id > state.quorum_id) {
    return Refuse(Code::kInvalidArgument, Reason::kQuorumNotIssued,
                  "quorum {} of job {} was never issued (current {})", quorum_id, job,
                  state.quorum_id);
  }
  WatchResult r;
  r.quorum_id = state.quorum_id;
  r.lost = quorum_id < state.quorum_id || state.lost;
  if (quorum_id == state.quorum_id) r.notices = state.notices;
  return r;
}

bool LighthouseCore::HasJob(const std::string& job) const { return impl_->jobs.count(job) > 0; }

uint32_t LighthouseCore::CommittedStep(const std::string& job) const {
  auto j = impl_->jobs.find(job);
  return j == impl_->jobs.end() ? 0 : j->second.committed_step;
}

size_t LighthouseCore::GroupCount() const { return impl_->group_count; }

size_t LighthouseCore::JobCount() const { return impl_->jobs.size(); }

}  // namespace lk::lighthouse
