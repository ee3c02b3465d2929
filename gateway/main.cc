// lk_gateway: one per site, on the host with a leg outside it. Parses options, validates them,
// logs the effective configuration, and relays until SIGTERM or SIGINT, which end the relays in
// flight (503 SHUTTING_DOWN) and exit 0. Every flag is also an LK_* environment variable.
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <malloc.h>

#include <csignal>
#include <cstdio>

#include "common/flags.h"
#include "common/log.h"
#include "gateway/gateway.h"

namespace lk::gateway {
namespace {

// What the flags set: the gateway's options, and what only this binary uses. Durations and
// sizes are integers here (the flags' types) until Apply moves them into the options.
struct Config {
  GatewayOptions o;
  std::string log_level = "info";
  LogLevel level = LogLevel::kInfo;
  uint32_t idle_timeout_ms = static_cast<uint32_t>(o.http.idle_timeout.count());
  uint32_t request_timeout_ms = static_cast<uint32_t>(o.http.request_timeout.count());
  int64_t body_max = static_cast<int64_t>(o.http.body_bytes_max);
  uint32_t connections_max = o.http.connections_max;
  int64_t request_buffer_max = static_cast<int64_t>(o.http.request_buffer_bytes_max);
  uint32_t upstream_timeout_ms = static_cast<uint32_t>(o.upstream_timeout.count());
  int64_t exchange_max = static_cast<int64_t>(o.exchange_bytes_max);
};

void AddFlags(Flags& flags, Config* c) {
  GatewayOptions& o = c->o;
  flags.Add("site", &o.site, "this site's name (e.g. alps), for logs; required");
  flags.Add("lighthouse", &o.lighthouse,
            "the lighthouse's URL (http://HOST:PORT or https://...); "
            "required");
  flags.Add("listen", &o.listen,
            "HOST:PORT where this site's agents reach the gateway (replica_agent --gateway); "
            "port 0 picks a free one");
  flags.Add("token-file", &o.token_file,
            "the jobs relayed for, in the lighthouse's format: 'JOB TOKEN' lines (that job's "
            "calls with that token), a bare 'TOKEN' (every job's); a call without one of them is "
            "refused here and never forwarded");
  flags.Add("insecure-no-auth", &o.insecure_no_auth,
            "listen beyond loopback without --token-file (every call that reaches --listen is "
            "relayed); refused otherwise");
  flags.Add("gateway-token-file", &o.gateway_token_file,
            "this gateway's own credential at the lighthouse (a 'role=gateway TOKEN' line of its "
            "token file): the lighthouse then shows, per group, the site it heartbeats through");
  flags.Add("proxy", &o.proxy,
            "HTTP CONNECT proxy for the calls to the lighthouse (http://[USER:PASSWORD@]HOST:PORT; "
            "TLS stays end to end); default: LK_PROXY, else https_proxy/http_proxy, except hosts "
            "in no_proxy and loopback");
  flags.MarkSecret("proxy");  // it may carry a password; gateway_listening shows it without
  flags.Add("ca-file", &o.ca_file,
            "CA (PEM) that an https lighthouse's certificate must chain "
            "to; its host name is checked too (default: the system's CAs)");
  flags.Add("tls-cert-file", &o.http.tls_cert_file,
            "TLS certificate chain (PEM) for --listen (agents then use --gateway https://...)");
  flags.Add("tls-key-file", &o.http.tls_key_file, "TLS private key (PEM) for --tls-cert-file");
  flags.Add("relays-max", &o.relays_max,
            "relayed calls in flight at once (a long poll holds one while it waits; an agent "
            "holds about three); more are answered 503 WORKERS_BUSY and retried by the agent");
  flags.Add("upstream-timeout-ms", &c->upstream_timeout_ms,
            "how long a call may take at the lighthouse beyond its own long-poll wait; keep it "
            "below the agents' 5 s margin so they hear LIGHTHOUSE_UNREACHABLE first");
  flags.Add("idle-timeout-ms", &c->idle_timeout_ms, "close keep-alive connections idle this long");
  flags.Add("request-timeout-ms", &c->request_timeout_ms,
            "a request must arrive in full within this once it started");
  flags.Add("body-bytes-max", &c->body_max, "largest request body accepted");
  flags.Add("connections-max", &c->connections_max, "connections beyond this are closed at once");
  flags.Add("request-buffer-bytes-max", &c->request_buffer_max,
            "bytes all connections' request buffers may hold together; a request that would "
            "grow them past it gets 503 BUFFER_BUDGET");
  flags.Add("wan-listen", &o.wan_listen,
            "HOST:PORT where the other sites' gateways reach this one for the outer exchange "
            "(one partial sum per site crosses the WAN); empty: this gateway only dials");
  flags.Add("wan-connect", &o.wan_connect,
            "the other sites' gateways this one dials, comma-separated HOST:PORT (their "
            "--wan-listen; https://HOST:PORT when they serve TLS): for a site that cannot be "
            "dialed (NAT). Each pair of sites needs one side to dial the other");
  flags.Add("wan-advertise", &o.wan_advertise,
            "HOST:PORT the other sites dial for --wan-listen (logged; never an unspecified "
            "address)");
  flags.Add("wan-ca-file", &o.wan_ca_file,
            "CA (PEM) that the dialed gateways' certificates must chain to");
  flags.Add("exchange-bytes-max", &c->exchange_max,
            "bytes the outer exchange may hold at once (contributions and partial sums); a "
            "contribution beyond it is refused 503 BUFFER_BUDGET");
  flags.Add("log-level", &c->log_level, "debug, info, warn or error");
}

// The binary's own checks, then the options'. A negative size becomes 0, which Validate refuses
// with the flag's own message.
Status Resolve(const Flags& flags, Config* c) {
  if (!ParseLogLevel(c->log_level, &c->level)) {
    return InvalidArgument("bad --log-level {}", c->log_level);
  }
  if (!flags.positional().empty()) {
    return InvalidArgument("unexpected argument '{}'", flags.positional()[0]);
  }
  GatewayOptions& o = c->o;
  o.http.single_thread = true;  // main's ioc.run() is the gateway's only io thread
  o.http.idle_timeout = Millis(c->idle_timeout_ms);
  o.http.request_timeout = Millis(c->request_timeout_ms);
  o.http.body_bytes_max = static_cast<uint64_t>(std::max<int64_t>(c->body_max, 0));
  o.http.connections_max = c->connections_max;
  o.http.request_buffer_bytes_max =
      static_cast<uint64_t>(std::max<int64_t>(c->request_buffer_max, 0));
  o.upstream_timeout = Millis(c->upstream_timeout_ms);
  o.exchange_bytes_max = static_cast<uint64_t>(std::max<int64_t>(c->exchange_max, 0));
  return o.Validate();
}

int Run(const Config& c) {
  std::signal(SIGPIPE, SIG_IGN);
  // The exchange takes and frees chunk-sized buffers (megabytes) many times a second. glibc
  // would serve each from a fresh mmap, or trim the heap after it, and every byte written
  // would fault its page in again: kept in the heap instead, they are reused warm.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  boost::asio::io_context ioc(1);
  Gateway gateway(ioc, c.o);
  if (Status st = gateway.Start(); !st.ok()) {
    LK_LOG_ERROR("gateway_start_failed error={}", Q(st.ToString()));
    return 1;
  }
  boost::asio::signal_set signals(ioc, SIGTERM, SIGINT);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    LK_LOG_INFO("signal_received signal={}", sig);
    gateway.Stop();
  });
  ioc.run();
  gateway.Join();
  LK_LOG_INFO("gateway_exit code=0");
  return 0;
}

}  // namespace
}  // namespace lk::gateway

int main(int argc, char** argv) {
  using namespace lk;
  using namespace lk::gateway;
  Config c;
  Flags flags("lk_gateway",
              "Lightkeeper's site gateway: the one host of a site with a leg outside it. The\n"
              "site's agents (replica_agent --gateway HOST:PORT) send their lighthouse calls here\n"
              "and it relays them to --lighthouse, only for the jobs whose token it holds; their\n"
              "trainers' outer exchange is summed here and swapped with the other sites' gateways\n"
              "(--wan-listen, --wan-connect), one partial sum per site.");
  AddFlags(flags, &c);
  if (auto code = flags.ParseCommandLine(argc, argv, [&] { return Resolve(flags, &c); })) {
    return *code;
  }
  SetLogLevel(c.level);
  SetLogPrefix(fmt::format("gateway={}", c.o.site));
  LK_LOG_INFO("gateway_start {}", flags.Effective());
  return Run(c);
}
