// The load generator's network layer: keep-alive HTTP/1.1 connections driven by one Asio
// io_context (Nagle off, one request in flight per connection, a deliberately tiny response
// parser so that the client costs little CPU next to the server it measures), a raw TCP barrier
// server that is the floor for quorum formation, and /proc readers for CPU and memory.
// Thread-safety: every HttpConn and the Loop belong to the thread that runs the Loop; the
// BarrierServer runs its own thread and exposes only atomics.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace lk::bench {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using SteadyClock = std::chrono::steady_clock;

// One answer as the load generator sees it: the status code, the body (only when asked for), and
// when the last byte arrived. status 0 means a transport error, described in `error`.
struct HttpResult {
  int status = 0;
  std::string body;
  SteadyClock::time_point done;
  std::string error;
};

// The bytes of one HTTP/1.1 request with a body, built once and sent many times.
std::string RequestBytes(std::string_view method, std::string_view target, std::string_view body,
                         std::string_view content_type);

// Parses "HOST:PORT" into a TCP endpoint (numeric host only).
tcp::endpoint ParseEndpoint(const std::string& address);

class HttpConn : public std::enable_shared_from_this<HttpConn> {
 public:
  using Callback = std::function<void(HttpResult&&)>;
  explicit HttpConn(asio::io_context& ioc) : socket_(ioc) {}

  void Connect(const tcp::endpoint& ep, std::function<void(bool ok)> done);
  // Sends `request` (kept alive by the shared_ptr) and calls `done` once with the answer. One
  // request at a time: Send while busy() is a programmer error.
  void Send(std::shared_ptr<const std::string> request, Callback done, bool want_body = false);
  void Close();
  bool busy() const { return static_cast<bool>(done_); }
  bool open() const { return socket_.is_open(); }

 private:
  void DoRead();
  // Delivers the answer when the buffer holds a whole response; false when more is needed.
  bool TryDeliver();
  void Fail(const std::string& why);

  tcp::socket socket_;
  std::shared_ptr<const std::string> request_;
  std::vector<char> in_ = std::vector<char>(8192);
  size_t in_len_ = 0;
  bool want_body_ = false;
  Callback done_;
};

// The calling thread's event loop: the orchestration is written as straight-line code that
// starts asynchronous work and then runs the loop until a condition holds or a bound passes.
class Loop {
 public:
  Loop() : work_(asio::make_work_guard(ioc_)) {}
  asio::io_context& ioc() { return ioc_; }
  // Runs handlers until pred() is true; false when `bound` passed first.
  bool RunUntil(const std::function<bool()>& pred, std::chrono::milliseconds bound);
  // Runs handlers for `d` (timers of a load run, for instance).
  void RunFor(std::chrono::milliseconds d);

 private:
  asio::io_context ioc_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
};

using ConnPtr = std::shared_ptr<HttpConn>;

// Opens `n` connections to `ep`, at most `parallel` connects in flight (the listen backlog is
// finite). Returns fewer than `n` when some failed or `bound` passed.
std::vector<ConnPtr> ConnectAll(Loop& loop, const tcp::endpoint& ep, size_t n, size_t parallel,
                                std::chrono::milliseconds bound);
void CloseAll(Loop& loop, std::vector<ConnPtr>& conns);

// Sends requests[i] on conns[i] for every i and waits for every answer, at most `bound`.
// Missing answers stay status 0 with error "no answer".
std::vector<HttpResult> SendAll(Loop& loop, const std::vector<ConnPtr>& conns,
                                const std::vector<std::shared_ptr<const std::string>>& requests,
                                std::chrono::milliseconds bound, bool want_body = false);

// A raw TCP barrier on 127.0.0.1, in its own thread: each client writes a 4-byte round size N;
// when N clients wait, all get one byte back. It has no HTTP, no protobuf and no disk, so it is
// the floor under any coordinator's "last join to every member answered" on this machine.
class BarrierServer {
 public:
  BarrierServer();
  ~BarrierServer();
  uint16_t port() const { return port_; }
  // Clients waiting in the current round; the orchestration polls it before the last arrival.
  size_t waiting() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
  std::thread thread_;
  uint16_t port_ = 0;
};

// CPU seconds a process has used in user and kernel mode, from /proc/PID/stat; -1 when
// unreadable.
struct CpuSeconds {
  double user = -1, sys = -1;
};
CpuSeconds ProcessCpuSeconds(pid_t pid);
// Resident set size in bytes, VmRSS from /proc/PID/status; -1 when unreadable.
int64_t ProcessRssBytes(pid_t pid);
// CPU seconds used by the calling thread.
double ThreadCpuSeconds();

// Nearest-rank percentile of `v` (sorted in place), q in [0, 1]; 0 for an empty vector.
double Percentile(std::vector<double>& v, double q);

}  // namespace lk::bench
