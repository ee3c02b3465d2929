// What lk_gateway relays and for whom: the agents' lighthouse routes, the job each call acts for
// (read from its body, its query or its path, as the lighthouse reads it), how long it may wait
// there (long polls), and whether the call's bearer token covers that job. The gateway decides
// all of it before a byte goes out, so a refused call never reaches the lighthouse.
// Thread-safety: pure functions.
#pragma once

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

#include <string>

#include "common/http/http.h"
#include "common/http/tokens.h"

namespace lk::gateway {

struct RelayCall {
  std::string job;
  // How long the lighthouse may hold the call before it answers (its timeout_ms): zero for a
  // call that is answered at once.
  Millis long_poll{0};
};

// The job and wait of an agent's call, or the refusal: kNotFound (NO_ENDPOINT) for a route the
// gateway does not relay (admin calls, /status, /metrics, anything unknown), kInvalidArgument
// (METHOD_NOT_ALLOWED or BAD_REQUEST) for a wrong method or a body, job name or timeout that does
// not parse. `quorum_wait_default` is the lighthouse's wait for a /v1/quorum ask without
// timeout_ms.
Result<RelayCall> ClassifyCall(const http::Request& req, Millis quorum_wait_default);

// Whether the request's bearer token may act for `job`: a "JOB TOKEN" line of that job or a bare
// (all-jobs) token. Refusals as the lighthouse words them: 401 TOKEN_MISSING, 401 TOKEN_INVALID
// (unknown, or a job token for another job), 403 ROLE_FORBIDS (a read-only token). With tokens
// off, every call passes. Every token is compared, in constant time.
Status AuthorizeCall(const http::Tokens& tokens, const http::Request& req, const std::string& job);

// The request target to send upstream: the decoded path and query encoded again.
std::string UpstreamTarget(const http::Request& req);

}  // namespace lk::gateway
