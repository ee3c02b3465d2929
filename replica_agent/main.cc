// replica_agent: one per node of a replica group (started before the trainers, e.g. with
// `srun --ntasks-per-node=1`). Every flag is also an LK_* environment variable.
#include <boost/asio/signal_set.hpp>

#include <cstdio>
#include <csignal>
#include <thread>

#include "common/flags.h"
#include "common/log.h"
#include "replica_agent/agent.h"

int main(int argc, char** argv) {
  using namespace lk;
  using namespace lk::agent;
  AgentOptions o;
  uint32_t heartbeat_interval_ms = static_cast<uint32_t>(o.heartbeat_interval.count());
  uint32_t quorum_timeout_ms = static_cast<uint32_t>(o.quorum_timeout.count());
  uint32_t drain_timeout_ms = static_cast<uint32_t>(o.drain_timeout.count());
  uint32_t backoff_max_ms = static_cast<uint32_t>(o.backoff_max.count());
  std::string log_level = "info";
  Flags flags("replica_agent",
              "Lightkeeper's node agent: heartbeats the lighthouse for its replica group, asks for\n"
              "the quorum at outer-step boundaries, relays quorums, recovery plans and failure\n"
              "notices to the trainers on this node (Unix socket), and reports a dead trainer or\n"
              "a signal to the lighthouse at once.");
  flags.Add("lighthouse", &o.lighthouse, "lighthouse URL (http://HOST:PORT or https://...)");
  flags.Add("job", &o.job, "the training job (lighthouse namespace)");
  flags.Add("group-id", &o.group_id, "this replica group, stable across restarts (e.g. jupiter-0)");
  flags.Add("incarnation", &o.incarnation,
            "id of this group life; default from SLURM_JOB_ID+SLURM_RESTART_COUNT, else random");
  flags.Add("node-rank", &o.node_rank, "this node's rank in the group (default $SLURM_NODEID)");
  flags.Add("nodes", &o.nodes, "nodes in the group (default $SLURM_NNODES)");
  flags.Add("socket", &o.socket, "Unix socket for the trainers (they read LK_AGENT_SOCKET)",
            "LK_AGENT_SOCKET");
  flags.Add("token-file", &o.token_file, "bearer token for the lighthouse");
  flags.Add("serve", &o.serve, "HOST:PORT where peers reach this agent (shards, health)");
  flags.Add("advertise", &o.advertise, "address peers use for --serve (default: its bound address)");
  flags.Add("serve-dir", &o.serve_dir, "directory of the trainers' live state to serve to peers");
  flags.Add("heartbeat-interval-ms", &heartbeat_interval_ms, "time between heartbeats");
  flags.Add("quorum-timeout-ms", &quorum_timeout_ms, "one quorum long-poll (retried while pending)");
  flags.Add("backoff-max-ms", &backoff_max_ms, "cap of the jittered retry backoff");
  flags.Add("drain-timeout-ms", &drain_timeout_ms, "how long trainers get to exit after a drain");
  flags.Add("log-level", &log_level, "debug, info, warn or error");
  Status st = flags.Parse(argc, argv);
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    return 0;
  }
  // Under Slurm the node rank and count come from the step's environment.
  if (!flags.IsSet("node-rank")) {
    if (const char* v = std::getenv("SLURM_NODEID")) o.node_rank = static_cast<uint32_t>(std::atoi(v));
  }
  if (!flags.IsSet("nodes")) {
    if (const char* v = std::getenv("SLURM_NNODES")) o.nodes = static_cast<uint32_t>(std::atoi(v));
  }
  LogLevel level;
  if (st.ok() && !ParseLogLevel(log_level, &level)) st = InvalidArgument("bad --log-level {}", log_level);
  if (st.ok() && o.job.empty()) st = InvalidArgument("--job is required");
  if (st.ok() && o.group_id.empty()) st = InvalidArgument("--group-id is required");
  if (st.ok() && o.socket.empty()) st = InvalidArgument("--socket is required");
  if (st.ok() && o.nodes == 0) st = InvalidArgument("--nodes must be at least 1");
  if (st.ok() && o.node_rank >= o.nodes) {
    st = InvalidArgument("--node-rank {} must be below --nodes {}", o.node_rank, o.nodes);
  }
  if (st.ok() && o.incarnation.empty()) {
    if (o.nodes > 1 && std::getenv("SLURM_JOB_ID") == nullptr) {
      st = InvalidArgument("a group of several nodes needs --incarnation outside Slurm (one id "
                           "shared by all its agents, new at every restart)");
    } else {
      o.incarnation = MakeIncarnation(o.nodes);
    }
  }
  if (!st.ok()) {
    std::fprintf(stderr, "replica_agent: %s\n", st.message().c_str());
    return 2;
  }
  SetLogLevel(level);
  SetLogPrefix(fmt::format("agent={}/{}", o.group_id, o.node_rank));
  o.heartbeat_interval = Millis(heartbeat_interval_ms);
  o.quorum_timeout = Millis(quorum_timeout_ms);
  o.drain_timeout = Millis(drain_timeout_ms);
  o.backoff_max = Millis(backoff_max_ms);
  LK_LOG_INFO("agent_start {} incarnation={}", flags.Effective(), o.incarnation);
  // Signals are taken on a thread of their own with sigwait, so a handler never runs inside
  // the agent's locks.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  Agent agent(o);
  if (st = agent.Start(); !st.ok()) {
    LK_LOG_ERROR("agent_start_failed error={}", Q(st.ToString()));
    return 1;
  }
  std::thread([&agent, set] {
    int sig = 0;
    while (sigwait(&set, &sig) == 0) {
      LK_LOG_INFO("signal_received signal={}", sig);
      agent.Drain(sig == SIGUSR2 ? "preempted" : "cancelled");
    }
  }).detach();
  int code = agent.Run();
  std::fflush(stderr);
  return code;
}
