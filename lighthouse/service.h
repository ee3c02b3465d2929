// The lighthouse shell: HTTP routes -> the pure core on one strand -> effects applied in order
// (persist, synced when a quorum_id is new; then answers, rejections, watch wake-ups; then log
// events). It owns the long-poll waiters (quorum, watch, KV GET), each with a deadline, and
// answers every one of them on every path, shutdown included.
// Thread-safety: run the io_context on one thread; every method runs on it.
#pragma once

#include <boost/asio/io_context.hpp>

#include <memory>
#include <string>

#include "common/http/server.h"
#include "lighthouse/lighthouse_core.h"
#include "lighthouse/state_store.h"

namespace lk::lighthouse {

struct ServiceOptions {
  // Where to listen; port 0 picks a free port (logged as listening address=HOST:PORT).
  std::string bind = "0.0.0.0:29510";
  // Job tokens: each line "TOKEN" (any job) or "JOB TOKEN" (that job only). Empty: no auth.
  std::string token_file;
  // The admin token (drain, forget, all jobs in /status, /metrics). Empty: admin calls need no
  // token when no job tokens are set either, and are refused when they are.
  std::string admin_token_file;
  // Without token_file a lighthouse that listens beyond loopback refuses to start (anyone who
  // reaches it could join, commit and read every job) unless this is set.
  bool insecure_no_auth = false;
  CoreOptions core;
  http::ServerOptions http;
  // A quorum request without timeout_ms waits this long; longer asks are capped at max.
  Millis quorum_wait_default{30'000};
  Millis long_poll_max{300'000};
  // Rendezvous limits per job and per value.
  uint32_t kv_keys_per_job_max = 4096;
  uint32_t kv_value_bytes_max = 64 * 1024;
  // Rendezvous epochs kept per job: the current quorum_id and this many before it.
  uint32_t kv_epochs_kept = 1;
  // quorum_ids are reserved on disk this many at a time: a new id within the synced
  // reservation is handed out after an unsynced write (which survives a process kill), so most
  // quorum changes cost no fsync. 1 syncs every new id. A machine crash may then forget the
  // last quorum record written since the last sync, never an id: a restart continues above the
  // reservation.
  uint32_t quorum_id_block = 1024;

  // kInvalidArgument naming the first option out of range, then the core's own checks. The
  // messages name the lighthouse's flags, which set these fields one for one.
  Status Validate() const;
};

class Service {
 public:
  Service(boost::asio::io_context& ioc, ServiceOptions options, std::unique_ptr<StateStore> store);
  ~Service();
  // Loads the durable state into the core and starts listening.
  Status Start();
  std::string address() const;
  // The route table as a handler, for handing a request over without a socket (tests, the route
  // fuzzer: http::CallHandler, then run the io_context until it is answered). Call it on the
  // io_context's thread, after Start.
  http::Handler handler() const;
  // Stops listening, answers every waiter (503 "shutting down"), closes idle connections.
  void Shutdown();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace lk::lighthouse
