// The lighthouse's /status as JSON with the fields that change on their own between two calls
// (uptime, heartbeat ages) cleared, so that a test can check that a refused request left the
// state exactly as it was. Test-only, header-only; include after doctest.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"

namespace lk::test {

inline std::string StatusJson(http::Client& c) {
  auto r = c.Do("GET", "/status");
  REQUIRE(r.ok());
  REQUIRE(r->status == 200);
  lightkeeper::v1::StatusResponse st;
  REQUIRE(http::Decode(r->body, http::Format::kJson, &st).ok());
  st.clear_uptime_s();
  for (auto& j : *st.mutable_jobs()) {
    for (auto& g : *j.mutable_groups()) g.clear_heartbeat_age_ms();
  }
  return http::ToJson(st);
}

// Job `job`'s part of /status at `url` (no token), or an empty JobStatus while the lighthouse
// does not answer (tests poll it with a deadline, also across a restart).
inline lightkeeper::v1::JobStatus JobStatusAt(const std::string& url, const std::string& job) {
  auto c = http::Client::Create(url);
  REQUIRE(c.ok());
  auto r = (*c)->Do("GET", "/status?job=" + job, "", "", Millis(3000));
  lightkeeper::v1::StatusResponse st;
  if (r.ok() && r->status == 200) (void)http::Decode(r->body, http::Format::kJson, &st);
  return st.jobs().empty() ? lightkeeper::v1::JobStatus() : st.jobs(0);
}

}  // namespace lk::test
