// lighthouse: the central coordinator. Parses options, validates them, logs the effective
// configuration, and serves until SIGTERM or SIGINT, which answer every waiter and exit 0.
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include <cstdio>

#include "common/flags.h"
#include "common/log.h"
#include "lighthouse/service.h"

int main(int argc, char** argv) {
  using namespace lk;
  using namespace lk::lighthouse;
  ServiceOptions o;
  std::string data_dir = "./lighthouse-data";
  uint32_t min_replicas = o.core.min_replicas;
  uint32_t join_timeout_ms = static_cast<uint32_t>(o.core.join_timeout.count());
  uint32_t heartbeat_timeout_ms = static_cast<uint32_t>(o.core.heartbeat_timeout.count());
  uint32_t progress_timeout_ms = static_cast<uint32_t>(o.core.progress_timeout.count());
  uint32_t idle_timeout_ms = static_cast<uint32_t>(o.http.idle_timeout.count());
  uint32_t request_timeout_ms = static_cast<uint32_t>(o.http.request_timeout.count());
  uint64_t body_bytes_max = o.http.body_bytes_max;
  int64_t body_max = static_cast<int64_t>(body_bytes_max);
  uint32_t connections_max = o.http.connections_max;
  int64_t request_buffer_max = static_cast<int64_t>(o.http.request_buffer_bytes_max);
  uint32_t jobs_max = o.core.jobs_max;
  uint32_t group_grace_ms = static_cast<uint32_t>(o.core.group_grace.count());
  std::string log_level = "info";

  Flags flags("lighthouse",
              "Lightkeeper's coordinator: tracks the replica groups of many training jobs, forms a\n"
              "quorum each outer step, keeps step numbers, hands out recovery plans and a\n"
              "rendezvous store. State is kept in RocksDB under --data-dir; a restart loses nothing.");
  flags.Add("bind", &o.bind, "HOST:PORT to listen on; port 0 picks a free port");
  flags.Add("data-dir", &data_dir, "directory of the RocksDB state (created if missing)");
  flags.Add("token-file", &o.token_file,
            "tokens, one per line: 'TOKEN' (all jobs), 'JOB TOKEN' (that job), "
            "'role=read-only TOKEN' (/status and /metrics of every job, changes nothing); "
            "empty = no auth");
  flags.Add("admin-token-file", &o.admin_token_file, "file holding the admin token");
  flags.Add("min-replicas", &min_replicas, "fewest groups in a quorum");
  flags.Add("join-timeout-ms", &join_timeout_ms,
            "after the first ask of a round, how long to wait for the other healthy groups");
  flags.Add("heartbeat-timeout-ms", &heartbeat_timeout_ms,
            "a group whose agents have not all heartbeated within this is unhealthy");
  flags.Add("progress-timeout-ms", &progress_timeout_ms,
            "a member whose step does not advance for this long is failed (0 = off)");
  flags.Add("quorum-id-block", &o.quorum_id_block,
            "quorum_ids reserved per fsync: a new id inside the synced reservation costs no fsync "
            "(1 = fsync every new id)");
  flags.Add("idle-timeout-ms", &idle_timeout_ms, "close keep-alive connections idle this long");
  flags.Add("request-timeout-ms", &request_timeout_ms,
            "a request must arrive in full within this once it started");
  flags.Add("body-bytes-max", &body_max, "largest request body accepted");
  flags.Add("connections-max", &connections_max, "connections beyond this are closed at once");
  flags.Add("request-buffer-bytes-max", &request_buffer_max,
            "bytes all connections' request buffers may hold together; a request that would "
            "grow them past it gets 503 BUFFER_BUDGET");
  flags.Add("jobs-max", &jobs_max,
            "jobs held at most; a new job beyond it is refused (429 JOBS_MAX), existing ones "
            "keep working");
  flags.Add("group-grace-ms", &group_grace_ms,
            "a group that left or stopped heartbeating is forgotten this long after (0 = never)");
  flags.Add("tls-cert-file", &o.http.tls_cert_file, "PEM certificate: serve HTTPS when set");
  flags.Add("tls-key-file", &o.http.tls_key_file, "PEM private key for --tls-cert-file");
  flags.Add("log-level", &log_level, "debug, info, warn or error");
  Status st = flags.Parse(argc, argv);
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    return 0;
  }
  LogLevel level;
  if (st.ok() && !ParseLogLevel(log_level, &level)) st = InvalidArgument("bad --log-level {}", log_level);
  if (st.ok() && o.quorum_id_block == 0) st = InvalidArgument("--quorum-id-block must be at least 1");
  if (st.ok() && !flags.positional().empty()) {
    st = InvalidArgument("unexpected argument '{}'", flags.positional()[0]);
  }
  if (st.ok() && min_replicas == 0) st = InvalidArgument("--min-replicas must be at least 1");
  if (st.ok() && heartbeat_timeout_ms == 0) st = InvalidArgument("--heartbeat-timeout-ms must be > 0");
  if (st.ok() && body_max <= 0) st = InvalidArgument("--body-bytes-max must be > 0");
  if (st.ok() && request_buffer_max < (64 << 10)) {
    st = InvalidArgument("--request-buffer-bytes-max must be at least 65536");
  }
  if (st.ok() && jobs_max == 0) st = InvalidArgument("--jobs-max must be at least 1");
  if (st.ok() && data_dir.empty()) st = InvalidArgument("--data-dir must not be empty");
  if (st.ok() && o.http.tls_cert_file.empty() != o.http.tls_key_file.empty()) {
    st = InvalidArgument("--tls-cert-file and --tls-key-file go together");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "lighthouse: %s\n", st.message().c_str());
    return 2;
  }
  SetLogLevel(level);
  o.core.min_replicas = min_replicas;
  o.core.join_timeout = Millis(join_timeout_ms);
  o.core.heartbeat_timeout = Millis(heartbeat_timeout_ms);
  o.core.progress_timeout = Millis(progress_timeout_ms);
  o.http.single_thread = true;  // ioc.run() below is the lighthouse's only io thread
  o.http.idle_timeout = Millis(idle_timeout_ms);
  o.http.request_timeout = Millis(request_timeout_ms);
  o.http.body_bytes_max = static_cast<uint64_t>(body_max);
  o.http.connections_max = connections_max;
  o.http.request_buffer_bytes_max = static_cast<uint64_t>(request_buffer_max);
  o.core.jobs_max = jobs_max;
  o.core.group_grace = Millis(group_grace_ms);
  LK_LOG_INFO("lighthouse_start {}", flags.Effective());

  auto store = OpenRocksDbStore(data_dir);
  if (!store.ok()) {
    LK_LOG_ERROR("state_open_failed data_dir={} error={}", Q(data_dir), Q(store.status().ToString()));
    return 1;
  }
  boost::asio::io_context ioc(1);
  Service service(ioc, o, std::move(*store));
  if (st = service.Start(); !st.ok()) {
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
