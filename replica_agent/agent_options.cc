// AgentOptions::Validate: the refusals of replica_agent's flags, apart from the binary so that
// main stays parse, validate, log, run.
#include "replica_agent/agent.h"

namespace lk::agent {

Status AgentOptions::Validate() const {
  if (job.empty()) return InvalidArgument("--job is required");
  if (group_id.empty()) return InvalidArgument("--group-id is required");
  if (socket.empty()) return InvalidArgument("--socket is required");
  if (nodes == 0) return InvalidArgument("--nodes must be at least 1");
  if (node_rank >= nodes) {
    return InvalidArgument("--node-rank {} must be below --nodes {}", node_rank, nodes);
  }
  return Status::Ok();
}

}  // namespace lk::agent
