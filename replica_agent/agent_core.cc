#include "replica_agent/agent_core.h"

#include <algorithm>

#include "common/log.h"

namespace lk::agent {

namespace {

Effect Log(std::string line, LogLevel level = LogLevel::kInfo) {
  Effect e;
  e.kind = Effect::Kind::kLog;
  e.text = std::move(line);
  e.level = level;
  return e;
}

constexpr LogLevel kWarn = LogLevel::kWarn;

Effect Of(Effect::Kind kind) {
  Effect e;
  e.kind = kind;
  return e;
}

}  // namespace

std::string_view PhaseName(Phase p) {
  switch (p) {
    case Phase::kStarting:
      return "starting";
    case Phase::kQuorum:
      return "quorum";
    case Phase::kTraining:
      return "training";
    case Phase::kDraining:
      return "draining";
    case Phase::kPeerWait:
      return "peer_wait";
  }
  return "starting";
}

std::string_view NoticeReasonName(NoticeReason r) {
  switch (r) {
    case NoticeReason::kTimeout:
      return "";
    case NoticeReason::kQuorumLost:
      return "quorum_lost";
    case NoticeReason::kAgentExiting:
      return "agent_exiting";
    case NoticeReason::kDrain:
      return "drain";
  }
  return "";
}

std::string_view LeaveReasonName(LeaveReason r) {
  switch (r) {
    case LeaveReason::kFinished:
      return "finished";
    case LeaveReason::kDrained:
      return "drained";
    case LeaveReason::kSignal:
      return "signal";
    case LeaveReason::kEvicted:
      return "evicted";
    case LeaveReason::kReplaced:
      return "replaced";
    case LeaveReason::kTrainerCrashed:
      return "trainer_crashed";
    case LeaveReason::kGroupSizeMismatch:
      return "group_size_mismatch";
    case LeaveReason::kJobFinished:
      return "job_finished";
    case LeaveReason::kNoTrainers:
      return "no_trainers";
  }
  return "";
}

AgentCore::AgentCore(CoreOptions options, TimePoint now) : o_(std::move(options)) {
  s_.started = now;
}

uint32_t AgentCore::ExpectedLocalTrainers() const {
  return std::max<uint32_t>(1, s_.group_size / std::max<uint32_t>(1, o_.nodes));
}

std::optional<uint32_t> AgentCore::WatchTarget() const {
  if (s_.ask.kind == Ask::Kind::kFetched) return s_.ask.fetched->quorum_id;
  if (s_.quorum) return s_.quorum->quorum_id;
  return std::nullopt;
}

Phase AgentCore::ReportedPhase() const {
  if (s_.phase != Phase::kTraining) return s_.phase;
  bool all = s_.trainers.size() >= ExpectedLocalTrainers();
  for (const auto& [r, t] : s_.trainers) {
    all &= t.peer_wait || (o_.board && t.slot && t.board_peer_wait);
  }
  return all ? Phase::kPeerWait : s_.phase;
}

// ---- trainers ----

Status AgentCore::Register(uint32_t group_rank, uint32_t size, int pid, Effects* fx) {
  if (size == 0) return InvalidArgument("group_size must be at least 1");
  if (group_rank >= size) {
    return InvalidArgument("group_rank {} is not below group_size {}", group_rank, size);
  }
  if (size % o_.nodes != 0) {
    return InvalidArgument("group_size {} is not a multiple of the group's {} nodes", size,
                           o_.nodes);
  }
  if (s_.group_size != 0 && size != s_.group_size) {
    return InvalidArgument("group_size {} differs from the {} other trainers gave", size,
                           s_.group_size);
  }
  if (!s_.trainers.count(group_rank) && s_.trainers.size() >= size / o_.nodes) {
    return InvalidArgument("node already has {} trainers; group_rank {} is one too many",
                           s_.trainers.size(), group_rank);
  }
  s_.group_size = size;
  s_.said_hello = true;
  TrainerState& t = s_.trainers[group_rank];
  t.group_rank = group_rank;
  if (o_.board && !t.slot && s_.board.next_slot < o_.board_slots) t.slot = s_.board.next_slot++;
  if (pid > 0 && t.pid != pid) {
    t.pid = pid;
    t.exited = false;
    Effect e = Of(Effect::Kind::kWatchPid);
    e.rank = group_rank;
    e.id = static_cast<uint64_t>(pid);
    fx->push_back(std::move(e));
  }
  return Status::Ok();
}

Status AgentCore::OnHello(uint32_t group_rank, uint32_t group_size, int pid, Effects* fx) {
  return Register(group_rank, group_size, pid, fx);
}

PollAnswer AgentCore::AnswerFor(TrainerState& t, bool fresh_answer) {
  PollAnswer r;
  r.drain = s_.draining;
  r.checkpoint_now = s_.checkpoint_now;
  if (s_.draining) {
    r.reason = s_.drain_reason;
    return r;
  }
  const Quorum& q = *s_.quorum;
  r.quorum_id = q.quorum_id;
  r.replica_rank = q.replica_rank;
  r.replica_world_size = q.replica_world_size;
  r.max_step = q.max_step;
  r.reconfigure = t.seen_quorum_id != q.quorum_id;
  // The plan's heal applies once, to the answer of the round that decided it.
  bool heal = fresh_answer && q.heal && t.heal_answered_quorum_id != q.quorum_id;
  if (fresh_answer && q.heal) t.heal_answered_quorum_id = q.quorum_id;
  r.heal = heal;
  if (heal) {
    r.heal_sources = q.heal_sources;
    r.restore_checkpoint = q.restore_checkpoint;
    r.initial = q.initial;
    // The trainer takes the state of max_step, which may lie before a step it committed (its
    // group healed as a whole); its next commit is the one after max_step.
    if (t.committed_step && *t.committed_step > q.max_step) t.committed_step = q.max_step;
  }
  r.reason = q.reason;
  t.seen_quorum_id = q.quorum_id;
  return r;
}

void AgentCore::AnswerPolls(bool fresh_answer, Effects* fx) {
  if (!s_.draining && !s_.quorum) return;  // nothing to answer with yet
  for (auto& [rank, t] : s_.trainers) {
    if (!t.waiting) continue;
    t.waiting = false;
    if (fresh_answer && s_.quorum && s_.quorum->heal) {
      s_.had_state = true;
      s_.without_state = false;
    }
    Effect e = Of(Effect::Kind::kAnswerPoll);
    e.rank = rank;
    e.answer = AnswerFor(t, fresh_answer);
    if (t.polled_step) t.sent.emplace(*t.polled_step, e.answer);
    fx->push_back(std::move(e));
  }
}

void AgentCore::OnPoll(const PollInput& in, TimePoint now, Effects* fx) {
  (void)now;
  auto refuse = [&](Status st) {
    Effect e = Of(Effect::Kind::kRefusePoll);
    e.rank = in.group_rank;
    e.status = std::move(st);
    e.incoming = true;
    fx->push_back(std::move(e));
  };
  Status st = Register(in.group_rank, in.group_size, in.pid, fx);
  if (st.ok() && s_.refusal) st = *s_.refusal;
  if (!st.ok()) return refuse(st);
  TrainerState& t = s_.trainers[in.group_rank];
  t.mixed_group_sizes = in.mixed_group_sizes;
  if (t.committed_step && in.step < *t.committed_step) {
    return refuse(Refuse(Code::kConflict, Reason::kWrongStep,
                         "step {} is below this trainer's committed step {}", in.step,
                         *t.committed_step));
  }
  for (auto& [rank, other] : s_.trainers) {
    if (rank != in.group_rank && other.waiting && other.polled_step != in.step) {
      return refuse(Refuse(Code::kConflict, Reason::kStepDisagreement,
                           "group_rank {} polls step {} but group_rank {} polls step {}",
                           in.group_rank, in.step, rank, *other.polled_step));
    }
  }
  if (t.waiting) {
    t.waiting = false;
    Effect e = Of(Effect::Kind::kRefusePoll);
    e.rank = in.group_rank;
    e.status = Status(Code::kConflict, "superseded by a newer poll", Reason::kRequestSuperseded);
    fx->push_back(std::move(e));
  }
  auto answer_now = [&](const PollAnswer& a) {
    Effect e = Of(Effect::Kind::kAnswerPoll);
    e.rank = in.group_rank;
    e.answer = a;
    e.incoming = true;
    fx->push_back(std::move(e));
  };
  // A poll that timed out on the trainer's side while its answer was on the way gets the same
  // answer while that quorum is still the node's and has lost nobody; otherwise a new round is
  // what it needs, and a drain is answered below. An answer that healed is sent again even
  // after its quorum was lost: the node's other trainers healed on it, and this one must reach
  // the same step (its step on the lost quorum then fails, as theirs does), or the node's
  // trainers split between two steps for good.
  const bool sent_current = s_.quorum && t.sent &&
                            s_.quorum->quorum_id == t.sent->second.quorum_id &&
                            !s_.lost_quorums.count(t.sent->second.quorum_id);
  if (in.resumed && t.sent && t.sent->first == in.step && !s_.draining && !t.sent->second.drain &&
      (sent_current || t.sent->second.heal)) {
    fx->push_back(Log(fmt::format("poll_answer_resent group_rank={} step={} quorum_id={}",
                                  in.group_rank, in.step, t.sent->second.quorum_id)));
    t.polled_step = in.step;
    return answer_now(t.sent->second);
  }
  t.sent.reset();  // kept until this poll only
  if (o_.board && t.slot && !s_.draining && !s_.board.closed) {
    // The node's answer for this step is on the board (up, or taken by another local trainer)
    // and this trainer has not had it: it gets that answer at once, as if it had read the
    // board itself. A trainer that had it already polls again because its step failed, and
    // goes through the barrier below to a new round.
    auto& handed = s_.board.handed;
    if ((!handed || handed->step != in.step) && in.board_ready && in.board_ready->step == in.step) {
      Effect take = Of(Effect::Kind::kTakeFor);
      take.step = in.step;
      fx->push_back(std::move(take));
      ApplyTaken(*in.board_ready, fx);
    }
    if (handed && handed->step == in.step && in.board_consumed != handed->gen) {
      Effect c = Of(Effect::Kind::kSetConsumed);
      c.rank = in.group_rank;
      c.gen = handed->gen;
      fx->push_back(std::move(c));
      t.polled_step = in.step;
      t.sent.emplace(in.step, AnswerFor(t, false));
      return answer_now(t.sent->second);
    }
  }
  t.polled_step = in.step;
  t.waiting = true;
  if (s_.draining) return AnswerPolls(false, fx);
  uint32_t waiting = 0;
  for (auto& [rank, other] : s_.trainers) waiting += other.waiting && other.polled_step == in.step;
  if (waiting < ExpectedLocalTrainers()) return;
  // Every local trainer reached the boundary. The group takes part in a lighthouse round at
  // every outer step (the round is a barrier across groups); normally it happened already,
  // asked ahead while the trainers ran their inner steps, and the poll is answered from it.
  Ask& a = s_.ask;
  if (a.kind == Ask::Kind::kFetched && a.step == in.step &&
      !s_.lost_quorums.count(a.fetched->quorum_id)) {
    Withdraw(fx);
    s_.quorum = std::move(a.fetched);
    a.Set(Ask::Kind::kIdle);
    s_.phase = Phase::kTraining;
    AnswerPolls(true, fx);
    return;
  }
  Withdraw(fx);
  if (a.kind == Ask::Kind::kFetched) a.Set(Ask::Kind::kIdle);  // lost, or fetched for another step
  if (a.asking() && a.step == in.step) {
    // The ask is on its way: its answer now goes to these polls (an ask behind them, too:
    // they came back to its step, their step on from it having failed).
    a.kind = Ask::Kind::kForTrainers;
    s_.phase = Phase::kQuorum;
    // The same ask (its serial stays): one held back as an ask ahead may go now.
    fx->push_back(AskEffect());
    return;
  }
  StartAsk(in.step, Ask::Kind::kForTrainers, fx);
}

std::optional<Effect> AgentCore::PendingAsk(bool commit_pending) const {
  if (!AskMayGo(commit_pending)) return std::nullopt;
  return AskEffect();
}

Effect AgentCore::AskEffect() const {
  Effect e = Of(Effect::Kind::kAsk);
  e.step = s_.ask.step;
  e.id = s_.ask.serial;
  e.ask_kind = s_.ask.kind == Ask::Kind::kForTrainers ? Effect::AskKind::kForTrainers
               : s_.ask.kind == Ask::Kind::kAhead     ? Effect::AskKind::kAhead
                                                      : Effect::AskKind::kBehind;
  e.fresh = (!s_.had_state && e.step == 0) || s_.without_state;
  e.group_size = s_.group_size;
  e.mixed_group_sizes = !s_.trainers.empty();
  for (const auto& [r, t] : s_.trainers) e.mixed_group_sizes &= t.mixed_group_sizes;
  e.quorum_id = s_.quorum ? s_.quorum->quorum_id : 0;
  return e;
}

void AgentCore::StartAsk(uint32_t step, Ask::Kind kind, Effects* fx) {
  Withdraw(fx);
  if (s_.ask.kind == Ask::Kind::kBehind) fx->push_back(Of(Effect::Kind::kCancelBehindAsk));
  s_.ask.Set(kind, step);
  ++s_.ask.serial;
  if (kind == Ask::Kind::kForTrainers) s_.phase = Phase::kQuorum;
  fx->push_back(AskEffect());
}

void AgentCore::AskAhead(uint32_t step, Effects* fx) {
  if (o_.ask_ahead && !s_.draining) StartAsk(step, Ask::Kind::kAhead, fx);
}

void AgentCore::Withdraw(Effects* fx) {
  auto& b = s_.board;
  if (!o_.board || !b.published || b.withdrawn) return;
  Effect e = Of(Effect::Kind::kWithdrawBoard);
  e.step = b.published->step;
  e.quorum_id = b.published->quorum_id;
  fx->push_back(std::move(e));
  // Kept (as withdrawn) until the shell's next look says whether a trainer took it first.
  b.withdrawn = true;
}

void AgentCore::ApplyTaken(BoardTicket taken, Effects* fx) {
  (void)fx;
  auto& b = s_.board;
  b.handed = taken;
  // What answering the node's polls from the quorum fetched ahead does on the socket path.
  if (s_.ask.kind == Ask::Kind::kFetched && s_.ask.step == taken.step) {
    s_.quorum = std::move(s_.ask.fetched);
    s_.ask.Set(Ask::Kind::kIdle);
  } else if (b.published && b.published->step == taken.step && b.published_quorum) {
    // A take that beat the withdraw: the answer stands for the node, and an ask ahead started
    // for its step since is moot (the trainers have their answer for it).
    s_.quorum = b.published_quorum;
    if (s_.ask.kind == Ask::Kind::kAhead && s_.ask.step == taken.step) s_.ask.Set(Ask::Kind::kIdle);
  }
  b.published.reset();
  b.published_quorum.reset();
  s_.board.withdrawn = false;
  if (!s_.draining) s_.phase = Phase::kTraining;
  for (auto& [rank, t] : s_.trainers) t.polled_step = taken.step;
}

void AgentCore::PublishAhead(Effects* fx) {
  if (!o_.board || s_.draining || s_.board.closed) return;
  const Ask& a = s_.ask;
  if (a.kind != Ask::Kind::kFetched || !s_.quorum || s_.lost_quorums.count(a.fetched->quorum_id)) {
    return;
  }
  // Only the unchanged case: a new quorum_id (the trainers rebuild their communicator) or a
  // heal carries more than the board holds, and goes over the socket.
  if (a.fetched->quorum_id != s_.quorum->quorum_id || a.fetched->heal) return;
  if (s_.board.handed && s_.board.handed->step == a.step) return;  // the node had it
  if (s_.trainers.size() < ExpectedLocalTrainers()) return;
  for (auto& [rank, t] : s_.trainers) {
    // A trainer already waiting on the socket is answered there, with the others (barrier).
    if (!t.slot || t.waiting || t.exited || t.seen_quorum_id != a.fetched->quorum_id) return;
  }
  BoardAnswer ans;
  ans.step = a.step;
  ans.quorum_id = a.fetched->quorum_id;
  ans.replica_rank = a.fetched->replica_rank;
  ans.replica_world_size = a.fetched->replica_world_size;
  ans.max_step = a.fetched->max_step;
  ans.reason = a.fetched->reason;
  s_.board.published = ans;
  s_.board.published_quorum = a.fetched;
  s_.board.withdrawn = false;
  Effect e = Of(Effect::Kind::kPublishBoard);
  e.board_answer = std::move(ans);
  fx->push_back(std::move(e));
}

void AgentCore::OnBoardLook(const BoardLook& look, Effects* fx) {
  if (look.taken && (!s_.board.handed || s_.board.handed->gen != look.taken->gen)) {
    ApplyTaken(*look.taken, fx);
  } else if (s_.board.withdrawn) {
    // The withdraw came first: nobody has that answer.
    s_.board.published.reset();
    s_.board.published_quorum.reset();
    s_.board.withdrawn = false;
  }
  // Commits trainers left in their slots, after the answer they polled (a commit names the
  // quorum it was made on).
  for (auto& [rank, t] : s_.trainers) {
    if (!t.slot) continue;
    auto it = look.slots.find(rank);
    if (it == look.slots.end()) continue;
    t.board_peer_wait = it->second.peer_wait;
    const auto& c = it->second;
    if (!c.commit_step || *c.commit_step <= t.board_commit_seen) continue;
    t.board_commit_seen = *c.commit_step;
    if (Status st = Commit(t, *c.commit_step, false, c.state_hash, c.tokens, fx); !st.ok()) {
      fx->push_back(Log(fmt::format("board_commit_refused group_rank={} step={} error={}", rank,
                                    *c.commit_step, Q(st.ToString())),
                        kWarn));
    }
  }
}

Result<uint32_t> AgentCore::OnCommit(const CommitInput& in, Effects* fx) {
  auto it = s_.trainers.find(in.group_rank);
  if (it == s_.trainers.end()) {
    return InvalidArgument("group_rank {} has not polled yet", in.group_rank);
  }
  if (in.failed && in.quorum_id != 0 && s_.quorum && in.quorum_id != s_.quorum->quorum_id) {
    fx->push_back(
        Log(fmt::format("outer_step_failed_stale group_rank={} step={} quorum_id={} current={}",
                        in.group_rank, in.step, in.quorum_id, s_.quorum->quorum_id)));
  } else {
    LK_RETURN_IF_ERROR(Commit(it->second, in.step, in.failed, in.state_hash, in.tokens, fx));
  }
  return in.failed ? s_.committed_step : in.step;
}

Status AgentCore::Commit(TrainerState& t, uint32_t step, bool failed, const std::string& hash,
                         uint64_t tokens, Effects* fx) {
  if (!s_.quorum) {
    return Status(Code::kConflict, "no quorum yet: poll first", Reason::kQuorumNotIssued);
  }
  if (hash.size() > 128) return InvalidArgument("state_hash over {} bytes", 128);
  auto queue = [&](uint32_t at, bool fail, std::string h, uint64_t tok) {
    Effect e = Of(Effect::Kind::kQueueCommit);
    e.step = at;
    e.quorum_id = s_.quorum->quorum_id;
    e.failed = fail;
    e.text = std::move(h);
    e.tokens = tok;
    fx->push_back(std::move(e));
  };
  if (failed) {
    // A failed outer step is the group's failure at once: the lighthouse then opens a new
    // round with a new quorum_id instead of handing the same quorum back to a retry.
    queue(step, true, "", 0);
    fx->push_back(Log(fmt::format("outer_step_failed group_rank={} step={} quorum_id={}",
                                  t.group_rank, step, s_.quorum->quorum_id),
                      kWarn));
    return Status::Ok();
  }
  if (t.committed_step && step <= *t.committed_step) {
    return Refuse(Code::kConflict, Reason::kWrongStep, "step {} is not after the committed step {}",
                  step, *t.committed_step);
  }
  t.committed_step = step;
  t.state_hash = hash;
  t.tokens = tokens;
  s_.had_state = true;
  s_.without_state = false;
  // The node commits once all its trainers committed this step.
  bool all = s_.trainers.size() >= ExpectedLocalTrainers();
  uint64_t group_tokens = 0;
  bool one_hash = true;
  for (auto& [r, o] : s_.trainers) {
    all &= o.committed_step == step;
    group_tokens = std::max(group_tokens, o.tokens);
    one_hash &= o.state_hash == s_.trainers.begin()->second.state_hash;
  }
  if (!all) return Status::Ok();
  s_.committed_step = step;
  if (s_.ask.kind == Ask::Kind::kContinued)
    s_.ask.Set(Ask::Kind::kIdle);  // past the step they went on from
  if (s_.ask.kind == Ask::Kind::kBehind && s_.ask.step < step) {
    // The trainers committed past the step the behind ask is for: a quorum it brought would
    // hold the other members in a step this group has left (they would wait in it for good).
    fx->push_back(Of(Effect::Kind::kCancelBehindAsk));
    fx->push_back(
        Log(fmt::format("ask_behind_withdrawn step={} committed_step={}", s_.ask.step, step)));
    s_.ask.Set(Ask::Kind::kIdle);
  }
  // Trainers that all report one hash give the node that hash; otherwise the shell hashes the
  // list of the trainers' hashes (kQueueCommit with an empty text and `fresh` set).
  std::string node_hash;
  if (one_hash) {
    node_hash = s_.trainers.begin()->second.state_hash;
  } else {
    for (auto& [r, o] : s_.trainers) node_hash += o.state_hash + ";";
  }
  queue(step, false, std::move(node_hash), group_tokens);
  fx->back().hash_list = !one_hash;
  // The node's outer step is done: the next round can start now, while the trainers run
  // their inner steps (the shell delivers the commit first).
  AskAhead(step, fx);
  return Status::Ok();
}

Status AgentCore::OnGoodbye(uint32_t group_rank, Effects* fx) {
  auto it = s_.trainers.find(group_rank);
  if (it == s_.trainers.end()) return InvalidArgument("group_rank {} never said hello", group_rank);
  it->second.finished = true;
  bool all_finished = s_.trainers.size() >= ExpectedLocalTrainers();
  for (auto& [r, t] : s_.trainers) all_finished &= t.finished;
  // Every trainer of this node is done: the group leaves cleanly and the agent exits 0.
  if (all_finished) OnDrain(LeaveReason::kFinished, "finished", false, fx);
  return Status::Ok();
}

Status AgentCore::OnPhase(uint32_t group_rank, bool peer_wait) {
  auto it = s_.trainers.find(group_rank);
  if (it == s_.trainers.end()) return InvalidArgument("group_rank {} never said hello", group_rank);
  it->second.peer_wait = peer_wait;
  return Status::Ok();
}

void AgentCore::OnNoticeWait(uint64_t id, uint32_t quorum_id, Effects* fx) {
  s_.notice_waiters[id] = quorum_id;
  AnswerNotices(false, fx);
}

void AgentCore::OnNoticeTimeout(uint64_t id, Effects* fx) {
  auto it = s_.notice_waiters.find(id);
  if (it == s_.notice_waiters.end()) return;
  Effect e = Of(Effect::Kind::kAnswerNotice);
  e.id = id;
  e.notice.quorum_id = it->second;
  s_.notice_waiters.erase(it);
  fx->push_back(std::move(e));
}

void AgentCore::AnswerNotices(bool force, Effects* fx) {
  for (auto it = s_.notice_waiters.begin(); it != s_.notice_waiters.end();) {
    uint32_t qid = it->second;
    bool lost = s_.lost_quorums.count(qid) > 0 || (s_.quorum && s_.quorum->quorum_id > qid);
    if (!force && !lost && !s_.draining) {
      ++it;
      continue;
    }
    Effect e = Of(Effect::Kind::kAnswerNotice);
    e.id = it->first;
    NoticeAnswer& n = e.notice;
    n.quorum_id = qid;
    n.lost = lost;
    n.drain = s_.draining || force;
    n.checkpoint_now = s_.checkpoint_now;
    n.why = s_.draining ? NoticeReason::kDrain
            : lost      ? NoticeReason::kQuorumLost
                        : NoticeReason::kAgentExiting;
    n.reason = s_.draining ? s_.drain_reason : std::string(NoticeReasonName(n.why));
    it = s_.notice_waiters.erase(it);
    fx->push_back(std::move(e));
  }
}

void AgentCore::OnTrainerExited(uint32_t group_rank, int pid, Effects* fx) {
  auto it = s_.trainers.find(group_rank);
  if (it != s_.trainers.end() && it->second.pid == pid) it->second.exited = true;
  bool expected =
      s_.draining || s_.signalled || s_.refusal || (it != s_.trainers.end() && it->second.finished);
  fx->push_back(Log(fmt::format("trainer_exited group_rank={} pid={} during_drain={}", group_rank,
                                pid, expected)));
  if (!expected) Fail(LeaveReason::kTrainerCrashed, "trainer_crashed", fx);
}

// ---- the lighthouse ----

void AgentCore::OnHeartbeat(const HeartbeatAnswer& in, Effects* fx) {
  if (!in.ok) {
    if (LeftWhileDraining(in.error, fx)) return;
    if (in.error.reason() == Reason::kGroupFinished) return OnGroupFinished(in.error.message(), fx);
    // A newer incarnation of this group exists: this life is over.
    if (in.error.code() == Code::kConflict) {
      Fail(LeaveReason::kReplaced, "replaced: " + in.error.message(), fx);
    }
    return;
  }
  if (in.names_this_group) return Fail(LeaveReason::kEvicted, "evicted", fx);
  if (!in.revived_from.empty() && !s_.draining) {
    // The lighthouse did not hear this node for heartbeat_timeout (a stalled host, a slow
    // network) and the quorum went on without the group. That is no reason to end the group:
    // this heartbeat made it healthy again, the watch aborts the trainers' step on the lost
    // quorum, and their next ask joins the next quorum, healing from its peers if behind.
    fx->push_back(
        Log(fmt::format("heartbeat_lapsed lighthouse_reason={} action=rejoin", Q(in.revived_from)),
            kWarn));
  }
  if (in.drain) return OnDrain(LeaveReason::kDrained, "drained", false, fx);
  if (in.round_pending && s_.ask.kind == Ask::Kind::kContinued && !s_.draining) {
    // The trainers went on from this step without a round, and a round is open now: their
    // step cannot finish before it does if a member waits in it.
    uint32_t step = s_.ask.step;
    fx->push_back(Log(fmt::format("ask_behind step={} quorum_id={} reason=round_pending", step,
                                  s_.quorum ? s_.quorum->quorum_id : 0)));
    StartAsk(step, Ask::Kind::kBehind, fx);
  }
}

void AgentCore::OnAskResult(const AskResult& in, Effects* fx) {
  Ask& a = s_.ask;
  const Status& st = in.status;
  const bool current = a.asking() && a.step == in.step && in.serial == a.serial;
  if (st.ok()) {
    s_.told_continuing = false;
    const Quorum& q = in.quorum;
    uint32_t known = a.kind == Ask::Kind::kFetched ? a.fetched->quorum_id
                     : s_.quorum                   ? s_.quorum->quorum_id
                                                   : 0;
    if (known != q.quorum_id) {
      fx->push_back(Log(fmt::format(
          "quorum quorum_id={} replica_rank={} world_size={} heal={} max_step={} ahead={} "
          "reason={}",
          q.quorum_id, q.replica_rank, q.replica_world_size, q.heal, q.max_step,
          a.kind == Ask::Kind::kAhead || a.kind == Ask::Kind::kBehind, Q(q.reason))));
      if (q.diverged_step != 0) {
        fx->push_back(Log(fmt::format("state_diverged step={} quorum_id={} heal={}",
                                      q.diverged_step, q.quorum_id, q.heal),
                          kWarn));
      }
    }
    // The trainers moved to another step while this ask was out (or a drain began): the answer
    // is for a step nobody will poll.
    if (!current) return;
    if (a.kind == Ask::Kind::kBehind) {
      // An answer on the trainers' quorum only tells that the lighthouse caught up. Another
      // quorum means theirs is over: their step on it is aborted, and their next poll (of this
      // step again) is answered from the quorum fetched.
      if (s_.quorum && q.quorum_id == s_.quorum->quorum_id) {
        a.Set(Ask::Kind::kIdle);
        return;
      }
      if (s_.quorum) s_.lost_quorums.insert(s_.quorum->quorum_id);
      a.Set(Ask::Kind::kFetched, in.step, q);
      AnswerNotices(false, fx);
      return;
    }
    if (a.kind == Ask::Kind::kAhead) {
      a.Set(Ask::Kind::kFetched, in.step, q);
      PublishAhead(fx);
      return;
    }
    a.Set(Ask::Kind::kIdle);
    s_.quorum = q;
    s_.phase = Phase::kTraining;
    AnswerPolls(true, fx);
    return;
  }
  if (st.code() == Code::kDeadlineExceeded) return;  // the round is still open: ask again
  if (st.reason() == Reason::kStepDisagreement && current && a.kind == Ask::Kind::kForTrainers) {
    // Another node of this group asked for a later step: its trainers healed (or went on) on an
    // answer this node's never received. This node's state is not the group's: it asks again
    // without state, and the lighthouse heals the group as a whole.
    if (!s_.without_state) {
      s_.without_state = true;
      fx->push_back(
          Log(fmt::format("step_disagreement step={} action=ask_without_state", in.step), kWarn));
    }
    return;
  }
  if (LeftWhileDraining(st, fx)) return;
  if (st.reason() == Reason::kGroupFinished) return OnGroupFinished(st.message(), fx);
  if (st.reason() == Reason::kStaleIncarnation || st.reason() == Reason::kIncarnationReplaced) {
    return Fail(LeaveReason::kReplaced, "replaced: " + st.message(), fx);
  }
  // Evicted for stalled progress while this ask waited: asking again would readmit the group.
  if (st.reason() == Reason::kGroupEvicted) return Fail(LeaveReason::kEvicted, "evicted", fx);
  if (st.reason() == Reason::kGroupSizeMismatch) {
    // The trainers get the lighthouse's words, without the HTTP status the client put first.
    std::string words = st.message();
    if (words.rfind("HTTP ", 0) == 0) {
      if (auto colon = words.find(": "); colon != std::string::npos)
        words = words.substr(colon + 2);
    }
    const Status why(st.code(), words, st.reason());
    fx->push_back(Log(
        fmt::format("quorum_refused code={} reason={}", ReasonName(why.reason()), Q(why.message())),
        LogLevel::kError));
    s_.refusal = why;
    s_.exit_code = 2;
    for (auto& [rank, t] : s_.trainers) {
      if (!t.waiting) continue;
      t.waiting = false;
      Effect e = Of(Effect::Kind::kRefusePoll);
      e.rank = rank;
      e.status = why;
      fx->push_back(std::move(e));
    }
    return OnDrain(LeaveReason::kGroupSizeMismatch, "group_size_mismatch", false, fx);
  }
  // The lighthouse is unreachable: while the membership has not changed (no loss known), the
  // trainers go on with the quorum they have; the next boundary asks again, and a heartbeat
  // that says round_pending asks for this step after all (OnHeartbeat). An ask ahead has no
  // trainer waiting on it: it keeps retrying until they poll.
  // A refusal for a lapsed heartbeat comes from a lighthouse that is there: the quorum is going
  // on without this group, so the ask is retried (the next heartbeat makes the group healthy).
  // A quorum newer than the trainers' that was lost (one fetched ahead, then lost) says theirs
  // is superseded: the others went on to a newer one, and trainers going on with the old one
  // alone would wait in its step for good (the agents' simulation, seed 20147: this node's
  // trainers continued on the old quorum while the group's other node took the next one).
  if (st.code() == Code::kUnavailable && st.reason() != Reason::kGroupUnhealthy && current &&
      s_.quorum && !s_.draining && a.kind == Ask::Kind::kForTrainers &&
      s_.lost_quorums.lower_bound(s_.quorum->quorum_id) == s_.lost_quorums.end()) {
    if (!s_.told_continuing) {
      s_.told_continuing = true;
      fx->push_back(
          Log(fmt::format("lighthouse_unreachable continuing quorum_id={}", s_.quorum->quorum_id),
              kWarn));
    }
    a.Set(Ask::Kind::kContinued, in.step);
    s_.phase = Phase::kTraining;
    AnswerPolls(false, fx);
  }
}

void AgentCore::OnQuorumLost(const LossInput& in, Effects* fx) {
  Ask& a = s_.ask;
  const uint32_t qid = in.quorum_id;
  // Superseded by the quorum fetched ahead: not a loss the trainers must hear of.
  if (a.kind == Ask::Kind::kFetched && qid < a.fetched->quorum_id) return;
  fx->push_back(Log(fmt::format("quorum_lost quorum_id={} notices={}", qid, Q(in.who))));
  s_.lost_quorums.insert(qid);
  if (in.evicted) {
    Withdraw(fx);
    if (a.kind == Ask::Kind::kFetched) a.Set(Ask::Kind::kIdle);
    AnswerNotices(false, fx);
    return Fail(LeaveReason::kEvicted, "evicted", fx);
  }
  // Off the board first: if a trainer took it already, it stands for the node (the take makes
  // it the trainers' quorum), and the notices below abort their step on it.
  if (a.kind == Ask::Kind::kFetched && a.fetched->quorum_id == qid) {
    Withdraw(fx);
    if (!in.names_this_group) {
      // The quorum fetched ahead lost a member before the trainers polled: fetch another.
      uint32_t step = a.step;
      a.Set(Ask::Kind::kIdle);
      AskAhead(step, fx);
    }
  }
  AnswerNotices(false, fx);
}

void AgentCore::OnJobFinished(Effects* fx) {
  OnDrain(LeaveReason::kJobFinished, "job_finished", false, fx);
}

// The answer to a heartbeat or ask that crossed this node's own leave, or another node's leave
// while this one drains too (a preemption warns every node; the first whose trainers saved
// leaves first). The drain goes on under its own reason and exit code: failing here would
// signal trainers in the middle of their save and exit 3 (the Python chaos test's drained
// group, whose heartbeat answer came back after its leave).
bool AgentCore::LeftWhileDraining(const Status& st, Effects* fx) {
  if (!s_.draining) return false;
  // Every refusal that says this life is over agrees with the drain, which ends it on purpose.
  // Once the group's leave is recorded the lighthouse may forget the group, and then it names
  // this life stale rather than left; and a life replaced while it drains must not fail
  // either, or its launcher would start yet another life over the one that replaced it.
  switch (st.reason()) {
    case Reason::kGroupLeft:
    case Reason::kGroupFinished:
    case Reason::kStaleIncarnation:
    case Reason::kIncarnationReplaced:
      break;
    default:
      return false;
  }
  if (!s_.left_heard) {
    s_.left_heard = true;
    fx->push_back(Log(fmt::format("group_left_during_drain detail={}", Q(st.message()))));
  }
  return true;
}

void AgentCore::OnGroupFinished(const std::string& detail, Effects* fx) {
  if (s_.draining) return;
  fx->push_back(Log(fmt::format("group_finished_by_peer detail={}", Q(detail))));
  OnDrain(LeaveReason::kFinished, "finished", false, fx);
}

// ---- life ----

void AgentCore::Fail(LeaveReason why, const std::string& detail, Effects* fx) {
  (void)why;
  s_.exit_code = 3;
  fx->push_back(Log(fmt::format("group_failed reason={}", Q(detail)), kWarn));
  // The group is one failure domain: the surviving local trainers stop too, and the launcher
  // restarts the whole group as a new incarnation.
  fx->push_back(Of(Effect::Kind::kSignalTrainers));
  OnDrain(why, detail, false, fx);
}

void AgentCore::OnDrain(LeaveReason why, const std::string& text, bool checkpoint, Effects* fx) {
  (void)why;
  if (s_.draining) return;
  s_.draining = true;
  s_.checkpoint_now = checkpoint;
  s_.drain_reason = text;
  s_.phase = Phase::kDraining;
  fx->push_back(Log(fmt::format("drain reason={} checkpoint={} trainers={}", text, checkpoint,
                                s_.trainers.size())));
  if (o_.board && !s_.board.closed) {
    // Trainers now poll over the socket and hear of the drain there; one that took the answer
    // already runs its step and hears of it from its notice.
    s_.board.closed = true;
    fx->push_back(Of(Effect::Kind::kCloseBoard));
  }
  AnswerPolls(false, fx);
  AnswerNotices(false, fx);
  if (!checkpoint) {
    // Leave at once so that the other groups' quorum shrinks without a heartbeat timeout, then
    // give the trainers drain_timeout to exit.
    s_.drain_stage = DrainStage::kLeaving;
    Effect e = Of(Effect::Kind::kLeave);
    e.text = text;
    fx->push_back(std::move(e));
    return;
  }
  // A durable save first: the group stays a member until its trainers have saved and exited.
  s_.drain_stage = DrainStage::kWaiting;
  fx->push_back(Of(Effect::Kind::kWaitTrainers));
}

void AgentCore::OnLeaveDone(Effects* fx) {
  if (s_.drain_stage == DrainStage::kLeaving) {
    s_.drain_stage = DrainStage::kWaitingAfterLeave;
    fx->push_back(Of(Effect::Kind::kWaitTrainers));
    return;
  }
  if (s_.drain_stage == DrainStage::kLeavingAfterWait) Exit(fx);
}

void AgentCore::OnTrainersGone(bool all_exited, Effects* fx) {
  if (s_.drain_stage == DrainStage::kWaiting) {
    if (!all_exited) fx->push_back(Log("checkpoint_not_confirmed reason=drain_timeout", kWarn));
    s_.drain_stage = DrainStage::kLeavingAfterWait;
    Effect e = Of(Effect::Kind::kLeave);
    e.text = s_.drain_reason;
    e.checkpoint = true;
    fx->push_back(std::move(e));
    return;
  }
  if (s_.drain_stage == DrainStage::kWaitingAfterLeave) Exit(fx);
}

void AgentCore::Exit(Effects* fx) {
  s_.drain_stage = DrainStage::kExited;
  Effect e = Of(Effect::Kind::kExit);
  e.code = s_.exit_code < 0 ? 0 : s_.exit_code;
  fx->push_back(std::move(e));
}

void AgentCore::OnTick(TimePoint now, Effects* fx) {
  if (s_.said_hello || s_.draining || o_.hello_timeout.count() <= 0) return;
  if (now - s_.started < o_.hello_timeout) return;
  // No trainer came: they failed at start (a mistyped flag, a missing file). Heartbeating on
  // as healthy without ever asking would hold the other groups' first quorum for good.
  fx->push_back(
      Log(fmt::format("no_trainers hello_timeout_ms={}", o_.hello_timeout.count()), kWarn));
  Fail(LeaveReason::kNoTrainers, "no_trainers", fx);
}

}  // namespace lk::agent
