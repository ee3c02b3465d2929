// An HTTP/1.1 server on Boost.Asio for every Lightkeeper process: keep-alive, a bound on the
// body size, a timeout while idle and another once a request has started (so a client that stalls
// mid-request is cut off), a limit on connections, Nagle off, optional TLS, and TCP or Unix-domain
// listeners. Handlers answer through a Responder, possibly later (long-polls).
// Thread-safety: create, Listen and Stop on the io_context's thread (or before it runs); the
// io_context may be run by several threads, each connection keeps to its own strand.
#pragma once

#include <boost/asio/io_context.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include <lightkeeper/clock.h>
#include "common/http/http.h"
#include <lightkeeper/status.h>

namespace lk::http {

struct ServerOptions {
  // Largest request body accepted; bigger ones get 413 and the connection is closed.
  uint64_t body_bytes_max = 4 << 20;
  // How long a keep-alive connection may sit without a new request before it is closed.
  Millis idle_timeout{60'000};
  // How long a request may take to arrive in full once its first byte came.
  Millis request_timeout{10'000};
  // How long writing a response may take.
  Millis write_timeout{10'000};
  // Connections beyond this are closed at once after accept.
  uint32_t connections_max = 20'000;
  // One budget for the request buffers of all connections together (heads, bodies, pipelined
  // bytes): a connection whose buffer would grow past it is answered 503 (BUFFER_BUDGET) and
  // closed, so that many large or slow requests cannot take the process's memory. Each
  // connection holds at least 16 KiB while it reads.
  uint64_t request_buffer_bytes_max = 512ull << 20;
  // Set when exactly one thread runs the io_context: connections then skip their strand, whose
  // locking and queueing are a measurable part of a small request's cost (a heartbeat).
  bool single_thread = false;
  // TLS for TCP listeners when both are set (PEM files).
  std::string tls_cert_file;
  std::string tls_key_file;
};

// The barrier every handler runs behind: a handler that throws (input it failed to check) is
// answered 500 with reason INTERNAL, unless it had answered already, and logged once as
// `handler_threw method=... path=... what=...`; the process and every other connection go on.
// LK_CHECK still aborts: a broken invariant is a programmer error, not input. The server calls
// its handlers through it; so may anything that hands a request to a handler without a socket
// (tests, the route fuzzers). `respond` is called at most once.
void CallHandler(const Handler& handler, Request&& req, Responder respond);
// The 500 INTERNAL answer of a handler that threw, logged as handler_threw.
Response HandlerThrew(std::string_view method, std::string_view path, std::string_view what);

class Server {
 public:
  Server(boost::asio::io_context& ioc, ServerOptions options, Handler handler);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Listens on "HOST:PORT" (port 0 picks a free one) or "unix:/path" (an existing socket file is
  // replaced). May be called several times for several listeners. A Unix socket file is made
  // mode 0600 before anyone can connect (it is bound in a private directory, then renamed into
  // place), and its requests carry the peer's credentials.
  Status Listen(const std::string& address);
  // The same with a handler of this listener's own: each listener carries only its own routes
  // (the agent's trainer API on its Unix socket, shard reads on its TCP port).
  Status Listen(const std::string& address, Handler handler);
  // The bound address of the first listener, "HOST:PORT" or "unix:/path".
  std::string LocalAddress() const;
  // Closes the listeners and every idle connection; connections with a request in flight close
  // after their response. Waiters must be answered by the owner (the handler's state).
  void Stop();
  uint64_t connections() const;
  // Bytes held by all connections' request buffers now.
  uint64_t buffer_bytes() const;

  struct Impl;  // public so that the connection classes in server.cc can name it

 private:
  void StartSweeping();
  std::shared_ptr<Impl> impl_;
};

// How far a listen address ("HOST:PORT", ":PORT", "unix:PATH") reaches. Loopback: a Unix socket
// or a loopback IP, only this host. Unspecified: an empty host, 0.0.0.0 or ::, every address of
// the host (no address to give peers). A bad address is neither.
bool ListensOnLoopback(const std::string& address);
bool ListensOnUnspecified(const std::string& address);
// The IPv4 address of network interface `name` ("ib0"), as text; kNotFound when there is no
// such interface or it has no IPv4 address.
Result<std::string> InterfaceIPv4(const std::string& name);

}  // namespace lk::http
