// The replica agent's Unix-socket routes (the trainer API, agent_listeners.cc TrainerRoute) as a
// trainer calls them: whole requests with peer credentials (the trainer child's, none, or
// another uid's) through the real route table and handlers, with the agent's threads and a real
// lighthouse behind them (agent_fixture.h).
// Invariants (besides route_fuzz.h's): a poll or a notice may stay held (long-polls, answered
// in a later input or when the agent stops, once); every other request is answered; a refusal
// carries its reason code; a refused request (4xx) changes neither the node's committed step
// nor its trainer count.
#include <unistd.h>

#include "fuzz/agent_fixture.h"
#include "fuzz/route_fuzz.h"

namespace {

using namespace lk;

const fuzz::RouteTables& Tables() {
  // The Authorization slot chooses the peer credentials here (see CredentialsFor).
  static const fuzz::RouteTables t{
      {"/v1/trainer/hello", "/v1/trainer/poll", "/v1/trainer/goodbye", "/v1/trainer/checkpoint",
       "/v1/trainer/phase", "/v1/trainer/commit", "/v1/trainer/notice", "/v1/trainer/kv/",
       "/v1/trainer/kv/1/", "/v1/agent/status", "/healthz", "", "/v1/trainer/",
       "/v1/shards/checkpoints"},
      {"", "", "", "", "", "", "", ""}};
  return t;
}

// The trainer's credentials, or none (choice 6), or another uid's (7).
std::optional<http::PeerCredentials> CredentialsFor(fuzz::AgentFixture& f, uint8_t b0) {
  uint32_t choice = (b0 >> 3) & 7;
  if (choice == 6) return std::nullopt;
  http::PeerCredentials c = f.TrainerCredentials();
  if (choice == 7) c.uid += 1;
  return c;
}

// The node's state a refusal must leave alone: "committed_step":N and "trainers":N of
// /v1/agent/status.
std::string NodeState(fuzz::AgentFixture& f) {
  http::Request req;
  req.method = "GET";
  req.path = "/v1/agent/status";
  req.credentials = CredentialsFor(f, 0);
  auto a = fuzz::Drive(f.ioc(), f.trainer(), std::move(req));
  std::lock_guard<std::mutex> lock(a->mu);
  if (a->calls == 0) return "stopped";
  const std::string& b = a->response.body;
  auto field = [&b](std::string_view name) {
    auto at = b.find(name);
    return at == std::string::npos ? std::string() : b.substr(at, b.find(',', at) - at);
  };
  return field("\"committed_step\":") + field("\"trainers\":");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::AgentFixture& f = fuzz::AgentFixture::Get();
  http::Request req = fuzz::DecodeRequest(data, size, Tables());
  req.credentials = CredentialsFor(f, size > 0 ? data[0] : 0);
  // Long-polls end within the input: a wait asked for is cut to 20 ms.
  if (auto t = req.query.find("timeout_ms"); t != req.query.end()) {
    auto ms = http::ParseU32(req.query, "timeout_ms", 0);
    if (ms.ok() && *ms > 20) t->second = "20";
  }
  bool may_hold = req.path == "/v1/trainer/poll" || req.path == "/v1/trainer/notice";
  std::string what = req.method + " " + req.path;
  std::string before = NodeState(f);
  auto a = fuzz::Drive(f.ioc(), f.trainer(), std::move(req), std::chrono::seconds(10), may_hold);
  int status = 0;
  {
    std::lock_guard<std::mutex> lock(a->mu);
    status = a->calls ? a->response.status : 0;
    if (a->calls) fuzz::CheckReasonCode(a->response, what);
  }
  if (status >= 400 && status < 500 && !f.ioc().stopped()) {
    std::string after = NodeState(f);
    LK_CHECK(after == before) << "refused (" << status << ") but the node changed: " << what
                              << " " << before << " -> " << after;
  }
  f.ReplaceIfFinished();
  return 0;
}
