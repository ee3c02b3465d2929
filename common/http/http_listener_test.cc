// The HTTP layer's part of the trust boundary: listeners with their own routes, Unix peers
// identified by the kernel, a socket file nobody else can open, cancellable client requests,
// and no process-wide SIGPIPE change.
#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/http/server.h"
#include "common/sigpipe.h"
#include "tests/support/process.h"
#include "tests/support/wait.h"

namespace lk::http {
namespace {

// A server on its own thread whose default handler answers "default" and holds /hold without
// answering (until the server stops).
struct Running {
  boost::asio::io_context ioc;
  std::unique_ptr<Server> server;
  std::thread thread;
  std::vector<Responder> held;

  Running() {
    server = std::make_unique<Server>(ioc, ServerOptions{}, [this](Request&& req, Responder r) {
      if (req.path == "/hold") {
        held.push_back(std::move(r));
        return;
      }
      r(TextReply(200, "text/plain", "default"));
    });
  }
  void Start() {
    thread = std::thread([this] { ioc.run(); });
  }
  ~Running() {
    boost::asio::post(ioc, [this] {
      server->Stop();
      held.clear();
    });
    if (thread.joinable()) thread.join();
  }
};

TEST_CASE("each listener has its own routes - a Unix peer comes with its kernel credentials") {
  Running rs;
  std::string dir = test::TempDir("http-listeners");
  std::string sock = dir + "/s.sock";
  REQUIRE(rs.server->Listen("127.0.0.1:0").ok());
  std::string tcp_address = rs.server->LocalAddress();
  REQUIRE(rs.server
              ->Listen("unix:" + sock,
                       [](Request&& req, Responder r) {
                         std::string creds = "none";
                         if (req.credentials) {
                           creds = fmt::format("pid={} uid={} gid={}", req.credentials->pid,
                                               req.credentials->uid, req.credentials->gid);
                         }
                         r(TextReply(200, "text/plain", "unix " + creds));
                       })
              .ok());
  rs.Start();
  // The socket file is the owner's alone from the moment it exists.
  struct stat st {};
  REQUIRE(::stat(sock.c_str(), &st) == 0);
  CHECK(S_ISSOCK(st.st_mode));
  CHECK((st.st_mode & 0777) == 0600);
  auto unix_client = Client::Create("unix:" + sock);
  REQUIRE(unix_client.ok());
  auto r = (*unix_client)->Do("GET", "/anything");
  REQUIRE(r.ok());
  CHECK(r->body == fmt::format("unix pid={} uid={} gid={}", ::getpid(), ::geteuid(), ::getegid()));
  auto tcp_client = Client::Create("http://" + tcp_address);
  REQUIRE(tcp_client.ok());
  r = (*tcp_client)->Do("GET", "/anything");
  REQUIRE(r.ok());
  CHECK(r->body == "default");
  // Nothing of the private directory the socket was bound in is left beside it.
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++entries;
    CHECK(e.path().filename() == "s.sock");
  }
  CHECK(entries == 1);
}

TEST_CASE(
    "a Unix socket replaces an old file at its path, and a path in a missing directory fails") {
  Running rs;
  std::string dir = test::TempDir("http-replace");
  std::string sock = dir + "/s.sock";
  { std::ofstream(sock) << "stale"; }
  REQUIRE(rs.server->Listen("unix:" + sock).ok());
  rs.Start();
  auto c = Client::Create("unix:" + sock);
  REQUIRE(c.ok());
  auto r = (*c)->Do("GET", "/x");
  REQUIRE(r.ok());
  CHECK(r->body == "default");
  Running other;
  auto st = other.server->Listen("unix:" + dir + "/missing/s.sock");
  CHECK(st.code() == Code::kUnavailable);
}

TEST_CASE("Cancel ends a request that waits on a server that never answers") {
  Running rs;
  REQUIRE(rs.server->Listen("127.0.0.1:0").ok());
  rs.Start();
  auto c = Client::Create("http://" + rs.server->LocalAddress());
  REQUIRE(c.ok());
  std::atomic<bool> returned{false};
  Result<Response> got = Status(Code::kInternal, "not yet");
  std::thread waiter([&] {
    got = (*c)->Do("GET", "/hold", "", "", Millis(600'000));
    returned = true;
  });
  // Cancel only once the request is in the server's hands (held), so that it is the wait
  // that is cut short, not the connect.
  std::atomic<size_t> held{0};
  REQUIRE(test::WaitUntil(
      [&] {
        boost::asio::post(rs.ioc, [&] { held = rs.held.size(); });
        return held == 1;
      },
      std::chrono::seconds(5), "the request held by the server", std::chrono::milliseconds(10)));
  CHECK_FALSE(returned.load());
  (*c)->Cancel();
  waiter.join();
  CHECK(got.status().code() == Code::kAborted);
  // A cancelled client stays cancelled.
  CHECK((*c)->Do("GET", "/x").status().code() == Code::kAborted);
}

TEST_CASE("no server changes SIGPIPE's disposition, and the guard keeps an EPIPE write alive") {
  struct sigaction dfl {};
  struct sigaction before {};
  dfl.sa_handler = SIG_DFL;
  REQUIRE(::sigaction(SIGPIPE, &dfl, &before) == 0);
  {
    Running rs;
    REQUIRE(rs.server->Listen("127.0.0.1:0").ok());
    struct sigaction now {};
    REQUIRE(::sigaction(SIGPIPE, nullptr, &now) == 0);
    bool still_default = now.sa_handler == SIG_DFL;
    CHECK(still_default);
  }
  // With the default disposition a write to a closed peer would kill this process: the guard
  // takes the signal on this thread and leaves nothing pending.
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  ::close(sv[1]);
  ssize_t n;
  int err;
  {
    ScopedSigpipeBlock guard;
    n = ::write(sv[0], "x", 1);
    err = errno;
  }
  ::close(sv[0]);
  CHECK(n == -1);
  CHECK(err == EPIPE);
  sigset_t pending;
  sigemptyset(&pending);
  REQUIRE(::sigpending(&pending) == 0);
  CHECK(sigismember(&pending, SIGPIPE) == 0);
  ::sigaction(SIGPIPE, &before, nullptr);
}

}  // namespace
}  // namespace lk::http
