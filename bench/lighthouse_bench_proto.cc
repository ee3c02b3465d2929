#include "bench/lighthouse_bench_proto.h"

#include "common/proto/lightkeeper.pb.h"

namespace lk::bench {

namespace pb = lightkeeper::v1;

namespace {
constexpr const char* kIncarnation = "inc-1";
constexpr const char* kAddress = "127.0.0.1:29600";

// The fields every simulated agent sends alike: a one-node group of one incarnation.
template <class Msg>
Msg AgentMessage(const std::string& job, const std::string& group, uint32_t step) {
  Msg r;
  r.set_job(job);
  r.set_group_id(group);
  r.set_incarnation(kIncarnation);
  r.set_node_rank(0);
  r.set_nodes(1);
  r.set_step(step);
  r.set_address(kAddress);
  return r;
}
}  // namespace

std::string HeartbeatBody(const std::string& job, const std::string& group, uint32_t step) {
  auto r = AgentMessage<pb::HeartbeatRequest>(job, group, step);
  r.set_phase("inner");
  return r.SerializeAsString();
}

std::string QuorumBody(const std::string& job, const std::string& group, uint32_t step) {
  auto r = AgentMessage<pb::QuorumRequest>(job, group, step);
  // Longer than any bound of the load generator: a slow answer is measured, never a 504.
  r.set_timeout_ms(60'000);
  r.set_compact(true);  // as replica_agent asks
  return r.SerializeAsString();
}

std::string ForgetBody(const std::string& job) {
  pb::ForgetRequest r;
  r.set_job(job);
  return r.SerializeAsString();
}

size_t CountParticipants(const std::string& status_body) {
  pb::StatusResponse s;
  if (!s.ParseFromString(status_body)) return 0;
  size_t n = 0;
  for (const auto& j : s.jobs()) {
    for (const auto& g : j.groups()) n += g.participant() ? 1 : 0;
  }
  return n;
}

std::optional<QuorumSummary> ParseQuorum(const std::string& body) {
  pb::QuorumResponse q;
  if (!q.ParseFromString(body)) return std::nullopt;
  return QuorumSummary{q.quorum_id(), static_cast<size_t>(q.replica_world_size()), q.replica_rank(),
                       q.reason()};
}

}  // namespace lk::bench
