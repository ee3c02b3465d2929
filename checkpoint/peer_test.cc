// Peer recovery over real HTTP on 127.0.0.1 (port 0): shard server routes and codes, striping over
// several donors, a donor process killed mid-transfer, a donor sending wrong bytes, short
// answers or a body cut off mid-way, the client's read straight into the caller's buffer, and
// live state published per rank and recovered onto another layout.
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <cstdio>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "checkpoint/live.h"
#include "checkpoint/manifest_proto.h"
#include "checkpoint/shard_server.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "common/http/server.h"

namespace lk::ckpt {
namespace {

using namespace testing;

// A ShardServer on its own io_context and threads; `tamper` may rewrite responses (a liar).
class TestServer {
 public:
  TestServer(const std::string& base_dir, std::function<void(http::Response&)> tamper = nullptr,
             bool sendfile = true)
      : shards_([&] {
          ShardServerOptions o;
          o.base_dir = base_dir;
          o.sendfile = sendfile;
          return o;
        }()),
        server_(ioc_, http::ServerOptions{},
                [this, tamper](http::Request&& req, http::Responder respond) {
                  shards_.Handle(std::move(req), [respond, tamper](http::Response r) {
                    if (tamper) tamper(r);
                    respond(std::move(r));
                  });
                }) {
    REQUIRE(server_.Listen("127.0.0.1:0").ok());
    for (int i = 0; i < 2; ++i) threads_.emplace_back([this] { ioc_.run(); });
  }
  ~TestServer() {
    boost::asio::post(ioc_, [this] {
      server_.Stop();
      ioc_.stop();
    });
    for (auto& t : threads_) t.join();
  }
  std::string url() const { return "http://" + server_.LocalAddress(); }
  const ShardServer& shards() const { return shards_; }

 private:
  boost::asio::io_context ioc_;
  ShardServer shards_;
  http::Server server_;
  std::vector<std::thread> threads_;
};

// The shard server sends file bytes as a file body (sendfile) or a shared body tail; a tamper
// that edits bytes wants them in the body.
void Materialize(http::Response& r) {
  if (r.body_tail) {
    r.body += *r.body_tail;
    r.body_tail.reset();
  }
  if (r.body_file) {
    std::string bytes(r.body_file->length, '\0');
    REQUIRE(::pread(r.body_file->fd, bytes.data(), bytes.size(),
                    static_cast<off_t>(r.body_file->offset)) == static_cast<ssize_t>(bytes.size()));
    r.body += bytes;
    r.body_file.reset();
  }
}

// A TCP proxy in front of a shard server, on real sockets: it relays every request and answer,
// but answers the `cut_at`-th file request of each connection with the full header and only the
// first half of the body, then closes the connection, as a peer that dies mid-body does.
class CuttingProxy {
 public:
  explicit CuttingProxy(const std::string& upstream_url, int cut_at = 1) : cut_at_(cut_at) {
    auto colon = upstream_url.rfind(':');
    upstream_port_ = static_cast<uint16_t>(std::stoi(upstream_url.substr(colon + 1)));
    listen_ = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(listen_ >= 0);
    sockaddr_in a = Loopback(0);
    REQUIRE(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listen_, 16) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~CuttingProxy() {
    ::shutdown(listen_, SHUT_RDWR);  // wakes accept(2)
    acceptor_.join();
    {
      std::lock_guard lock(mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : workers_) t.join();
    for (int fd : fds_) ::close(fd);
    ::close(listen_);
  }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }
  int cuts() const { return cuts_.load(); }

 private:
  static sockaddr_in Loopback(uint16_t port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    return a;
  }
  // Reads until `in` holds a blank line; returns the head and leaves the rest in `in`.
  static bool ReadHead(int fd, std::string& in, std::string* head) {
    char buf[65536];
    size_t end;
    while ((end = in.find("\r\n\r\n")) == std::string::npos) {
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) return false;
      in.append(buf, static_cast<size_t>(n));
    }
    *head = in.substr(0, end + 4);
    in.erase(0, end + 4);
    return true;
  }
  static bool SendAll(int fd, std::string_view s) {
    while (!s.empty()) {
      ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      s.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  void Accept() {
    while (true) {
      int fd = ::accept(listen_, nullptr, nullptr);
      if (fd < 0) return;
      int up = ::socket(AF_INET, SOCK_STREAM, 0);
      std::lock_guard lock(mu_);
      fds_.push_back(fd);
      fds_.push_back(up);
      workers_.emplace_back([this, fd, up] { Relay(fd, up); });
    }
  }

  void Relay(int fd, int up) {
    sockaddr_in a = Loopback(upstream_port_);
    if (::connect(up, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return;
    std::string from_client, from_server, req, head;
    int file_requests = 0;
    while (ReadHead(fd, from_client, &req) && SendAll(up, req) &&
           ReadHead(up, from_server, &head)) {
      auto at = head.find("Content-Length: ");
      if (at == std::string::npos) return;
      size_t length = std::stoul(head.substr(at + 16));
      char buf[65536];
      while (from_server.size() < length) {
        ssize_t n = ::read(up, buf, sizeof buf);
        if (n <= 0) return;
        from_server.append(buf, static_cast<size_t>(n));
      }
      std::string body = from_server.substr(0, length);
      from_server.erase(0, length);
      bool file = req.find(" /v1/shards/files/") != std::string::npos;
      bool cut = file && ++file_requests == cut_at_ && length > 1;
      std::string_view send = cut ? std::string_view(body).substr(0, length / 2) : body;
      if (!SendAll(fd, head) || !SendAll(fd, send)) return;
      if (cut) {
        ++cuts_;
        ::shutdown(fd, SHUT_RDWR);
        return;
      }
    }
  }

  int cut_at_;
  uint16_t upstream_port_ = 0;
  uint16_t port_ = 0;
  int listen_ = -1;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> workers_;
  std::atomic<int> cuts_{0};
};

// A donor process: `lk_checkpoint_tool serve ROOT`, killed with SIGKILL by the test.
struct Donor {
  pid_t pid = -1;
  std::string url;
};

Donor StartDonor(const std::string& root) {
  const char* bin = std::getenv("LK_BIN_DIR");
  REQUIRE(bin != nullptr);
  std::string tool = std::string(bin) + "/lk_checkpoint_tool";
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::execl(tool.c_str(), "checkpoint", "serve", root.c_str(), "--listen", "127.0.0.1:0", nullptr);
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string line;
  char c;
  while (::read(fds[0], &c, 1) == 1 && c != '\n') line += c;
  ::close(fds[0]);
  REQUIRE_MESSAGE(line.rfind("listening ", 0) == 0, "donor said: " << line);
  return Donor{pid, "http://" + line.substr(10)};
}

void StopDonor(Donor& d) {
  if (d.pid <= 0) return;
  ::kill(d.pid, SIGKILL);
  ::waitpid(d.pid, nullptr, 0);
  d.pid = -1;
}

// ~24 MiB in 1 MiB reads: long enough to kill a donor while it is still being read from.
std::vector<TensorSpec> BigModel() {
  return {{"w", DType::kF32, {6144, 1024}}, {"b", DType::kBF16, {1000}}, {"s", DType::kI64, {}}};
}

PeerRecoveryOptions Recovery(uint32_t ranks, uint32_t rank) {
  PeerRecoveryOptions o;
  o.layout = TargetLayout{ranks, rank};
  o.plan.read_bytes_max = 1 << 20;
  o.fetch.streams_per_source = 2;
  return o;
}

TEST_CASE("shard server answers ranges with 206 - bad ranges with 416 and hides non-checkpoints") {
  TempDir tmp;
  std::string dir = SaveModel(tmp.path(), SmallModel(), 3, 1);
  std::filesystem::create_directories(tmp.Sub(".tmp-step-000000000004-x"));
  TestServer server(tmp.path());
  auto client = http::Client::Create(server.url());
  REQUIRE(client.ok());
  auto list = (*client)->Do("GET", "/v1/shards/checkpoints");
  REQUIRE(list.ok());
  CHECK(list->status == 200);
  pb::ServedCheckpoints served;
  REQUIRE(served.ParseFromString(list->body));
  REQUIRE(served.checkpoints_size() == 1);
  CHECK(served.checkpoints(0).root() == "_");  // the temp dir is not listed
  CHECK(served.checkpoints(0).dir() == "step-000000000003");
  std::string file = "/v1/shards/files/_/step-000000000003/shard-00000-of-00001.safetensors";
  uint64_t size = served.checkpoints(0).manifest().files(0).size_bytes();
  auto part = (*client)->Do("GET", file, "", "", Millis(5000), "Range", "bytes=0-7");
  REQUIRE(part.ok());
  CHECK(part->status == 206);
  CHECK(part->body.size() == 8);
  bool has_range = false;
  for (const auto& [k, v] : part->headers) {
    if (k == "Content-Range") has_range = v == fmt::format("bytes 0-7/{}", size);
  }
  CHECK(has_range);
  auto beyond = (*client)->Do("GET", file, "", "", Millis(5000), "Range", fmt::format("bytes={}-", size));
  REQUIRE(beyond.ok());
  CHECK(beyond->status == 416);
  auto multi = (*client)->Do("GET", file, "", "", Millis(5000), "Range", "bytes=0-1,4-5");
  CHECK(multi->status == 416);
  // The largest end a 64-bit parser reads is clipped to the file, not wrapped to an empty range.
  auto max_end = (*client)->Do("GET", file, "", "", Millis(5000), "Range", "bytes=0-18446744073709551615");
  REQUIRE(max_end.ok());
  CHECK(max_end->status == 206);
  CHECK(max_end->body.size() == size);
  for (const auto& [k, v] : max_end->headers) {
    if (k == "Content-Range") CHECK(v == fmt::format("bytes 0-{}/{}", size - 1, size));
  }
  // One past 64 bits is refused with the reason, and the server goes on answering.
  auto over = (*client)->Do("GET", file, "", "", Millis(5000), "Range", "bytes=18446744073709551616-");
  REQUIRE(over.ok());
  CHECK(over->status == 416);
  CHECK_MESSAGE(over->body.find("bad range start") != std::string::npos, over->body);
  auto after = (*client)->Do("GET", file, "", "", Millis(5000), "Range", "bytes=0-7");
  REQUIRE(after.ok());
  CHECK(after->status == 206);
  for (const char* path : {"/v1/shards/files/_/step-000000000003/../../etc/passwd",
                           "/v1/shards/files/_/.tmp-step-000000000004-x/MANIFEST",
                           "/v1/shards/files/_/step-000000000003/.hidden", "/v1/other"}) {
    auto r = (*client)->Do("GET", path);
    REQUIRE(r.ok());
    CHECK_MESSAGE(r->status == 404, path);
  }
}

TEST_CASE("peer recovery completes from the others when a donor is killed mid-transfer") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 21, 2, 256 << 10);
  std::vector<Donor> donors;
  for (int i = 0; i < 3; ++i) donors.push_back(StartDonor(tmp.path()));
  std::vector<std::string> urls;
  for (const auto& d : donors) urls.push_back(d.url);
  PeerRecoveryOptions o = Recovery(1, 0);  // all 24 MiB: many reads left after the kill
  std::atomic<int> from_victim{0};
  o.fetch.on_read_done = [&](size_t source, uint64_t) {
    if (source == 0 && ++from_victim == 1) StopDonor(donors[0]);
  };
  FetchReport report;
  auto state = RecoverFromPeers(urls, o, &report);
  for (auto& d : donors) StopDonor(d);
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  CHECK(state->step == 21);
  CheckState(*state, model, 21);
  REQUIRE(report.sources.size() == 3);
  CHECK(report.sources[0].dropped);
  CHECK(report.sources[0].bytes > 0);  // it did send before it died
  CHECK(report.sources[1].bytes > 0);
  CHECK(report.sources[2].bytes > 0);
  CHECK(report.sources[0].bytes + report.sources[1].bytes + report.sources[2].bytes == report.bytes);
}

TEST_CASE("shard server answers on the calling thread or on its reader threads alike") {
  TempDir tmp;
  SaveModel(tmp.path(), SmallModel(), 3, 1);
  std::string path = tmp.Sub("step-000000000003/shard-00000-of-00001.safetensors");
  std::string want(16, '\0');
  {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    REQUIRE(f != nullptr);
    REQUIRE(std::fread(want.data(), 1, want.size(), f) == want.size());
    std::fclose(f);
  }
  for (uint32_t readers : {0u, 2u}) {
    for (bool sendfile : {false, true}) {
      ShardServerOptions o;
      o.base_dir = tmp.path();
      o.read_threads = readers;
      o.sendfile = sendfile;
      ShardServer shards(o);
      http::Request req;
      req.method = "GET";
      req.path = "/v1/shards/files/_/step-000000000003/shard-00000-of-00001.safetensors";
      req.range = "bytes=0-15";
      req.file_body_ok = true;
      std::promise<std::pair<http::Response, std::thread::id>> answer;
      shards.Handle(std::move(req), [&answer](http::Response r) {
        answer.set_value({std::move(r), std::this_thread::get_id()});
      });
      auto [r, thread] = answer.get_future().get();
      CHECK(r.status == 206);
      // With sendfile the range is an open file for the server to send, not bytes read here.
      CHECK(r.body_file.has_value() == sendfile);
      CHECK(!r.body_tail == sendfile);
      Materialize(r);
      CHECK(r.body == want);
      CHECK((thread == std::this_thread::get_id()) == (readers == 0));
    }
  }
}

TEST_CASE("peer recovery fills the caller's tensors in place - from servers with and without sendfile") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 9, 2, 256 << 10);
  TestServer with(tmp.path()), without(tmp.path(), nullptr, /*sendfile=*/false);
  for (uint32_t rank : {0u, 1u}) {
    // The caller's memory for "w" only; the other tensors get fresh buffers.
    std::vector<uint8_t> mine;
    PeerRecoveryOptions o = Recovery(2, rank);
    o.fetch.into = [&](const TargetTensor& t) -> uint8_t* {
      if (t.name != "w") return nullptr;
      mine.assign(t.bytes, 0xAB);
      return mine.data();
    };
    FetchReport report;
    auto state = RecoverFromPeers({with.url(), without.url()}, o, &report);
    REQUIRE_MESSAGE(state.ok(), state.status().ToString());
    CheckState(*state, model, 9);
    const RestoredTensor* w = state->Find("w");
    REQUIRE(w != nullptr);
    CHECK(w->data.data() == mine.data());  // in place: no buffer of its own
    CHECK(state->Find("b")->data.data() != nullptr);
    CHECK(report.sources[0].bytes > 0);
    CHECK(report.sources[1].bytes > 0);
    CHECK(!report.sources[0].dropped);
    CHECK(!report.sources[1].dropped);
  }
}

TEST_CASE("a peer sending wrong bytes is caught by the checksum and dropped") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 5, 1, 256 << 10);
  auto flip = [](http::Response& r) {
    Materialize(r);
    if (r.status == 206 && r.body.size() > 100) r.body[r.body.size() / 2] ^= 0x01;
  };
  TestServer honest1(tmp.path()), liar(tmp.path(), flip), honest2(tmp.path());
  FetchReport report;
  auto state = RecoverFromPeers({honest1.url(), liar.url(), honest2.url()}, Recovery(2, 0), &report);
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  CheckState(*state, model, 5);
  CHECK(report.sources[1].dropped);
  CHECK(report.sources[1].reason.find("checksum mismatch") != std::string::npos);
  CHECK(!report.sources[0].dropped);
  CHECK(!report.sources[2].dropped);
  // With only the liar left, recovery fails with data loss instead of returning bad bytes.
  auto alone = RecoverFromPeers({liar.url()}, Recovery(2, 0));
  CHECK(alone.status().code() == Code::kDataLoss);
}

TEST_CASE("a peer answering fewer bytes than asked is dropped and its reads refetched") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 6, 1, 256 << 10);
  // The answer is consistent (Content-Length matches) but holds half the bytes asked for.
  auto halve = [](http::Response& r) {
    Materialize(r);
    if (r.status == 206 && r.body.size() > 1) r.body.resize(r.body.size() / 2);
  };
  TestServer honest1(tmp.path()), short_peer(tmp.path(), halve), honest2(tmp.path());
  FetchReport report;
  auto state =
      RecoverFromPeers({honest1.url(), short_peer.url(), honest2.url()}, Recovery(1, 0), &report);
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  CheckState(*state, model, 6);
  CHECK(report.sources[1].dropped);
  CHECK_MESSAGE(report.sources[1].reason.find("bytes instead of") != std::string::npos,
                report.sources[1].reason);
  CHECK(report.sources[0].bytes + report.sources[2].bytes == report.bytes);
  auto alone = RecoverFromPeers({short_peer.url()}, Recovery(1, 0));
  CHECK(alone.status().code() == Code::kDataLoss);
}

TEST_CASE("a peer that closes the connection mid-body is dropped and its reads refetched") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 7, 1, 256 << 10);
  TestServer honest1(tmp.path()), behind_proxy(tmp.path()), honest2(tmp.path());
  CuttingProxy proxy(behind_proxy.url());
  FetchReport report;
  auto state =
      RecoverFromPeers({honest1.url(), proxy.url(), honest2.url()}, Recovery(1, 0), &report);
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  CheckState(*state, model, 7);
  CHECK(proxy.cuts() >= 1);
  CHECK(report.sources[1].dropped);
  CHECK(report.sources[1].bytes == 0);
  CHECK_MESSAGE(report.sources[1].reason.find("read body from") != std::string::npos,
                report.sources[1].reason);
  CHECK(report.sources[0].bytes + report.sources[2].bytes == report.bytes);
  auto alone = RecoverFromPeers({proxy.url()}, Recovery(1, 0));
  CHECK(alone.status().code() == Code::kUnavailable);
}

TEST_CASE("a body cut off on a reused connection is fetched again and checked anew") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 8, 1, 256 << 10);
  TestServer behind_proxy(tmp.path());
  // Every connection's second file request is cut: the client retries it once on a fresh
  // connection, which rewrites the same bytes of dst, so the chunk checks must start over.
  CuttingProxy proxy(behind_proxy.url(), 2);
  FetchReport report;
  auto state = RecoverFromPeers({proxy.url()}, Recovery(1, 0), &report);
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  CheckState(*state, model, 8);
  CHECK(proxy.cuts() >= 1);
  CHECK(!report.sources[0].dropped);
  CHECK(report.sources[0].bytes == report.bytes);
}

TEST_CASE("GetInto fills the caller's buffer - returns error answers - refuses too large a body") {
  TempDir tmp;
  std::string dir = SaveModel(tmp.path(), SmallModel(), 3, 1);
  TestServer server(tmp.path());
  auto client = http::Client::Create(server.url());
  REQUIRE(client.ok());
  std::string file = "/v1/shards/files/_/step-000000000003/shard-00000-of-00001.safetensors";
  auto whole = (*client)->Do("GET", file);
  REQUIRE(whole.ok());
  REQUIRE(whole->status == 200);
  REQUIRE(whole->body.size() > 4096);
  // The same range twice on one keep-alive connection: the first answer was consumed exactly.
  for (int i = 0; i < 2; ++i) {
    std::vector<uint8_t> dst(5000, 0xee);
    uint64_t got = 0;
    auto r =
        (*client)->GetInto(file, dst.data(), 4000, &got, Millis(5000), "Range", "bytes=100-4099");
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    CHECK(r->status == 206);
    CHECK(r->body.empty());
    CHECK(got == 4000);
    CHECK(std::memcmp(dst.data(), whole->body.data() + 100, 4000) == 0);
    CHECK(dst[4000] == 0xee);  // nothing written past the body
  }
  uint64_t got = 0;
  std::vector<uint8_t> dst(16);
  auto bad = (*client)->GetInto(file, dst.data(), dst.size(), &got, Millis(5000), "Range",
                                "bytes=999999999-");
  REQUIRE(bad.ok());
  CHECK(bad->status == 416);
  CHECK(bad->body.find("range not satisfiable") != std::string::npos);
  auto big =
      (*client)->GetInto(file, dst.data(), dst.size(), &got, Millis(5000), "Range", "bytes=0-99");
  CHECK(big.status().code() == Code::kDataLoss);
  // The client opens a new connection after refusing the body.
  auto again =
      (*client)->GetInto(file, dst.data(), dst.size(), &got, Millis(5000), "Range", "bytes=0-15");
  REQUIRE_MESSAGE(again.ok(), again.status().ToString());
  CHECK(got == 16);
  CHECK(std::memcmp(dst.data(), whole->body.data(), 16) == 0);
}

TEST_CASE("GetInto reads bodies around its wake-up size then tiny ones on one connection") {
  TempDir tmp;
  SaveModel(tmp.path(), BigModel(), 9, 1);
  TestServer server(tmp.path());
  auto client = http::Client::Create(server.url());
  REQUIRE(client.ok());
  std::string file = "/v1/shards/files/_/step-000000000009/shard-00000-of-00001.safetensors";
  auto whole = (*client)->Do("GET", file, "", "", Millis(20'000), "Range", "bytes=0-3000000");
  REQUIRE(whole.ok());
  REQUIRE(whole->body.size() == 3000001);
  // Sizes around the 256 KiB wake-up mark, each followed by a tiny one: a wake-up size left
  // over from a large body would make the next answer wait for bytes that never come.
  for (uint64_t size : {uint64_t{3000001}, uint64_t{(256 << 10) + 1}, uint64_t{256 << 10},
                        uint64_t{(256 << 10) - 1}, uint64_t{1}}) {
    std::vector<uint8_t> dst(size);
    uint64_t got = 0, last_landed = 0;
    auto r = (*client)->GetInto(file, dst.data(), size, &got, Millis(5000), "Range",
                                fmt::format("bytes=0-{}", size - 1), [&](uint64_t n) {
                                  CHECK(n >= last_landed);
                                  last_landed = n;
                                });
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    CHECK(got == size);
    CHECK(last_landed == size);
    CHECK(std::memcmp(dst.data(), whole->body.data(), size) == 0);
    uint8_t tiny[3];
    auto t = (*client)->GetInto(file, tiny, 3, &got, Millis(5000), "Range", "bytes=10-12");
    REQUIRE_MESSAGE(t.ok(), t.status().ToString());
    CHECK(std::memcmp(tiny, whole->body.data() + 10, 3) == 0);
  }
}

TEST_CASE("live state published per rank is recovered from several groups onto another layout") {
  TempDir tmp;
  auto model = BigModel();
  // Group A: both ranks on one node. Group B: one rank per node. Each node has its own
  // node-local directory and its own agent (server).
  std::string node_a = tmp.Sub("a"), node_b0 = tmp.Sub("b0"), node_b1 = tmp.Sub("b1");
  auto publish = [&](const std::string& base, uint32_t rank, int64_t step) {
    LiveStatePublisher p(LivePublisherOptions{base, 2, 256 << 10, nullptr});
    auto r = p.Publish(MakeSnapshot(model, step, rank, 2));
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    CHECK(r->committed);
  };
  for (int64_t step : {30, 31, 32}) {
    publish(node_a, 0, step);
    publish(node_a, 1, step);
  }
  publish(node_b0, 0, 32);
  publish(node_b1, 1, 32);
  auto refs = ListCommitted(Env::Default(), LiveRankRoot(node_a, 0));
  REQUIRE(refs.ok());
  CHECK(refs->size() == 2);  // live state keeps two steps
  TestServer a(node_a), b0(node_b0), b1(node_b1);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    FetchReport report;
    auto state = RecoverFromPeers({a.url(), b0.url(), b1.url()}, Recovery(3, rank), &report);
    REQUIRE_MESSAGE(state.ok(), state.status().ToString());
    CHECK(state->step == 32);
    CheckState(*state, model, 32);
    for (const auto& s : report.sources) CHECK(!s.dropped);
  }
  CHECK(b0.shards().bytes_served() > 0);
  CHECK(b1.shards().bytes_served() > 0);
  // Only rank 1's state is reachable: recovery says so instead of restoring half a model.
  auto half = RecoverFromPeers({b1.url()}, Recovery(1, 0));
  CHECK(half.status().code() == Code::kUnavailable);
  CHECK(half.status().message().find("only ranks 1") != std::string::npos);
  // A step the plan names explicitly, held only by group A.
  PeerRecoveryOptions o = Recovery(1, 0);
  o.step = 31;
  auto older = RecoverFromPeers({a.url(), b0.url(), b1.url()}, o);
  REQUIRE_MESSAGE(older.ok(), older.status().ToString());
  CheckState(*older, model, 31);
}

TEST_CASE("peers holding the state in different layouts: the first layout that covers every rank is fetched") {
  // Groups of different sizes: group A serves the step as 2 ranks on one node, group C as 1
  // rank, group B only rank 1 of its 2 (its other node is gone). Parts of two layouts never
  // merge; the healer takes whichever whole layout comes first.
  TempDir tmp;
  auto model = BigModel();
  std::string node_a = tmp.Sub("a"), node_b1 = tmp.Sub("b1"), node_c = tmp.Sub("c");
  auto publish = [&](const std::string& base, uint32_t rank, uint32_t ranks) {
    LiveStatePublisher p(LivePublisherOptions{base, ranks, 256 << 10, nullptr});
    auto r = p.Publish(MakeSnapshot(model, 40, rank, ranks));
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  };
  publish(node_a, 0, 2);
  publish(node_a, 1, 2);
  publish(node_b1, 1, 2);
  publish(node_c, 0, 1);
  TestServer a(node_a), b1(node_b1), c(node_c);
  for (const std::vector<std::string>& urls :
       {std::vector<std::string>{c.url(), a.url()}, std::vector<std::string>{a.url(), c.url()},
        std::vector<std::string>{b1.url(), c.url()}}) {
    for (uint32_t rank = 0; rank < 3; ++rank) {
      auto state = RecoverFromPeers(urls, Recovery(3, rank));
      REQUIRE_MESSAGE(state.ok(), state.status().ToString());
      CHECK(state->step == 40);
      CheckState(*state, model, 40);
    }
  }
  // B's half alone is still refused, and says which ranks it has.
  auto half = RecoverFromPeers({b1.url()}, Recovery(1, 0));
  CHECK(half.status().code() == Code::kUnavailable);
  CHECK(half.status().message().find("only ranks 1") != std::string::npos);
}

TEST_CASE("a manifest over 2 GiB is refused with a reason, never handed to protobuf") {
  // Protobuf takes an int size: 2^31 bytes and more threw inside it. The pages are reserved,
  // not touched.
  const size_t n = (size_t{1} << 31) + 16;
  void* p = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(p != MAP_FAILED);
  auto m = ParseManifest(std::string_view(static_cast<const char*>(p), n));
  CHECK(m.status().code() == Code::kDataLoss);
  ::munmap(p, n);
}

TEST_CASE("merging parts refuses a slice that names a file the part does not list") {
  // Parts from peers are validated before they are merged, but MergeManifests is public: a
  // slice's file index is checked where it is used to index.
  Manifest part;
  part.ranks = 2;
  part.chunk_bytes = 64;
  part.files.push_back(ShardFileInfo{"rank-0.safetensors", 0, 100, 16, 1});
  TensorInfo t{"w", DType::kU8, {4}, {}};
  t.slices.push_back(SliceInfo{0, RowRange{0, 4}, 16, 4, {7}});
  part.tensors.push_back(t);
  REQUIRE(MergeManifests({part}).ok());
  for (uint32_t bad : {1u, 1000u, 1u << 31, UINT32_MAX}) {
    CAPTURE(bad);
    Manifest broken = part;
    broken.tensors[0].slices[0].file = bad;
    auto merged = MergeManifests({part, broken});
    CHECK(merged.status().code() == Code::kInvalidArgument);
    CHECK(merged.status().message().find("names file") != std::string::npos);
  }
}

}  // namespace
}  // namespace lk::ckpt
