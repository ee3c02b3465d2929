// Private to the agent: the state behind Agent, shared by agent.cc (lighthouse threads, life
// cycle) and agent_routes.cc (the trainers' socket API).
// Thread-safety: every field below `mu` is guarded by it.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
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
#include "replica_agent/poll_board_writer.h"
#include "replica_agent/outbox.h"
#include "replica_agent/worker_pool.h"

namespace lk::agent {

namespace pb = lightkeeper::v1;

struct Agent::Impl : std::enable_shared_from_this<Agent::Impl> {
  struct Trainer {
    uint32_t group_rank = 0;
    int pid = 0;
    std::unique_ptr<boost::asio::posix::stream_descriptor> pidfd;
    std::optional<uint32_t> polled_step;
    http::Responder poll_respond;
    // The answer last sent to its poll of step `first`, kept until its next poll: a poll that
    // says it resumes one that timed out gets it again (TrainerPollRequest.resumed).
    std::optional<std::pair<uint32_t, pb::TrainerPollResponse>> sent;
    http::Format poll_format = http::Format::kJson;
    uint32_t seen_quorum_id = 0;
    uint32_t heal_answered_quorum_id = 0;
    std::optional<uint32_t> committed_step;
    std::string state_hash;
    uint64_t tokens = 0;  // the group's tokens it reported with its last commit
    bool finished = false;  // said goodbye: its exit is not a crash
    bool exited = false;
    bool peer_wait = false;  // blocked in the cross-group collective
    // Its last poll said it averages across groups of other sizes: the node asks with
    // mixed_group_sizes when every local trainer did.
    bool mixed_group_sizes = false;
    std::optional<uint32_t> slot;  // its place on the poll board
    uint32_t board_commit_seen = 0;  // the last commit taken from its slot
  };
  struct NoticeWaiter {
    uint64_t id;
    uint32_t quorum_id;
    http::Responder respond;
    http::Format format;
    std::unique_ptr<boost::asio::steady_timer> timer;
  };

  explicit Impl(AgentOptions o) : options(std::move(o)), outbox(options.outbox_max) {}

  // ---- life cycle (agent.cc) ----
  Status Start();
  int Run();
  void Drain(const std::string& reason, bool checkpoint = false,
             std::function<void()> after_leave = {});
  void WaitForTrainersThen(std::function<void(bool all_exited)> then);
  void Fail(const std::string& reason);
  // The lighthouse refused this group for good (its trainer count differs from the quorum's):
  // every poll now fails with that refusal, so the trainers exit with it, and the agent leaves
  // and exits 2 (a configuration error: restarting the same group would be refused again).
  void Refused(const Status& why);
  void Finish(int code);

  // ---- lighthouse threads (agent.cc; the outbox and the leave: agent_outbox.cc) ----
  void HeartbeatLoop();
  void QuorumLoop();
  void WatchLoop();
  // Delivers the outbox's reports in order, retrying with backoff while the lighthouse is away;
  // a report it refuses is logged and dropped (the lighthouse judged it).
  void OutboxLoop();
  // One delivery attempt of `r`; the lighthouse's answer or why none came.
  Status Deliver(http::Client& client, const Report& r);
  // With mu held: puts `r` in the outbox and logs a report dropped past its bound.
  void QueueReportLocked(Report r);
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
  // With mu held: a trainer's commit (from the socket or its board slot).
  Status CommitLocked(Trainer& t, uint32_t step, bool failed, const std::string& state_hash,
                      uint64_t tokens = 0);
  void HandleNotice(const http::Request& req, http::Responder respond);
  void HandleKv(const http::Request& req, http::Responder respond);
  void HandleStatus(const http::Request& req, http::Responder respond);
  Status Register(uint32_t group_rank, uint32_t group_size, int pid);
  void WatchPid(Trainer& t);
  // With mu held: answer every waiting poll from the current quorum.
  void AnswerPollsLocked(bool fresh_answer);
  pb::TrainerPollResponse PollAnswerLocked(Trainer& t, bool fresh_answer);
  void AnswerNoticesLocked(bool force);
  // Queues a commit for the lighthouse (the commit thread sends it, retrying while it is away).
  void QueueCommitLocked(uint32_t step, bool failed, std::string state_hash, uint64_t tokens = 0);
  void DrainTrainersLocked();
  uint32_t ExpectedLocalTrainersLocked() const;
  // The quorum the watch thread follows: the one fetched ahead if any, else the trainers' own.
  std::optional<uint32_t> WatchTargetLocked() const;
  // Starts an ask for `step` (any quorum fetched ahead is dropped); `ahead_of_trainers` when no
  // trainer polls it yet.
  void AskLocked(uint32_t step, bool ahead_of_trainers);
  // An ask ahead for `step` (the node just committed it, or the one fetched ahead was lost),
  // unless --ask-ahead is off or the node drains.
  void AskAheadLocked(uint32_t step);
  // ---- the poll board (agent_routes.cc) ----
  // With mu held: applies what trainers did on the board since the last look (an answer they
  // took, commits they left), as their socket calls would have been applied. Every path that
  // reads or changes the quorum state calls it first.
  void SyncBoardLocked();
  // The taken-answer half of SyncBoardLocked (what withdrawing needs; no commits, so that it
  // can run inside a commit's own ask).
  void ApplyTakenLocked();
  // Wakes on the board's doorbell and applies the commits trainers left (so that the ask
  // ahead starts as soon as the node committed).
  void BoardLoop();
  // With mu held: puts `ahead` on the board when it is the unchanged case and every local
  // trainer can take it from there.
  void PublishAheadLocked();
  // With mu held: takes the answer off the board before `ahead` is dropped or replaced. One
  // that trainers took first stands and is applied (`ahead` then is the trainers' quorum).
  void WithdrawBoardLocked();

  // With mu held: the phase heartbeats report: `phase`, or peer_wait while every local trainer
  // waits in the cross-group collective (said over the socket or on the board).
  std::string ReportedPhaseLocked() const;

  // Whether a failure notice is about this agent's own group life.
  bool NamesThisGroup(const pb::FailureNotice& n) const;

  AgentOptions options;
  std::string token;
  http::ClientOptions lighthouse_client_options;  // the token and the CA
  // The rendezvous KV and checkpoint registration: bounded, beyond its queue a 503.
  std::unique_ptr<WorkerPool> workers;
  boost::asio::io_context ioc{1};
  std::unique_ptr<http::Server> socket_server;
  std::unique_ptr<http::Server> peer_server;
  std::unique_ptr<ckpt::ShardServer> shard_server;
  std::atomic<bool> stopping{false};
  std::atomic<int> exit_code{-1};
  std::optional<Status> refusal;  // guarded by mu: set by Refused, answers every later poll
  std::atomic<bool> signalled{false};
  // This incarnation's generation as the lighthouse handed it out (0 until its first answer);
  // sent back on every heartbeat, ask and leave, so that a restarted lighthouse can tell this
  // life from an older one.
  std::atomic<uint32_t> generation{0};

  std::mutex mu;
  std::condition_variable cv;
  std::map<uint32_t, Trainer> trainers;
  uint32_t group_size = 0;
  std::optional<pb::QuorumResponse> quorum;
  std::set<uint32_t> lost_quorums;   // quorum ids known to have lost a member
  bool ask_needed = false;
  uint32_t ask_step = 0;
  // The pending ask is ahead of the trainers (sent after the node committed ask_step, before
  // they poll it): its answer goes to `ahead` instead of to waiting polls.
  bool ask_ahead = false;
  // The pending ask is behind the trainers: they went on with their quorum from ask_step
  // without a round (QuorumLoop), and a round opened since (HeartbeatLoop). Its answer is no
  // trainer's; it lets a group that waits in that round into their step, or ends it. Cleared
  // by any newer ask (AskLocked), which also cancels its call (behind_call).
  bool ask_behind = false;
  http::Client* behind_call = nullptr;
  // The step the trainers went on from without a round, the lighthouse being unreachable; until
  // the node commits the next step or asks again.
  std::optional<uint32_t> continued_step;
  // A quorum fetched ahead for the trainers' poll of ahead_step; `quorum` stays the one they
  // were last handed until they poll. Dropped when lost before that.
  std::optional<pb::QuorumResponse> ahead;
  uint32_t ahead_step = 0;
  bool had_state = false;            // a trainer committed or healed in this life
  bool draining = false;
  bool checkpoint_now = false;
  std::string drain_reason;
  uint32_t committed_step = 0;       // the group's step as this node knows it
  std::string phase = "starting";
  // Every report the lighthouse must hear of, in the node's order (OutboxLoop delivers it).
  Outbox outbox;
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
  // The poll board (null with --poll-board=false) and the last answer trainers took from it
  // that the agent applied.
  std::unique_ptr<board::Board> board;
  std::optional<board::Ticket> handed;
  uint32_t next_slot = 0;
};

}  // namespace lk::agent
