// lighthouse: the central coordinator. Parses options, validates them, logs the effective
// configuration, and serves until SIGTERM or SIGINT, which answer every waiter and exit 0.
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include <cstdio>

#include "common/flags.h"
#include "common/log.h"
#include "lighthouse/service.h"

namespace lk::lighthouse {
namespace {

// What the flags set: the service's options, and what only this binary uses. Durations and
// sizes are integers here (the flags' types) until Apply moves them into the options.
struct Config {
  ServiceOptions o;
  std::string data_dir = "./lighthouse-data";
  std::string log_level = "info";
  LogLevel level = LogLevel::kInfo;
  uint32_t min_replicas = o.core.min_replicas;
  uint32_t join_timeout_ms = static_cast<uint32_t>(o.core.join_timeout.count());
  uint32_t heartbeat_timeout_ms = static_cast<uint32_t>(o.core.heartbeat_timeout.count());
  uint32_t progress_timeout_ms = static_cast<uint32_t>(o.core.progress_timeout.count());
  uint32_t idle_timeout_ms = static_cast<uint32_t>(o.http.idle_timeout.count());
  uint32_t request_timeout_ms = static_cast<uint32_t>(o.http.request_timeout.count());
  int64_t body_max = static_cast<int64_t>(o.http.body_bytes_max);
  uint32_t connections_max = o.http.connections_max;
  int64_t request_buffer_max = static_cast<int64_t>(o.http.request_buffer_bytes_max);
  uint32_t jobs_max = o.core.jobs_max;
  uint32_t group_grace_ms = static_cast<uint32_t>(o.core.group_grace.count());
};

void AddFlags(Flags& flags, Config* c) {
  ServiceOptions& o = c->o;
  flags.Add("bind", &o.bind, "HOST:PORT to listen on; port 0 picks a free port");
  flags.Add("data-dir", &c->data_dir, "directory of the RocksDB state (created if missing)");
  flags.Add("token-file", &o.token_file,
            "tokens, one per line: 'TOKEN' (all jobs), 'JOB TOKEN' (that job), "
            "'role=read-only TOKEN' (/status and /metrics of every job, changes nothing), "
            "'role=gateway TOKEN' (an lk_gateway's credential: the site it relays for); "
            "empty = no auth");
  flags.Add("admin-token-file", &o.admin_token_file, "file holding the admin token");
  flags.Add("insecure-no-auth", &o.insecure_no_auth,
            "run without --token-file on an address beyond loopback (anyone who reaches the port "
            "may join, commit and read every job); refused otherwise");
  flags.Add("min-replicas", &c->min_replicas, "fewest groups in a quorum");
  flags.Add("join-timeout-ms", &c->join_timeout_ms,
            "after the first ask of a round, how long to wait for the other healthy groups");
  flags.Add("heartbeat-timeout-ms", &c->heartbeat_timeout_ms,
            "a group whose agents have not all heartbeated within this is unhealthy");
  flags.Add("progress-timeout-ms", &c->progress_timeout_ms,
            "a member whose step does not advance for this long is failed (0 = off)");
  flags.Add("quorum-id-block", &o.quorum_id_block,
            "quorum_ids reserved per fsync: a new id inside the synced reservation costs no fsync "
            "(1 = fsync every new id)");
  flags.Add("idle-timeout-ms", &c->idle_timeout_ms, "close keep-alive connections idle this long");
  flags.Add("request-timeout-ms", &c->request_timeout_ms,
            "a request must arrive in full within this once it started");
  flags.Add("body-bytes-max", &c->body_max, "largest request body accepted");
  flags.Add("connections-max", &c->connections_max, "connections beyond this are closed at once");
  flags.Add("request-buffer-bytes-max", &c->request_buffer_max,
            "bytes all connections' request buffers may hold together; a request that would "
            "grow them past it gets 503 BUFFER_BUDGET");
  flags.Add("jobs-max", &c->jobs_max,
            "jobs held at most; a new job beyond it is refused (429 JOBS_MAX), existing ones "
            "keep working");
  flags.Add("group-grace-ms", &c->group_grace_ms,
            "a group that left or stopped heartbeating is forgotten this long after (0 = never)");
  flags.Add("tls-cert-file", &o.http.tls_cert_file, "PEM certificate: serve HTTPS when set");
  flags.Add("tls-key-file", &o.http.tls_key_file, "PEM private key for --tls-cert-file");
  flags.Add("log-level", &c->log_level, "debug, info, warn or error");
}

// Moves the flags' integers into the options. A negative size becomes 0, which Validate
// refuses with the flag's own message.
void Apply(Config* c) {
  ServiceOptions& o = c->o;
  o.core.min_replicas = c->min_replicas;
  o.core.join_timeout = Millis(c->join_timeout_ms);
  o.core.heartbeat_timeout = Millis(c->heartbeat_timeout_ms);
  o.core.progress_timeout = Millis(c->progress_timeout_ms);
  o.core.jobs_max = c->jobs_max;
  o.core.group_grace = Millis(c->group_grace_ms);
  o.http.single_thread = true;  // main's ioc.run() is the lighthouse's only io thread
  o.http.idle_timeout = Millis(c->idle_timeout_ms);
  o.http.request_timeout = Millis(c->request_timeout_ms);
  o.http.body_bytes_max = static_cast<uint64_t>(std::max<int64_t>(c->body_max, 0));
  o.http.connections_max = c->connections_max;
  o.http.request_buffer_bytes_max =
      static_cast<uint64_t>(std::max<int64_t>(c->request_buffer_max, 0));
}

// The binary's own checks, then the service's options'.
Status Validate(const Flags& flags, Config* c) {
  if (!ParseLogLevel(c->log_level, &c->level)) {
    return InvalidArgument("bad --log-level {}", c->log_level);
  }
  if (!flags.positional().empty()) {
    return InvalidArgument("unexpected argument '{}'", flags.positional()[0]);
  }
  if (c->data_dir.empty()) return InvalidArgument("--data-dir must not be empty");
  Apply(c);
  return c->o.Validate();
}

// Serves until SIGTERM or SIGINT; the process's exit code.
int Run(const Config& c) {
  auto store = OpenRocksDbStore(c.data_dir);
  if (!store.ok()) {
    LK_LOG_ERROR("state_open_failed data_dir={} error={}", Q(c.data_dir),
                 Q(store.status().ToString()));
    return 1;
  }
  boost::asio::io_context ioc(1);
  Service service(ioc, c.o, std::move(*store));
  if (Status st = service.Start(); !st.ok()) {
    LK_LOG_ERROR("start_failed error={}", Q(st.ToString()));
    return 1;
  }
  boost::asio::signal_set signals(ioc, SIGTERM, SIGINT);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    LK_LOG_INFO("signal_received signal={}", sig);
    service.Shutdown();
  });
  ioc.run();
  LK_LOG_INFO("lighthouse_exit code=0");
  return 0;
}

}  // namespace
}  // namespace lk::lighthouse

int main(int argc, char** argv) {
  using namespace lk;
  using namespace lk::lighthouse;
  Config c;
  Flags flags("lighthouse",
              "Lightkeeper's coordinator: tracks the replica groups of many training jobs, forms a\n"
              "quorum each outer step, keeps step numbers, hands out recovery plans and a\n"
              "rendezvous store. State is kept in RocksDB under --data-dir; a restart loses nothing.");
  AddFlags(flags, &c);
  if (auto code = flags.ParseCommandLine(argc, argv, [&] { return Validate(flags, &c); })) {
    return *code;
  }
  SetLogLevel(c.level);
  LK_LOG_INFO("lighthouse_start {}", flags.Effective());
  return Run(c);
}
