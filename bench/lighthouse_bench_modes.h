// The lighthouse benchmark's modes. Each starts the lighthouse processes it needs (fresh data
// directories under BenchOptions::work_dir), measures its figure and the figure of a peer in the
// same run, stops what it started, and returns plain numbers; lighthouse_bench.cc prints them.
// Every wait is bounded; a bound that passes is a failure recorded in the result, not a hang.
// Thread-safety: call from one thread, which runs the Loop.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/lighthouse_bench_net.h"
#include <lightkeeper/status.h>
#include "tests/support/process.h"

namespace lk::bench {

struct BenchOptions {
  std::string bin_dir;   // holds the lighthouse binary
  std::string work_dir;  // data directories and logs of the lighthouses started here
  std::string nginx;     // HOST:PORT of the nginx peer serving a static 204; empty: no peer
  pid_t nginx_worker_pid = 0;  // for its CPU time; 0: not reported
  double warm_s = 1.0;         // load before the measured window
  double measure_s = 3.0;      // the measured window of a throughput run
  double scale = 1.0;          // repetitions are multiplied by this (a quick run uses < 1)
};

// A lighthouse child process on 127.0.0.1, with its address, pid and log.
struct LighthouseProc {
  std::unique_ptr<test::Process> process;
  std::string address;
  std::string data_dir;
  std::string log_path;
};
LighthouseProc StartBenchLighthouse(const BenchOptions& o, const std::string& tag,
                                    const std::vector<std::string>& extra_flags);

// ---- (1) heartbeat throughput ----

struct LoadResult {
  bool ran = false;
  size_t connections = 0;
  double rate_per_s = 0;
  uint64_t ok = 0, errors = 0;
  double p50_ms = 0, p99_ms = 0;   // per-request latency inside the window
  double server_cpu_us = -1;       // server CPU per answered request (user + kernel)
  double server_sys_us = -1;       // the kernel's part of it
  double client_cpu_frac = 0;      // load generator's thread busy fraction
  std::string first_error;
};

struct HeartbeatFigures {
  size_t agents = 0;
  LoadResult lighthouse, nginx;
};
HeartbeatFigures RunHeartbeat(Loop& loop, const BenchOptions& o, size_t agents);

// ---- (2) quorum formation and (3) unchanged quorum ----

struct LatencyStats {
  size_t samples = 0;
  size_t failures = 0;
  double p50_ms = 0, p99_ms = 0, max_ms = 0;
  std::string first_error;
  std::string reason;  // the lighthouse's reason for the last quorum (what path it took)
};
LatencyStats Summarize(std::vector<double> ms, size_t failures, std::string first_error);

struct FormationFigures {
  uint32_t groups = 0;
  LatencyStats lighthouse, barrier;
};
// Formation of a new quorum (no previous one) for each group count, `reps(n)` times each.
std::vector<FormationFigures> RunFormation(Loop& loop, const BenchOptions& o,
                                           const std::vector<uint32_t>& group_counts);
// Every member of a formed quorum re-asks with its next step, `rounds` times.
FormationFigures RunUnchanged(Loop& loop, const BenchOptions& o, uint32_t groups);
// One raw TCP round trip on loopback, p50/p99 over many.
LatencyStats RunEchoRtt(const BarrierServer& server, size_t rounds);
// A 100-byte write plus fdatasync in `dir`, in place or appended: the floor under every new
// quorum_id, which is synced before anyone hears of it.
LatencyStats RunFsync(const std::string& dir, size_t rounds, bool append);

// ---- (4) cold starts ----

struct ColdStartFigures {
  size_t sets = 0, groups_per_set = 0, joins = 0;
  size_t answered = 0, hung = 0, failed = 0, inconsistent_sets = 0;
  double bound_ms = 0;
  LatencyStats latency;  // from the set's start (connect included) to each join's answer
};
ColdStartFigures RunColdStarts(Loop& loop, const BenchOptions& o, size_t sets,
                               size_t groups_per_set, size_t sets_at_once);

// ---- (5) restart to serving and (6) memory per group ----

struct RestartFigures {
  size_t groups = 0, jobs = 0;
  bool ok = false;
  std::string error;
  int64_t rss_base = 0, rss_heartbeats = 0, rss_quorums = 0, rss_restarted = 0;
  double bytes_per_group_tracked = 0;  // heartbeats only
  double bytes_per_group_quorum = 0;   // after every group is in a quorum
  double healthz_ms = 0;               // from exec to /healthz answering 200
  double quorum_ms = 0;                // from exec to a one-group job's next quorum answered
  double job_quorum_ms = 0;            // from exec to a 100-group job's next quorum answered
  double load_ms = -1;                 // the lighthouse's own state_loaded load_ms
};
RestartFigures RunRestartAndMemory(Loop& loop, const BenchOptions& o, size_t jobs,
                                   size_t groups_per_job);

}  // namespace lk::bench
