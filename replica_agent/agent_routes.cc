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

template <class Msg>
Status DecodeAs(const http::Request& req, Msg* msg) {
  return http::Decode(req.body, http::BodyFormat(req.content_type), msg);
}

}  // namespace

// A pidfd becomes readable when the process exits: the agent learns of a trainer's death at
// once, whatever the trainer was doing (even blocked in a collective, or killed with -9).
void Agent::Impl::WatchPid(uint32_t rank, int pid) {
  Trainer& t = trainers[rank];
  t.pid = pid;
  t.exited = false;
  t.pidfd.reset();
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) {
    LK_LOG_WARN("pidfd_open_failed pid={} errno={}", pid, errno);
    return;
  }
  t.pidfd = std::make_unique<boost::asio::posix::stream_descriptor>(ioc, fd);
  t.pidfd->async_wait(boost::asio::posix::stream_descriptor::wait_read,
                      [self = shared_from_this(), rank, pid](const boost::system::error_code& ec) {
                        if (ec || self->stopping) return;
                        auto it = self->trainers.find(rank);
                        if (it != self->trainers.end() && it->second.pid == pid) {
                          it->second.exited = true;
                        }
                        Effects fx;
                        self->core->OnTrainerExited(rank, pid, &fx);
                        self->Apply(std::move(fx));
                      });
}

void Agent::Impl::HandleHello(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerHelloRequest in;
  Status st = DecodeAs(req, &in);
  // The pid to watch is the connected process's, from the kernel: a pid in the body is what the
  // caller says, and watching it would let any caller tie the group's life to another process.
  int pid = PeerPid(req);
  if (st.ok() && in.pid() != 0 && static_cast<int>(in.pid()) != pid) {
    LK_LOG_WARN("trainer_pid_claim_ignored group_rank={} claimed_pid={} peer_pid={}",
                in.group_rank(), in.pid(), pid);
  }
  Effects fx;
  if (st.ok()) st = core->OnHello(in.group_rank(), in.group_size(), pid, &fx);
  Apply(std::move(fx));
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  pb::TrainerHelloResponse out;
  out.set_incarnation(options.incarnation);
  if (!options.gateway.empty()) {
    // The trainers' cross-site exchange goes through the same gateway. The token goes only to
    // a process of the agent's own uid (the socket is 0600 and its peers are checked).
    out.set_gateway(lighthouse_url);
    out.set_gateway_token(token);
    out.set_job(options.job);
    out.set_gateway_ca_file(options.ca_file);
  }
  const TrainerState& t = core->state().trainers.at(in.group_rank());
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
  SyncBoard();  // its last commit, if it left it on the board, comes before its goodbye
  Effects fx;
  if (st.ok()) st = core->OnGoodbye(in.group_rank(), &fx);
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  respond(http::Reply(pb::Empty(), f));
  // Every trainer of this node is done: the group leaves cleanly and the agent exits 0.
  Apply(std::move(fx));
}

void Agent::Impl::HandlePoll(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerPollRequest in;
  Status st = DecodeAs(req, &in);
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  SyncBoard();
  PollInput p;
  p.group_rank = in.group_rank();
  p.group_size = in.group_size();
  p.step = in.step();
  p.pid = PeerPid(req);
  p.mixed_group_sizes = in.mixed_group_sizes();
  p.resumed = in.resumed();
  if (board) {
    if (auto r = board->Ready()) p.board_ready = BoardTicket{r->gen, r->step};
    auto it = core->state().trainers.find(in.group_rank());
    if (it != core->state().trainers.end() && it->second.slot) {
      p.board_consumed = board->Consumed(*it->second.slot);
    }
  }
  Effects fx;
  core->OnPoll(p, std::chrono::steady_clock::now(), &fx);
  // The poll waits unless an effect answers it: its responder is the rank's waiting one then.
  bool answered = false;
  for (const Effect& e : fx) {
    answered |= e.incoming &&
                (e.kind == Effect::Kind::kAnswerPoll || e.kind == Effect::Kind::kRefusePoll);
  }
  if (answered) return Apply(std::move(fx), &respond, f);
  // Registered by now (the core accepted the poll): the responder waits with its trainer.
  // Effects that supersede the rank's earlier poll come first in `fx` and answer that one.
  size_t i = 0;
  for (; i < fx.size(); ++i) {
    if (fx[i].kind == Effect::Kind::kRefusePoll && !fx[i].incoming &&
        fx[i].rank == in.group_rank()) {
      break;
    }
  }
  if (i < fx.size()) {
    Effects first(fx.begin(), fx.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    Apply(std::move(first));
    fx.erase(fx.begin(), fx.begin() + static_cast<std::ptrdiff_t>(i) + 1);
  }
  Trainer& t = trainers[in.group_rank()];
  t.poll_respond = std::move(respond);
  t.poll_format = f;
  Apply(std::move(fx));
}

bool Agent::Impl::NamesThisGroup(const pb::FailureNotice& n) const {
  return n.group_id() == options.group_id && n.incarnation() == options.incarnation;
}

void Agent::Impl::HandleCommit(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerCommitRequest in;
  Status st = DecodeAs(req, &in);
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  SyncBoard();
  CommitInput c;
  c.group_rank = in.group_rank();
  c.step = in.step();
  c.quorum_id = in.quorum_id();
  c.failed = in.failed();
  c.state_hash = in.state_hash();
  c.tokens = in.tokens();
  Effects fx;
  auto committed = core->OnCommit(c, &fx);
  Apply(std::move(fx));
  if (!committed.ok()) return respond(http::ErrorReply(committed.status(), f));
  pb::TrainerCommitResponse out;
  out.set_committed_step(*committed);
  respond(http::Reply(out, f));
}

void Agent::Impl::HandleNotice(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  // The lighthouse's parser: "-1" or a value past 2^32 - 1 is refused, never wrapped.
  auto qid_or = http::ParseU32(req.query, "quorum_id", 0);
  auto timeout_or = http::ParseU32(req.query, "timeout_ms", 30'000);
  if (!qid_or.ok()) return respond(http::ErrorReply(qid_or.status(), f));
  if (!timeout_or.ok()) return respond(http::ErrorReply(timeout_or.status(), f));
  uint32_t qid = *qid_or, timeout_ms = *timeout_or;
  SyncBoard();
  uint64_t id = next_id++;
  auto timer = std::make_unique<boost::asio::steady_timer>(ioc, Millis(std::min(timeout_ms, 300'000u)));
  timer->async_wait([self = shared_from_this(), id](const boost::system::error_code& ec) {
    if (ec) return;
    Effects fx;
    self->core->OnNoticeTimeout(id, &fx);
    self->Apply(std::move(fx));
  });
  notice_waiters.emplace(id, NoticeWaiter{id, qid, std::move(respond), f, std::move(timer)});
  Effects fx;
  core->OnNoticeWait(id, qid, &fx);
  Apply(std::move(fx));
}

void Agent::Impl::HandlePhase(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::TrainerPhaseRequest in;
  Status st = DecodeAs(req, &in);
  SyncBoard();
  // The node waits on peers when every local trainer does; the next heartbeat says so.
  if (st.ok()) st = core->OnPhase(in.group_rank(), in.peer_wait());
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  respond(http::Reply(pb::Empty(), f));
}

}  // namespace lk::agent
