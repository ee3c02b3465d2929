// Peer recovery over real HTTP on 127.0.0.1 (port 0): shard server routes and codes, striping over
// several donors, a donor process killed mid-transfer, a donor sending wrong bytes, and live state
// published per rank and recovered onto another layout.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
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
  TestServer(const std::string& base_dir, std::function<void(http::Response&)> tamper = nullptr)
      : shards_(ShardServerOptions{base_dir}),
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

TEST_CASE("a peer sending wrong bytes is caught by the checksum and dropped") {
  TempDir tmp;
  auto model = BigModel();
  SaveModel(tmp.path(), model, 5, 1, 256 << 10);
  auto flip = [](http::Response& r) {
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

}  // namespace
}  // namespace lk::ckpt
