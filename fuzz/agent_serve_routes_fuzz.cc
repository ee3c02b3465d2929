// The replica agent's --serve routes (agent_listeners.cc PeerRoute: /healthz, the token-guarded
// /v1/agent/status and the shard reads of a heal over a served directory holding a real
// checkpoint), as a peer on the network sends them: whole requests with any token, Range
// header included, through the real route table and the shard server (agent_fixture.h).
// Invariants (besides route_fuzz.h's): every request is answered; nothing but /healthz is
// answered 2xx without the job's token; no trainer route is reachable.
#include "fuzz/agent_fixture.h"
#include "fuzz/route_fuzz.h"

namespace {

using namespace lk;

const fuzz::RouteTables& Tables() {
  static const fuzz::RouteTables t{
      {"/healthz", "/v1/agent/status", "/v1/shards/checkpoints", "/v1/shards/files/",
       "/v1/shards/files/rank-00000/step-000000000003/", "/v1/shards/", "/v1/trainer/hello",
       "/v1/trainer/kv/1/", "", "/v1/shards/files/rank-00000/"},
      {"", "Bearer secret-j", "Bearer wrong", "secret-j", "Bearer ", "bearer secret-j",
       "Bearer secret-j ", "Basic c2VjcmV0LWo="}};
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::AgentFixture& f = fuzz::AgentFixture::Get();
  http::Request req = fuzz::DecodeRequest(data, size, Tables());
  // The Range header of a shard read: the query line's "range=" parameter, when there is one.
  if (auto r = req.query.find("range"); r != req.query.end()) req.range = r->second;
  req.file_body_ok = false;
  bool token = req.authorization == "Bearer secret-j";
  bool healthz = req.path == "/healthz";
  bool trainer_api = req.path.rfind("/v1/trainer/", 0) == 0;
  std::string what = req.method + " " + req.path;
  auto a = fuzz::Drive(f.ioc(), f.peer(), std::move(req), std::chrono::seconds(10));
  std::lock_guard<std::mutex> lock(a->mu);
  if (a->calls == 1) {
    int status = a->response.status;
    LK_CHECK(status >= 300 || token || healthz) << "answered " << status << " without the token: "
                                                << what;
    LK_CHECK(!trainer_api || status == 404) << "a trainer route on --serve: " << what;
  }
  return 0;
}
