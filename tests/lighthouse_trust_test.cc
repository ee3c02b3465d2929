// The lighthouse's trust boundary, on the real binary: each attack of issue 14 that reaches the
// lighthouse is refused with its reason code while the process stays up and /status stays as
// it was; a zombie incarnation stays dead across a kill -9 restart; token roles (read-only on
// /status and /metrics, refused on every mutating endpoint); --jobs-max; groups collected after
// --group-grace-ms; the request buffer budget.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <thread>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "tests/support/process.h"
#include "tests/support/status_snapshot.h"
#include "tests/support/wait.h"

namespace lk::test {
namespace {

namespace pb = lightkeeper::v1;
using namespace std::chrono_literals;
using http::Response;

std::unique_ptr<http::Client> Connect(const std::string& url, const std::string& token = "") {
  http::ClientOptions o;
  o.token = token;
  auto c = http::Client::Create(url, o);
  REQUIRE(c.ok());
  return std::move(*c);
}

std::string Hb(const std::string& job, const std::string& group, const std::string& inc,
               uint32_t generation = 0) {
  return fmt::format(
      R"({{"job":"{}","group_id":"{}","incarnation":"{}","nodes":1,"generation":{}}})", job, group,
      inc, generation);
}

// The answer's status and, for an error, its reason code's name ("" for a 2xx).
struct Answer {
  int status = 0;
  std::string code;
  std::string body;
};

Answer Send(http::Client& c, const std::string& method, const std::string& target,
            const std::string& body = "") {
  auto r = c.Do(method, target, body, http::kJsonType);
  REQUIRE(r.ok());
  Answer a{r->status, "", r->body};
  if (r->status >= 300) {
    pb::ErrorResponse e;
    REQUIRE(http::Decode(r->body, http::Format::kJson, &e).ok());
    a.code = pb::ErrorResponse::Code_Name(e.code());
  }
  return a;
}

void ExpectRefused(http::Client& c, const std::string& method, const std::string& target,
                   const std::string& body, int status, const std::string& code) {
  Answer a = Send(c, method, target, body);
  INFO(method << " " << target << " " << body << " -> " << a.body);
  CHECK(a.status == status);
  CHECK(a.code == code);
}

struct Secured {
  std::string dir;
  Lighthouse lh;
};

std::vector<std::string> SecuredFlags(const std::string& dir) {
  return {"--token-file", dir + "/tokens", "--admin-token-file", dir + "/admin",
          "--heartbeat-timeout-ms", "60000"};
}

Secured StartSecured(const std::string& tag, std::vector<std::string> extra = {}) {
  Secured s;
  s.dir = TempDir(tag);
  { std::ofstream(s.dir + "/tokens") << "# job, read-only\nj secret-j\nrole=read-only prom\n"; }
  { std::ofstream(s.dir + "/admin") << "root-token\n"; }
  std::vector<std::string> flags = SecuredFlags(s.dir);
  flags.insert(flags.end(), extra.begin(), extra.end());
  s.lh = StartLighthouse(s.dir + "/data", flags, s.dir + "/lh.log");
  return s;
}

// kill -9 of the secured lighthouse, and a new one on its data and address with its token files.
Lighthouse KillAndRestart(Secured& s) {
  s.lh.process->Signal(SIGKILL);
  REQUIRE(s.lh.process->Wait(10s).has_value());
  return StartLighthouse(s.dir + "/data", SecuredFlags(s.dir), s.dir + "/lh.log", s.lh.address);
}

TEST_CASE("trust: lk::Reason and ErrorResponse.Code agree - and a code survives the wire") {
  const auto* desc = pb::ErrorResponse::Code_descriptor();
  CHECK(desc->value_count() == kReasonCount);
  for (int i = 0; i < kReasonCount; ++i) {
    CAPTURE(i);
    REQUIRE(desc->FindValueByNumber(i) != nullptr);
    CHECK(desc->FindValueByNumber(i)->name() == std::string(ReasonName(static_cast<Reason>(i))));
  }
  for (http::Format f : {http::Format::kJson, http::Format::kProto}) {
    Response r = http::ErrorReply(
        Refuse(Code::kConflict, Reason::kStaleIncarnation, "stale incarnation x"), f);
    CHECK(r.status == 409);
    Status back = http::StatusFromErrorBody(r.status, r.body, r.content_type);
    CHECK(back.code() == Code::kConflict);
    CHECK(back.reason() == Reason::kStaleIncarnation);
    CHECK(back.WithContext("ask").reason() == Reason::kStaleIncarnation);
  }
  // A refusal without a reason of its own gets its class's default.
  Response bad = http::ErrorReply(InvalidArgument("x"), http::Format::kJson);
  CHECK(bad.body.find("\"code\":\"BAD_REQUEST\"") != std::string::npos);
}

TEST_CASE("trust: the lighthouse attacks of issue 14 are refused with codes and change nothing") {
  auto s = StartSecured("lh-trust");
  auto job = Connect(s.lh.url(), "secret-j");
  auto admin = Connect(s.lh.url(), "root-token");
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);
  pb::QuorumRequest ask;
  ask.set_job("j");
  ask.set_group_id("a");
  ask.set_incarnation("a1");
  ask.set_nodes(1);
  ask.set_timeout_ms(10'000);
  pb::QuorumResponse q;
  REQUIRE(job->Call("POST", "/v1/quorum", ask, &q, Millis(15'000)).ok());
  // c comes after the quorum formed: a group outside it.
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "c", "c1")).status == 200);
  const uint32_t qid = q.quorum_id();
  auto commit = [&](const std::string& group, const std::string& inc, uint64_t step) {
    return fmt::format(
        R"({{"job":"j","group_id":"{}","incarnation":"{}","quorum_id":{},"step":{}}})", group, inc,
        qid, step);
  };
  REQUIRE(Send(*job, "POST", "/v1/commit", commit("a", "a1", 1)).status == 200);
  REQUIRE(Send(*job, "POST", "/v1/checkpoints",
               R"({"job":"j","step":1,"location":"/ckpt/j","group_id":"a"})")
              .status == 200);
  const std::string before = StatusJson(*admin);

  ExpectRefused(*job, "POST", "/v1/commit", commit("a", "a1", 4294967295u), 409, "WRONG_STEP");
  ExpectRefused(*job, "POST", "/v1/commit", commit("c", "c1", 1), 409, "NOT_A_MEMBER");
  ExpectRefused(*job, "POST", "/v1/commit", commit("a", "ghost", 1), 409, "UNKNOWN_INCARNATION");
  ExpectRefused(*job, "POST", "/v1/checkpoints",
                R"({"job":"j","step":1000,"location":"/ckpt/evil","group_id":"a"})", 409,
                "CHECKPOINT_NOT_COMMITTED");
  ExpectRefused(*job, "POST", "/v1/checkpoints",
                R"({"job":"j","step":1,"location":"../../etc","group_id":"a"})", 400,
                "CHECKPOINT_LOCATION_INVALID");
  ExpectRefused(*job, "POST", "/v1/leave",
                R"({"job":"j","group_id":"a","incarnation":"never-lived","reason":"x"})", 409,
                "UNKNOWN_INCARNATION");
  ExpectRefused(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a0", 1), 409, "STALE_INCARNATION");
  auto anon = Connect(s.lh.url());
  ExpectRefused(*anon, "POST", "/v1/heartbeat", Hb("j", "a", "a1"), 401, "TOKEN_MISSING");
  auto wrong = Connect(s.lh.url(), "guess");
  ExpectRefused(*wrong, "POST", "/v1/heartbeat", Hb("j", "a", "a1"), 401, "TOKEN_INVALID");
  ExpectRefused(*wrong, "GET", "/status", "", 401, "TOKEN_INVALID");
  ExpectRefused(*job, "POST", "/v1/admin/forget", R"({"job":"j"})", 401, "TOKEN_INVALID");

  CHECK(s.lh.process->Running());
  CHECK(Connect(s.lh.url())->Do("GET", "/healthz")->status == 200);
  CHECK(StatusJson(*admin) == before);
  CHECK(Send(*job, "POST", "/v1/commit", commit("a", "a1", 1)).status == 200);  // still works
}

// Issue 27: the bare "/v1/kv" reached the KV handler, which cut the path past its end and
// aborted the process. Every truncated or odd route path is answered with a 4xx and a reason
// code, with and without token files, and changes nothing.
TEST_CASE("trust: truncated and odd route paths get a 4xx with a code and the lighthouse stays up") {
  const std::vector<std::pair<std::string, std::string>> kOdd = {
      {"GET", "/v1/kv"},          {"PUT", "/v1/kv"},           {"GET", "/v1/kv/"},
      {"PUT", "/v1/kv/"},         {"GET", "/v1/kv/j"},         {"PUT", "/v1/kv/j"},
      {"GET", "/v1/kv/j/"},       {"PUT", "/v1/kv/j/"},        {"GET", "/v1/kv/j/0"},
      {"GET", "/v1/kv/j/0/"},     {"PUT", "/v1/kv/j/0/"},      {"GET", "/v1/kv//0/k"},
      {"GET", "/v1/kv/j//k"},     {"PUT", "/v1/kv/j/-1/k"},    {"GET", "/v1/kv/j/99999999999/k"},
      {"POST", "/v1/kv"},         {"DELETE", "/v1/kv/j/0/k"},  {"GET", "/v1/kv?job=j"},
      {"GET", "/v1"},             {"GET", "/v1/"},             {"POST", "/v1/"},
      {"GET", "/v1/watch/"},      {"GET", "/v1/watch"},        {"POST", "/v1/heartbeat/"},
      {"POST", "/v1/admin"},      {"POST", "/v1/admin/"},      {"GET", "/v1/checkpoints/"},
      {"GET", "/v1/checkpoints"}, {"GET", "/status/"},         {"POST", "/status"},
      {"GET", "//"},              {"GET", "/%00"},             {"PUT", "/v1/kv/%2F/0/k"}};
  for (bool secured : {false, true}) {
    CAPTURE(secured);
    Secured s;
    if (secured) {
      s = StartSecured("lh-odd-secured");
    } else {
      s.dir = TempDir("lh-odd-open");
      s.lh = StartLighthouse(s.dir + "/data", {}, s.dir + "/lh.log");
    }
    std::string token = secured ? "root-token" : "";
    auto admin = Connect(s.lh.url(), token);
    REQUIRE(Send(*admin, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);
    const std::string before = StatusJson(*admin);
    for (const std::string& who : {std::string(), std::string("secret-j"), token}) {
      auto c = Connect(s.lh.url(), who);
      for (const auto& [method, target] : kOdd) {
        Answer a = Send(*c, method, target, method == "PUT" ? "value" : "");
        INFO(method << " " << target << " token=" << who << " -> " << a.status << " " << a.body);
        CHECK(a.status >= 400);
        CHECK(a.status < 500);
        CHECK(!a.code.empty());
        CHECK(a.code != "UNSPECIFIED");
        REQUIRE(s.lh.process->Running());
      }
    }
    CHECK(Connect(s.lh.url())->Do("GET", "/healthz")->status == 200);
    CHECK(StatusJson(*admin) == before);
  }
}

TEST_CASE("trust: the read-only role reads /status and /metrics and changes nothing") {
  auto s = StartSecured("lh-ro");
  auto job = Connect(s.lh.url(), "secret-j");
  auto admin = Connect(s.lh.url(), "root-token");
  auto ro = Connect(s.lh.url(), "prom");
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);
  const std::string before = StatusJson(*admin);

  Answer st = Send(*ro, "GET", "/status");
  CHECK(st.status == 200);
  CHECK(st.body.find("\"job\":\"j\"") != std::string::npos);
  Answer m = Send(*ro, "GET", "/metrics");
  CHECK(m.status == 200);
  CHECK(m.body.find("lk_groups{job=\"j\"") != std::string::npos);
  CHECK(Send(*ro, "GET", "/v1/checkpoints?job=j").status == 200);
  ExpectRefused(*Connect(s.lh.url()), "GET", "/metrics", "", 401, "TOKEN_MISSING");
  ExpectRefused(*job, "GET", "/metrics", "", 403, "ROLE_FORBIDS");

  const std::string hb = Hb("j", "a", "a1");
  const std::string ask =
      R"({"job":"j","group_id":"a","incarnation":"a1","nodes":1,"timeout_ms":100})";
  const std::string leave = R"({"job":"j","group_id":"a","incarnation":"a1","reason":"x"})";
  const std::string commit =
      R"({"job":"j","group_id":"a","incarnation":"a1","quorum_id":0,"step":1})";
  ExpectRefused(*ro, "POST", "/v1/heartbeat", hb, 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "POST", "/v1/quorum", ask, 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "POST", "/v1/leave", leave, 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "POST", "/v1/commit", commit, 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "POST", "/v1/checkpoints", R"({"job":"j","step":0,"location":"/c"})", 403,
                "ROLE_FORBIDS");
  ExpectRefused(*ro, "PUT", "/v1/kv/j/0/key", "value", 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "GET", "/v1/kv/j/0/key?timeout_ms=0", "", 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "GET", "/v1/watch?job=j&quorum_id=0&timeout_ms=0", "", 403, "ROLE_FORBIDS");
  ExpectRefused(*ro, "POST", "/v1/admin/drain", R"({"job":"j","group_id":"a"})", 403,
                "ROLE_FORBIDS");
  ExpectRefused(*ro, "POST", "/v1/admin/forget", R"({"job":"j"})", 403, "ROLE_FORBIDS");
  // lkctl names the code of a refusal; with the read-only token it can still show the status.
  { std::ofstream(s.dir + "/ro-token") << "prom\n"; }
  Process drain({BinDir() + "/lkctl", "--lighthouse", s.lh.url(), "--token-file",
                 s.dir + "/ro-token", "drain", "j", "a"},
                s.dir + "/lkctl-drain.log");
  CHECK(drain.Wait(10s) == 1);
  CHECK(drain.Log().find("[ROLE_FORBIDS]") != std::string::npos);
  Process status({BinDir() + "/lkctl", "--lighthouse", s.lh.url(), "--token-file",
                  s.dir + "/ro-token", "status"},
                 s.dir + "/lkctl-status.log");
  CHECK(status.Wait(10s) == 0);
  CHECK(status.Log().find("a1") != std::string::npos);  // group a, incarnation a1
  CHECK(StatusJson(*admin) == before);
}

TEST_CASE("trust: a zombie incarnation stays dead across a kill -9 restart") {
  auto s = StartSecured("lh-zombie");
  auto job = Connect(s.lh.url(), "secret-j");
  Answer first = Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a1"));
  REQUIRE(first.status == 200);
  pb::HeartbeatResponse r1;
  REQUIRE(http::Decode(first.body, http::Format::kJson, &r1).ok());
  CHECK(r1.generation() == 1);
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a2")).status == 200);  // a1 replaced

  auto lh2 = KillAndRestart(s);
  auto job2 = Connect(lh2.url(), "secret-j");
  auto admin = Connect(lh2.url(), "root-token");
  const std::string before = StatusJson(*admin);
  CHECK(before.find("\"incarnation\":\"a2\"") != std::string::npos);
  // The zombie, by name and by its generation, on every call it could make.
  ExpectRefused(*job2, "POST", "/v1/heartbeat", Hb("j", "a", "a1"), 409, "STALE_INCARNATION");
  ExpectRefused(*job2, "POST", "/v1/heartbeat", Hb("j", "a", "a1", 1), 409, "STALE_INCARNATION");
  ExpectRefused(*job2, "POST", "/v1/quorum",
                R"({"job":"j","group_id":"a","incarnation":"a1","nodes":1,"timeout_ms":100})", 409,
                "STALE_INCARNATION");
  ExpectRefused(*job2, "POST", "/v1/leave",
                R"({"job":"j","group_id":"a","incarnation":"a1","reason":"zombie"})", 409,
                "STALE_INCARNATION");
  CHECK(lh2.process->Running());
  CHECK(StatusJson(*admin) == before);
  Answer live = Send(*job2, "POST", "/v1/heartbeat", Hb("j", "a", "a2", 2));
  REQUIRE(live.status == 200);
  CHECK(live.body.find("\"generation\":2") != std::string::npos);
}

// Issue 31: what a group's launcher reports about a life (POST /v1/event) is counted once per
// crashed life, kept through a kill -9 of the lighthouse, and refused to strangers, to the
// read-only role and on bad input without changing anything.
TEST_CASE("trust: /v1/event counts a crash once, keeps it across a restart, refuses bad calls") {
  auto s = StartSecured("lh-event");
  auto job = Connect(s.lh.url(), "secret-j");
  auto admin = Connect(s.lh.url(), "root-token");
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);
  auto event = [](const std::string& j, const std::string& inc, const std::string& what,
                  const std::string& detail = "") {
    return fmt::format(
        R"({{"job":"{}","group_id":"a","incarnation":"{}","event":"{}","detail":"{}"}})", j, inc,
        what, detail);
  };
  const std::string before = StatusJson(*admin);
  ExpectRefused(*Connect(s.lh.url()), "POST", "/v1/event", event("j", "a1", "trainer_crashed"),
                401, "TOKEN_MISSING");
  ExpectRefused(*Connect(s.lh.url(), "prom"), "POST", "/v1/event",
                event("j", "a1", "trainer_crashed"), 403, "ROLE_FORBIDS");
  ExpectRefused(*job, "POST", "/v1/event", event("j", "a1", "meteor_strike"), 400,
                "BAD_REQUEST");
  ExpectRefused(*job, "POST", "/v1/event", event("j", "a1", "requeue_refused", std::string(300, 'x')),
                400, "BAD_REQUEST");
  ExpectRefused(*job, "POST", "/v1/event", "{not json", 400, "BAD_REQUEST");
  ExpectRefused(*job, "GET", "/v1/event", "", 400, "METHOD_NOT_ALLOWED");
  CHECK(StatusJson(*admin) == before);

  auto counts = [&](const std::string& body) {
    Answer a = Send(*job, "POST", "/v1/event", body);
    INFO(body << " -> " << a.body);
    REQUIRE(a.status == 200);
    pb::GroupEventResponse r;
    REQUIRE(http::Decode(a.body, http::Format::kJson, &r).ok());
    return std::make_pair(r.crashes(), r.requeue_refusals());
  };
  CHECK(counts(event("j", "a1", "trainer_crashed", "rc=1")) == std::make_pair(1u, 0u));
  CHECK(counts(event("j", "a1", "trainer_crashed", "rc=1")) == std::make_pair(1u, 0u));
  CHECK(counts(event("j", "a1", "requeue_refused", "slurm said no")) == std::make_pair(1u, 1u));
  CHECK(s.lh.process->WaitForLog("group_event job=j group=a incarnation=a1 event=requeue_refused",
                                 10s)
            .find("requeue_refusals=1") != std::string::npos);
  const std::string shown = StatusJson(*admin);
  CHECK(shown.find("\"crashes\":1") != std::string::npos);
  CHECK(shown.find("\"last_event\":\"requeue_refused: slurm said no\"") != std::string::npos);

  auto lh2 = KillAndRestart(s);
  job = Connect(lh2.url(), "secret-j");
  // The next life crashed before its agent was heard of: counted on top of the first.
  CHECK(counts(event("j", "a2", "trainer_crashed", "rc=134")) == std::make_pair(2u, 1u));
  ExpectRefused(*job, "POST", "/v1/event", event("nojob", "a2", "trainer_crashed"), 401,
                "TOKEN_INVALID");
  ExpectRefused(*Connect(lh2.url(), "root-token"), "POST", "/v1/event",
                event("nojob", "a2", "trainer_crashed"), 404, "UNKNOWN_JOB");
}

TEST_CASE("trust: --jobs-max refuses a new job and groups are collected after the grace period") {
  auto s = StartSecured(
      "lh-bounds", {"--jobs-max", "1", "--group-grace-ms", "300", "--heartbeat-timeout-ms", "200"});
  auto job = Connect(s.lh.url(), "secret-j");
  auto admin = Connect(s.lh.url(), "root-token");
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);
  REQUIRE(Send(*job, "POST", "/v1/heartbeat", Hb("j", "b", "b1")).status == 200);
  ExpectRefused(*admin, "POST", "/v1/heartbeat", Hb("k", "a", "a1"), 429, "JOBS_MAX");
  CHECK(Send(*job, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);  // j goes on
  REQUIRE(Send(*job, "POST", "/v1/leave",
               R"({"job":"j","group_id":"b","incarnation":"b1","reason":"done"})")
              .status == 200);
  // b left; a stops heartbeating. Both are collected once their grace period passed.
  CHECK(WaitUntil(
      [&] {
        std::string st = StatusJson(*admin);
        return st.find("\"group_id\":\"a\"") == std::string::npos &&
               st.find("\"group_id\":\"b\"") == std::string::npos;
      },
      5s, "groups a and b collected from /status"));
  CHECK(s.lh.process->Log().find("group_collected job=j group=b") != std::string::npos);
  // The collected life stays refused by its generation; a new one is welcome.
  ExpectRefused(*job, "POST", "/v1/heartbeat", Hb("j", "b", "b1", 2), 409, "STALE_INCARNATION");
  CHECK(Send(*job, "POST", "/v1/heartbeat", Hb("j", "b", "b2")).status == 200);
  // Forgetting the job removes its metric series and makes room under --jobs-max.
  CHECK(Send(*admin, "GET", "/metrics").body.find("job=\"j\"") != std::string::npos);
  REQUIRE(Send(*admin, "POST", "/v1/admin/forget", R"({"job":"j"})").status == 200);
  CHECK(Send(*admin, "GET", "/metrics").body.find("job=\"j\"") == std::string::npos);
  CHECK(Send(*admin, "POST", "/v1/heartbeat", Hb("k", "a", "a1")).status == 200);
}

TEST_CASE("trust: a request past the buffer budget gets 503 BUFFER_BUDGET and the rest go on") {
  auto dir = TempDir("lh-budget");
  auto lh = StartLighthouse(dir + "/data",
                            {"--request-buffer-bytes-max", "65536", "--body-bytes-max", "1048576"},
                            dir + "/lh.log");
  int fd = ConnectTcp(lh.address);
  REQUIRE(fd >= 0);
  // A 200 KB body announced, and exactly the 64 KiB the budget allows sent: the server reads all
  // of it into a buffer that then needs to grow past the budget, and refuses. (Sending the whole
  // body would leave unread bytes at the close, and the reset could swallow the answer.)
  std::string req =
      "POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: "
      "application/json\r\nContent-Length: 200000\r\n\r\n";
  req.resize(65536, ' ');
  timeval tv{10, 0};  // bounds the test if the lighthouse never answers
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  (void)!write(fd, req.data(), req.size());
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) got.append(buf, static_cast<size_t>(n));
  close(fd);
  INFO(got);
  CHECK(got.rfind("HTTP/1.1 503", 0) == 0);
  CHECK(got.find("BUFFER_BUDGET") != std::string::npos);
  CHECK(lh.process->Running());
  auto c = Connect(lh.url());
  CHECK(Send(*c, "POST", "/v1/heartbeat", Hb("j", "a", "a1")).status == 200);
}

}  // namespace
}  // namespace lk::test
