// The gateway's edge: which calls it relays, for which job, and with which token (relay_rules.h).
#include "gateway/relay_rules.h"

#include <algorithm>

#include "common/http/auth.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"

namespace lk::gateway {
namespace {

namespace pb = lightkeeper::v1;

// The job of a POST whose body is `Msg` (every agent report names its job in field 1).
template <class Msg>
Result<std::string> JobOfBody(const http::Request& req, Msg* msg) {
  LK_RETURN_IF_ERROR(http::Decode(req.body, http::BodyFormat(req.content_type), msg));
  return msg->job();
}

Status WrongMethod(const http::Request& req) {
  return Refuse(Code::kInvalidArgument, Reason::kMethodNotAllowed, "{} does not accept {}",
                req.path, req.method);
}

Result<Millis> QueryWait(const http::Request& req, Millis max) {
  LK_ASSIGN_OR_RETURN(uint32_t ms, http::ParseU32(req.query, "timeout_ms", 30'000));
  return std::min(Millis(ms), max);
}

Result<RelayCall> Classify(const http::Request& req, Millis quorum_wait_default) {
  const std::string& p = req.path;
  const bool post = req.method == "POST";
  const bool get = req.method == "GET";
  RelayCall call;
  if (p == "/v1/heartbeat" || p == "/v1/leave" || p == "/v1/commit" || p == "/v1/event" ||
      p == "/v1/quorum") {
    if (!post) return WrongMethod(req);
    if (p == "/v1/heartbeat") {
      pb::HeartbeatRequest m;
      LK_ASSIGN_OR_RETURN(call.job, JobOfBody(req, &m));
    } else if (p == "/v1/leave") {
      pb::LeaveRequest m;
      LK_ASSIGN_OR_RETURN(call.job, JobOfBody(req, &m));
    } else if (p == "/v1/commit") {
      pb::CommitRequest m;
      LK_ASSIGN_OR_RETURN(call.job, JobOfBody(req, &m));
    } else if (p == "/v1/event") {
      pb::GroupEventRequest m;
      LK_ASSIGN_OR_RETURN(call.job, JobOfBody(req, &m));
    } else {
      pb::QuorumRequest m;
      LK_ASSIGN_OR_RETURN(call.job, JobOfBody(req, &m));
      call.long_poll = m.timeout_ms() == 0 ? quorum_wait_default : Millis(m.timeout_ms());
    }
    return call;
  }
  if (p == "/v1/watch") {
    if (!get) return WrongMethod(req);
    auto it = req.query.find("job");
    call.job = it == req.query.end() ? "" : it->second;
    LK_ASSIGN_OR_RETURN(call.long_poll, QueryWait(req, Millis::max()));
    return call;
  }
  if (p == "/v1/checkpoints") {
    if (post) {
      pb::CheckpointInfo m;
      LK_ASSIGN_OR_RETURN(call.job, JobOfBody(req, &m));
      return call;
    }
    if (!get) return WrongMethod(req);
    auto it = req.query.find("job");
    call.job = it == req.query.end() ? "" : it->second;
    return call;
  }
  if (p.rfind("/v1/kv/", 0) == 0) {
    // /v1/kv/JOB/QUORUM_ID/KEY: the job is the first segment, as the lighthouse reads it.
    if (!get && req.method != "PUT") return WrongMethod(req);
    std::string_view rest = std::string_view(p).substr(7);
    call.job = std::string(rest.substr(0, rest.find('/')));
    if (get) {
      LK_ASSIGN_OR_RETURN(call.long_poll, QueryWait(req, Millis::max()));
    }
    return call;
  }
  return Refuse(Code::kNotFound, Reason::kNoEndpoint,
                "no endpoint {} at lk_gateway: it relays only the agents' lighthouse calls", p);
}

}  // namespace

Result<RelayCall> ClassifyCall(const http::Request& req, Millis quorum_wait_default) {
  auto call = Classify(req, quorum_wait_default);
  Status st = call.ok() ? http::ValidName("job", call->job) : call.status();
  if (st.ok()) return call;
  // Every refusal names its reason, in the answer and in the gateway's log line.
  return st.reason() == Reason::kUnspecified ? st.WithReason(DefaultReason(st.code())) : st;
}

Status AuthorizeCall(const http::Tokens& tokens, const http::Request& req, const std::string& job) {
  if (!tokens.enabled) return Status::Ok();
  std::string_view tok = http::BearerToken(req.authorization);
  if (tok.empty()) {
    return Refuse(Code::kUnauthenticated, Reason::kTokenMissing,
                  "missing Authorization: Bearer token");
  }
  bool all = false, mine = false, read = false;
  for (const auto& t : tokens.any_job) all |= http::ConstantTimeEquals(tok, t);
  for (const auto& t : tokens.read_only) read |= http::ConstantTimeEquals(tok, t);
  for (const auto& [name, list] : tokens.per_job) {
    bool hit = false;
    for (const auto& t : list) hit |= http::ConstantTimeEquals(tok, t);
    if (name == job) mine |= hit;
  }
  if (all || mine) return Status::Ok();
  if (read) {
    return Refuse(Code::kPermissionDenied, Reason::kRoleForbids,
                  "this token's role (read-only) may not do this");
  }
  return Refuse(Code::kUnauthenticated, Reason::kTokenInvalid,
                "token not valid for job {} at this gateway", job);
}

std::string UpstreamTarget(const http::Request& req) {
  std::string t = http::PercentEncodePath(req.path);
  char sep = '?';
  for (const auto& [k, v] : req.query) {
    t += sep;
    t += http::PercentEncode(k);
    t += '=';
    t += http::PercentEncode(v);
    sep = '&';
  }
  return t;
}

}  // namespace lk::gateway
