// Request bodies and answer summaries of the lighthouse's wire protocol, as the load generator
// needs them: binary protobuf, the format replica_agent uses.
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace lk::bench {

inline constexpr std::string_view kProtoType = "application/x-protobuf";

// One-node groups, incarnation "inc-1", with a shard-server address as a real agent has.
std::string HeartbeatBody(const std::string& job, const std::string& group, uint32_t step);
std::string QuorumBody(const std::string& job, const std::string& group, uint32_t step);
std::string ForgetBody(const std::string& job);

// Groups of a StatusResponse (one job) that asked for the quorum.
size_t CountParticipants(const std::string& status_body);

struct QuorumSummary {
  uint32_t quorum_id = 0;
  size_t members = 0;
  uint32_t replica_rank = 0;
  std::string reason;
};
std::optional<QuorumSummary> ParseQuorum(const std::string& body);

}  // namespace lk::bench
