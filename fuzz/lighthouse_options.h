// The lighthouse that lighthouse_routes fuzzes and gateway_routes relays to: in process, on
// loopback, over the in-memory state store. Every long poll ends at once, so a request is
// answered within its input, and nothing times out on its own between two inputs (groups, joins
// and their grace last an hour). State carries over from input to input within small limits
// (jobs, groups, nodes, checkpoints, KV keys) that keep it bounded and make those refusals
// reachable.
#pragma once

#include <string>

#include "lighthouse/service.h"

namespace lk::fuzz {

inline lighthouse::ServiceOptions FuzzedLighthouseOptions(const std::string& token_file,
                                                          const std::string& admin_token_file) {
  lighthouse::ServiceOptions o;
  o.bind = "127.0.0.1:0";
  o.token_file = token_file;
  o.admin_token_file = admin_token_file;
  o.http.single_thread = true;
  o.long_poll_max = Millis(0);
  o.quorum_wait_default = Millis(0);
  o.core.heartbeat_timeout = Millis(3'600'000);
  o.core.join_timeout = Millis(3'600'000);
  o.core.group_grace = Millis(3'600'000);
  o.core.jobs_max = 8;
  o.core.groups_per_job_max = 16;
  o.core.nodes_max = 8;
  o.core.checkpoints_per_job_max = 8;
  o.kv_keys_per_job_max = 16;
  return o;
}

}  // namespace lk::fuzz
