#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <optional>
#include <thread>

#include "common/http/auth.h"
#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/http/server.h"
#include "common/proto/lightkeeper.pb.h"
#include "tests/support/process.h"
#include "tests/support/tcp_relay.h"
#include "tests/support/wait.h"

namespace lk::http {
namespace {

namespace pb = lightkeeper::v1;

// A file for the file-body routes: 8 MiB, more than a socket buffer holds, so that sendfile has
// to wait for room.
constexpr uint64_t kFileBodyBytes = uint64_t{8} << 20;

const std::string& FileBodyPath() {
  struct TempFile {
    std::string path;
    ~TempFile() { ::unlink(path.c_str()); }
  };
  static const TempFile file{[] {
    std::string p = "/tmp/lk_http_file_body_" + std::to_string(getpid());
    std::string data(kFileBodyBytes, '\0');
    for (uint64_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 7919) >> 3);
    FILE* f = std::fopen(p.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(std::fwrite(data.data(), 1, data.size(), f) == data.size());
    std::fclose(f);
    return p;
  }()};
  return file.path;
}

std::string FileBodyExpected() {
  std::string want = "F:";
  for (uint64_t i = 10; i < kFileBodyBytes; ++i) want += static_cast<char>((i * 7919) >> 3);
  return want;
}

// Runs a Server on its own thread; answers /echo with the HeartbeatRequest it got (step + 1),
// /later after 50 ms from another thread, and anything else with 404.
struct TestServer {
  boost::asio::io_context ioc;
  std::unique_ptr<Server> server;
  std::thread thread;

  explicit TestServer(ServerOptions opts = {}, std::string address = "127.0.0.1:0") {
    server = std::make_unique<Server>(ioc, opts, [](Request&& req, Responder respond) {
      if (req.path == "/echo") {
        pb::HeartbeatRequest hb;
        Format f = BodyFormat(req.content_type);
        if (Status st = Decode(req.body, f, &hb); !st.ok()) return respond(ErrorReply(st, f));
        hb.set_step(hb.step() + 1);
        return respond(Reply(hb, ReplyFormat(req)));
      }
      if (req.path == "/tail") {
        Response r = TextReply(200, "text/plain", "head-");
        r.headers.emplace_back("X-Extra", "1");
        r.body_tail = std::make_shared<const std::string>(std::string(100'000, 't'));
        return respond(std::move(r));
      }
      if (req.path == "/file" || req.path == "/shortfile") {
        // "F:" then bytes [10, 10 + n) of the test file, as a file body; /shortfile promises
        // more than the file holds.
        int fd = ::open(FileBodyPath().c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return respond(TextReply(500, "text/plain", "no test file"));
        auto owner = std::shared_ptr<const void>(nullptr, [fd](const void*) { ::close(fd); });
        Response r = TextReply(200, "application/octet-stream", "F:");
        r.headers.emplace_back("X-File-Body-Ok", req.file_body_ok ? "1" : "0");
        uint64_t n = kFileBodyBytes - 10 + (req.path == "/shortfile" ? 4096 : 0);
        r.body_file = FileBody{owner, fd, 10, n};
        return respond(std::move(r));
      }
      if (req.path == "/throw") {
        // A handler that trusts its input: the bare path is cut past its end.
        return respond(TextReply(200, "text/plain", req.path.substr(7)));
      }
      if (req.path == "/answer-then-throw") {
        respond(TextReply(200, "text/plain", "answered"));
        throw std::runtime_error("after the answer");
      }
      if (req.path == "/later") {
        std::thread([respond] {
          // Kept: a handler that answers late is what this route is for, not an order.
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          respond(TextReply(200, "text/plain", "late"));
        }).detach();
        return;
      }
      respond(ErrorReply(Error(Code::kNotFound, "no route {}", req.path), Format::kJson));
    });
    REQUIRE(server->Listen(address).ok());
    thread = std::thread([this] { ioc.run(); });
  }
  ~TestServer() {
    boost::asio::post(ioc, [this] { server->Stop(); });
    thread.join();
  }
  std::string Url() const {
    auto a = server->LocalAddress();
    return a.rfind("unix:", 0) == 0 ? a : "http://" + a;
  }
};

// A plain TCP connection for raw-socket checks of the framing; the test stops when it fails.
int RawConnect(const std::string& hostport) {
  int fd = test::ConnectTcp(hostport);
  REQUIRE(fd >= 0);
  return fd;
}

TEST_CASE("query integers: digits only, 32 bits, the default when absent - never a wrap") {
  using Q = std::map<std::string, std::string>;
  CHECK(*ParseU32(Q{}, "n", 7) == 7);
  CHECK(*ParseU32(Q{{"n", ""}}, "n", 7) == 7);
  CHECK(*ParseU32(Q{{"n", "0"}}, "n", 7) == 0);
  CHECK(*ParseU32(Q{{"n", "4294967295"}}, "n", 7) == 4294967295u);
  for (const char* bad : {"4294967296", "-1", "+1", " 1", "1 ", "0x10", "1e3",
                          "18446744073709551616", "99999999999999999999999"}) {
    auto r = ParseU32(Q{{"n", bad}}, "n", 7);
    CHECK_MESSAGE(r.status().code() == Code::kInvalidArgument, bad);
  }
}

TEST_CASE("a protobuf body over 2 GiB is refused with a reason, never handed to protobuf") {
  // Protobuf takes an int size: 2^31 bytes and more turned negative and it aborted. Answers
  // are read up to 8 GiB (shard bodies), so an answer this large can reach Decode. The pages
  // are reserved, not touched: zero bytes, which no parse gets far into.
  const size_t n = (size_t{1} << 31) + 16;
  void* p = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(p != MAP_FAILED);
  lightkeeper::v1::HeartbeatResponse msg;
  Status st = Decode(std::string_view(static_cast<const char*>(p), n), Format::kProto, &msg);
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("2147483647") != std::string::npos);
  ::munmap(p, n);
}

TEST_CASE(
    "libprotobuf's own complaints about bad bodies reach the log as project lines, at most one "
    "per window") {
  // A LeaveRequest whose job (field 1) is not UTF-8: libprotobuf refuses it and writes a line of
  // its own, once per body a stranger sends. Here they go through the project's log, limited.
  const std::string bad = std::string("\x0a\x02\xff\xfe", 4);
  char path[] = "/tmp/lk-protolog-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(fd, STDERR_FILENO);
  for (int i = 0; i < 50; ++i) {
    lightkeeper::v1::LeaveRequest msg;
    CHECK(Decode(bad, Format::kProto, &msg).code() == Code::kInvalidArgument);
  }
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::string out(4096, '\0');
  out.resize(static_cast<size_t>(std::max<ssize_t>(0, ::pread(fd, out.data(), out.size(), 0))));
  ::close(fd);
  ::unlink(path);
  size_t lines = 0;
  for (size_t at = out.find("protobuf_message"); at != std::string::npos;
       at = out.find("protobuf_message", at + 1)) {
    ++lines;
  }
  CHECK_MESSAGE(lines == 1, out);
  CHECK_MESSAGE(out.find("invalid UTF-8") != std::string::npos, out);
  CHECK_MESSAGE(out.find("[libprotobuf") == std::string::npos, out);
}

TEST_CASE("protobuf and JSON bodies round-trip over one keep-alive connection") {
  TestServer ts;
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  pb::HeartbeatRequest req, resp;
  req.set_job("j");
  req.set_step(41);
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(resp.step() == 42);
  CHECK(resp.job() == "j");

  auto r = (*c)->Do("POST", "/echo", R"({"job":"k","group_id":"g","step":7,"extra":1})",
                    kJsonType);
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(r->body.find("\"step\":8") != std::string::npos);
  CHECK(r->body.find("\"group_id\":\"g\"") != std::string::npos);
  CHECK(ts.server->connections() == 1);
}

// Reads from fd until the peer closes it (or 5 s pass), for raw-socket checks of the framing.
std::string ReadAll(int fd) {
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}

TEST_CASE("a shared body tail follows the body and counts in Content-Length") {
  TestServer ts;
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  for (int i = 0; i < 3; ++i) {  // the same keep-alive connection, framing intact each time
    auto r = (*c)->Do("GET", "/tail", "", "text/plain");
    REQUIRE(r.ok());
    CHECK(r->status == 200);
    REQUIRE(r->body.size() == 5 + 100'000);
    CHECK(r->body.substr(0, 5) == "head-");
    CHECK(r->body.find_first_not_of('t', 5) == std::string::npos);
  }
}

TEST_CASE("a file body goes out with sendfile after the body - TCP and Unix sockets - keep-alive intact") {
  std::string path = "/tmp/lk_http_test_file_" + std::to_string(getpid()) + ".sock";
  std::string want = FileBodyExpected();
  for (std::string address : {std::string("127.0.0.1:0"), "unix:" + path}) {
    TestServer ts({}, address);
    auto c = Client::Create(ts.Url());
    REQUIRE(c.ok());
    for (int i = 0; i < 3; ++i) {
      auto r = (*c)->Do("GET", "/file", "", "");
      REQUIRE(r.ok());
      CHECK(r->status == 200);
      CHECK(r->body.size() == want.size());
      CHECK(r->body == want);
    }
    CHECK(ts.server->connections() == 1);
  }
  unlink(path.c_str());
}

TEST_CASE("a file body that ends early cuts the connection - never a short body taken as whole") {
  TestServer ts;
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  auto r = (*c)->Do("GET", "/shortfile", "", "", Millis(5000));
  CHECK_FALSE(r.ok());
  // The server goes on serving other connections.
  auto again = Client::Create(ts.Url());
  REQUIRE(again.ok());
  auto ok = (*again)->Do("GET", "/file", "", "");
  REQUIRE(ok.ok());
  CHECK(ok->body == FileBodyExpected());
}

TEST_CASE("HEAD of a file body gets its Content-Length and no bytes") {
  TestServer ts;
  int fd = RawConnect(ts.server->LocalAddress());
  std::string req = "HEAD /file HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  REQUIRE(::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size()));
  std::string got = ReadAll(fd);
  ::close(fd);
  CHECK(got.find(fmt::format("Content-Length: {}\r\n", 2 + kFileBodyBytes - 10)) != std::string::npos);
  CHECK(got.find("X-File-Body-Ok: 1\r\n") != std::string::npos);
  CHECK(got.size() == got.find("\r\n\r\n") + 4);
}

TEST_CASE("HTTP/1.0 closes after the response and HEAD gets headers only") {
  TestServer ts;
  int fd = RawConnect(ts.server->LocalAddress());
  std::string req = "GET /tail HTTP/1.0\r\nHost: x\r\n\r\n";
  REQUIRE(::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size()));
  std::string got = ReadAll(fd);  // returns only because the server closed the connection
  ::close(fd);
  CHECK(got.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
  CHECK(got.find("Content-Length: 100005\r\n") != std::string::npos);
  CHECK(got.find("X-Extra: 1\r\n") != std::string::npos);
  CHECK(got.size() == got.find("\r\n\r\n") + 4 + 100'005);

  fd = RawConnect(ts.server->LocalAddress());
  req = "HEAD /tail HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  REQUIRE(::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size()));
  got = ReadAll(fd);
  ::close(fd);
  CHECK(got.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  CHECK(got.find("Connection: close\r\n") != std::string::npos);
  CHECK(got.size() == got.find("\r\n\r\n") + 4);
}

TEST_CASE("malformed JSON and wrong field types get 400 with a reason") {
  TestServer ts;
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  auto r = (*c)->Do("POST", "/echo", "{not json", kJsonType);
  REQUIRE(r.ok());
  CHECK(r->status == 400);
  CHECK(r->body.find("invalid_argument") != std::string::npos);
  r = (*c)->Do("POST", "/echo", R"({"step":"many"})", kJsonType);
  REQUIRE(r.ok());
  CHECK(r->status == 400);
  r = (*c)->Do("POST", "/echo", "\xff\xff\xff garbage", kProtoType);
  REQUIRE(r.ok());
  CHECK(r->status == 400);
  CHECK(StatusFromResponse(*r).code() == Code::kInvalidArgument);
}

TEST_CASE("a body over the limit gets 413 and the connection closes") {
  ServerOptions opts;
  opts.body_bytes_max = 1024;
  TestServer ts(opts);
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  auto r = (*c)->Do("POST", "/echo", std::string(4096, 'x'), kJsonType);
  REQUIRE(r.ok());
  CHECK(r->status == 413);
}

TEST_CASE("a client that stalls mid-request is cut off by the request timeout") {
  ServerOptions opts;
  opts.request_timeout = Millis(200);
  TestServer ts(opts);
  int fd = RawConnect(ts.server->LocalAddress());
  std::string partial = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{";
  REQUIRE(write(fd, partial.data(), partial.size()) == static_cast<ssize_t>(partial.size()));
  timeval tv{5, 0};  // bounds the test if the server never closes
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[64];
  ssize_t n = read(fd, buf, sizeof(buf));
  CHECK(n == 0);  // closed by the server, not our 5 s bound
  close(fd);
}

// Writes all of `data` to fd.
void WriteAll(int fd, std::string_view data) {
  REQUIRE(::write(fd, data.data(), data.size()) == static_cast<ssize_t>(data.size()));
}

// Sends `request` on a fresh connection and reads until the server closes it.
std::string RawExchange(const std::string& hostport, std::string_view request) {
  int fd = RawConnect(hostport);
  WriteAll(fd, request);
  std::string got = ReadAll(fd);
  ::close(fd);
  return got;
}

TEST_CASE("pipelined requests on one connection are answered in order") {
  TestServer ts;
  std::string one = R"({"job":"j","step":1})", two = R"({"job":"j","step":2})";
  std::string reqs = fmt::format(
      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}"
      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
      "Connection: close\r\n\r\n{}",
      one.size(), one, two.size(), two);
  std::string got = RawExchange(ts.server->LocalAddress(), reqs);
  auto first = got.find("\"step\":2"), second = got.find("\"step\":3");
  REQUIRE(first != std::string::npos);
  REQUIRE(second != std::string::npos);
  CHECK(first < second);
  CHECK(got.find("HTTP/1.1 200 OK") == 0);
  CHECK(got.find("HTTP/1.1 200 OK", 1) != std::string::npos);
}

TEST_CASE("a large body and then small ones share one keep-alive connection") {
  ServerOptions opts;
  opts.body_bytes_max = 8 << 20;
  TestServer ts(opts);
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  std::string job(3 << 20, 'j');
  for (int round = 0; round < 2; ++round) {
    auto big = (*c)->Do("POST", "/echo", fmt::format(R"({{"job":"{}","step":1}})", job), kJsonType);
    REQUIRE(big.ok());
    CHECK(big->status == 200);
    CHECK(big->body.find(job) != std::string::npos);
    for (int i = 0; i < 3; ++i) {
      auto small = (*c)->Do("POST", "/echo", R"({"job":"k","step":5})", kJsonType);
      REQUIRE(small.ok());
      CHECK(small->body.find("\"step\":6") != std::string::npos);
    }
  }
  CHECK(ts.server->connections() == 1);
}

TEST_CASE("a request arriving a byte at a time is answered once whole") {
  TestServer ts;
  int fd = RawConnect(ts.server->LocalAddress());
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::string body = R"({"job":"j","step":41})";
  std::string req = fmt::format(
      "\r\nPOST /echo HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
      "content-length: {}\r\nconnection: Close\r\n\r\n{}",
      body.size(), body);
  for (char c : req) {
    WriteAll(fd, std::string_view(&c, 1));
    // Kept: pacing a slow writer (one byte per read) is what is under test, not an order.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::string got = ReadAll(fd);
  ::close(fd);
  CHECK(got.find("HTTP/1.1 200 OK") == 0);
  CHECK(got.find("\"step\":42") != std::string::npos);
}

TEST_CASE("Expect: 100-continue gets the interim answer before the body is sent") {
  TestServer ts;
  int fd = RawConnect(ts.server->LocalAddress());
  std::string body = R"({"job":"j","step":7})";
  WriteAll(fd, fmt::format("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           "Content-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
                           body.size()));
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string interim(25, '\0');
  REQUIRE(::recv(fd, interim.data(), interim.size(), MSG_WAITALL) == 25);
  CHECK(interim == "HTTP/1.1 100 Continue\r\n\r\n");
  WriteAll(fd, body);
  std::string got = ReadAll(fd);
  ::close(fd);
  CHECK(got.find("HTTP/1.1 200 OK") == 0);
  CHECK(got.find("\"step\":8") != std::string::npos);
}

TEST_CASE("bad framing gets a 4xx with its reason and the connection closes") {
  TestServer ts;
  std::string hp = ts.server->LocalAddress();
  struct Case {
    std::string request;
    std::string status, reason;
  };
  std::vector<Case> cases = {
      {"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
       "400", "Transfer-Encoding is not supported"},
      {"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "400",
       "conflicting Content-Length"},
      {"POST /echo HTTP/1.1\r\nContent-Length: -2\r\n\r\n{}", "400", "bad Content-Length"},
      {"GET /echo HTTP/2.0\r\n\r\n", "400", "bad version"},
      {"GET /echo HTTP/1.1\r\nNo colon here\r\n\r\n", "400", "bad header line"},
      {"GET /echo HTTP/1.1\r\nX-Big: " + std::string(20'000, 'a') + "\r\n\r\n", "431",
       "request head over"},
      {"GET /echo HTTP/1.1\r\nX-Big: " + std::string(20'000, 'a'), "431", "request head over"},
  };
  for (const auto& c : cases) {
    std::string got = RawExchange(hp, c.request);  // returns because the server closes
    CHECK_MESSAGE(got.rfind("HTTP/1.1 " + c.status, 0) == 0, got.substr(0, 200));
    CHECK_MESSAGE(got.find(c.reason) != std::string::npos, got.substr(0, 400));
    CHECK(got.find("Connection: close\r\n") != std::string::npos);
  }
  // The server is unharmed.
  auto c = Client::Create(ts.Url());
  REQUIRE(c.ok());
  pb::HeartbeatRequest req, resp;
  req.set_step(1);
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(resp.step() == 2);
}

TEST_CASE("an idle keep-alive connection is closed after idle_timeout") {
  ServerOptions opts;
  opts.idle_timeout = Millis(200);
  TestServer ts(opts);
  int fd = RawConnect(ts.server->LocalAddress());
  WriteAll(fd, "GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n");
  auto t0 = std::chrono::steady_clock::now();
  std::string got = ReadAll(fd);  // the answer, then the close (ReadAll gives up after 5 s)
  ::close(fd);
  // Closed by the server, not ended by ReadAll's own 5 s bound.
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(4));
  CHECK(got.find("HTTP/1.1 404") == 0);
  CHECK(got.find("Connection: close") == std::string::npos);  // it was kept, then timed out
}

TEST_CASE("a client that never reads its answer is cut off by the write timeout") {
  ServerOptions opts;
  opts.write_timeout = Millis(300);
  TestServer ts(opts);
  for (const char* path : {"/file", "/tail"}) {
    int fd = RawConnect(ts.server->LocalAddress());
    int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    // Many requests pipelined, never read: the answers fill the socket buffers and stall.
    std::string reqs;
    for (int i = 0; i < 200; ++i) reqs += fmt::format("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", path);
    WriteAll(fd, reqs);
    // connect() returns before the server accepted: wait for the connection to be counted, or
    // a count of 0 read too early would pass for the cut.
    const auto bound = std::chrono::seconds(10);
    REQUIRE(test::WaitUntil([&] { return ts.server->connections() > 0; }, bound,
                            "the connection counted", std::chrono::milliseconds(1)));
    (void)test::WaitUntil([&] { return ts.server->connections() == 0; }, bound,
                          "the connection cut");
    CHECK_MESSAGE(ts.server->connections() == 0, path);
    ::close(fd);
  }
}

TEST_CASE("garbage instead of HTTP gets 400") {
  TestServer ts;
  int fd = RawConnect(ts.server->LocalAddress());
  std::string junk = "\x01\x02 hello there\r\n\r\n";
  REQUIRE(write(fd, junk.data(), junk.size()) > 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[256] = {};
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  REQUIRE(n > 0);
  CHECK(std::string(buf).find("400") != std::string::npos);
  close(fd);
}

TEST_CASE("a handler that throws gets 500 INTERNAL and the server goes on") {
  for (bool single : {false, true}) {
    CAPTURE(single);
    ServerOptions opts;
    opts.single_thread = single;
    TestServer ts(opts);
    auto c = Client::Create(ts.Url());
    REQUIRE(c.ok());
    auto other = Client::Create(ts.Url());
    REQUIRE(other.ok());
    pb::HeartbeatRequest hb, back;
    REQUIRE((*other)->Call("POST", "/echo", hb, &back).ok());  // a second connection, open
    auto r = (*c)->Do("GET", "/throw");
    REQUIRE(r.ok());
    CHECK(r->status == 500);
    Status st = StatusFromErrorBody(r->status, r->body, r->content_type);
    CHECK(st.code() == Code::kInternal);
    CHECK(st.reason() == Reason::kInternal);
    CHECK(r->body.find("\"code\":\"INTERNAL\"") != std::string::npos);
    // An answer given before the throw stands, and is the only one.
    r = (*c)->Do("GET", "/answer-then-throw");
    REQUIRE(r.ok());
    CHECK(r->status == 200);
    CHECK(r->body == "answered");
    // The same connection and the other one go on.
    hb.set_step(4);
    REQUIRE((*c)->Call("POST", "/echo", hb, &back).ok());
    CHECK(back.step() == 5);
    REQUIRE((*other)->Call("POST", "/echo", hb, &back).ok());
    CHECK(back.step() == 5);
  }
}

// Found by the lighthouse_routes fuzzer: a refusal that quotes the request (a path, a name) with
// bytes that are not UTF-8 made protobuf's JSON printer fail, and the 4xx went out with an empty
// body: no reason code for the client to read.
TEST_CASE("an error reply quoting bytes that are not UTF-8 keeps its body and reason code") {
  const std::string bad = std::string("no endpoint /x") + "\xff\xc3(\xed\xa0\x80" + '\0' + "y";
  for (Format f : {Format::kJson, Format::kProto}) {
    CAPTURE(static_cast<int>(f));
    Response r = ErrorReply(Refuse(Code::kNotFound, Reason::kNoEndpoint, "{}", bad), f);
    CHECK(r.status == 404);
    REQUIRE(!r.body.empty());
    Status back = StatusFromErrorBody(r.status, r.body, r.content_type);
    CHECK(back.reason() == Reason::kNoEndpoint);
    CHECK(back.message().find("no endpoint /x") != std::string::npos);
    CHECK(back.message().find('y') != std::string::npos);
  }
  // Valid UTF-8 passes unchanged.
  Response ok = ErrorReply(InvalidArgument("caf\xc3\xa9 \xe2\x82\xac"), Format::kJson);
  CHECK(StatusFromErrorBody(ok.status, ok.body, ok.content_type).message().find(
            "caf\xc3\xa9 \xe2\x82\xac") != std::string::npos);
}

TEST_CASE("CallHandler answers a throwing handler once with 500 INTERNAL - without a socket") {
  std::vector<Response> got;
  Responder collect = [&](Response r) { got.push_back(std::move(r)); };
  Request req;
  req.method = "GET";
  req.path = "/x";
  CallHandler([](Request&& r, Responder) { (void)r.path.substr(7); }, std::move(req), collect);
  REQUIRE(got.size() == 1);
  CHECK(got[0].status == 500);
  CHECK(StatusFromErrorBody(got[0].status, got[0].body, got[0].content_type).reason() ==
        Reason::kInternal);
  got.clear();
  CallHandler(
      [](Request&&, Responder respond) {
        respond(TextReply(204, "text/plain", ""));
        respond(TextReply(200, "text/plain", "twice"));
        throw 7;
      },
      Request{}, collect);
  REQUIRE(got.size() == 1);
  CHECK(got[0].status == 204);
}

TEST_CASE("a handler may answer later from another thread - client deadlines hold") {
  // Both connection modes: a strand per connection, and none when one thread runs the server.
  for (bool single : {false, true}) {
    CAPTURE(single);
    ServerOptions opts;
    opts.single_thread = single;
    TestServer ts(opts);
    auto c = Client::Create(ts.Url());
    REQUIRE(c.ok());
    auto r = (*c)->Do("GET", "/later");
    REQUIRE(r.ok());
    CHECK(r->body == "late");
    auto slow = (*c)->Do("GET", "/later", "", "", Millis(5));
    CHECK(slow.status().code() == Code::kDeadlineExceeded);
    r = (*c)->Do("GET", "/later");  // the client reconnects after a deadline
    REQUIRE(r.ok());
    CHECK(r->body == "late");
  }
}

TEST_CASE("Unix-domain sockets serve the same protocol") {
  std::string path = "/tmp/lk_http_test_" + std::to_string(getpid()) + ".sock";
  TestServer ts({}, "unix:" + path);
  auto c = Client::Create("unix:" + path);
  REQUIRE(c.ok());
  pb::HeartbeatRequest req, resp;
  req.set_step(1);
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(resp.step() == 2);
  unlink(path.c_str());
}

TEST_CASE("a stopped server removes its Unix socket file - not one a later server bound") {
  std::string path = "/tmp/lk_http_test_stop_" + std::to_string(getpid()) + ".sock";
  {
    TestServer ts({}, "unix:" + path);
    CHECK(access(path.c_str(), F_OK) == 0);
  }
  CHECK(access(path.c_str(), F_OK) != 0);
  // The path taken over by a second server before the first stops: the first leaves it alone.
  auto first = std::make_unique<TestServer>(ServerOptions{}, "unix:" + path);
  TestServer second({}, "unix:" + path);
  first.reset();
  CHECK(access(path.c_str(), F_OK) == 0);
  auto c = Client::Create("unix:" + path);
  REQUIRE(c.ok());
  CHECK((*c)->Do("GET", "/nothing").ok());
}

TEST_CASE("a refused connection is an Unavailable error - not a hang") {
  auto c = Client::Create("http://127.0.0.1:1");
  REQUIRE(c.ok());
  auto r = (*c)->Do("GET", "/healthz", "", "", Millis(2000));
  CHECK(r.status().code() == Code::kUnavailable);
  CHECK(Client::Create("ftp://x").status().code() == Code::kInvalidArgument);
}

TEST_CASE("Stop closes idle keep-alive connections so run() returns") {
  auto ts = std::make_unique<TestServer>();
  auto c = Client::Create(ts->Url());
  REQUIRE(c.ok());
  REQUIRE((*c)->Do("GET", "/nothing").ok());
  // ~TestServer joins the io_context thread, which would wait for ever if the idle connection
  // stayed open. It runs on a helper thread and the wait for it is bounded, so that a
  // regression fails here within seconds instead of hanging until CTest's timeout.
  std::promise<void> stopped;
  std::future<void> done = stopped.get_future();
  std::thread stopper([&] {
    ts.reset();
    stopped.set_value();
  });
  bool in_time = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!in_time) {
    // The stuck thread still owns the server: nothing can be torn down safely.
    std::fprintf(stderr, "FAILED: run() did not return within 10 s of Stop with an idle "
                         "keep-alive connection open\n");
    std::_Exit(1);
  }
  stopper.join();
  CHECK(in_time);
  // And the server is gone, not merely unblocked: the next request finds nobody listening.
  CHECK((*c)->Do("GET", "/nothing", "", "", Millis(2000)).status().code() == Code::kUnavailable);
}

TEST_CASE("TLS: the same protocol over HTTPS with a self-signed certificate") {
  std::string dir = "/tmp/lk_tls_test_" + std::to_string(getpid());
  std::string cmd = "mkdir -p " + dir + " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 "
                    "-subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 -keyout " + dir +
                    "/key.pem -out " + dir + "/cert.pem >/dev/null 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  ServerOptions opts;
  opts.tls_cert_file = dir + "/cert.pem";
  opts.tls_key_file = dir + "/key.pem";
  TestServer ts(opts);
  ClientOptions co;
  co.ca_file = dir + "/cert.pem";
  auto c = Client::Create("https://" + ts.server->LocalAddress(), co);
  REQUIRE(c.ok());
  pb::HeartbeatRequest req, resp;
  req.set_step(9);
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(resp.step() == 10);
  // TLS cannot use sendfile: the server says so to handlers, and a file body offered anyway is
  // read and encrypted like any other.
  auto file = (*c)->Do("GET", "/file", "", "");
  REQUIRE(file.ok());
  CHECK(file->body == FileBodyExpected());
  bool said_no = false;
  for (const auto& [k, v] : file->headers) said_no |= k == "X-File-Body-Ok" && v == "0";
  CHECK(said_no);
  // A client that does not trust the certificate is refused, and plain HTTP gets nowhere.
  auto untrusting = Client::Create("https://" + ts.server->LocalAddress());
  REQUIRE(untrusting.ok());
  CHECK((*untrusting)->Call("POST", "/echo", req, &resp, Millis(3000)).code() == Code::kUnavailable);
  auto plain = Client::Create("http://" + ts.server->LocalAddress());
  REQUIRE(plain.ok());
  CHECK_FALSE((*plain)->Call("POST", "/echo", req, &resp, Millis(3000)).ok());
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("bearer tokens compare in constant time and parse strictly") {
  CHECK(ConstantTimeEquals("abc", "abc"));
  CHECK_FALSE(ConstantTimeEquals("abc", "abd"));
  CHECK_FALSE(ConstantTimeEquals("abc", "abcd"));
  CHECK_FALSE(ConstantTimeEquals("", ""));
  CHECK(BearerToken("Bearer xyz") == "xyz");
  CHECK(BearerToken("Basic xyz").empty());
  CHECK(BearerToken("Bearer ").empty());
}

TEST_CASE("query strings are percent-decoded") {
  auto q = ParseQuery("job=a%20b&timeout_ms=5&flag");
  CHECK(q["job"] == "a b");
  CHECK(q["timeout_ms"] == "5");
  CHECK(q.count("flag") == 1);
  CHECK(PercentDecode(PercentEncode("x/y z")) == "x/y z");
}

TEST_CASE("a decoded path is encoded again segment by segment, its slashes kept") {
  CHECK(PercentEncodePath("1/a?b") == "1/a%3Fb");
  CHECK(PercentEncodePath("1/x y/#%") == "1/x%20y/%23%25");
  CHECK(PercentEncodePath("") == "");
  CHECK(PercentEncodePath("/") == "/");
  CHECK(PercentEncodePath("a//b/") == "a//b/");
  using namespace std::string_literals;
  const std::string odd = "k\r\n\0/..\x7f"s;
  CHECK(PercentDecode(PercentEncodePath(odd)) == odd);
}

}  // namespace
}  // namespace lk::http

namespace lk::http {
namespace {

TEST_CASE("listen addresses: loopback, unspecified, and an interface's IPv4 address") {
  CHECK(ListensOnLoopback("127.0.0.1:0"));
  CHECK(ListensOnLoopback("127.8.9.10:7070"));
  CHECK(ListensOnLoopback("[::1]:7070"));
  CHECK(ListensOnLoopback("unix:/tmp/x.sock"));
  CHECK_FALSE(ListensOnLoopback("0.0.0.0:7070"));
  CHECK_FALSE(ListensOnLoopback(":7070"));
  CHECK_FALSE(ListensOnLoopback("10.1.2.3:7070"));
  CHECK_FALSE(ListensOnLoopback("localhost:7070"));  // the server takes IP literals only
  CHECK_FALSE(ListensOnLoopback("nonsense"));
  CHECK(ListensOnUnspecified("0.0.0.0:7070"));
  CHECK(ListensOnUnspecified(":7070"));
  CHECK(ListensOnUnspecified("[::]:7070"));
  CHECK_FALSE(ListensOnUnspecified("127.0.0.1:7070"));
  CHECK_FALSE(ListensOnUnspecified("10.1.2.3:7070"));
  CHECK_FALSE(ListensOnUnspecified("unix:/tmp/x.sock"));
  auto lo = InterfaceIPv4("lo");
  REQUIRE(lo.ok());
  CHECK(*lo == "127.0.0.1");
  auto none = InterfaceIPv4("lk-none0");
  CHECK(none.status().code() == Code::kNotFound);
  CHECK(none.status().message() == "interface lk-none0: no such interface");
}


// Sets environment variables for one scope and restores what was there.
struct ScopedEnv {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  explicit ScopedEnv(const std::vector<std::pair<std::string, std::string>>& vars) {
    for (const char* name : {"LK_PROXY", "https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY",
                             "no_proxy", "NO_PROXY"}) {
      const char* v = std::getenv(name);
      saved.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(name);
    }
    for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved) {
      if (v) {
        ::setenv(k.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(k.c_str());
      }
    }
  }
};

TEST_CASE("the proxy from the environment: LK_PROXY, then the scheme's, except no_proxy and loopback") {
  struct Row {
    const char* name;
    std::vector<std::pair<std::string, std::string>> env;
    const char* url;
    const char* want;
  };
  const Row rows[] = {
      {"none set", {}, "https://lh.example:1", ""},
      {"https_proxy for https", {{"https_proxy", "http://p:3128"}}, "https://lh.example:1",
       "http://p:3128"},
      {"HTTPS_PROXY too", {{"HTTPS_PROXY", "http://P:3128"}}, "https://lh.example:1",
       "http://P:3128"},
      {"lower case first", {{"https_proxy", "http://a:1"}, {"HTTPS_PROXY", "http://b:1"}},
       "https://lh.example:1", "http://a:1"},
      {"http_proxy not for https", {{"http_proxy", "http://p:3128"}}, "https://lh.example:1", ""},
      {"http_proxy for http", {{"http_proxy", "http://p:3128"}}, "http://lh.example:1",
       "http://p:3128"},
      {"bare HOST:PORT is http", {{"http_proxy", "http://p:3128"}}, "lh.example:1",
       "http://p:3128"},
      {"LK_PROXY first", {{"LK_PROXY", "http://lk:1"}, {"https_proxy", "http://p:1"}},
       "https://lh.example:1", "http://lk:1"},
      {"LK_PROXY for http too", {{"LK_PROXY", "http://lk:1"}}, "http://lh.example:1",
       "http://lk:1"},
      {"loopback never", {{"LK_PROXY", "http://lk:1"}}, "http://127.0.0.1:1", ""},
      {"127/8 never", {{"LK_PROXY", "http://lk:1"}}, "http://127.3.2.1:1", ""},
      {"::1 never", {{"LK_PROXY", "http://lk:1"}}, "http://[::1]:1", ""},
      {"localhost never", {{"LK_PROXY", "http://lk:1"}}, "http://localhost:1", ""},
      {"unix never", {{"LK_PROXY", "http://lk:1"}}, "unix:/tmp/a.sock", ""},
      {"no_proxy exact", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "lh.example"}},
       "https://lh.example:1", ""},
      {"no_proxy domain covers subdomains",
       {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "example"}}, "https://lh.example:1", ""},
      {"no_proxy .domain", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "x, .example"}},
       "https://lh.example:1", ""},
      {"no_proxy is no suffix match",
       {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "ample"}}, "https://lh.example:1",
       "http://lk:1"},
      {"no_proxy with a port", {{"LK_PROXY", "http://lk:1"}, {"NO_PROXY", "lh.example:99"}},
       "https://lh.example:1", ""},
      {"no_proxy address", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "10.0.0.5"}},
       "http://10.0.0.5:1", ""},
      {"no_proxy other address", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "10.0.0.5"}},
       "http://10.0.0.50:1", "http://lk:1"},
      {"no_proxy *", {{"https_proxy", "http://p:1"}, {"no_proxy", "*"}}, "https://lh.example:1",
       ""},
      {"no_proxy network", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "x,10.1.0.0/16"}},
       "http://10.1.200.3:1", ""},
      {"no_proxy other network", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "10.1.0.0/16"}},
       "http://10.2.0.3:1", "http://lk:1"},
      {"no_proxy /0 and odd bits", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "10.0.0.0/33"}},
       "http://10.0.0.1:1", "http://lk:1"},
      {"no_proxy v6 network", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "fd00::/8"}},
       "http://[fd12::5]:1", ""},
      {"no_proxy a name is no network", {{"LK_PROXY", "http://lk:1"}, {"no_proxy", "10.0.0.0/8"}},
       "http://lh.example:1", "http://lk:1"},
  };
  for (const Row& r : rows) {
    CAPTURE(r.name);
    ScopedEnv env(r.env);
    CHECK(ProxyFromEnv(r.url) == r.want);
  }
}

TEST_CASE("a proxy's password never reaches a log line") {
  CHECK(WithoutUserinfo("http://u:secret@p:3128") == "http://***@p:3128");
  CHECK(WithoutUserinfo("http://u:se@cret@p:3128/x") == "http://***@p:3128/x");
  CHECK(WithoutUserinfo("http://p:3128/a@b") == "http://p:3128/a@b");
  CHECK(WithoutUserinfo("http://p:3128") == "http://p:3128");
  CHECK(WithoutUserinfo("") == "");
}

TEST_CASE("through a CONNECT proxy: a name only the proxy resolves, credentials, its restarts") {
  TestServer ts;
  const std::string port = ts.server->LocalAddress().substr(ts.server->LocalAddress().rfind(':'));
  // "dXNlcjpwYXNz" is base64("user:pass"), as the client must send it.
  test::TcpRelay proxy(test::TcpRelay::ConnectProxy{{{"lighthouse.invalid", "127.0.0.1"}},
                                                    "Basic dXNlcjpwYXNz"});
  ClientOptions co;
  co.proxy = "http://user:pass@" + proxy.address();
  auto c = Client::Create("http://lighthouse.invalid" + port, co);
  REQUIRE(c.ok());
  pb::HeartbeatRequest req, resp;
  req.set_step(1);
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(resp.step() == 2);
  // One tunnel carries the keep-alive connection's requests.
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  REQUIRE(proxy.Targets().size() == 1);
  CHECK(proxy.Targets()[0] == "lighthouse.invalid" + port);
  // The proxy goes away, and comes back: the next call after it is back opens a new tunnel.
  proxy.Cut();
  CHECK((*c)->Call("POST", "/echo", req, &resp, Millis(2000)).code() == Code::kUnavailable);
  proxy.Mend();
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(proxy.Targets().size() == 2);
  // Without the credentials the proxy refuses, and the error says who refused what.
  ClientOptions anonymous;
  anonymous.proxy = "http://" + proxy.address();
  auto a = Client::Create("http://lighthouse.invalid" + port, anonymous);
  REQUIRE(a.ok());
  Status refused = (*a)->Call("POST", "/echo", req, &resp, Millis(2000));
  CHECK(refused.code() == Code::kUnavailable);
  CHECK(refused.message().find("refused CONNECT lighthouse.invalid" + port + ": 407") !=
        std::string::npos);
  // Without the proxy the name does not resolve at all: the proxy was the only way.
  auto direct = Client::Create("http://lighthouse.invalid" + port);
  REQUIRE(direct.ok());
  CHECK((*direct)->Call("POST", "/echo", req, &resp, Millis(2000)).code() == Code::kUnavailable);
  // An https proxy URL is refused at once: CONNECT goes to the proxy in the clear.
  ClientOptions tls_proxy;
  tls_proxy.proxy = "https://" + proxy.address();
  CHECK(Client::Create("http://lighthouse.invalid" + port, tls_proxy).status().code() ==
        Code::kInvalidArgument);
}

TEST_CASE("TLS through a CONNECT proxy stays end to end: the server's name is verified") {
  std::string dir = "/tmp/lk_tls_proxy_test_" + std::to_string(getpid());
  std::string cmd = "mkdir -p " + dir + " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 "
                    "-subj /CN=lighthouse.invalid -addext subjectAltName=DNS:lighthouse.invalid "
                    "-keyout " + dir + "/key.pem -out " + dir + "/cert.pem >/dev/null 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  ServerOptions opts;
  opts.tls_cert_file = dir + "/cert.pem";
  opts.tls_key_file = dir + "/key.pem";
  TestServer ts(opts);
  const std::string port = ts.server->LocalAddress().substr(ts.server->LocalAddress().rfind(':'));
  test::TcpRelay proxy(test::TcpRelay::ConnectProxy{
      {{"lighthouse.invalid", "127.0.0.1"}, {"other.invalid", "127.0.0.1"}}, ""});
  ClientOptions co;
  co.ca_file = dir + "/cert.pem";
  co.proxy = "http://" + proxy.address();
  auto c = Client::Create("https://lighthouse.invalid" + port, co);
  REQUIRE(c.ok());
  pb::HeartbeatRequest req, resp;
  req.set_step(4);
  REQUIRE((*c)->Call("POST", "/echo", req, &resp).ok());
  CHECK(resp.step() == 5);
  // The same server under a name its certificate does not carry: the proxy connects, and the
  // client still refuses it.
  auto wrong = Client::Create("https://other.invalid" + port, co);
  REQUIRE(wrong.ok());
  CHECK((*wrong)->Call("POST", "/echo", req, &resp, Millis(3000)).code() == Code::kUnavailable);
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace lk::http
