#include "replica_agent/agent.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <algorithm>
#include <random>

#include "common/flags.h"
#include "replica_agent/agent_impl.h"

namespace lk::agent {

namespace {

std::string RandomHex(int n) {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^
                                          static_cast<uint64_t>(getpid()) << 32);
  std::string out;
  for (int i = 0; i < n; ++i) out += "0123456789abcdef"[rng() % 16];
  return out;
}

}  // namespace

std::string MakeIncarnation(uint32_t nodes) {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (job != nullptr && *job != '\0') {
    const char* restarts = std::getenv("SLURM_RESTART_COUNT");
    // Every node of one Slurm job life computes the same id; a requeue changes it.
    return fmt::format("slurm-{}-r{}", job, restarts && *restarts ? restarts : "0");
  }
  (void)nodes;
  char host[64] = {};
  gethostname(host, sizeof(host) - 1);
  std::string h = host;
  for (char& c : h) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') c = '-';
  }
  return fmt::format("{}-{}-{}", h.substr(0, 32), getpid(), RandomHex(6));
}

Agent::Agent(AgentOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}
Agent::~Agent() = default;

http::Handler Agent::trainer_handler() const {
  return [impl = impl_](http::Request&& r, http::Responder w) {
    impl->TrainerRoute(std::move(r), std::move(w));
  };
}

http::Handler Agent::peer_handler() const {
  return [impl = impl_](http::Request&& r, http::Responder w) {
    impl->PeerRoute(std::move(r), std::move(w));
  };
}

boost::asio::io_context& Agent::io_context() { return impl_->ioc; }
Status Agent::Start() { return impl_->Start(); }
int Agent::Run() { return impl_->Run(); }
void Agent::Drain(const std::string& reason, bool checkpoint, std::function<void()> after_leave) {
  impl_->Drain(reason, checkpoint, std::move(after_leave));
}
void Agent::SignalArrived() {
  impl_->signalled = true;
  impl_->cv.notify_all();  // a final-report wait shortens to the quick bound (SendLeave)
}
const std::string& Agent::incarnation() const { return impl_->options.incarnation; }

std::shared_ptr<http::Client> Agent::Impl::CancellableLighthouseClient() {
  auto c = http::Client::Create(options.lighthouse, lighthouse_client_options);
  LK_CHECK(c.ok()) << c.status().ToString();  // the URL and CA were validated at start
  http::Client* raw = c->release();
  std::lock_guard<std::mutex> lock(clients_mu);
  clients.insert(raw);
  if (clients_cancelled) raw->Cancel();
  // The Impl outlives every thread that holds one of these (each holds the Impl too).
  return std::shared_ptr<http::Client>(raw, [this](http::Client* p) {
    {
      std::lock_guard<std::mutex> lock(clients_mu);
      clients.erase(p);
    }
    delete p;
  });
}

void Agent::Impl::CancelLighthouseClients() {
  std::lock_guard<std::mutex> lock(clients_mu);
  clients_cancelled = true;
  for (http::Client* c : clients) c->Cancel();
}

void Agent::Impl::Spawn(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(threads_mu);
  threads.emplace_back(std::move(fn));
}

void Agent::Impl::JoinThreads() {
  // A thread may still start one (a drain's leave): join until none is left.
  while (true) {
    std::vector<std::thread> batch;
    {
      std::lock_guard<std::mutex> lock(threads_mu);
      batch.swap(threads);
    }
    if (batch.empty()) return;
    for (auto& t : batch) t.join();
  }
}

Millis Agent::Impl::Backoff(int attempt) {
  // Capped exponential backoff with full jitter, so that many agents that lost the lighthouse
  // at once do not come back in lockstep.
  static thread_local std::mt19937 rng(std::random_device{}());
  int64_t cap = std::min<int64_t>(options.backoff_max.count(), int64_t{50} << std::min(attempt, 10));
  return Millis(std::uniform_int_distribution<int64_t>(cap / 2, cap)(rng));
}

Status Agent::Impl::Start() {
  if (!options.token_file.empty()) {
    LK_ASSIGN_OR_RETURN(token, ReadTokenFile(options.token_file));
  }
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return InvalidArgument("--tls-cert-file and --tls-key-file go together");
  }
  if (options.workers == 0) return InvalidArgument("--workers must be at least 1");
  lighthouse_client_options.token = token;
  lighthouse_client_options.ca_file = options.ca_file;
  // A bad URL or an unreadable CA file is an error now, not in a thread later.
  LK_RETURN_IF_ERROR(http::Client::Create(options.lighthouse, lighthouse_client_options).status());
  if (token.empty() && !options.serve.empty()) {
    LK_LOG_WARN("agent_serve_open reason=no_token_file detail={}",
                Q("without --token-file, --serve answers status and shard reads to anyone"));
  }
  workers = std::make_unique<WorkerPool>(options.workers, options.worker_queue_max);
  // Run() is the only thread on ioc, so connections need no strands.
  http::ServerOptions server_options;
  server_options.single_thread = true;
  auto self = shared_from_this();
  socket_server = std::make_unique<http::Server>(
      ioc, server_options, [self](http::Request&& r, http::Responder w) {
        self->TrainerRoute(std::move(r), std::move(w));
      });
  LK_RETURN_IF_ERROR(socket_server->Listen("unix:" + options.socket));
  if (options.poll_board) {
    // Without a board the trainers poll over the socket, slower but the same answers.
    auto b = board::Board::Create(options.socket + ".board");
    if (b.ok()) {
      board = std::move(*b);
    } else {
      LK_LOG_WARN("poll_board_unavailable error={}", Q(b.status().ToString()));
    }
  }
  if (!options.serve_dir.empty()) {
    ckpt::ShardServerOptions so;
    so.base_dir = options.serve_dir;
    shard_server = std::make_unique<ckpt::ShardServer>(so);
  }
  if (!options.serve.empty()) {
    http::ServerOptions peer_options = server_options;
    peer_options.tls_cert_file = options.tls_cert_file;
    peer_options.tls_key_file = options.tls_key_file;
    peer_server = std::make_unique<http::Server>(
        ioc, peer_options, [self](http::Request&& r, http::Responder w) {
          self->PeerRoute(std::move(r), std::move(w));
        });
    LK_RETURN_IF_ERROR(peer_server->Listen(options.serve));
    if (options.advertise.empty()) {
      options.advertise = options.tls_cert_file.empty()
                              ? peer_server->LocalAddress()
                              : "https://" + peer_server->LocalAddress();
    }
  }
  LK_LOG_INFO("agent_listening socket={} serve={} advertise={} incarnation={} serve_tls={}",
              options.socket, peer_server ? peer_server->LocalAddress() : "", options.advertise,
              options.incarnation, !options.tls_cert_file.empty());
  Spawn([self] { self->HeartbeatLoop(); });
  Spawn([self] { self->QuorumLoop(); });
  Spawn([self] { self->WatchLoop(); });
  Spawn([self] { self->OutboxLoop(); });
  if (board) Spawn([self] { self->BoardLoop(); });
  return Status::Ok();
}

int Agent::Impl::Run() {
  ioc.run();
  // The lighthouse threads may sit in a long-poll: cancelled, they return at once and are
  // joined, as are the pool's workers and any leave still on its way.
  {
    // Under mu: a loop between its predicate check and its wait must not miss this.
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  cv.notify_all();
  if (board) board->RingDoorbell();
  CancelLighthouseClients();
  if (workers) workers->Stop();
  JoinThreads();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!outbox.empty()) {
      LK_LOG_WARN("outbox_undelivered pending={} delivered={} dropped={} {}", outbox.size(),
                  outbox_delivered, outbox.dropped(), outbox.Summary());
    }
  }
  return exit_code.load() < 0 ? 0 : exit_code.load();
}

void Agent::Impl::HeartbeatLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  while (!stopping) {
    pb::HeartbeatRequest hb;
    {
      std::lock_guard<std::mutex> lock(mu);
      // After a drain the group has left: a heartbeat now would only be refused as stale.
      if (draining) return;
      SyncBoardLocked();
      hb.set_step(committed_step);
      hb.set_phase(ReportedPhaseLocked());
    }
    hb.set_job(options.job);
    hb.set_group_id(options.group_id);
    hb.set_incarnation(options.incarnation);
    hb.set_node_rank(options.node_rank);
    hb.set_nodes(options.nodes);
    hb.set_address(options.advertise);
    hb.set_generation(generation.load());
    pb::HeartbeatResponse resp;
    Status st = client->Call("POST", "/v1/heartbeat", hb, &resp, Millis(5000));
    Millis wait = options.heartbeat_interval;
    if (st.ok()) {
      if (failures > 0) LK_LOG_INFO("lighthouse_reachable after_failures={}", failures);
      failures = 0;
      if (resp.generation() != 0) generation = resp.generation();
      bool evicted = false;
      for (const auto& n : resp.notices()) evicted |= NamesThisGroup(n);
      if (evicted) {
        Fail("evicted");
        return;
      }
      if (resp.drain()) {
        Drain("drained");
        return;
      }
      if (resp.round_pending()) {
        std::lock_guard<std::mutex> lock(mu);
        if (continued_step && !ask_needed && !draining) {
          // See QuorumLoop: the trainers went on from this step without a round, and a round
          // is open now. Their step cannot finish before it does if a member waits in it.
          LK_LOG_INFO("ask_behind step={} quorum_id={} reason=round_pending", *continued_step,
                      quorum ? quorum->quorum_id() : 0);
          AskLocked(*continued_step, /*ahead_of_trainers=*/true);
          ask_behind = true;
        }
      }
    } else if (st.code() == Code::kConflict) {
      // A newer incarnation of this group exists: this life is over.
      Fail("replaced: " + st.message());
      return;
    } else {
      if (failures++ == 0) LK_LOG_WARN("heartbeat_failed error={}", Q(st.ToString()));
      wait = std::min(wait, Backoff(failures));
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, wait, [&] { return stopping.load(); });
  }
}

void Agent::Impl::QuorumLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  // Whether this run of failures has said it goes on with the quorum it has: its first failure
  // may have been an ask ahead, which does not go on, so the count alone cannot tell.
  bool told_continuing = false;
  while (!stopping) {
    uint32_t step;
    bool fresh;
    bool was_ahead;
    {
      std::unique_lock<std::mutex> lock(mu);
      // An ask ahead waits until the node's commit reached the lighthouse, so that a new
      // quorum never overtakes the commit of the step before it.
      cv.wait(lock, [&] {
        return stopping.load() ||
               (ask_needed && !draining && (!ask_ahead || !outbox.Holds(ReportKind::kCommit)));
      });
      if (stopping) return;
      step = ask_step;
      fresh = !had_state && step == 0;
      was_ahead = ask_ahead;
      if (!ask_ahead) phase = "quorum";
    }
    pb::QuorumRequest q;
    q.set_job(options.job);
    q.set_group_id(options.group_id);
    q.set_incarnation(options.incarnation);
    q.set_node_rank(options.node_rank);
    q.set_nodes(options.nodes);
    q.set_step(step);
    q.set_timeout_ms(static_cast<uint32_t>(options.quorum_timeout.count()));
    q.set_address(options.advertise);
    q.set_fresh(fresh);
    q.set_compact(true);  // the agent needs its donors' addresses, not the whole member list
    q.set_generation(generation.load());
    {
      std::lock_guard<std::mutex> lock(mu);
      q.set_group_size(group_size);
      q.set_mixed_group_sizes(!trainers.empty() &&
                              std::all_of(trainers.begin(), trainers.end(), [](const auto& kv) {
                                return kv.second.mixed_group_sizes;
                              }));
    }
    // An ask behind the trainers goes on a client of its own, which a newer ask cancels: the
    // lighthouse must not keep a step the trainers have left as this group's ask.
    std::shared_ptr<http::Client> behind_client;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (ask_behind && ask_step == step) {
        behind_client = CancellableLighthouseClient();
        behind_call = behind_client.get();
      }
    }
    pb::QuorumResponse resp;
    Status st = (behind_client ? behind_client : client)
                    ->Call("POST", "/v1/quorum", q, &resp, options.quorum_timeout + Millis(5000));
    if (behind_client) {
      std::lock_guard<std::mutex> lock(mu);
      behind_call = nullptr;
      if (!ask_needed || ask_step != step) continue;  // superseded (and cancelled)
    }
    if (st.ok()) {
      failures = 0;
      told_continuing = false;
      if (resp.generation() != 0) generation = resp.generation();
      std::lock_guard<std::mutex> lock(mu);
      SyncBoardLocked();
      uint32_t known = ahead ? ahead->quorum_id() : quorum ? quorum->quorum_id() : 0;
      if (known != resp.quorum_id()) {
        LK_LOG_INFO("quorum quorum_id={} replica_rank={} world_size={} heal={} max_step={} ahead={} reason={}",
                    resp.quorum_id(), resp.replica_rank(), resp.replica_world_size(), resp.heal(),
                    resp.max_step(), ask_ahead, Q(resp.reason()));
        // The commit's own answer says so only when this group's commit was the one that
        // decided; the quorum that heals it always does.
        if (resp.diverged_step() != 0) {
          LK_LOG_WARN("state_diverged step={} quorum_id={} heal={}", resp.diverged_step(),
                      resp.quorum_id(), resp.heal());
        }
      }
      // The trainers moved to another step while this ask was out (or a drain began): the
      // answer is for a step nobody will poll; ask again for the one they are at.
      if (!ask_needed || ask_step != step) continue;
      ask_needed = false;
      if (ask_behind) {
        ask_behind = false;
        ask_ahead = false;
        // The step the trainers went on from without a round: an answer on their quorum only
        // tells that the lighthouse caught up (and lets the group that waited in the round
        // into their step). Another quorum means theirs is over: their step on it is aborted,
        // and their next poll (of this step again) is answered from `ahead`.
        if (quorum && resp.quorum_id() == quorum->quorum_id()) continue;
        if (quorum) lost_quorums.insert(quorum->quorum_id());
        ahead = std::move(resp);
        ahead_step = step;
        AnswerNoticesLocked(false);
        cv.notify_all();
        continue;
      }
      if (ask_ahead) {
        ask_ahead = false;
        ahead = std::move(resp);
        ahead_step = step;
        PublishAheadLocked();
        cv.notify_all();  // the watch thread follows the quorum fetched ahead
        continue;
      }
      quorum = std::move(resp);
      phase = "training";
      AnswerPollsLocked(true);
      cv.notify_all();  // the watch thread follows the new quorum
      continue;
    }
    if (st.code() == Code::kDeadlineExceeded) continue;  // the round is still open: ask again
    if (st.reason() == Reason::kStaleIncarnation || st.reason() == Reason::kIncarnationReplaced) {
      Fail("replaced: " + st.message());
      return;
    }
    // Evicted for stalled progress while this ask waited: asking again would readmit the group
    // (an ask counts as coming back), and an ask made ahead says nothing about whether the
    // trainers still progress. The group fails, as when a heartbeat brings the eviction.
    if (st.reason() == Reason::kGroupEvicted) {
      Fail("evicted");
      return;
    }
    if (st.reason() == Reason::kGroupSizeMismatch) {
      Refused(st);
      return;
    }
    if (failures++ == 0) LK_LOG_WARN("quorum_failed error={}", Q(st.ToString()));
    std::unique_lock<std::mutex> lock(mu);
    // The lighthouse is unreachable: while the membership has not changed (no loss known), the
    // trainers go on with the quorum they have; every group sees the same outage and does the
    // same, and the next boundary asks again. An ask ahead has no trainer waiting on it: it
    // keeps retrying until they poll, and then takes this path. The step they went on from is
    // kept: should another group's ask reach the lighthouse at this boundary (it came back in
    // between, or only this node lost it), that group waits in a round for this one while
    // these trainers wait in the step's allreduce for that group; the heartbeat then says
    // round_pending, and this node asks for the step after all (HeartbeatLoop).
    if (st.code() == Code::kUnavailable && quorum && !draining && !ask_ahead &&
        !lost_quorums.count(quorum->quorum_id())) {
      if (!told_continuing) {
        told_continuing = true;
        LK_LOG_WARN("lighthouse_unreachable continuing quorum_id={}", quorum->quorum_id());
      }
      ask_needed = false;
      continued_step = step;
      phase = "training";
      AnswerPollsLocked(false);
      continue;
    }
    cv.wait_for(lock, Backoff(failures), [&] { return stopping.load() || (was_ahead && !ask_ahead); });
  }
}

void Agent::Impl::WatchLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  while (!stopping) {
    uint32_t qid;
    {
      std::unique_lock<std::mutex> lock(mu);
      // Watch the newest quorum known (fetched ahead, else the trainers') until it is lost;
      // then wait for the next one.
      cv.wait(lock, [&] {
        auto target = WatchTargetLocked();
        return stopping.load() || (target && !lost_quorums.count(*target));
      });
      if (stopping) return;
      qid = *WatchTargetLocked();
    }
    auto r = client->Do("GET",
                        fmt::format("/v1/watch?job={}&quorum_id={}&timeout_ms=20000",
                                    http::PercentEncode(options.job), qid),
                        "", http::kProtoType, Millis(25'000));
    Status st = r.ok() ? http::StatusFromResponse(*r) : r.status();
    pb::WatchResponse w;
    if (st.ok()) st = http::Decode(r->body, http::BodyFormat(r->content_type), &w);
    if (!st.ok()) {
      if (failures++ == 0) LK_LOG_WARN("watch_failed error={}", Q(st.ToString()));
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, Backoff(failures), [&] { return stopping.load(); });
      continue;
    }
    failures = 0;
    if (!w.lost()) continue;
    std::lock_guard<std::mutex> lock(mu);
    SyncBoardLocked();
    // Superseded by the quorum this agent fetched ahead: not a loss the trainers must hear of
    // (they are between outer steps, and their next poll hands them the newer quorum).
    if (ahead && qid < ahead->quorum_id()) continue;
    std::string who;
    for (const auto& n : w.notices()) who += (who.empty() ? "" : ",") + n.group_id() + ":" + n.reason();
    LK_LOG_INFO("quorum_lost quorum_id={} notices={}", qid, Q(who));
    lost_quorums.insert(qid);
    // A loss that names this group itself (evicted, or its own leave) is not a reason to ask
    // again: an ask would readmit a group whose trainers stalled.
    bool self_named = false, evicted = false;
    for (const auto& n : w.notices()) {
      if (!NamesThisGroup(n)) continue;
      self_named = true;
      evicted |= n.reason() == "progress_stalled";
    }
    if (evicted) {
      WithdrawBoardLocked();
      ahead.reset();
      AnswerNoticesLocked(false);
      boost::asio::post(ioc, [self = shared_from_this()] { self->Fail("evicted"); });
      continue;
    }
    // Off the board first: if a trainer took it already, it stands for the node (WithdrawBoard
    // makes it the trainers' quorum), and the notices below abort their step on it.
    if (ahead && ahead->quorum_id() == qid) WithdrawBoardLocked();
    if (ahead && ahead->quorum_id() == qid && !self_named) {
      // The quorum fetched ahead lost a member before the trainers polled: fetch another.
      uint32_t step = ahead_step;
      ahead.reset();
      if (!ask_needed) AskAheadLocked(step);
    }
    AnswerNoticesLocked(false);
  }
}

void Agent::Impl::BoardLoop() {
  while (!stopping) {
    uint32_t seen = board->Doorbell();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return;
      SyncBoardLocked();
    }
    board->WaitDoorbell(seen, Millis(500));
  }
}

void Agent::Impl::Drain(const std::string& reason, bool checkpoint,
                        std::function<void()> after_leave) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (draining) return;
    draining = true;
    checkpoint_now = checkpoint;
    drain_reason = reason;
    phase = "draining";
    LK_LOG_INFO("drain reason={} checkpoint={} trainers={}", reason, checkpoint, trainers.size());
    DrainTrainersLocked();
  }
  cv.notify_all();
  auto self = shared_from_this();
  auto finish = [self] { self->Finish(self->exit_code.load() < 0 ? 0 : self->exit_code.load()); };
  if (!checkpoint) {
    // Leave at once so that the other groups' quorum shrinks without a heartbeat timeout, then
    // give the trainers drain_timeout to exit.
    Spawn([self, reason, finish] {
      self->SendLeave(reason);
      self->WaitForTrainersThen([finish](bool) { finish(); });
    });
    return;
  }
  // A durable save first: the group stays a member until its trainers have saved and exited.
  WaitForTrainersThen([self, reason, finish, after_leave](bool all_exited) {
    if (!all_exited) LK_LOG_WARN("checkpoint_not_confirmed reason=drain_timeout");
    self->Spawn([self, reason, finish, after_leave] {
      self->SendLeave(reason);
      if (after_leave) after_leave();
      finish();
    });
  });
}

// Calls `then(all_exited)` on the io thread once every known trainer process has exited, or
// after drain_timeout.
void Agent::Impl::WaitForTrainersThen(std::function<void(bool)> then) {
  boost::asio::post(ioc, [self = shared_from_this(), then = std::move(then)] {
    auto deadline = std::chrono::steady_clock::now() + self->options.drain_timeout;
    // The check holds itself only weakly: the timer's handler holds it while it waits, so it is
    // freed (with `then` and the Impl it captures) once it has called `then`.
    auto check = std::make_shared<std::function<void()>>();
    std::weak_ptr<std::function<void()>> weak_check = check;
    *check = [self, deadline, then, weak_check] {
      bool alive = false;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        // The pidfd says when a trainer is gone; kill(pid, 0) would still find a zombie that
        // its launcher has not reaped, so it only serves trainers without a pidfd.
        for (auto& [r, t] : self->trainers) {
          if (t.pid <= 0 || t.exited) continue;
          alive |= t.pidfd ? true : ::kill(t.pid, 0) == 0;
        }
      }
      if (!alive || std::chrono::steady_clock::now() >= deadline) {
        if (alive) LK_LOG_WARN("drain_timeout trainers_still_running=true");
        return then(!alive);
      }
      auto poll = std::make_shared<boost::asio::steady_timer>(self->ioc, Millis(20));
      poll->async_wait([check = weak_check.lock(), poll](const boost::system::error_code&) {
        (*check)();
      });
    };
    (*check)();
  });
}

void Agent::Impl::Fail(const std::string& reason) {
  exit_code = 3;
  LK_LOG_WARN("group_failed reason={}", Q(reason));
  // The group is one failure domain: the surviving local trainers stop too, and the launcher
  // restarts the whole group as a new incarnation.
  // Only processes the agent holds a pidfd for: a pid alone may by now name another process
  // (reused), and a pidfd names exactly the process that connected.
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [r, t] : trainers) {
      if (!t.pidfd || t.exited) continue;
      if (::syscall(SYS_pidfd_send_signal, t.pidfd->native_handle(), SIGTERM, nullptr, 0) != 0) {
        LK_LOG_WARN("trainer_signal_failed group_rank={} pid={} errno={}", r, t.pid, errno);
      }
    }
  }
  Drain(reason);
}

void Agent::Impl::Refused(const Status& refused) {
  // The trainers get the lighthouse's words, without the HTTP status the client put before
  // them (their own client adds the agent's).
  std::string words = refused.message();
  if (words.rfind("HTTP ", 0) == 0) {
    if (auto colon = words.find(": "); colon != std::string::npos) words = words.substr(colon + 2);
  }
  const Status why(refused.code(), words, refused.reason());
  LK_LOG_ERROR("quorum_refused code={} reason={}", ReasonName(why.reason()), Q(why.message()));
  {
    std::lock_guard<std::mutex> lock(mu);
    refusal = why;
    exit_code = 2;
    for (auto& [rank, t] : trainers) {
      if (!t.poll_respond) continue;
      auto respond = std::move(t.poll_respond);
      t.poll_respond = nullptr;
      respond(http::ErrorReply(why, t.poll_format));
    }
  }
  Drain("group_size_mismatch");
}

void Agent::Impl::Finish(int code) {
  LK_LOG_INFO("agent_exit code={}", code);
  exit_code = code;
  stopping = true;
  cv.notify_all();
  if (board) board->RingDoorbell();
  boost::asio::post(ioc, [self = shared_from_this()] {
    if (self->socket_server) self->socket_server->Stop();
    if (self->peer_server) self->peer_server->Stop();
    std::lock_guard<std::mutex> lock(self->mu);
    if (self->board) {
      self->board->Close();
      self->board->Unlink();
    }
    self->AnswerNoticesLocked(true);
    for (auto& [r, t] : self->trainers) {
      if (t.pidfd) t.pidfd->close();
    }
    self->ioc.stop();
  });
}

}  // namespace lk::agent
