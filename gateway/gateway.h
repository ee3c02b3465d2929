// lk_gateway: one per site, the only process of the site with a leg outside it. It carries the
// site's outer exchange (exchange.h: one partial sum per site crosses the WAN) and the control
// plane: the site's agents (replica_agent --gateway) send every lighthouse
// call to it, and it relays them to the lighthouse unchanged (bodies, status codes, long polls
// and watches), only for the jobs whose token it holds. A request without a token, with a token
// it does not know, or for a job its token does not cover is refused here with a reason code and
// never forwarded; the agents' own HTTP server limits (body size, timeouts, connection count,
// buffer budget) hold on its listener as on the lighthouse's.
// Thread-safety: the server runs on one io_context thread (the caller's, in Run or their own);
// each relayed request runs on a relay thread of a bounded set (a long poll holds its thread
// while it waits); Stop from the io thread, Join after the io_context returned.
#pragma once

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <memory>
#include <string>

#include "common/http/http.h"
#include "common/http/server.h"

namespace lk::gateway {

struct GatewayOptions {
  // This site's name, for logs (and, later, the lighthouse's view of the topology). Required.
  std::string site;
  // The lighthouse's URL (http://HOST:PORT or https://...). Required.
  std::string lighthouse;
  // Where the site's agents reach the gateway; port 0 picks a free one (logged).
  std::string listen = "127.0.0.1:29520";
  // The jobs it relays for, in the lighthouse's token-file format (common/http/tokens.h): a
  // "JOB TOKEN" line relays JOB's calls carrying TOKEN, a bare TOKEN relays every job's. Empty:
  // every call is relayed as it is (the lighthouse still checks its tokens); refused beyond
  // loopback unless insecure_no_auth.
  std::string token_file;
  bool insecure_no_auth = false;
  // The gateway's own credential at the lighthouse (a "role=gateway TOKEN" line of its token
  // file): with it, every relayed call says which site it came through (the Lk-Gateway header)
  // and the lighthouse's /status shows the site per group. Empty: calls arrive as the agents'.
  std::string gateway_token_file;
  // An HTTP CONNECT proxy for the calls to the lighthouse; empty: the environment's
  // (http::ProxyFromEnv: LK_PROXY, https_proxy, no_proxy), else direct.
  std::string proxy;
  // CA (PEM) an https lighthouse's certificate must chain to (system CAs if empty).
  std::string ca_file;
  // The listener's limits and TLS (tls_cert_file/tls_key_file), as the lighthouse's.
  http::ServerOptions http;
  // Relayed calls in flight at once, each on a thread of its own (a long poll holds one while it
  // waits: an agent holds about three). Beyond it a call is answered 503 WORKERS_BUSY at once and
  // the agent retries; more costs a thread's stack (mostly untouched) each.
  uint32_t relays_max = 1024;
  // How long a call that is not a long poll may take at the lighthouse; a long poll gets its own
  // wait (its timeout_ms, capped at long_poll_max) plus this. Below the agent's own margin over
  // each wait (5 s), so that a lighthouse the gateway cannot reach (a black-holed WAN) is
  // answered 503 LIGHTHOUSE_UNREACHABLE before the agent gives up on its own deadline.
  Millis upstream_timeout{4'000};
  Millis long_poll_max{300'000};

  // The outer exchange across sites (gateway/exchange.h). `wan_listen`: where the other sites'
  // gateways reach this one ("HOST:PORT"; empty: none reaches it, it only dials). `wan_connect`:
  // the other gateways this one dials, comma-separated "HOST:PORT" or "https://HOST:PORT" (a
  // site that cannot be dialed, behind NAT, dials; a site that cannot dial out is dialed). Each
  // pair of sites needs one way: one side's wan_connect names the other's wan_listen.
  // `wan_advertise`: the address other sites dial for wan_listen, for logs and the operators'
  // configuration (an unspecified wan_listen host is never taken for it).
  std::string wan_listen;
  std::string wan_connect;
  std::string wan_advertise;
  // CA (PEM) the dialed gateways' certificates must chain to, for https:// in wan_connect.
  std::string wan_ca_file;
  // Bytes the exchange may hold at once (contributions and partials of all rounds).
  uint64_t exchange_bytes_max = 4ull << 30;
  // The longest a round may wait for its members and the other sites (a member's timeout_ms is
  // capped at it), and how often rounds past their deadline are failed.
  Millis exchange_timeout_max{600'000};
  Millis exchange_sweep{500};

  // kInvalidArgument naming the first flag out of range (a required one empty, an open listener
  // without tokens, a certificate without its key).
  Status Validate() const;
};

class Gateway {
 public:
  Gateway(boost::asio::io_context& ioc, GatewayOptions options);
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;
  // Reads the token file, checks the lighthouse URL and CA, and listens.
  Status Start();
  // The bound listen address, "HOST:PORT".
  std::string address() const;
  // The bound --wan-listen address, "HOST:PORT"; empty without one.
  std::string wan_address() const;
  // Stops listening, ends the relays in flight (their callers get 503 SHUTTING_DOWN) and
  // refuses new ones; on the io thread.
  void Stop();
  // Joins the relay threads; after the io_context has returned (or from any thread but its).
  void Join();
  // The route table as a handler, for handing a request over without a socket (tests).
  http::Handler handler() const;
  // The same for the --wan-listen route table (the other gateways' side).
  http::Handler wan_handler() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace lk::gateway
