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
  boost::asio::post(impl_->ioc, [impl = impl_] { impl->core->OnSignalArrived(); });
  impl_->Wake();  // a final-report wait shortens to the quick bound (SendLeave)
}
const std::string& Agent::incarnation() const { return impl_->options.incarnation; }

// The lighthouse's text_bytes_max for an event's detail.
constexpr size_t kEventDetailBytesMax = 256;

Status Agent::ReportEvent(const std::string& event, const std::string& detail, Millis timeout,
                          uint32_t* crashes, uint32_t* refusals) {
  pb::GroupEventRequest in;
  in.set_job(impl_->options.job);
  in.set_group_id(impl_->options.group_id);
  in.set_incarnation(impl_->options.incarnation);
  in.set_event(event);
  in.set_detail(OneLine(detail, kEventDetailBytesMax));
  pb::GroupEventResponse out;
  LK_RETURN_IF_ERROR(impl_->CancellableLighthouseClient()->Call("POST", "/v1/event", in, &out,
                                                                timeout));
  if (crashes) *crashes = out.crashes();
  if (refusals) *refusals = out.requeue_refusals();
  return Status::Ok();
}

std::shared_ptr<http::Client> Agent::Impl::CancellableLighthouseClient() {
  auto c = http::Client::Create(lighthouse_url, lighthouse_client_options);
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
  // main validated them already; a program that embeds the agent gets the same refusals.
  LK_RETURN_IF_ERROR(options.Validate());
  if (!options.token_file.empty()) {
    LK_ASSIGN_OR_RETURN(token, ReadTokenFile(options.token_file));
  }
  lighthouse_client_options.token = token;
  lighthouse_client_options.ca_file = options.ca_file;
  lighthouse_url = options.LighthouseUrl();
  // The site's gateway is inside the site: the environment's proxy (for the way out) is not for
  // it, only an explicit --proxy.
  lighthouse_client_options.proxy = !options.proxy.empty()   ? options.proxy
                                    : options.gateway.empty() ? http::ProxyFromEnv(lighthouse_url)
                                                              : "";
  // A bad URL or an unreadable CA file is an error now, not in a thread later.
  LK_RETURN_IF_ERROR(http::Client::Create(lighthouse_url, lighthouse_client_options).status());
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
  LK_RETURN_IF_ERROR(ListenPeers(server_options));
  // No input reached the core yet, and no thread runs: it starts again knowing whether
  // trainers have a board.
  core = MakeCore(board != nullptr);
  StartHelloTimer();
  LK_LOG_INFO(
      "agent_listening socket={} serve={} advertise={} incarnation={} serve_tls={} proxy={} "
      "lighthouse={} gateway={}",
      options.socket, peer_server ? peer_server->LocalAddress() : "", options.advertise,
      options.incarnation, !options.tls_cert_file.empty(),
      http::WithoutUserinfo(lighthouse_client_options.proxy),
      options.gateway.empty() ? lighthouse_url : "", options.gateway);
  Spawn([self] { self->HeartbeatLoop(); });
  Spawn([self] { self->QuorumLoop(); });
  Spawn([self] { self->WatchLoop(); });
  Spawn([self] { self->OutboxLoop(); });
  if (board) Spawn([self] { self->BoardLoop(); });
  return Status::Ok();
}

// The --serve port (live state and checkpoint shards for healing peers) and the address peers
// are given for it: the bound address, or an interface's IPv4 address with the bound port.
Status Agent::Impl::ListenPeers(const http::ServerOptions& server_options) {
  if (options.serve.empty()) return Status::Ok();
  http::ServerOptions peer_options = server_options;
  peer_options.tls_cert_file = options.tls_cert_file;
  peer_options.tls_key_file = options.tls_key_file;
  auto self = shared_from_this();
  peer_server = std::make_unique<http::Server>(
      ioc, peer_options, [self](http::Request&& r, http::Responder w) {
        self->PeerRoute(std::move(r), std::move(w));
      });
  LK_RETURN_IF_ERROR(peer_server->Listen(options.serve));
  const std::string scheme = options.tls_cert_file.empty() ? "" : "https://";
  if (options.advertise.empty()) {
    options.advertise = scheme + peer_server->LocalAddress();
  } else if (options.advertise.find_first_of(":/") == std::string::npos) {
    LK_ASSIGN_OR_RETURN(std::string ip, http::InterfaceIPv4(options.advertise));
    const std::string bound = peer_server->LocalAddress();
    options.advertise = scheme + ip + bound.substr(bound.rfind(':'));
  }
  return Status::Ok();
}

int Agent::Impl::Run() {
  ioc.run();
  // The io thread is done: a thread handing it an input gets nothing back and ends. The
  // lighthouse threads may sit in a long-poll: cancelled, they return at once and are joined,
  // as are the pool's workers and any leave still on its way.
  io_done = true;
  stopping = true;
  Wake();
  if (board) board->RingDoorbell();
  CancelLighthouseClients();
  if (workers) workers->Stop();
  JoinThreads();
  // Every thread is joined: this one is the only one left.
  if (!outbox.empty()) {
    LK_LOG_WARN("outbox_undelivered pending={} delivered={} dropped={} {}", outbox.size(),
                outbox_delivered, outbox.dropped(), outbox.Summary());
  }
  return exit_code.load() < 0 ? 0 : exit_code.load();
}

void Agent::Impl::Wake() {
  {
    std::lock_guard<std::mutex> lock(wake_mu);
    ++wake_seq;
  }
  wake_cv.notify_all();
}

uint64_t Agent::Impl::WakeSeq() {
  std::lock_guard<std::mutex> lock(wake_mu);
  return wake_seq;
}

void Agent::Impl::WaitWake(uint64_t seen, Millis max) {
  std::unique_lock<std::mutex> lock(wake_mu);
  wake_cv.wait_for(lock, max, [&] { return wake_seq != seen || stopping.load(); });
}

void Agent::Impl::SleepUnlessStopping(Millis d) {
  std::unique_lock<std::mutex> lock(wake_mu);
  wake_cv.wait_for(lock, d, [&] { return stopping.load(); });
}

bool Agent::Impl::AwaitOnIo(const std::function<bool()>& pred,
                            std::chrono::steady_clock::time_point deadline) {
  while (!stopping) {
    // Read before asking: a change after the ask bumps it, and the wait below returns at once.
    const uint64_t seen = WakeSeq();
    std::optional<bool> holds = OnIo([&] { return pred(); });
    if (!holds) return false;
    if (*holds) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    // Woken by every change the io thread makes; the cap only bounds a wait for a change made
    // by nobody (a time that passes), which none of the predicates is.
    WaitWake(seen, std::min(std::chrono::duration_cast<Millis>(deadline - now), Millis(1000)));
  }
  return false;
}

void Agent::Impl::StartHelloTimer() {
  if (options.hello_timeout.count() <= 0) return;
  hello_timer = std::make_unique<boost::asio::steady_timer>(ioc, options.hello_timeout);
  hello_timer->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->stopping) return;
    Effects fx;
    self->core->OnTick(std::chrono::steady_clock::now(), &fx);
    self->Apply(std::move(fx));
  });
}

void Agent::Impl::HeartbeatLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  while (!stopping) {
    // After a drain the group has left: a heartbeat now would only be refused as stale.
    std::optional<std::optional<pb::HeartbeatRequest>> hb = OnIo([&] {
      std::optional<pb::HeartbeatRequest> r;
      if (!core->state().draining) r = HeartbeatRequestNow();
      return r;
    });
    if (!hb || !*hb) return;
    pb::HeartbeatResponse resp;
    Status st = client->Call("POST", "/v1/heartbeat", **hb, &resp, Millis(5000));
    Millis wait = options.heartbeat_interval;
    if (st.ok()) {
      if (failures > 0) LK_LOG_INFO("lighthouse_reachable after_failures={}", failures);
      failures = 0;
      if (resp.generation() != 0) generation = resp.generation();
    } else if (st.code() != Code::kConflict) {
      if (failures++ == 0) LK_LOG_WARN("heartbeat_failed error={}", Q(st.ToString()));
      wait = std::min(wait, Backoff(failures));
    }
    const HeartbeatAnswer in = HeartbeatAnswerOf(st, resp);
    std::optional<bool> draining = OnIo([&] {
      Effects fx;
      core->OnHeartbeat(in, &fx);
      Apply(std::move(fx));
      return core->state().draining;
    });
    if (!draining || *draining) return;
    SleepUnlessStopping(wait);
  }
}

pb::HeartbeatRequest Agent::Impl::HeartbeatRequestNow() {
  SyncBoard();
  pb::HeartbeatRequest hb;
  hb.set_step(core->state().committed_step);
  hb.set_phase(std::string(PhaseName(core->ReportedPhase())));
  hb.set_job(options.job);
  hb.set_group_id(options.group_id);
  hb.set_incarnation(options.incarnation);
  hb.set_node_rank(options.node_rank);
  hb.set_nodes(options.nodes);
  hb.set_address(options.advertise);
  hb.set_generation(generation.load());
  return hb;
}

HeartbeatAnswer Agent::Impl::HeartbeatAnswerOf(const Status& st,
                                               const pb::HeartbeatResponse& resp) const {
  HeartbeatAnswer in;
  in.ok = st.ok();
  in.error = st;
  if (!st.ok()) return in;
  for (const auto& n : resp.notices()) {
    if (!NamesThisGroup(n)) continue;
    // A lapse of this group's heartbeats is no eviction (revived_from tells of it).
    if (n.reason() != "heartbeat_timeout") in.names_this_group = true;
  }
  in.revived_from = resp.revived_from();
  in.drain = resp.drain();
  in.round_pending = resp.round_pending();
  return in;
}

pb::QuorumRequest Agent::Impl::QuorumRequestFor(const Effect& ask) const {
  pb::QuorumRequest q;
  q.set_job(options.job);
  q.set_group_id(options.group_id);
  q.set_incarnation(options.incarnation);
  q.set_node_rank(options.node_rank);
  q.set_nodes(options.nodes);
  q.set_step(ask.step);
  q.set_timeout_ms(static_cast<uint32_t>(options.quorum_timeout.count()));
  q.set_address(options.advertise);
  q.set_fresh(ask.fresh);
  q.set_compact(true);  // the agent needs its donors' addresses, not the whole member list
  q.set_generation(generation.load());
  q.set_group_size(ask.group_size);
  q.set_mixed_group_sizes(ask.mixed_group_sizes);
  q.set_on_quorum_id(ask.quorum_id);
  return q;
}

void Agent::Impl::FeedAsk(const Effect& ask, const Status& st, pb::QuorumResponse resp) {
  SyncBoard();
  AskResult in;
  in.serial = ask.id;
  in.step = ask.step;
  in.kind = ask.ask_kind;
  in.status = st;
  if (st.ok()) {
    in.quorum = FromWire(resp);
    answers[resp.quorum_id()] = std::move(resp);
  }
  Effects fx;
  core->OnAskResult(in, &fx);
  Apply(std::move(fx));
}

void Agent::Impl::QuorumLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  while (!stopping) {
    // An ask ahead waits until the node's commit reached the lighthouse, so that a new quorum
    // never overtakes the commit of the step before it.
    Effect ask;
    if (!AwaitOnIo([&] {
          const bool commit_pending = outbox.Holds(ReportKind::kCommit);
          if (!core->AskMayGo(commit_pending)) return false;
          ask = *core->PendingAsk(commit_pending);
          return true;
        })) {
      return;
    }
    pb::QuorumResponse resp;
    std::optional<Status> st = CallQuorum(*client, ask, &resp, &failures);
    if (!st) return;
    // Answered, superseded, or gone on without the lighthouse: nothing to retry; an open round
    // (deadline) is asked again at once.
    std::optional<bool> retry = OnIo([&] {
      if (ask.ask_kind == Effect::AskKind::kBehind && core->state().ask.serial != ask.id) {
        return false;  // superseded, and its call cancelled
      }
      FeedAsk(ask, *st, std::move(resp));
      const Ask& now = core->state().ask;
      return !st->ok() && st->code() != Code::kDeadlineExceeded && now.asking() &&
             now.serial == ask.id;
    });
    if (!retry) return;
    if (!*retry) continue;
    // An ask ahead whose trainers came to poll meanwhile is retried at once, for them.
    const bool was_ahead = ask.ask_kind == Effect::AskKind::kAhead;
    const auto until = std::chrono::steady_clock::now() + Backoff(failures);
    AwaitOnIo([&] { return was_ahead && core->state().ask.kind != Ask::Kind::kAhead; }, until);
  }
}

std::optional<Status> Agent::Impl::CallQuorum(http::Client& client, const Effect& ask,
                                              pb::QuorumResponse* resp, int* failures) {
  std::optional<Status> st = SendQuorum(client, ask, resp);
  if (!st) return st;
  if (st->ok()) {
    *failures = 0;
    if (resp->generation() != 0) generation = resp->generation();
  } else if (st->code() != Code::kDeadlineExceeded && (*failures)++ == 0) {
    LK_LOG_WARN("quorum_failed error={}", Q(st->ToString()));
  }
  return st;
}

std::optional<Status> Agent::Impl::SendQuorum(http::Client& client, const Effect& ask,
                                              pb::QuorumResponse* resp) {
  const pb::QuorumRequest q = QuorumRequestFor(ask);
  const Millis wait = options.quorum_timeout + Millis(5000);
  if (ask.ask_kind != Effect::AskKind::kBehind) {
    return client.Call("POST", "/v1/quorum", q, resp, wait);
  }
  // An ask behind the trainers goes on a client of its own, which a newer ask cancels: the
  // lighthouse must not keep a step the trainers have left as this group's ask.
  std::shared_ptr<http::Client> behind = CancellableLighthouseClient();
  if (!OnIo([&] { behind_call = behind.get(); })) return std::nullopt;
  Status st = behind->Call("POST", "/v1/quorum", q, resp, wait);
  // Forgotten before the client goes: the io thread cancels through behind_call.
  if (!OnIo([&] {
        if (behind_call == behind.get()) behind_call = nullptr;
      })) {
    return std::nullopt;
  }
  return st;
}

void Agent::Impl::WatchLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  while (!stopping) {
    // Watch the newest quorum known (fetched ahead, else the trainers') until it is lost; then
    // wait for the next one.
    uint32_t qid = 0;
    if (!AwaitOnIo([&] {
          auto target = core->WatchTarget();
          if (!target || core->state().lost_quorums.count(*target)) return false;
          qid = *target;
          return true;
        })) {
      return;
    }
    pb::WatchResponse w;
    Status st = CallWatch(*client, qid, &w);
    if (!st.ok()) {
      if (failures++ == 0) LK_LOG_WARN("watch_failed error={}", Q(st.ToString()));
      SleepUnlessStopping(Backoff(failures));
      continue;
    }
    failures = 0;
    if (!w.lost()) continue;
    const LossInput in = LossOf(qid, w);
    if (!OnIo([&] {
          SyncBoard();
          Effects fx;
          core->OnQuorumLost(in, &fx);
          Apply(std::move(fx));
        })) {
      return;
    }
  }
}

Status Agent::Impl::CallWatch(http::Client& client, uint32_t qid, pb::WatchResponse* w) {
  auto r = client.Do("GET",
                     fmt::format("/v1/watch?job={}&quorum_id={}&timeout_ms=20000",
                                 http::PercentEncode(options.job), qid),
                     "", http::kProtoType, Millis(25'000));
  Status st = r.ok() ? http::StatusFromResponse(*r) : r.status();
  if (st.ok()) st = http::Decode(r->body, http::BodyFormat(r->content_type), w);
  return st;
}

LossInput Agent::Impl::LossOf(uint32_t qid, const pb::WatchResponse& w) const {
  LossInput in;
  in.quorum_id = qid;
  for (const auto& n : w.notices()) {
    in.who += (in.who.empty() ? "" : ",") + n.group_id() + ":" + n.reason();
    if (!NamesThisGroup(n)) continue;
    in.names_this_group = true;
    in.evicted |= n.reason() == "progress_stalled";
  }
  return in;
}

void Agent::Impl::BoardLoop() {
  // Posted, not awaited: the trainer that rang is woken first, and this thread goes back to the
  // doorbell at once. One sync in the io thread's queue at a time covers every ring before it
  // runs (it reads every slot).
  while (!stopping) {
    uint32_t seen = board->Doorbell();
    if (!board_sync_queued.exchange(true)) {
      boost::asio::post(ioc, [self = shared_from_this()] {
        self->board_sync_queued = false;
        self->SyncBoard();
      });
    }
    board->WaitDoorbell(seen, Millis(500));
  }
}

void Agent::Impl::Drain(const std::string& reason, bool checkpoint,
                        std::function<void()> after) {
  // Posted, not awaited: the caller may be the thread that runs the io context next (a signal's
  // handler on it, or a test that drives it).
  boost::asio::post(ioc, [self = shared_from_this(), reason, checkpoint,
                          after = std::move(after)]() mutable {
    if (self->core->state().draining) return;
    self->after_leave = std::move(after);
    Effects fx;
    self->core->OnDrain(LeaveReason::kSignal, reason, checkpoint, &fx);
    self->Apply(std::move(fx));
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
      // The pidfd says when a trainer is gone; kill(pid, 0) would still find a zombie that its
      // launcher has not reaped, so it only serves trainers without a pidfd.
      for (auto& [r, t] : self->trainers) {
        if (t.pid <= 0 || t.exited) continue;
        alive |= t.pidfd ? true : ::kill(t.pid, 0) == 0;
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

void Agent::Impl::Finish(int code) {
  LK_LOG_INFO("agent_exit code={}", code);
  exit_code = code;
  stopping = true;
  Wake();
  if (board) board->RingDoorbell();
  boost::asio::post(ioc, [self = shared_from_this()] {
    if (self->socket_server) self->socket_server->Stop();
    if (self->peer_server) self->peer_server->Stop();
    if (self->hello_timer) self->hello_timer->cancel();
    if (self->board) {
      self->board->Close();
      self->board->Unlink();
    }
    Effects fx;
    self->core->OnStopping(&fx);
    self->Apply(std::move(fx));
    for (auto& [r, t] : self->trainers) {
      if (t.pidfd) t.pidfd->close();
    }
    self->ioc.stop();
  });
}

}  // namespace lk::agent
