// The trainers' API on the agent's Unix socket (the routes of each listener: agent_listeners.cc):
//   POST /v1/trainer/hello   {group_rank, group_size}    register; the peer's pid is watched
//   POST /v1/trainer/poll    {group_rank, group_size, step, mixed_group_sizes}   once per
//                                                              outer step
//   POST /v1/trainer/goodbye {group_rank}                      done: its exit is not a crash
//   POST /v1/trainer/checkpoint {step, location, manifest_digest}  register a durable one
//   POST /v1/trainer/commit  {group_rank, step, failed, state_hash, tokens, quorum_id}
//   GET  /v1/trainer/notice?quorum_id=Q&timeout_ms=T         returns when Q is lost or on drain
//   PUT/GET /v1/trainer/kv/QUORUM_ID/KEY                      the lighthouse rendezvous KV
#include <sys/syscall.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <xxhash.h>

#include "replica_agent/agent_impl.h"

namespace lk::agent {

namespace {

// The phase name the lighthouse's rule 8 knows (lighthouse/lighthouse_core.h, kPhasePeerWait);
// the agent does not link the lighthouse, so the word is repeated here.
constexpr const char* lighthouse_phase_peer_wait = "peer_wait";

template <class Msg>
Status DecodeAs(const http::Request& req, Msg* msg) {
  return http::Decode(req.body, http::BodyFormat(req.content_type), msg);
}

}  // namespace

uint32_t Agent::Impl::ExpectedLocalTrainersLocked() const {
  return std::max<uint32_t>(1, group_size / options.nodes);
}

Status Agent::Impl::Register(uint32_t group_rank, uint32_t size, int pid) {
  if (size == 0) return InvalidArgument("group_size must be at least 1");
  if (group_rank >= size) {
    return InvalidArgument("group_rank {} is not below group_size {}", group_rank, size);
  }
  if (size % options.nodes != 0) {
    return InvalidArgument("group_size {} is not a multiple of the group's {} nodes", size,
                           options.nodes);
  }
  if (group_size != 0 && size != group_size) {
    return InvalidArgument("group_size {} differs from the {} other trainers gave", size, group_size);
  }
  if (!trainers.count(group_rank) && trainers.size() >= size / options.nodes) {
    return InvalidArgument("node already has {} trainers; group_rank {} is one too many",
                           trainers.size(), group_rank);
  }
  group_size = size;
  Trainer& t = trainers[group_rank];
  t.group_rank = group_rank;
  if (board && !t.slot && next_slot < board::kMaxSlots) t.slot = next_slot++;
  if (pid > 0 && t.pid != pid) {
    t.pid = pid;
    t.pidfd.reset();
    WatchPid(t);
  }
  return Status::Ok();
}

// A pidfd becomes readable when the process exits: the agent learns of a trainer's death at
// once, whatever the trainer was doing (even blocked in a collective, or killed with -9).
void Agent::Impl::WatchPid(Trainer& t) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, t.pid, 0));
  if (fd < 0) {
    LK_LOG_WARN("pidfd_open_failed pid={} errno={}", t.pid, errno);
    return;
  }
  t.pidfd = std::make_unique<boost::asio::posix::stream_descriptor>(ioc, fd);
  uint32_t rank = t.group_rank;
  int pid = t.pid;
  t.pidfd->async_wait(boost::asio::posix::stream_descriptor::wait_read,
                      [self = shared_from_this(), rank, pid](const boost::system::error_code& ec) {
                        if (ec || self->stopping) return;
                        bool expected;
                        {
                          std::lock_guard<std::mutex> lock(self->mu);
                          auto it = self->trainers.find(rank);
                          if (it != self->trainers.end() && it->second.pid == pid) {
                            it->second.exited = true;
                          }
                          expected = self->draining || self->signalled || self->refusal ||
                                     (it != self->trainers.end() && it->second.finished);
                        }
                        LK_LOG_INFO("trainer_exited group_rank={} pid={} during_drain={}", rank,
                                    pid, expected);
                        if (!expected) self->Fail("trainer_crashed");
                      });
}

void Agent::Impl::HandleHello(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerHelloRequest in;
  Status st = DecodeAs(req, &in);
  std::lock_guard<std::mutex> lock(mu);
  // The pid to watch is the connected process's, from the kernel: a pid in the body is what the
  // caller says, and watching it would let any caller tie the group's life to another process.
  int pid = PeerPid(req);
  if (st.ok() && in.pid() != 0 && static_cast<int>(in.pid()) != pid) {
    LK_LOG_WARN("trainer_pid_claim_ignored group_rank={} claimed_pid={} peer_pid={}",
                in.group_rank(), in.pid(), pid);
  }
  if (st.ok()) st = Register(in.group_rank(), in.group_size(), pid);
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  pb::TrainerHelloResponse out;
  out.set_incarnation(options.incarnation);
  const Trainer& t = trainers[in.group_rank()];
  if (board && t.slot) {
    out.set_poll_board(board->path());
    out.set_poll_slot(*t.slot);
  }
  respond(http::Reply(out, f));
}

void Agent::Impl::HandleGoodbye(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerHelloRequest in;
  Status st = DecodeAs(req, &in);
  bool all_finished = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    SyncBoardLocked();  // its last commit, if it left it on the board, comes before its goodbye
    if (st.ok() && !trainers.count(in.group_rank())) {
      st = InvalidArgument("group_rank {} never said hello", in.group_rank());
    }
    if (st.ok()) {
      trainers[in.group_rank()].finished = true;
      all_finished = trainers.size() >= ExpectedLocalTrainersLocked();
      for (auto& [r, t] : trainers) all_finished &= t.finished;
    }
  }
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  respond(http::Reply(pb::Empty(), f));
  // Every trainer of this node is done: the group leaves cleanly and the agent exits 0.
  if (all_finished) Drain("finished");
}

pb::TrainerPollResponse Agent::Impl::PollAnswerLocked(Trainer& t, bool fresh_answer) {
  pb::TrainerPollResponse r;
  r.set_incarnation(options.incarnation);
  r.set_drain(draining);
  r.set_checkpoint_now(checkpoint_now);
  if (draining) {
    r.set_reason(drain_reason);
    return r;
  }
  const auto& q = *quorum;
  r.set_quorum_id(q.quorum_id());
  r.set_replica_rank(q.replica_rank());
  r.set_replica_world_size(q.replica_world_size());
  r.set_max_step(q.max_step());
  r.set_reconfigure(t.seen_quorum_id != q.quorum_id());
  *r.mutable_members() = q.members();
  *r.mutable_group_sizes() = q.group_sizes();
  // The plan's heal applies once, to the answer of the round that decided it.
  bool heal = fresh_answer && q.heal() && t.heal_answered_quorum_id != q.quorum_id();
  if (fresh_answer && q.heal()) t.heal_answered_quorum_id = q.quorum_id();
  r.set_heal(heal);
  if (heal) {
    // Donors come in `sources` (compact answers) or are looked up in the member list.
    auto add_source = [&](const pb::Member& m) {
      if (options.node_rank < static_cast<uint32_t>(m.addresses_size())) {
        r.add_heal_sources(m.addresses(static_cast<int>(options.node_rank)));
      }
    };
    if (q.sources_size() > 0) {
      for (const auto& m : q.sources()) add_source(m);
    } else {
      for (uint32_t src : q.recovery().source_ranks()) {
        if (src < static_cast<uint32_t>(q.members_size())) add_source(q.members(static_cast<int>(src)));
      }
    }
    if (q.recovery().has_restore_checkpoint()) {
      *r.mutable_restore_checkpoint() = q.recovery().restore_checkpoint();
    }
    r.set_initial(q.recovery().initial());
  }
  r.set_reason(q.reason());
  t.seen_quorum_id = q.quorum_id();
  return r;
}

void Agent::Impl::AnswerPollsLocked(bool fresh_answer) {
  for (auto& [rank, t] : trainers) {
    if (!t.poll_respond) continue;
    auto respond = std::move(t.poll_respond);
    t.poll_respond = nullptr;
    if (fresh_answer && quorum && quorum->heal()) had_state = true;
    pb::TrainerPollResponse answer = PollAnswerLocked(t, fresh_answer);
    if (t.polled_step) t.sent.emplace(*t.polled_step, answer);
    respond(http::Reply(answer, t.poll_format));
  }
}

void Agent::Impl::HandlePoll(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerPollRequest in;
  Status st = DecodeAs(req, &in);
  std::lock_guard<std::mutex> lock(mu);
  if (st.ok()) st = Register(in.group_rank(), in.group_size(), PeerPid(req));
  if (st.ok() && refusal) st = *refusal;
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  Trainer& t = trainers[in.group_rank()];
  t.mixed_group_sizes = in.mixed_group_sizes();
  if (t.committed_step && in.step() < *t.committed_step) {
    return respond(http::ErrorReply(
        Refuse(Code::kConflict, Reason::kWrongStep,
               "step {} is below this trainer's committed step {}", in.step(), *t.committed_step),
        f));
  }
  for (auto& [rank, other] : trainers) {
    if (rank != in.group_rank() && other.poll_respond && other.polled_step != in.step()) {
      return respond(http::ErrorReply(
          Refuse(Code::kConflict, Reason::kStepDisagreement,
                 "group_rank {} polls step {} but group_rank {} polls step {}",
                 in.group_rank(), in.step(), rank, *other.polled_step),
          f));
    }
  }
  if (t.poll_respond) {
    t.poll_respond(http::ErrorReply(
        Status(Code::kConflict, "superseded by a newer poll", Reason::kRequestSuperseded),
        t.poll_format));
  }
  // A poll that timed out on the trainer's side while its answer was on the way: the answer
  // went nowhere, and without it this poll would wait for a new round that the group's other
  // trainers, who did get it, never join. It gets the same answer while that quorum is still
  // the node's and has lost nobody; otherwise a new round is what it needs, and a drain is
  // answered below.
  if (in.resumed() && t.sent && t.sent->first == in.step() && !draining &&
      !t.sent->second.drain() && quorum && quorum->quorum_id() == t.sent->second.quorum_id() &&
      !lost_quorums.count(t.sent->second.quorum_id())) {
    LK_LOG_INFO("poll_answer_resent group_rank={} step={} quorum_id={}", in.group_rank(),
                in.step(), t.sent->second.quorum_id());
    t.polled_step = in.step();
    return respond(http::Reply(t.sent->second, f));
  }
  t.sent.reset();  // kept until this poll only
  SyncBoardLocked();
  if (board && t.slot && !draining) {
    // The node's answer for this step is on the board (up, or taken by another local trainer)
    // and this trainer has not had it: it gets that answer at once, as if it had read the
    // board itself. A trainer that had it already polls again because its step failed, and
    // goes through the barrier below to a new round.
    if (!handed || handed->step != in.step()) {
      if (board->TakeFor(in.step())) SyncBoardLocked();
    }
    if (handed && handed->step == in.step() && board->Consumed(*t.slot) != handed->gen) {
      board->SetConsumed(*t.slot, handed->gen);
      t.polled_step = in.step();
      if (t.poll_respond) t.poll_respond = nullptr;  // superseded above
      t.sent.emplace(in.step(), PollAnswerLocked(t, false));
      return respond(http::Reply(t.sent->second, f));
    }
  }
  t.polled_step = in.step();
  t.poll_respond = std::move(respond);
  t.poll_format = f;
  if (draining) return AnswerPollsLocked(false);
  uint32_t waiting = 0;
  for (auto& [rank, other] : trainers) waiting += other.poll_respond && other.polled_step == in.step();
  if (waiting < ExpectedLocalTrainersLocked()) return;
  // Every local trainer reached the boundary. The group takes part in a lighthouse round at
  // every outer step: the round is a barrier across groups, so every group takes the same
  // decision at the same step (going on with a cached quorum while another group waits in a
  // round would leave the two blocked on each other). Normally the round already happened:
  // the agent asked right after the node committed (AskAheadLocked), while the trainers ran
  // their inner steps, and the poll is answered from that.
  if (ahead && ahead_step == in.step() && !lost_quorums.count(ahead->quorum_id())) {
    WithdrawBoardLocked();
    if (ahead) {
      quorum = std::move(*ahead);
      ahead.reset();
    }
    phase = "training";
    AnswerPollsLocked(true);
    cv.notify_all();
    return;
  }
  WithdrawBoardLocked();
  ahead.reset();  // lost, or fetched for another step
  if (ask_needed && ask_step == in.step()) {
    // The ask is on its way: its answer now goes to these polls (an ask behind them, too:
    // they came back to its step, their step on from it having failed).
    ask_ahead = false;
    ask_behind = false;
    phase = "quorum";
    cv.notify_all();
    return;
  }
  AskLocked(in.step(), /*ahead_of_trainers=*/false);
}

void Agent::Impl::AskLocked(uint32_t step, bool ahead_of_trainers) {
  WithdrawBoardLocked();
  ahead.reset();
  ask_needed = true;
  ask_step = step;
  ask_ahead = ahead_of_trainers;
  ask_behind = false;
  continued_step.reset();
  if (behind_call) behind_call->Cancel();
  cv.notify_all();
}

void Agent::Impl::AskAheadLocked(uint32_t step) {
  if (options.ask_ahead && !draining) AskLocked(step, /*ahead_of_trainers=*/true);
}

void Agent::Impl::SyncBoardLocked() {
  if (!board) return;
  ApplyTakenLocked();
  // Commits trainers left in their slots, after the answer they polled (a commit names the
  // quorum it was made on).
  for (auto& [rank, t] : trainers) {
    if (!t.slot) continue;
    auto c = board->CommitOf(*t.slot);
    if (!c || c->step <= t.board_commit_seen) continue;
    t.board_commit_seen = c->step;
    if (Status st = CommitLocked(t, c->step, false, c->state_hash, c->tokens); !st.ok()) {
      LK_LOG_WARN("board_commit_refused group_rank={} step={} error={}", rank, c->step, Q(st.ToString()));
    }
  }
}

void Agent::Impl::ApplyTakenLocked() {
  auto taken = board->Taken();
  if (!taken || (handed && handed->gen == taken->gen)) return;
  handed = taken;
  // What answering the node's polls from `ahead` does on the socket path (HandlePoll).
  if (ahead && ahead_step == taken->step) {
    quorum = std::move(*ahead);
    ahead.reset();
  }
  if (!draining) phase = "training";
  for (auto& [rank, t] : trainers) t.polled_step = taken->step;
  cv.notify_all();
}

void Agent::Impl::PublishAheadLocked() {
  if (!board || draining) return;
  SyncBoardLocked();
  if (!ahead || !quorum || lost_quorums.count(ahead->quorum_id())) return;
  // Only the unchanged case: a new quorum_id (the trainers rebuild their communicator) or a
  // heal carries more than the board holds, and goes over the socket.
  if (ahead->quorum_id() != quorum->quorum_id() || ahead->heal()) return;
  if (handed && handed->step == ahead_step) return;  // the node had its answer for this step
  if (trainers.size() < ExpectedLocalTrainersLocked()) return;
  for (auto& [rank, t] : trainers) {
    // A trainer already waiting on the socket is answered there, with the others (barrier).
    if (!t.slot || t.poll_respond || t.exited || t.seen_quorum_id != ahead->quorum_id()) return;
  }
  board::Answer a;
  a.step = ahead_step;
  a.quorum_id = ahead->quorum_id();
  a.replica_rank = ahead->replica_rank();
  a.replica_world_size = ahead->replica_world_size();
  a.max_step = ahead->max_step();
  a.reason = ahead->reason();
  board->Publish(a);
}

void Agent::Impl::WithdrawBoardLocked() {
  if (!board) return;
  if (board->Withdraw()) {
    LK_LOG_INFO("poll_answer_withdrawn step={} quorum_id={}", ahead_step, ahead ? ahead->quorum_id() : 0);
  }
  ApplyTakenLocked();
}

bool Agent::Impl::NamesThisGroup(const pb::FailureNotice& n) const {
  return n.group_id() == options.group_id && n.incarnation() == options.incarnation;
}

std::optional<uint32_t> Agent::Impl::WatchTargetLocked() const {
  if (ahead) return ahead->quorum_id();
  if (quorum) return quorum->quorum_id();
  return std::nullopt;
}

void Agent::Impl::HandleCommit(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerCommitRequest in;
  Status st = DecodeAs(req, &in);
  std::lock_guard<std::mutex> lock(mu);
  SyncBoardLocked();
  if (st.ok() && !trainers.count(in.group_rank())) {
    st = InvalidArgument("group_rank {} has not polled yet", in.group_rank());
  }
  if (st.ok() && in.failed() && in.quorum_id() != 0 && quorum &&
      in.quorum_id() != quorum->quorum_id()) {
    LK_LOG_INFO("outer_step_failed_stale group_rank={} step={} quorum_id={} current={}",
                in.group_rank(), in.step(), in.quorum_id(), quorum->quorum_id());
  } else if (st.ok()) {
    st = CommitLocked(trainers[in.group_rank()], in.step(), in.failed(), in.state_hash(),
                      in.tokens());
  }
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  pb::TrainerCommitResponse out;
  out.set_committed_step(in.failed() ? committed_step : in.step());
  respond(http::Reply(out, f));
}

Status Agent::Impl::CommitLocked(Trainer& t, uint32_t step, bool failed,
                                 const std::string& state_hash, uint64_t tokens) {
  if (!quorum) {
    return Status(Code::kConflict, "no quorum yet: poll first", Reason::kQuorumNotIssued);
  }
  if (state_hash.size() > board::kMaxStateHash) {
    return InvalidArgument("state_hash over {} bytes", board::kMaxStateHash);
  }
  if (failed) {
    // A failed outer step (its communicator could not be built, or a collective failed with
    // no notice) is the group's failure at once: the lighthouse then opens a new round with a
    // new quorum_id instead of handing the same quorum back to a retry. Nothing is committed.
    QueueCommitLocked(step, /*failed=*/true, "");
    LK_LOG_WARN("outer_step_failed group_rank={} step={} quorum_id={}", t.group_rank, step,
                quorum->quorum_id());
    return Status::Ok();
  }
  if (t.committed_step && step <= *t.committed_step) {
    return Refuse(Code::kConflict, Reason::kWrongStep,
                  "step {} is not after the committed step {}", step, *t.committed_step);
  }
  t.committed_step = step;
  t.state_hash = state_hash;
  t.tokens = tokens;
  had_state = true;
  // The node commits once all its trainers committed this step; its hash covers all shards.
  bool all = trainers.size() >= ExpectedLocalTrainersLocked();
  std::string hashes;
  // Every trainer reports the group's count (the library sums it over the group); the largest
  // stands for the node, so one trainer that left it out does not zero it.
  uint64_t group_tokens = 0;
  for (auto& [r, o] : trainers) {
    all &= o.committed_step == step;
    hashes += o.state_hash + ";";
    group_tokens = std::max(group_tokens, o.tokens);
  }
  if (all) {
    committed_step = step;
    continued_step.reset();  // the trainers are past the step they went on from
    // Trainers that all report one hash (the DiLoCo library's hash of the whole global weights)
    // give the node that hash, so that nodes of groups of different sizes compare equal;
    // otherwise (a hash per shard) the node's hash covers the list.
    bool one_hash = true;
    for (auto& [r, o] : trainers) one_hash &= o.state_hash == trainers.begin()->second.state_hash;
    QueueCommitLocked(step, /*failed=*/false,
                      one_hash ? trainers.begin()->second.state_hash
                               : fmt::format("{:016x}", XXH3_64bits(hashes.data(), hashes.size())),
                      group_tokens);
    // The node's outer step is done: the next round can start now, while the trainers run
    // their inner steps (the quorum loop sends the commit first).
    AskAheadLocked(step);
  }
  return Status::Ok();
}

void Agent::Impl::QueueCommitLocked(uint32_t step, bool failed, std::string state_hash,
                                    uint64_t tokens) {
  pb::CommitRequest c;
  c.set_job(options.job);
  c.set_group_id(options.group_id);
  c.set_incarnation(options.incarnation);
  c.set_node_rank(options.node_rank);
  c.set_quorum_id(quorum->quorum_id());
  c.set_step(step);
  c.set_failed(failed);
  c.set_state_hash(std::move(state_hash));
  c.set_tokens(tokens);
  Report r;
  r.kind = ReportKind::kCommit;
  r.step = step;
  r.quorum_id = c.quorum_id();
  r.failed = failed;
  r.body = c.SerializeAsString();
  QueueReportLocked(std::move(r));
}

void Agent::Impl::AnswerNoticesLocked(bool force) {
  for (auto it = notice_waiters.begin(); it != notice_waiters.end();) {
    bool lost = lost_quorums.count(it->second.quorum_id) > 0 ||
                (quorum && quorum->quorum_id() > it->second.quorum_id);
    if (!force && !lost && !draining) {
      ++it;
      continue;
    }
    pb::TrainerNoticeResponse r;
    r.set_quorum_id(it->second.quorum_id);
    r.set_lost(lost);
    r.set_drain(draining || force);
    r.set_checkpoint_now(checkpoint_now);
    r.set_reason(draining ? drain_reason : lost ? "quorum_lost" : "agent_exiting");
    it->second.timer->cancel();
    auto respond = std::move(it->second.respond);
    http::Format f = it->second.format;
    it = notice_waiters.erase(it);
    respond(http::Reply(r, f));
  }
}

void Agent::Impl::DrainTrainersLocked() {
  if (board) {
    // Trainers now poll over the socket and hear of the drain there; one that took the answer
    // already runs its step and hears of it from its notice.
    board->Close();
    SyncBoardLocked();
  }
  AnswerPollsLocked(false);
  AnswerNoticesLocked(false);
}

void Agent::Impl::HandleNotice(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  // The lighthouse's parser: "-1" or a value past 2^32 - 1 is refused, never wrapped.
  auto qid_or = http::ParseU32(req.query, "quorum_id", 0);
  auto timeout_or = http::ParseU32(req.query, "timeout_ms", 30'000);
  if (!qid_or.ok()) return respond(http::ErrorReply(qid_or.status(), f));
  if (!timeout_or.ok()) return respond(http::ErrorReply(timeout_or.status(), f));
  uint32_t qid = *qid_or, timeout_ms = *timeout_or;
  std::lock_guard<std::mutex> lock(mu);
  SyncBoardLocked();
  uint64_t id = next_id++;
  auto timer = std::make_unique<boost::asio::steady_timer>(ioc, Millis(std::min(timeout_ms, 300'000u)));
  timer->async_wait([self = shared_from_this(), id, qid](const boost::system::error_code& ec) {
    if (ec) return;
    std::lock_guard<std::mutex> lock(self->mu);
    auto it = self->notice_waiters.find(id);
    if (it == self->notice_waiters.end()) return;
    pb::TrainerNoticeResponse r;
    r.set_quorum_id(qid);
    auto respond = std::move(it->second.respond);
    http::Format f = it->second.format;
    self->notice_waiters.erase(it);
    respond(http::Reply(r, f));
  });
  notice_waiters.emplace(id, NoticeWaiter{id, qid, std::move(respond), f, std::move(timer)});
  AnswerNoticesLocked(false);
}

void Agent::Impl::HandlePhase(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerPhaseRequest in;
  Status st = DecodeAs(req, &in);
  std::lock_guard<std::mutex> lock(mu);
  SyncBoardLocked();
  if (st.ok() && !trainers.count(in.group_rank())) {
    st = InvalidArgument("group_rank {} never said hello", in.group_rank());
  }
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  // The node waits on peers when every local trainer does; the next heartbeat says so.
  trainers[in.group_rank()].peer_wait = in.peer_wait();
  respond(http::Reply(pb::Empty(), f));
}

std::string Agent::Impl::ReportedPhaseLocked() const {
  if (phase != "training") return phase;
  bool all = trainers.size() >= ExpectedLocalTrainersLocked();
  for (const auto& [r, t] : trainers) {
    all &= t.peer_wait || (board && t.slot && board->PeerWait(*t.slot));
  }
  return all ? lighthouse_phase_peer_wait : phase;
}

}  // namespace lk::agent
