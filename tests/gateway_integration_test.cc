// lk_gateway as a site runs it: real lighthouse, gateway, agents (replica_agent --gateway) and
// trainers on loopback, port 0. Two groups train through one gateway to the end while the
// gateway is killed and restarted on the same port; and the gateway's refusals (no token, a
// wrong token, another job) never reach the lighthouse. Every wait is bounded and waits for a
// condition.
#include <doctest/doctest.h>
#include <signal.h>

#include <fstream>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "tests/support/process.h"
#include "tests/support/tcp_relay.h"
#include "tests/support/wait.h"

namespace lk::test {
namespace {

using namespace std::chrono_literals;
namespace pb = lightkeeper::v1;

constexpr const char* kToken = "tok-t-0123456789";
constexpr const char* kOtherToken = "tok-other-0123456789";
constexpr const char* kAdminToken = "tok-admin-0123456789";
constexpr const char* kGatewayToken = "tok-gateway-0123456789";

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

struct GatewayProcess {
  std::unique_ptr<Process> process;
  std::string address;
};

// Starts lk_gateway and waits for its gateway_listening line (the `occurrence`th in its log).
GatewayProcess StartGateway(const std::string& lighthouse_url, const std::string& token_file,
                            const std::string& credential_file, const std::string& log,
                            const std::string& listen, size_t occurrence = 1,
                            const std::vector<std::string>& extra = {}) {
  GatewayProcess g;
  std::vector<std::string> argv{BinDir() + "/lk_gateway", "--site", "site-a", "--lighthouse",
                                lighthouse_url, "--listen", listen, "--token-file", token_file,
                                "--gateway-token-file", credential_file};
  argv.insert(argv.end(), extra.begin(), extra.end());
  g.process = std::make_unique<Process>(argv, log);
  std::string line = g.process->WaitForLog("gateway_listening", 20s, occurrence);
  REQUIRE_MESSAGE(!line.empty(), "lk_gateway did not start: " << g.process->Log());
  auto pos = line.find(" listen=") + 8;
  g.address = line.substr(pos, line.find(' ', pos) - pos);
  CHECK(line.find("site=site-a") != std::string::npos);
  CHECK(line.find("lighthouse=" + lighthouse_url) != std::string::npos);
  return g;
}

// The lighthouse's view of job `job` (with the admin token), or an empty JobStatus while it
// does not answer.
pb::JobStatus JobStatus(const std::string& url, const std::string& job) {
  http::ClientOptions o;
  o.token = kAdminToken;
  auto c = http::Client::Create(url, o);
  REQUIRE(c.ok());
  auto r = (*c)->Do("GET", "/status?job=" + job, "", "", Millis(3000));
  pb::StatusResponse st;
  if (r.ok() && r->status == 200) (void)http::Decode(r->body, http::Format::kJson, &st);
  return st.jobs().empty() ? pb::JobStatus() : st.jobs(0);
}

bool LogHas(const std::string& path, const std::function<bool(const std::string&)>& pred) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (pred(line)) return true;
  }
  return false;
}

struct Site {
  std::string dir = TempDir("gateway");
  Lighthouse lh;
  GatewayProcess gw;
  std::string gateway_tokens = dir + "/gateway-tokens";
  std::string agent_token = dir + "/agent-token";
  std::string credential = dir + "/gateway-credential";

  // `proxy`: the gateway reaches the lighthouse by a name only that CONNECT proxy resolves.
  explicit Site(TcpRelay* proxy = nullptr) {
    WriteFile(dir + "/lh-tokens",
              fmt::format("t {}\nother {}\nrole=gateway {}\n", kToken, kOtherToken, kGatewayToken));
    WriteFile(credential, kGatewayToken);
    WriteFile(dir + "/admin-token", kAdminToken);
    WriteFile(gateway_tokens, fmt::format("# the jobs this site relays for\nt {}\n", kToken));
    WriteFile(agent_token, kToken);
    lh = StartLighthouse(
        dir + "/data",
        {"--token-file", dir + "/lh-tokens", "--admin-token-file", dir + "/admin-token",
         "--heartbeat-timeout-ms", "10000", "--join-timeout-ms", "300"},
        dir + "/lighthouse.log");
    if (proxy == nullptr) {
      gw = StartGateway(lh.url(), gateway_tokens, credential, dir + "/gateway.log", "127.0.0.1:0");
      return;
    }
    gw = StartGateway(
        "http://lighthouse.invalid" + lh.address.substr(lh.address.rfind(':')), gateway_tokens,
        credential, dir + "/gateway.log", "127.0.0.1:0", 1,
        {"--proxy", "http://user:pass@" + proxy->address()});
  }
};

struct Group {
  std::unique_ptr<Process> agent;
  std::unique_ptr<Process> trainer;
  std::string trainer_log;
};

Group StartGroup(const Site& site, const std::string& name, uint32_t steps) {
  Group g;
  const std::string socket = fmt::format("{}/{}.sock", site.dir, name);
  g.agent = std::make_unique<Process>(
      std::vector<std::string>{BinDir() + "/replica_agent", "--gateway", site.gw.address,
                               "--token-file", site.agent_token, "--job", "t", "--group-id", name,
                               "--socket", socket, "--heartbeat-interval-ms", "100",
                               "--drain-timeout-ms", "5000", "--backoff-max-ms", "300"},
      fmt::format("{}/agent-{}.log", site.dir, name));
  std::string listening = g.agent->WaitForLog("agent_listening", 10s);
  REQUIRE_MESSAGE(!listening.empty(), g.agent->Log());
  CHECK(listening.find("gateway=" + site.gw.address) != std::string::npos);
  g.trainer_log = fmt::format("{}/trainer-{}.jsonl", site.dir, name);
  g.trainer = std::make_unique<Process>(
      std::vector<std::string>{BinDir() + "/test_trainer", "--group-rank", "0", "--group-size", "1",
                               "--steps", std::to_string(steps), "--step-sleep-ms", "30", "--log",
                               g.trainer_log},
      g.trainer_log + ".stderr", std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}});
  return g;
}

TEST_CASE(
    "two groups train through one gateway to the end; the gateway killed, the groups go on as "
    "in a lighthouse outage, and after its restart on the same port commits reach the "
    "lighthouse again") {
  constexpr uint32_t kSteps = 150;
  Site site;
  std::map<std::string, Group> groups;
  groups["a"] = StartGroup(site, "a", kSteps);
  groups["b"] = StartGroup(site, "b", kSteps);
  // Both groups in one quorum, committing through the gateway.
  REQUIRE(WaitUntil(
      [&] {
        auto j = JobStatus(site.lh.url(), "t");
        return j.members_size() == 2 && j.committed_step() >= 3;
      },
      60s, "two members committing through the gateway"));
  // The lighthouse knows the site each group is behind (the gateway's vouched header).
  const pb::JobStatus running = JobStatus(site.lh.url(), "t");
  for (const auto& g : running.groups()) {
    CAPTURE(g.group_id());
    CHECK(g.gateway() == "site-a");
  }
  site.gw.process->Signal(SIGKILL);
  REQUIRE(site.gw.process->Wait(10s).has_value());
  // The groups go on without the lighthouse, as in its outage.
  for (auto& [name, g] : groups) {
    CAPTURE(name);
    CHECK_FALSE(g.agent->WaitForLog("lighthouse_unreachable continuing", 30s).empty());
    CHECK(g.trainer->Running());
  }
  const uint32_t before = JobStatus(site.lh.url(), "t").committed_step();
  // The gateway back on the same port: the agents' calls reach the lighthouse again.
  site.gw = StartGateway(site.lh.url(), site.gateway_tokens, site.credential,
                         site.dir + "/gateway.log", site.gw.address, 2);
  REQUIRE(WaitUntil([&] { return JobStatus(site.lh.url(), "t").committed_step() > before; }, 60s,
                    "a commit after the gateway's restart"));
  for (auto& [name, g] : groups) {
    CAPTURE(name);
    auto code = g.trainer->Wait(120s);
    REQUIRE_MESSAGE(code.has_value(), name << "'s trainer did not finish");
    CHECK(*code == 0);
    CHECK(LogHas(g.trainer_log, [&](const std::string& line) {
      return JsonField(line, "event") == "done" &&
             JsonField(line, "step") == std::to_string(kSteps);
    }));
    auto agent = g.agent->Wait(60s);
    REQUIRE(agent.has_value());
    CHECK(*agent == 0);
  }
  pb::JobStatus job = JobStatus(site.lh.url(), "t");
  CHECK(job.committed_step() == kSteps);
  REQUIRE(job.groups_size() == 2);
  for (const auto& g : job.groups()) {
    CAPTURE(g.group_id());
    CHECK(g.state() == "left");
    CHECK(g.reason() == "finished");
  }
}

TEST_CASE(
    "the gateway refuses no token, a wrong token and another job with a reason code, and the "
    "lighthouse never hears of them") {
  Site site;
  auto client = http::Client::Create("http://" + site.gw.address);
  REQUIRE(client.ok());
  // A heartbeat of group `group` to `url` (the gateway unless given), with `token` and an
  // Lk-Gateway header `claim` when not empty.
  auto beat = [&](const std::string& job, const std::string& token, const std::string& group = "g0",
                  std::string url = "", const std::string& claim = "") {
    if (url.empty()) url = "http://" + site.gw.address;
    http::ClientOptions o;
    o.token = token;
    auto c = http::Client::Create(url, o);
    REQUIRE(c.ok());
    pb::HeartbeatRequest hb;
    hb.set_job(job);
    hb.set_group_id(group);
    hb.set_incarnation("i0");
    hb.set_nodes(1);
    auto r = (*c)->Do("POST", "/v1/heartbeat", http::Encode(hb, http::Format::kProto),
                      http::kProtoType, Millis(5000), claim.empty() ? "" : "Lk-Gateway", claim);
    REQUIRE(r.ok());
    return *r;
  };
  auto reason = [](const http::Response& r) {
    return ReasonName(http::StatusFromResponse(r).reason());
  };
  struct Row {
    const char* name;
    std::string job;
    std::string token;
    int status;
    std::string_view reason;
  };
  const Row rows[] = {
      {"no token", "t", "", 401, "TOKEN_MISSING"},
      {"a wrong token", "t", "guessed-token", 401, "TOKEN_INVALID"},
      // The lighthouse knows this job and token, the gateway does not relay for it.
      {"another job with its own token", "other", kOtherToken, 401, "TOKEN_INVALID"},
      {"another job with this job's token", "other", kToken, 401, "TOKEN_INVALID"},
      {"the admin token", "t", kAdminToken, 401, "TOKEN_INVALID"},
      {"the gateway's own credential", "t", kGatewayToken, 401, "TOKEN_INVALID"},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    http::Response r = beat(row.job, row.token);
    CHECK(r.status == row.status);
    CHECK(reason(r) == row.reason);
  }
  // Garbage and an oversized body: the HTTP server's limits, as at the lighthouse.
  auto garbage = (*client)->Do("POST", "/v1/heartbeat", "\xff\x01 not protobuf", http::kProtoType,
                               Millis(5000), "Authorization", std::string("Bearer ") + kToken);
  REQUIRE(garbage.ok());
  CHECK(garbage->status == 400);
  CHECK(reason(*garbage) == "BAD_REQUEST");
  auto big = (*client)->Do("POST", "/v1/heartbeat", std::string(5 << 20, 'x'), http::kProtoType,
                           Millis(10'000), "Authorization", std::string("Bearer ") + kToken);
  if (big.ok()) CHECK(big->status == 413);  // else the server closed the connection mid-body
  auto admin = (*client)->Do("POST", "/v1/admin/forget", "{\"job\":\"t\"}", http::kJsonType,
                             Millis(5000), "Authorization", std::string("Bearer ") + kAdminToken);
  REQUIRE(admin.ok());
  CHECK(admin->status == 404);
  CHECK(reason(*admin) == "NO_ENDPOINT");
  CHECK_FALSE(site.gw.process->WaitForLog("relay_refused", 1s).empty());
  // None reached the lighthouse: it knows no job, and logged no refusal.
  CHECK(JobStatus(site.lh.url(), "t").job().empty());
  CHECK(JobStatus(site.lh.url(), "other").job().empty());
  CHECK(site.lh.process->Log().find("TOKEN_") == std::string::npos);
  // The job's own token is relayed, and the lighthouse's answer comes back unchanged.
  http::Response ok = beat("t", kToken);
  CHECK(ok.status == 200);
  pb::HeartbeatResponse resp;
  CHECK(http::Decode(ok.body, http::BodyFormat(ok.content_type), &resp).ok());
  pb::JobStatus job = JobStatus(site.lh.url(), "t");
  REQUIRE(job.groups_size() == 1);
  CHECK(job.groups(0).gateway() == "site-a");
  // The operator sees it too.
  Process lkctl({BinDir() + "/lkctl", "--lighthouse", site.lh.url(), "--token-file",
                 site.dir + "/admin-token", "status"},
                site.dir + "/lkctl.log");
  REQUIRE(lkctl.Wait(20s).has_value());
  CHECK(lkctl.Log().find("via gateway site-a") != std::string::npos);
  // An agent's own Lk-Gateway header is never passed on: the gateway's credential speaks.
  CHECK(beat("t", kToken, "g0", "", "forged site-z").status == 200);
  CHECK(JobStatus(site.lh.url(), "t").groups(0).gateway() == "site-a");
  // Straight to the lighthouse: no header is no gateway, and a claim without a gateway's
  // credential is refused.
  CHECK(beat("t", kToken, "g1", site.lh.url()).status == 200);
  http::Response forged = beat("t", kToken, "g2", site.lh.url(), "guessed site-z");
  CHECK(forged.status == 401);
  CHECK(reason(forged) == "TOKEN_INVALID");
  // A gateway's credential is no job token.
  CHECK(beat("t", kGatewayToken, "g3", site.lh.url()).status == 401);
  job = JobStatus(site.lh.url(), "t");
  REQUIRE(job.groups_size() == 2);
  CHECK(job.groups(0).group_id() == "g0");
  CHECK(job.groups(1).group_id() == "g1");
  CHECK(job.groups(1).gateway().empty());
}

TEST_CASE(
    "a lighthouse the gateway cannot reach: 503 LIGHTHOUSE_UNREACHABLE, logged once, and "
    "relayed again when it is back") {
  Site site;
  http::ClientOptions o;
  o.token = kToken;
  auto client = http::Client::Create("http://" + site.gw.address, o);
  REQUIRE(client.ok());
  pb::HeartbeatRequest hb;
  hb.set_job("t");
  hb.set_group_id("g0");
  hb.set_incarnation("i0");
  hb.set_nodes(1);
  auto beat = [&] {
    auto r = (*client)->Do("POST", "/v1/heartbeat", http::Encode(hb, http::Format::kProto),
                           http::kProtoType, Millis(5000));
    REQUIRE(r.ok());
    return *r;
  };
  CHECK(beat().status == 200);
  site.lh.process->Signal(SIGKILL);
  REQUIRE(site.lh.process->Wait(10s).has_value());
  for (int i = 0; i < 3; ++i) {
    http::Response r = beat();
    CHECK(r.status == 503);
    CHECK(ReasonName(http::StatusFromResponse(r).reason()) == "LIGHTHOUSE_UNREACHABLE");
  }
  std::string down = site.gw.process->WaitForLog("lighthouse_unreachable site=site-a", 5s);
  CHECK_FALSE(down.empty());
  CHECK(site.gw.process->WaitForLog("lighthouse_unreachable", 1s, 2).empty());  // once
  site.lh = StartLighthouse(
      site.dir + "/data",
      {"--token-file", site.dir + "/lh-tokens", "--admin-token-file", site.dir + "/admin-token"},
      site.dir + "/lighthouse.log", site.lh.address);
  CHECK(beat().status == 200);
  CHECK_FALSE(site.gw.process->WaitForLog("lighthouse_reachable site=site-a", 5s).empty());
}

TEST_CASE(
    "a gateway behind a CONNECT proxy: the lighthouse by a name only the proxy resolves, and the "
    "groups go on through the proxy's restart") {
  // base64("user:pass"): the gateway must send its proxy URL's credentials.
  TcpRelay proxy(TcpRelay::ConnectProxy{{{"lighthouse.invalid", "127.0.0.1"}}, "Basic dXNlcjpwYXNz"});
  Site site(&proxy);
  const std::string target = "lighthouse.invalid" + site.lh.address.substr(site.lh.address.rfind(':'));
  const std::string listening = site.gw.process->WaitForLog("gateway_listening", 1s);
  CHECK(listening.find("proxy=http://***@" + proxy.address()) != std::string::npos);
  CHECK(site.gw.process->Log().find("pass@") == std::string::npos);
  std::map<std::string, Group> groups;
  groups["a"] = StartGroup(site, "a", 100000);
  groups["b"] = StartGroup(site, "b", 100000);
  REQUIRE(WaitUntil(
      [&] {
        auto j = JobStatus(site.lh.url(), "t");
        return j.members_size() == 2 && j.committed_step() >= 3;
      },
      60s, "two members committing through the gateway and the proxy"));
  // Nothing on this host resolves the name: every relayed call went through the proxy.
  REQUIRE_FALSE(proxy.Targets().empty());
  for (const auto& t : proxy.Targets()) CHECK(t == target);
  // The proxy restarts: its tunnels close (the long polls relayed in them end) and new
  // connections are turned away; the gateway answers LIGHTHOUSE_UNREACHABLE and the groups go
  // on as in a lighthouse outage.
  proxy.Cut();
  CHECK_FALSE(site.gw.process->WaitForLog("lighthouse_unreachable site=site-a", 30s).empty());
  for (auto& [name, g] : groups) {
    CAPTURE(name);
    CHECK_FALSE(g.agent->WaitForLog("lighthouse_unreachable continuing", 30s).empty());
  }
  const size_t tunnels_before = proxy.Targets().size();
  const uint32_t committed_before = JobStatus(site.lh.url(), "t").committed_step();
  proxy.Mend();
  CHECK(WaitUntil(
      [&] { return JobStatus(site.lh.url(), "t").committed_step() >= committed_before + 3; }, 60s,
      "3 more commits recorded after the proxy came back"));
  CHECK(proxy.Targets().size() > tunnels_before);
  CHECK_FALSE(site.gw.process->WaitForLog("lighthouse_reachable site=site-a", 10s).empty());
  for (auto& [name, g] : groups) {
    CAPTURE(name);
    CHECK(g.agent->Running());
    CHECK(g.trainer->Running());
    CHECK(g.agent->Log().find("group_failed") == std::string::npos);
  }
}

TEST_CASE("a gateway listening beyond loopback without --token-file refuses to start") {
  std::string dir = TempDir("gateway-open");
  Process p({BinDir() + "/lk_gateway", "--site", "s", "--lighthouse", "http://127.0.0.1:9",
             "--listen", "0.0.0.0:0"},
            dir + "/gateway.log");
  auto code = p.Wait(10s);
  REQUIRE(code.has_value());
  CHECK(*code == 2);
  CHECK(p.Log().find("--insecure-no-auth") != std::string::npos);
}

}  // namespace
}  // namespace lk::test
