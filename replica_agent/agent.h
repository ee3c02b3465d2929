// The replica agent: one per node of a replica group. It heartbeats the lighthouse with its
// trainers' progress, asks for the quorum at an outer-step boundary when a round is pending,
// relays quorums, recovery plans and failure notices to its trainers over a Unix socket, and
// turns a trainer's death or a signal into a leave with a reason at once.
// Its two listeners carry different routes: the trainer API only on the Unix socket (mode 0600,
// peers of the agent's own uid, identified by SO_PEERCRED), health, status and token-protected
// shard reads only on --serve.
// Reports the lighthouse must not miss (commits, failure reports, checkpoint registrations, the
// leave) go through one bounded outbox (outbox.h) and reach it in order, also after an outage.
// Thread-safety: all state is behind one mutex; lighthouse calls run on their own threads
// (heartbeat, quorum, watch, outbox, a bounded pool for the trainers' KV and checkpoint calls)
// so that a slow or absent lighthouse never blocks trainers; all are joined before Run returns.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <lightkeeper/clock.h>
#include "common/http/http.h"
#include <lightkeeper/status.h>

namespace boost::asio {
class io_context;
}  // namespace boost::asio

namespace lk::agent {

inline constexpr const char* kDefaultLighthouse = "http://127.0.0.1:29510";

struct AgentOptions {
  // The lighthouse's URL; empty: kDefaultLighthouse, unless `gateway` is set.
  std::string lighthouse;
  // This site's lk_gateway ("HOST:PORT", or "https://HOST:PORT" when it serves TLS): every
  // lighthouse call goes through it and the agent needs no route out of the site. Excludes
  // `lighthouse` (the gateway knows it). The environment's proxy is not used for it (the
  // gateway is inside the site); an explicit `proxy` still is.
  std::string gateway;
  std::string job;
  std::string group_id;
  // Same on every node of one group life. Default: derived from the Slurm job id and restart
  // count (equal on all nodes of the job), else random (only valid for one-node groups).
  std::string incarnation;
  uint32_t node_rank = 0;
  uint32_t nodes = 1;
  std::string socket;       // the trainers' Unix socket
  std::string token_file;   // the job's bearer token: for the lighthouse, and for shard reads
  std::string ca_file;      // CA for an https lighthouse (system CAs if empty)
  // An HTTP CONNECT proxy for the lighthouse calls ("http://[USER:PASSWORD@]HOST:PORT"); empty:
  // the environment's (http::ProxyFromEnv: LK_PROXY, https_proxy, no_proxy), else direct.
  std::string proxy;
  std::string serve;        // HOST:PORT for peers (shards, /healthz); empty: none
  // TLS for --serve (PEM files, both or neither); peers then fetch over https with their CA.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Without token_file an agent whose --serve reaches beyond loopback refuses to start (anyone
  // could read its group's live state) unless this is set.
  bool insecure_no_auth = false;
  // Address peers use to reach --serve; default: its bound address, as https://HOST:PORT when
  // --serve has TLS. An interface name ("ib0") stands for its IPv4 address and the bound port.
  // Required when --serve binds every address (0.0.0.0, ::).
  std::string advertise;
  std::string serve_dir;    // what /v1/shards serves: the trainers' published live state
  Millis heartbeat_interval{500};
  Millis quorum_timeout{30'000};  // one long-poll; retried while the round is pending
  Millis backoff_max{2'000};      // lighthouse retries: capped, jittered exponential backoff
  Millis drain_timeout{30'000};   // how long trainers get to exit after a drain
  std::string leave_reason = "cancelled";  // reason sent on SIGTERM
  // Ask the lighthouse for the next outer step's quorum as soon as the node commits, so that
  // the round overlaps the inner steps and the trainers' next poll is answered at once.
  bool ask_ahead = true;
  // Publish the answer to the trainers' next poll on the poll board (SOCKET.board) when
  // nothing changed, so that their poll reads it from memory instead of a socket round trip.
  bool poll_board = true;
  // Threads and queue of the pool that runs the trainers' KV and checkpoint calls to the
  // lighthouse (a KV GET waits for its key); a request beyond the queue gets 503.
  uint32_t workers = 16;
  uint32_t worker_queue_max = 256;
  // Reports for the lighthouse (commits, failure reports, checkpoint registrations, the leave)
  // kept while it is away, delivered in order when it answers again. Past the bound the oldest
  // report that is not the leave is dropped (logged): a larger bound rides out longer outages
  // for a few hundred bytes a report.
  uint32_t outbox_max = 65'536;
  // How long an agent whose trainers all finished stays to deliver its final commit and its
  // leave while the lighthouse is away; then it logs what it could not deliver and exits.
  // Other leaves (a signal, a failure) wait at most the shorter of this and a few seconds.
  Millis final_report_timeout{300'000};
  // How long the agent waits for the first trainer's hello; then it leaves with no_trainers
  // and exits 3 (its trainers failed at start: a group that heartbeats as healthy and never
  // asks would hold the other groups' first quorum for good). Zero waits for ever.
  Millis hello_timeout{600'000};

  // kInvalidArgument naming the first option out of range (a required one empty, node_rank not
  // below nodes); the messages name the agent's flags, which set these fields one for one. An
  // empty incarnation passes: the caller derives one (MakeIncarnation) where that is possible.
  Status Validate() const;
  // Where the lighthouse calls go: the gateway's URL, else the lighthouse's (or its default).
  std::string LighthouseUrl() const;
};

class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();
  // Listens on the socket (and --serve) and starts the lighthouse threads.
  Status Start();
  // Runs until the agent is done; returns the process exit code: 0 after a graceful drain,
  // 3 when the group failed (a trainer died, the group was evicted or replaced, no trainer came).
  int Run();
  // From a signal: drain the trainers, leave with `reason`, exit 0. With `checkpoint` the
  // trainers first save a durable checkpoint and the group leaves once they have exited (the
  // save is done); `after_leave` then runs (e.g. the Slurm requeue) before the agent exits.
  void Drain(const std::string& reason, bool checkpoint = false,
             std::function<void()> after_leave = {});
  // Call as soon as a leave signal arrives, before deciding why: from then on a trainer that
  // exits (Slurm signals the trainers at the same moment) is part of the leave, not a crash.
  void SignalArrived();
  const std::string& incarnation() const;
  // Reports an event about this life to the lighthouse (POST /v1/event: "requeue_refused",
  // "trainer_crashed") with a one-line detail, bounded by `timeout`. The group's counts after it
  // (crashes, requeue refusals) in `*crashes`/`*refusals` when given. From any thread.
  Status ReportEvent(const std::string& event, const std::string& detail, Millis timeout,
                     uint32_t* crashes = nullptr, uint32_t* refusals = nullptr);
  // The two listeners' route tables as handlers, for handing a request over without a socket
  // (the route fuzzers: http::CallHandler, then run io_context() until it is answered). After
  // Start, on the one thread that runs io_context() (Run, or the caller instead of Run).
  http::Handler trainer_handler() const;
  http::Handler peer_handler() const;
  boost::asio::io_context& io_context();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// A fresh incarnation id for this start (see AgentOptions::incarnation).
std::string MakeIncarnation(uint32_t nodes);

}  // namespace lk::agent
