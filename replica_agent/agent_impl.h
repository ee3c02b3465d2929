// Private to the agent: the shell around the core (agent_core.h), shared by agent.cc (lighthouse
// threads, life cycle), agent_routes.cc (the trainers' socket API), agent_listeners.cc and
// agent_outbox.cc. The shell does I/O only: it turns what it hears (a request, a lighthouse
// answer, a process exit, the board) into the core's inputs and applies the effects in order.
// Thread-safety: one thread, the io thread (Run), owns the core and every field below `core`:
// the listeners, timers and pidfds run there, and the threads that block on the lighthouse (the
// heartbeat, quorum, watch and outbox loops, a leave, the worker pool) hand it their inputs
// with OnIo and sleep on the wake counter, which guards nothing but itself. No lock guards a
// decision: the core is only ever called from the io thread.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/http/server.h"
#include "common/log.h"
#include "common/proto/lightkeeper.pb.h"
#include "checkpoint/shard_server.h"
#include "replica_agent/agent.h"
#include "replica_agent/agent_core.h"
#include "replica_agent/poll_board_writer.h"
#include "replica_agent/outbox.h"
#include "replica_agent/worker_pool.h"

namespace lk::agent {

namespace pb = lightkeeper::v1;

struct Agent::Impl : std::enable_shared_from_this<Agent::Impl> {
  // What the shell holds of a trainer: its process and its waiting poll (the core holds the
  // rest, agent_core.h TrainerState).
  struct Trainer {
    int pid = 0;
    std::unique_ptr<boost::asio::posix::stream_descriptor> pidfd;
    http::Responder poll_respond;
    http::Format poll_format = http::Format::kJson;
    bool exited = false;
  };
  struct NoticeWaiter {
    uint64_t id;
    uint32_t quorum_id;
    http::Responder respond;
    http::Format format;
    std::unique_ptr<boost::asio::steady_timer> timer;
  };

  explicit Impl(AgentOptions o)
      : options(std::move(o)), outbox(options.outbox_max), core(MakeCore(false)) {}

  // ---- feeding the core (agent.cc) ----
  std::unique_ptr<AgentCore> MakeCore(bool with_board) const;
  // On the io thread: applies `fx` in order. `incoming` answers the poll being fed (OnPoll).
  void Apply(Effects fx, const http::Responder* incoming = nullptr,
                   http::Format incoming_format = http::Format::kJson);
  // On the io thread: reads what trainers did on the board and feeds it to the core (their taken
  // answers, commits and peer waits), as their socket calls would have been fed.
  void SyncBoard();
  pb::TrainerPollResponse ToWire(const PollAnswer& a) const;
  Quorum FromWire(const pb::QuorumResponse& q) const;
  void QueueCommit(const Effect& e);

  // ---- life cycle (agent.cc) ----
  Status Start();
  Status ListenPeers(const http::ServerOptions& server_options);
  int Run();
  void Drain(const std::string& reason, bool checkpoint = false,
             std::function<void()> after_leave = {});
  void WaitForTrainersThen(std::function<void(bool all_exited)> then);
  void Finish(int code);
  // Arms the hello bound (AgentOptions::hello_timeout): the core decides when it passes.
  void StartHelloTimer();

  // ---- lighthouse threads (agent.cc; the outbox and the leave: agent_outbox.cc) ----
  void HeartbeatLoop();
  // On the io thread: the heartbeat to send now (the node's step and phase).
  pb::HeartbeatRequest HeartbeatRequestNow();
  // The core's input from a heartbeat's outcome.
  HeartbeatAnswer HeartbeatAnswerOf(const Status& st, const pb::HeartbeatResponse& resp) const;
  void QuorumLoop();
  // Sends `ask` and counts the outcome in `failures` (the first failure of a run is logged);
  // nullopt once the io thread is done.
  std::optional<Status> CallQuorum(http::Client& client, const Effect& ask,
                                   pb::QuorumResponse* resp, int* failures);
  // The call itself; a behind ask on a client of its own that the io thread can cancel.
  std::optional<Status> SendQuorum(http::Client& client, const Effect& ask,
                                   pb::QuorumResponse* resp);
  // The lighthouse request of the core's pending ask (kAsk).
  pb::QuorumRequest QuorumRequestFor(const Effect& ask) const;
  // On the io thread: the lighthouse's answer to `ask` (or why none came) to the core.
  void FeedAsk(const Effect& ask, const Status& st, pb::QuorumResponse resp);
  void WatchLoop();
  // One long-poll of the watch of quorum `qid`.
  Status CallWatch(http::Client& client, uint32_t qid, pb::WatchResponse* w);
  // The core's input from a watch that says `qid` was lost.
  LossInput LossOf(uint32_t qid, const pb::WatchResponse& w) const;
  // Delivers the outbox's reports in order, retrying with backoff while the lighthouse is away;
  // a report it refuses is logged and dropped (the lighthouse judged it).
  void OutboxLoop();
  // On the io thread: the outcome `st` of delivering `r` (the first in line). False: the
  // lighthouse is away, `r` stays first (failures counts the attempts of this outage).
  bool Delivered(const Report& r, const Status& st, int* failures);
  // One delivery attempt of `r`; the lighthouse's answer or why none came.
  Status Deliver(http::Client& client, const Report& r);
  // On the io thread: puts `r` in the outbox and logs a report dropped past its bound.
  void QueueReport(Report r);
  // Puts the leave in the outbox and waits until it was delivered or refused, up to the bound
  // (final_report_timeout for a finished group, shorter otherwise); logs what stays undelivered.
  void SendLeave(const std::string& reason);
  Millis Backoff(int attempt);
  std::shared_ptr<http::Client> LighthouseClient() { return CancellableLighthouseClient(); }

  // ---- trainers' socket API (agent_routes.cc) ----
  // ---- each listener's routes (agent_listeners.cc) ----
  // The Unix socket: the trainer API, for peers of this agent's own uid only.
  void TrainerRoute(http::Request&& req, http::Responder respond);
  // --serve: /healthz, /v1/agent/status and /v1/shards/... (the last two need the job token
  // when the agent has one); every other path is 404 there.
  void PeerRoute(http::Request&& req, http::Responder respond);
  // Why a peer request may not read (empty: it may): a missing or wrong bearer token.
  Status CheckPeerToken(const http::Request& req) const;
  // The pid of a socket request's process (SO_PEERCRED); 0 when the kernel gave none.
  static int PeerPid(const http::Request& req);
  // Runs `run` on the worker pool, or answers 503 when its queue is full.
  // Runs `run` on a worker thread behind the server's barrier: if it throws, `respond` gets
  // 500 INTERNAL and the throw is logged as handler_threw with `route`.
  void OffThread(std::string route, std::function<void()> run, http::Responder respond,
                 http::Format f);
  // A lighthouse client that Finish can cancel (a thread in a long-poll then returns at once
  // and can be joined).
  std::shared_ptr<http::Client> CancellableLighthouseClient();
  void CancelLighthouseClients();
  // Starts a thread the agent joins when it exits.
  void Spawn(std::function<void()> fn);
  void JoinThreads();
  void HandleHello(const http::Request& req, http::Responder respond);
  void HandleGoodbye(const http::Request& req, http::Responder respond);
  void HandleCheckpoint(const http::Request& req, http::Responder respond);
  void HandlePhase(const http::Request& req, http::Responder respond);
  void HandlePoll(const http::Request& req, http::Responder respond);
  void HandleCommit(const http::Request& req, http::Responder respond);
  void HandleNotice(const http::Request& req, http::Responder respond);
  void HandleKv(const http::Request& req, http::Responder respond);
  void HandleStatus(const http::Request& req, http::Responder respond);
  void WatchPid(uint32_t rank, int pid);
  // Wakes on the board's doorbell and feeds the commits trainers left (so that the ask ahead
  // starts as soon as the node committed).
  void BoardLoop();

  // Whether a failure notice is about this agent's own group life.
  bool NamesThisGroup(const pb::FailureNotice& n) const;

  AgentOptions options;
  std::string token;
  http::ClientOptions lighthouse_client_options;  // the token and the CA
  std::string lighthouse_url;  // options.LighthouseUrl(): the lighthouse, or the site's gateway
  // The rendezvous KV and checkpoint registration: bounded, beyond its queue a 503.
  std::unique_ptr<WorkerPool> workers;
  boost::asio::io_context ioc{1};
  std::unique_ptr<http::Server> socket_server;
  std::unique_ptr<http::Server> peer_server;
  std::unique_ptr<ckpt::ShardServer> shard_server;
  std::unique_ptr<boost::asio::steady_timer> hello_timer;
  std::atomic<bool> stopping{false};
  std::atomic<int> exit_code{-1};
  std::atomic<bool> signalled{false};
  // This incarnation's generation as the lighthouse handed it out (0 until its first answer);
  // sent back on every heartbeat, ask and leave, so that a restarted lighthouse can tell this
  // life from an older one.
  std::atomic<uint32_t> generation{0};

  // ---- the io thread's hand-off (agent.cc) ----
  // From any thread but the io thread: runs `f` there and returns its result, or nullopt once
  // the io thread has stopped for good (the agent is exiting). A thread that gives up never
  // sees `f` run later: the io context does not run again.
  template <class F>
  auto OnIo(F&& f) -> std::optional<std::conditional_t<std::is_void_v<std::invoke_result_t<F&>>,
                                                       bool, std::invoke_result_t<F&>>>;
  // Bumps the wake counter: the io thread's state changed (effects applied), a waiting loop
  // looks again.
  void Wake();
  uint64_t WakeSeq();
  // Sleeps until the wake counter moves past `seen`, the agent stops, or `max` passes.
  void WaitWake(uint64_t seen, Millis max);
  // Sleeps for `d` or until the agent stops.
  void SleepUnlessStopping(Millis d);
  // Runs `pred` on the io thread until it holds (true), the agent stops or `deadline` passes
  // (false), sleeping on the wake counter in between.
  bool AwaitOnIo(const std::function<bool()>& pred,
                 std::chrono::steady_clock::time_point deadline =
                     std::chrono::steady_clock::time_point::max());
  std::atomic<bool> io_done{false};  // Run's io context returned: OnIo gives up
  std::atomic<bool> board_sync_queued{false};  // BoardLoop's sync waits in the io queue
  std::mutex wake_mu;                // guards wake_seq only
  std::condition_variable wake_cv;
  uint64_t wake_seq = 0;

  Outbox outbox;  // declared before `core`: the constructor reads options first
  // Every decision's state (agent_core.h).
  std::unique_ptr<AgentCore> core;
  std::map<uint32_t, Trainer> trainers;
  // The lighthouse's answers by quorum_id, for what the core does not hold (the member list,
  // the group sizes, the checkpoint to restore); dropped once older than the trainers' quorum.
  std::map<uint32_t, pb::QuorumResponse> answers;
  // The call of a behind ask in flight (the core cancels it through kCancelBehindAsk).
  http::Client* behind_call = nullptr;
  // Runs after a checkpoint drain's leave (the Slurm requeue), before the agent exits.
  std::function<void()> after_leave;
  uint64_t outbox_delivered = 0;  // reports the lighthouse took (and refused) in this life
  bool outbox_failing = false;    // the last delivery found the lighthouse away
  std::map<uint64_t, NoticeWaiter> notice_waiters;
  uint64_t next_id = 1;
  // Every thread the agent starts; joined in Run after the io_context stopped.
  std::mutex threads_mu;
  std::vector<std::thread> threads;
  // The lighthouse clients in use, so that Finish can cancel their long-polls.
  std::mutex clients_mu;
  std::set<http::Client*> clients;
  bool clients_cancelled = false;
  // The poll board (null with --poll-board=false).
  std::unique_ptr<board::Board> board;
};

template <class F>
auto Agent::Impl::OnIo(F&& f)
    -> std::optional<std::conditional_t<std::is_void_v<std::invoke_result_t<F&>>, bool,
                                        std::invoke_result_t<F&>>> {
  using R = std::invoke_result_t<F&>;
  using T = std::conditional_t<std::is_void_v<R>, bool, R>;
  LK_CHECK(!ioc.get_executor().running_in_this_thread()) << "OnIo on the io thread";
  if (io_done) return std::nullopt;
  auto result = std::make_shared<std::promise<T>>();
  std::future<T> ready = result->get_future();
  boost::asio::post(ioc, [result, &f] {
    if constexpr (std::is_void_v<R>) {
      f();
      result->set_value(true);
    } else {
      result->set_value(f());
    }
  });
  // The caller waits here, so `f` (held by reference) outlives its run; once the io context is
  // done it never runs, and the handler is destroyed with the context unrun.
  while (ready.wait_for(Millis(50)) != std::future_status::ready) {
    if (io_done) return std::nullopt;
  }
  return ready.get();
}

}  // namespace lk::agent
