// replica_agent: one per node of a replica group (started before the trainers, e.g. with
// `srun --ntasks-per-node=1`). Every flag is also an LK_* environment variable.
#include <boost/asio/signal_set.hpp>

#include <atomic>
#include <cstdio>
#include <csignal>
#include <thread>

#include "common/flags.h"
#include "common/log.h"
#include "replica_agent/agent.h"
#include "slurm/requeue.h"
#include "slurm/slurm_env.h"

namespace lk::agent {
namespace {

// What the flags set: the agent's options, and what only this binary uses. Durations are
// integers here (the flags' type) until Resolve moves them into the options.
struct Config {
  AgentOptions o;
  uint32_t heartbeat_interval_ms = static_cast<uint32_t>(o.heartbeat_interval.count());
  uint32_t quorum_timeout_ms = static_cast<uint32_t>(o.quorum_timeout.count());
  uint32_t drain_timeout_ms = static_cast<uint32_t>(o.drain_timeout.count());
  uint32_t backoff_max_ms = static_cast<uint32_t>(o.backoff_max.count());
  uint32_t final_report_timeout_ms = static_cast<uint32_t>(o.final_report_timeout.count());
  uint32_t hello_timeout_ms = static_cast<uint32_t>(o.hello_timeout.count());
  std::string log_level = "info";
  LogLevel level = LogLevel::kInfo;
  uint32_t signal_before_s = 120;
  bool requeue = true;
};

void AddFlags(Flags& flags, Config* c) {
  AgentOptions& o = c->o;
  flags.Add("lighthouse", &o.lighthouse,
            "lighthouse URL (http://HOST:PORT or https://...); default http://127.0.0.1:29510 "
            "unless --gateway is given");
  flags.Add("gateway", &o.gateway,
            "this site's lk_gateway, HOST:PORT (https://HOST:PORT when it serves TLS): every "
            "lighthouse call goes through it, so the node needs no route out of the site; "
            "excludes --lighthouse");
  flags.Add("job", &o.job, "the training job (lighthouse namespace)");
  flags.Add("group-id", &o.group_id, "this replica group, stable across restarts (e.g. jupiter-0)");
  flags.Add("incarnation", &o.incarnation,
            "id of this group life; default from SLURM_JOB_ID+SLURM_RESTART_COUNT, else random");
  flags.Add("node-rank", &o.node_rank, "this node's rank in the group (default $SLURM_NODEID)");
  flags.Add("nodes", &o.nodes, "nodes in the group (default $SLURM_NNODES)");
  flags.Add("socket", &o.socket, "Unix socket for the trainers (they read LK_AGENT_SOCKET)",
            "LK_AGENT_SOCKET");
  flags.Add("token-file", &o.token_file,
            "the job's bearer token: sent to the lighthouse, and required of peers' shard and "
            "status reads on --serve");
  flags.Add("ca-file", &o.ca_file, "CA (PEM) that an https lighthouse's certificate must chain "
            "to; its host name is checked too (default: the system's CAs)");
  flags.Add("serve", &o.serve,
            "HOST:PORT where peers reach this agent (/healthz, /v1/agent/status, /v1/shards)");
  flags.Add("tls-cert-file", &o.tls_cert_file, "TLS certificate chain (PEM) for --serve");
  flags.Add("tls-key-file", &o.tls_key_file, "TLS private key (PEM) for --serve");
  flags.Add("insecure-no-auth", &o.insecure_no_auth,
            "serve peers beyond loopback without --token-file (anyone may read the group's live "
            "state); refused otherwise");
  flags.Add("advertise", &o.advertise,
            "address peers use for --serve: HOST:PORT, or an interface name (ib0: its IPv4 "
            "address and the bound port); default: the bound address, https://HOST:PORT with "
            "--tls-cert-file; required when --serve binds 0.0.0.0");
  flags.Add("proxy", &o.proxy,
            "HTTP CONNECT proxy for the lighthouse calls (http://[USER:PASSWORD@]HOST:PORT; TLS "
            "stays end to end); default: LK_PROXY, else https_proxy/http_proxy, except hosts in "
            "no_proxy and loopback");
  flags.MarkSecret("proxy");  // it may carry a password; agent_listening shows it without
  flags.Add("serve-dir", &o.serve_dir, "directory of the trainers' live state to serve to peers");
  flags.Add("heartbeat-interval-ms", &c->heartbeat_interval_ms, "time between heartbeats");
  flags.Add("ask-ahead", &o.ask_ahead,
            "ask for the next outer step's quorum right after the node commits (the round then "
            "overlaps the inner steps); false asks when the trainers poll");
  flags.Add("poll-board", &o.poll_board,
            "publish the next poll's answer in shared memory (the file SOCKET.board) when nothing "
            "changed, so that trainers read it without a socket round trip");
  flags.Add("quorum-timeout-ms", &c->quorum_timeout_ms,
            "one quorum long-poll (retried while pending)");
  flags.Add("backoff-max-ms", &c->backoff_max_ms, "cap of the jittered retry backoff");
  flags.Add("drain-timeout-ms", &c->drain_timeout_ms,
            "how long trainers get to exit after a drain");
  flags.Add("signal-before-s", &c->signal_before_s,
            "Slurm: seconds before the time limit that the warning signal comes (--signal=B:USR2@S)");
  flags.Add("requeue", &c->requeue,
            "Slurm: requeue the job after a preemption or time-limit leave");
  flags.Add("workers", &o.workers,
            "threads for the trainers' KV and checkpoint calls to the lighthouse");
  flags.Add("worker-queue-max", &o.worker_queue_max,
            "such calls queued beyond the busy workers; more get 503");
  flags.Add("outbox-max", &o.outbox_max,
            "reports for the lighthouse (commits, checkpoint registrations, the leave) kept while "
            "it is away, delivered in order when it is back; past this the oldest is dropped");
  flags.Add("final-report-timeout-ms", &c->final_report_timeout_ms,
            "after the trainers finished, how long the agent stays to deliver its final commit "
            "and leave to a lighthouse that is away (then it logs what is undelivered and exits)");
  flags.Add("hello-timeout-ms", &c->hello_timeout_ms,
            "how long to wait for the first trainer's hello; then the group leaves with "
            "no_trainers and the agent exits 3 (its trainers failed at start); 0: for ever");
  flags.Add("log-level", &c->log_level, "debug, info, warn or error");
}

// Fills what the flags left to the environment (under Slurm the node rank and count come from
// the step's environment, the incarnation from the job), validates, and moves the flags'
// integers into the options.
Status Resolve(const Flags& flags, Config* c) {
  AgentOptions& o = c->o;
  if (!flags.IsSet("node-rank")) {
    if (const char* v = std::getenv("SLURM_NODEID")) o.node_rank = static_cast<uint32_t>(std::atoi(v));
  }
  if (!flags.IsSet("nodes")) {
    if (const char* v = std::getenv("SLURM_NNODES")) o.nodes = static_cast<uint32_t>(std::atoi(v));
  }
  if (!ParseLogLevel(c->log_level, &c->level)) {
    return InvalidArgument("bad --log-level {}", c->log_level);
  }
  LK_RETURN_IF_ERROR(o.Validate());
  if (o.incarnation.empty()) {
    if (o.nodes > 1 && std::getenv("SLURM_JOB_ID") == nullptr) {
      return InvalidArgument("a group of several nodes needs --incarnation outside Slurm (one id "
                             "shared by all its agents, new at every restart)");
    }
    o.incarnation = MakeIncarnation(o.nodes);
  }
  o.heartbeat_interval = Millis(c->heartbeat_interval_ms);
  o.quorum_timeout = Millis(c->quorum_timeout_ms);
  o.drain_timeout = Millis(c->drain_timeout_ms);
  o.backoff_max = Millis(c->backoff_max_ms);
  o.final_report_timeout = Millis(c->final_report_timeout_ms);
  o.hello_timeout = Millis(c->hello_timeout_ms);
  return Status::Ok();
}

// Under Slurm the environment tells why the job is told to go; outside it a warning is a
// preemption and SIGTERM a cancellation, and nothing is requeued.
std::optional<slurm::SlurmEnv> ReadSlurmEnv() {
  if (!slurm::InSlurm()) return std::nullopt;
  auto env = slurm::ParseSlurmEnv(slurm::ProcessEnv());
  if (!env.ok()) {
    LK_LOG_WARN("slurm_env_unparsable error={}", Q(env.status().ToString()));
    return std::nullopt;
  }
  slurm::SubprocessRunner runner;
  if (Status fe = slurm::FillEndTime(runner, &*env); !fe.ok()) {
    LK_LOG_WARN("slurm_end_time_unknown error={}", Q(fe.ToString()));
  }
  LK_LOG_INFO("slurm job={} restart_count={}", env->JobRef(), env->restart_count);
  return std::move(*env);
}

// The first leave signal drains the agent with the reason Slurm's state gives; later ones are
// ignored. Returns when `exiting` is set and a signal of `set` wakes the loop.
void HandleSignals(Agent& agent, const sigset_t& set, const std::atomic<bool>& exiting,
                   const std::optional<slurm::SlurmEnv>& slurm_env, const Config& c) {
  int sig = 0;
  bool leaving = false;
  while (sigwait(&set, &sig) == 0) {
    if (exiting) return;  // woken by main to be joined
    if (leaving) {
      // Slurm sends SIGTERM right after a requeue, and may repeat the warning: one leave.
      LK_LOG_INFO("signal_ignored signal={} reason=already_leaving", sig);
      continue;
    }
    leaving = true;
    agent.SignalArrived();
    slurm::LeaveInput in;
    in.signal = sig == SIGUSR2 ? slurm::LeaveSignal::kWarning : slurm::LeaveSignal::kTerm;
    in.in_slurm = slurm_env.has_value();
    in.now = std::chrono::system_clock::now();
    in.margin = slurm::TimeLimitMargin(std::chrono::seconds(c.signal_before_s));
    if (slurm_env) {
      in.limit_end = slurm_env->end_time;
      in.restart_count = slurm_env->restart_count;
      slurm::SubprocessRunner runner;
      if (auto job = slurm::QueryJob(runner, slurm_env->JobRef()); job.ok()) in.job_now = *job;
    }
    auto d = slurm::ClassifyLeave(in);
    std::string reason(slurm::LeaveReasonName(d.reason));
    LK_LOG_INFO("signal_received signal={} leave_reason={} requeue={} why={}", sig, reason,
                d.requeue && c.requeue, Q(d.why));
    // A warning or a preemption: the trainers save a durable checkpoint before the group
    // leaves. A cancellation leaves at once.
    bool checkpoint = d.reason != slurm::LeaveReason::kCancelled;
    std::function<void()> after_leave;
    if (d.requeue && c.requeue && slurm_env) {
      after_leave = [env = *slurm_env, &agent] {
        // slurmctld may be busy or restarting for a while: a bounded retry. A refusal that
        // stays (requeue disabled, the job gone) is not retried. Either way the lighthouse
        // hears of a requeue that did not happen (the operator sees it in lkctl status), since
        // the group will not come back by itself.
        slurm::SubprocessRunner runner;
        int attempts = 0;
        Status st = slurm::RequeueWithRetry(
            env, runner, slurm::RetryPolicy{},
            [](std::chrono::seconds s) {
              LK_LOG_WARN("requeue_retry wait_s={}", s.count());
              std::this_thread::sleep_for(s);
            },
            &attempts);
        if (st.ok()) {
          if (attempts > 1) LK_LOG_INFO("requeue_retried attempts={}", attempts);
          LK_LOG_INFO("requeued job={}", env.JobRef());
          return;
        }
        LK_LOG_ERROR("requeue_refused job={} attempts={} error={}", env.JobRef(), attempts,
                     Q(st.ToString()));
        uint32_t refusals = 0;
        Status told = agent.ReportEvent("requeue_refused", st.message(), Millis(10'000), nullptr,
                                        &refusals);
        if (told.ok()) {
          LK_LOG_INFO("requeue_refused_reported requeue_refusals={}", refusals);
        } else {
          LK_LOG_WARN("event_report_failed event=requeue_refused error={}",
                      Q(told.ToString()));
        }
      };
    }
    agent.Drain(reason, checkpoint, after_leave);
  }
}

// Runs the agent until it is done, with its signals taken on a thread of their own (sigwait),
// so that a handler never runs inside the agent's locks; the process's exit code.
int Run(const Config& c) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  Agent agent(c.o);
  if (Status st = agent.Start(); !st.ok()) {
    LK_LOG_ERROR("agent_start_failed error={}", Q(st.ToString()));
    return 1;
  }
  std::optional<slurm::SlurmEnv> slurm_env = ReadSlurmEnv();
  std::atomic<bool> exiting{false};
  std::thread signals([&] { HandleSignals(agent, set, exiting, slurm_env, c); });
  int code = agent.Run();
  // The signal thread waits in sigwait: a signal of its set sent to it alone wakes it to exit.
  exiting = true;
  pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  std::fflush(stderr);
  return code;
}

}  // namespace
}  // namespace lk::agent

int main(int argc, char** argv) {
  using namespace lk;
  using namespace lk::agent;
  Config c;
  Flags flags("replica_agent",
              "Lightkeeper's node agent: heartbeats the lighthouse for its replica group, asks for\n"
              "the quorum at outer-step boundaries, relays quorums, recovery plans and failure\n"
              "notices to the trainers on this node (Unix socket), and reports a dead trainer or\n"
              "a signal to the lighthouse at once.");
  AddFlags(flags, &c);
  if (auto code = flags.ParseCommandLine(argc, argv, [&] { return Resolve(flags, &c); })) {
    return *code;
  }
  SetLogLevel(c.level);
  SetLogPrefix(fmt::format("agent={}/{}", c.o.group_id, c.o.node_rank));
  LK_LOG_INFO("agent_start {} incarnation={}", flags.Effective(), c.o.incarnation);
  return Run(c);
}
