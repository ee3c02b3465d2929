// lk_gateway's rules as tables: the flags' refusals (GatewayOptions::Validate), which calls it
// relays and for which job (ClassifyCall), which token covers which job (AuthorizeCall), and the
// target it sends on. The real binaries are in tests/gateway_integration_test.cc.
#include "gateway/gateway.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <functional>
#include <string>

#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "gateway/relay_rules.h"

namespace lk::gateway {
namespace {

namespace pb = lightkeeper::v1;

GatewayOptions Complete() {
  GatewayOptions o;
  o.site = "alps";
  o.lighthouse = "http://lh.example:29510";
  o.listen = "127.0.0.1:0";
  return o;
}

TEST_CASE("gateway options: a complete set passes, each bad one is refused naming its flag") {
  struct Row {
    const char* name;
    std::function<void(GatewayOptions&)> change;
    std::string error;
  };
  const Row rows[] = {
      {"no site", [](GatewayOptions& o) { o.site.clear(); },
       "--site is required (this site's name, e.g. alps)"},
      {"a site with a slash", [](GatewayOptions& o) { o.site = "a/b"; },
       "--site 'a/b' has a character outside [A-Za-z0-9-_.:@+]"},
      {"no lighthouse", [](GatewayOptions& o) { o.lighthouse.clear(); },
       "--lighthouse is required (the lighthouse's URL, http://HOST:PORT)"},
      {"no listen", [](GatewayOptions& o) { o.listen.clear(); },
       "--listen is required (HOST:PORT)"},
      {"a certificate without its key", [](GatewayOptions& o) { o.http.tls_cert_file = "/c"; },
       "--tls-cert-file and --tls-key-file go together"},
      {"no relays", [](GatewayOptions& o) { o.relays_max = 0; }, "--relays-max must be at least 1"},
      {"open beyond this host", [](GatewayOptions& o) { o.listen = "0.0.0.0:29520"; },
       "--listen 0.0.0.0:29520 reaches beyond this host and there is no --token-file: anyone "
       "who reaches it could act for every job through this gateway. Give --token-file (the "
       "jobs it relays for, 'JOB TOKEN' lines), listen on a loopback address, or pass "
       "--insecure-no-auth to relay open on purpose"},
  };
  CHECK(Complete().Validate().ok());
  for (const Row& row : rows) {
    CAPTURE(row.name);
    GatewayOptions o = Complete();
    row.change(o);
    Status st = o.Validate();
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK(st.message() == row.error);
  }
  // Beyond loopback with tokens, or open on purpose.
  GatewayOptions with_tokens = Complete();
  with_tokens.listen = "10.0.0.2:29520";
  with_tokens.token_file = "/tokens";
  CHECK(with_tokens.Validate().ok());
  GatewayOptions open = Complete();
  open.listen = "0.0.0.0:29520";
  open.insecure_no_auth = true;
  CHECK(open.Validate().ok());
}

http::Request Post(const std::string& path, const google::protobuf::Message& m) {
  http::Request r;
  r.method = "POST";
  r.path = path;
  r.content_type = http::kProtoType;
  r.body = http::Encode(m, http::Format::kProto);
  return r;
}

http::Request Get(const std::string& path, std::map<std::string, std::string> query) {
  http::Request r;
  r.method = "GET";
  r.path = path;
  r.query = std::move(query);
  return r;
}

TEST_CASE("classify: every agent route names its job; long polls carry their wait") {
  pb::HeartbeatRequest hb;
  hb.set_job("j1");
  pb::QuorumRequest q;
  q.set_job("j2");
  q.set_timeout_ms(7000);
  pb::QuorumRequest q_default;
  q_default.set_job("j2");
  pb::LeaveRequest leave;
  leave.set_job("j3");
  pb::CommitRequest commit;
  commit.set_job("j4");
  pb::GroupEventRequest event;
  event.set_job("j5");
  pb::CheckpointInfo ckpt;
  ckpt.set_job("j6");
  struct Row {
    const char* name;
    http::Request req;
    std::string job;
    int64_t long_poll_ms;
  };
  http::Request json = Post("/v1/heartbeat", hb);
  json.content_type = http::kJsonType;
  json.body = R"({"job":"jj","group_id":"g"})";
  http::Request kv_put = Get("/v1/kv/j9/3/some/key", {});
  kv_put.method = "PUT";
  const Row rows[] = {
      {"heartbeat", Post("/v1/heartbeat", hb), "j1", 0},
      {"heartbeat as JSON", json, "jj", 0},
      {"quorum", Post("/v1/quorum", q), "j2", 7000},
      {"quorum, the lighthouse's default wait", Post("/v1/quorum", q_default), "j2", 30000},
      {"leave", Post("/v1/leave", leave), "j3", 0},
      {"commit", Post("/v1/commit", commit), "j4", 0},
      {"event", Post("/v1/event", event), "j5", 0},
      {"checkpoint registration", Post("/v1/checkpoints", ckpt), "j6", 0},
      {"checkpoint list", Get("/v1/checkpoints", {{"job", "j7"}}), "j7", 0},
      {"watch", Get("/v1/watch", {{"job", "j8"}, {"quorum_id", "4"}, {"timeout_ms", "20000"}}),
       "j8", 20000},
      {"kv get", Get("/v1/kv/j9/3/some/key", {{"timeout_ms", "5000"}}), "j9", 5000},
      {"kv put", kv_put, "j9", 0},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    auto call = ClassifyCall(row.req, Millis(30'000));
    REQUIRE(call.ok());
    CHECK(call->job == row.job);
    CHECK(call->long_poll.count() == row.long_poll_ms);
  }
}

TEST_CASE("classify: what the gateway does not relay is refused with a reason code") {
  pb::HeartbeatRequest no_job;
  no_job.set_group_id("g");
  pb::HeartbeatRequest bad_job;
  bad_job.set_job("../x");
  http::Request garbage = Post("/v1/heartbeat", no_job);
  garbage.body = "\xff\xff\xff not protobuf";
  http::Request get_heartbeat = Post("/v1/heartbeat", no_job);
  get_heartbeat.method = "GET";
  http::Request drain = Post("/v1/admin/drain", no_job);
  struct Row {
    const char* name;
    http::Request req;
    Code code;
    Reason reason;
  };
  const Row rows[] = {
      {"admin calls", drain, Code::kNotFound, Reason::kNoEndpoint},
      {"status", Get("/status", {}), Code::kNotFound, Reason::kNoEndpoint},
      {"metrics", Get("/metrics", {}), Code::kNotFound, Reason::kNoEndpoint},
      {"the dashboard", Get("/", {}), Code::kNotFound, Reason::kNoEndpoint},
      {"a wrong method", get_heartbeat, Code::kInvalidArgument, Reason::kMethodNotAllowed},
      {"garbage", garbage, Code::kInvalidArgument, Reason::kBadRequest},
      {"no job", Post("/v1/heartbeat", no_job), Code::kInvalidArgument, Reason::kBadRequest},
      {"a job outside the alphabet", Post("/v1/heartbeat", bad_job), Code::kInvalidArgument,
       Reason::kBadRequest},
      {"a watch without a job", Get("/v1/watch", {{"quorum_id", "1"}}), Code::kInvalidArgument,
       Reason::kBadRequest},
      {"a bad timeout", Get("/v1/watch", {{"job", "j"}, {"timeout_ms", "-1"}}),
       Code::kInvalidArgument, Reason::kBadRequest},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    auto call = ClassifyCall(row.req, Millis(30'000));
    REQUIRE_FALSE(call.ok());
    CHECK(call.status().code() == row.code);
    CHECK(ReasonName(call.status().reason()) == ReasonName(row.reason));
  }
}

TEST_CASE("authorize: a job token covers its job only, a bare token every job") {
  http::Tokens t;
  t.enabled = true;
  t.per_job["a"] = {"tok-a"};
  t.per_job["b"] = {"tok-b"};
  t.any_job = {"tok-all"};
  t.read_only = {"tok-ro"};
  auto with = [](const std::string& token) {
    http::Request r;
    if (!token.empty()) r.authorization = "Bearer " + token;
    return r;
  };
  struct Row {
    const char* name;
    std::string token;
    std::string job;
    Code code;
    Reason reason;
  };
  const Row rows[] = {
      {"its own job", "tok-a", "a", Code::kOk, Reason::kUnspecified},
      {"every job", "tok-all", "b", Code::kOk, Reason::kUnspecified},
      {"no token", "", "a", Code::kUnauthenticated, Reason::kTokenMissing},
      {"another job's token", "tok-b", "a", Code::kUnauthenticated, Reason::kTokenInvalid},
      {"a job no line names", "tok-a", "c", Code::kUnauthenticated, Reason::kTokenInvalid},
      {"an unknown token", "guess", "a", Code::kUnauthenticated, Reason::kTokenInvalid},
      {"a read-only token", "tok-ro", "a", Code::kPermissionDenied, Reason::kRoleForbids},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    Status st = AuthorizeCall(t, with(row.token), row.job);
    CHECK(st.code() == row.code);
    CHECK(ReasonName(st.reason()) == ReasonName(row.reason));
  }
  CHECK(AuthorizeCall(http::Tokens{}, with(""), "a").ok());  // tokens off: the lighthouse checks
}

TEST_CASE("upstream target: the decoded path and query are encoded again") {
  http::Request r = Get("/v1/kv/j/3/a key?#", {{"timeout_ms", "5"}, {"x y", "1&2"}});
  CHECK(UpstreamTarget(r) == "/v1/kv/j/3/a%20key%3F%23?timeout_ms=5&x%20y=1%262");
}

}  // namespace
}  // namespace lk::gateway

namespace lk::gateway {
namespace {

TEST_CASE("token file: role=gateway lines are a gateway's credentials, apart from every role") {
  char path[] = "/tmp/lk-gateway-tokens-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  const std::string text = "# a site's tokens\nt tok-t\nrole=gateway tok-gw\ntok-all\n";
  REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(fd);
  auto t = http::LoadTokens(path, "");
  unlink(path);
  REQUIRE(t.ok());
  CHECK(t->gateway == std::vector<std::string>{"tok-gw"});
  CHECK(t->any_job == std::vector<std::string>{"tok-all"});
  CHECK(t->per_job.at("t") == std::vector<std::string>{"tok-t"});
  // A gateway's credential relays nothing by itself.
  http::Request r;
  r.authorization = "Bearer tok-gw";
  CHECK(AuthorizeCall(*t, r, "t").reason() == Reason::kTokenInvalid);
}

}  // namespace
}  // namespace lk::gateway
