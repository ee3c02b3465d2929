// The shell's side of the core: the core's effects applied in order (answers, the board, asks,
// reports, notices, signals, the leave and the exit), and the wire messages turned into the
// core's plain structs and back. Nothing here decides: every branch is on what an effect says
// or on what the I/O returned.
#include <sys/syscall.h>
#include <unistd.h>

#include <csignal>
#include <xxhash.h>

#include "replica_agent/agent_impl.h"

namespace lk::agent {

std::unique_ptr<AgentCore> Agent::Impl::MakeCore(bool with_board) const {
  CoreOptions o;
  o.group_id = options.group_id;
  o.incarnation = options.incarnation;
  o.node_rank = options.node_rank;
  o.nodes = options.nodes;
  o.ask_ahead = options.ask_ahead;
  o.board = with_board;
  o.board_slots = board::kMaxSlots;
  o.hello_timeout = options.hello_timeout;
  return std::make_unique<AgentCore>(o, std::chrono::steady_clock::now());
}

Quorum Agent::Impl::FromWire(const pb::QuorumResponse& q) const {
  Quorum out;
  out.quorum_id = q.quorum_id();
  out.replica_rank = q.replica_rank();
  out.replica_world_size = q.replica_world_size();
  out.max_step = q.max_step();
  out.heal = q.heal();
  out.initial = q.recovery().initial();
  out.restore_checkpoint = q.recovery().has_restore_checkpoint();
  out.reason = q.reason();
  out.diverged_step = q.diverged_step();
  // Donors come in `sources` (compact answers) or are looked up in the member list; this node
  // fetches from the donor agent of its own rank.
  auto add_source = [&](const pb::Member& m) {
    if (options.node_rank < static_cast<uint32_t>(m.addresses_size())) {
      out.heal_sources.push_back(m.addresses(static_cast<int>(options.node_rank)));
    }
  };
  if (q.sources_size() > 0) {
    for (const auto& m : q.sources()) add_source(m);
  } else {
    for (uint32_t src : q.recovery().source_ranks()) {
      if (src < static_cast<uint32_t>(q.members_size())) add_source(q.members(static_cast<int>(src)));
    }
  }
  return out;
}

pb::TrainerPollResponse Agent::Impl::ToWire(const PollAnswer& a) const {
  pb::TrainerPollResponse r;
  r.set_incarnation(options.incarnation);
  r.set_drain(a.drain);
  r.set_checkpoint_now(a.checkpoint_now);
  r.set_reason(a.reason);
  if (a.drain) return r;
  r.set_quorum_id(a.quorum_id);
  r.set_replica_rank(a.replica_rank);
  r.set_replica_world_size(a.replica_world_size);
  r.set_max_step(a.max_step);
  r.set_reconfigure(a.reconfigure);
  auto it = answers.find(a.quorum_id);
  if (it != answers.end()) {
    *r.mutable_members() = it->second.members();
    *r.mutable_group_sizes() = it->second.group_sizes();
  }
  r.set_heal(a.heal);
  if (a.heal) {
    for (const auto& s : a.heal_sources) r.add_heal_sources(s);
    if (a.restore_checkpoint && it != answers.end()) {
      *r.mutable_restore_checkpoint() = it->second.recovery().restore_checkpoint();
    }
    r.set_initial(a.initial);
  }
  return r;
}

void Agent::Impl::QueueCommit(const Effect& e) {
  pb::CommitRequest c;
  c.set_job(options.job);
  c.set_group_id(options.group_id);
  c.set_incarnation(options.incarnation);
  c.set_node_rank(options.node_rank);
  c.set_quorum_id(e.quorum_id);
  c.set_step(e.step);
  c.set_failed(e.failed);
  // A hash per shard: the node's hash covers the list.
  c.set_state_hash(e.hash_list ? fmt::format("{:016x}", XXH3_64bits(e.text.data(), e.text.size()))
                               : e.text);
  c.set_tokens(e.tokens);
  Report r;
  r.kind = ReportKind::kCommit;
  r.step = e.step;
  r.quorum_id = e.quorum_id;
  r.failed = e.failed;
  r.body = c.SerializeAsString();
  QueueReport(std::move(r));
}

void Agent::Impl::SyncBoard() {
  if (!board) return;
  BoardLook look;
  if (auto t = board->Taken()) look.taken = BoardTicket{t->gen, t->step};
  for (const auto& [rank, t] : core->state().trainers) {
    if (!t.slot) continue;
    BoardLook::SlotLook& s = look.slots[rank];
    if (auto c = board->CommitOf(*t.slot)) {
      s.commit_step = c->step;
      s.state_hash = c->state_hash;
      s.tokens = c->tokens;
    }
    s.peer_wait = board->PeerWait(*t.slot);
  }
  Effects fx;
  core->OnBoardLook(look, &fx);
  Apply(std::move(fx));
}

void Agent::Impl::Apply(Effects fx, const http::Responder* incoming,
                              http::Format incoming_format) {
  for (Effect& e : fx) {
    switch (e.kind) {
      case Effect::Kind::kLog:
        Log(e.level, "{}", e.text);
        break;
      case Effect::Kind::kAnswerPoll:
      case Effect::Kind::kRefusePoll: {
        http::Responder respond;
        http::Format f = incoming_format;
        if (e.incoming) {
          if (incoming) respond = *incoming;
        } else {
          auto it = trainers.find(e.rank);
          if (it == trainers.end() || !it->second.poll_respond) break;
          respond = std::move(it->second.poll_respond);
          it->second.poll_respond = nullptr;
          f = it->second.poll_format;
        }
        if (!respond) break;
        respond(e.kind == Effect::Kind::kAnswerPoll ? http::Reply(ToWire(e.answer), f)
                                                    : http::ErrorReply(e.status, f));
        break;
      }
      case Effect::Kind::kAsk:
        break;  // the quorum thread sends core->PendingAsk() (woken below)
      case Effect::Kind::kCancelBehindAsk:
        if (behind_call) behind_call->Cancel();
        break;
      case Effect::Kind::kQueueCommit:
        QueueCommit(e);
        break;
      case Effect::Kind::kPublishBoard: {
        if (!board) break;
        board::Answer a;
        a.step = e.board_answer.step;
        a.quorum_id = e.board_answer.quorum_id;
        a.replica_rank = e.board_answer.replica_rank;
        a.replica_world_size = e.board_answer.replica_world_size;
        a.max_step = e.board_answer.max_step;
        a.reason = e.board_answer.reason;
        board->Publish(a);
        break;
      }
      case Effect::Kind::kWithdrawBoard:
        if (!board) break;
        if (board->Withdraw()) {
          LK_LOG_INFO("poll_answer_withdrawn step={} quorum_id={}", e.step, e.quorum_id);
        }
        SyncBoard();  // a trainer that took it first: the take stands
        break;
      case Effect::Kind::kTakeFor:
        if (board) board->TakeFor(e.step);
        break;
      case Effect::Kind::kSetConsumed: {
        const auto& ts = core->state().trainers;
        auto it = ts.find(e.rank);
        if (board && it != ts.end() && it->second.slot) board->SetConsumed(*it->second.slot, e.gen);
        break;
      }
      case Effect::Kind::kCloseBoard:
        if (!board) break;
        board->Close();
        SyncBoard();
        break;
      case Effect::Kind::kAnswerNotice: {
        auto it = notice_waiters.find(e.id);
        if (it == notice_waiters.end()) break;
        pb::TrainerNoticeResponse r;
        r.set_quorum_id(e.notice.quorum_id);
        r.set_lost(e.notice.lost);
        r.set_drain(e.notice.drain);
        r.set_checkpoint_now(e.notice.checkpoint_now);
        r.set_reason(e.notice.reason);
        it->second.timer->cancel();
        auto respond = std::move(it->second.respond);
        http::Format f = it->second.format;
        notice_waiters.erase(it);
        respond(http::Reply(r, f));
        break;
      }
      case Effect::Kind::kSignalTrainers:
        // Only processes the agent holds a pidfd for: a pid alone may by now name another
        // process (reused), and a pidfd names exactly the process that connected.
        for (auto& [r, t] : trainers) {
          if (!t.pidfd || t.exited) continue;
          if (::syscall(SYS_pidfd_send_signal, t.pidfd->native_handle(), SIGTERM, nullptr, 0) != 0) {
            LK_LOG_WARN("trainer_signal_failed group_rank={} pid={} errno={}", r, t.pid, errno);
          }
        }
        break;
      case Effect::Kind::kWatchPid:
        WatchPid(e.rank, static_cast<int>(e.id));
        break;
      case Effect::Kind::kLeave: {
        exit_code = core->state().exit_code;
        auto self = shared_from_this();
        Spawn([self, reason = e.text, checkpoint = e.checkpoint] {
          self->SendLeave(reason);
          // after_leave is set once, on the io thread, before the drain that led here.
          if (checkpoint && self->after_leave) self->after_leave();
          self->OnIo([&] {
            Effects next;
            self->core->OnLeaveDone(&next);
            self->Apply(std::move(next));
          });
        });
        break;
      }
      case Effect::Kind::kWaitTrainers:
        WaitForTrainersThen([self = shared_from_this()](bool all_exited) {
          Effects next;
          self->core->OnTrainersGone(all_exited, &next);
          self->Apply(std::move(next));
        });
        break;
      case Effect::Kind::kExit:
        // Finish posts its work to the io thread, which runs it after this returns.
        Finish(e.code);
        break;
    }
  }
  // The threads that wait on the core's state (the quorum, watch and outbox threads, a leave)
  // look again.
  Wake();
  // The lighthouse's answers older than the trainers' quorum are no longer read.
  if (const auto& q = core->state().quorum) {
    uint32_t keep = q->quorum_id;
    if (auto w = core->WatchTarget()) keep = std::min(keep, *w);
    answers.erase(answers.begin(), answers.lower_bound(keep));
  }
}

}  // namespace lk::agent
