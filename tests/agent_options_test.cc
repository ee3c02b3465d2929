// AgentOptions::Validate: a complete set passes, and each option out of range is refused with the
// message of the flag that sets it (replica_agent prints it and exits 2). Here rather than beside
// the agent while its internals are rewritten; it needs only agent.h.
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "replica_agent/agent.h"

namespace lk::agent {
namespace {

AgentOptions Complete() {
  AgentOptions o;
  o.job = "job";
  o.group_id = "g0";
  o.socket = "/tmp/agent.sock";
  return o;
}

TEST_CASE("agent options: a complete set passes, each bad one is refused naming its flag") {
  struct Row {
    const char* name;
    std::function<void(AgentOptions&)> change;
    std::string error;
  };
  const Row rows[] = {
      {"no job", [](AgentOptions& o) { o.job.clear(); }, "--job is required"},
      {"no group", [](AgentOptions& o) { o.group_id.clear(); }, "--group-id is required"},
      {"no socket", [](AgentOptions& o) { o.socket.clear(); }, "--socket is required"},
      {"no nodes", [](AgentOptions& o) { o.nodes = 0; }, "--nodes must be at least 1"},
      {"rank at nodes",
       [](AgentOptions& o) {
         o.nodes = 2;
         o.node_rank = 2;
       },
       "--node-rank 2 must be below --nodes 2"},
  };
  CHECK(Complete().Validate().ok());
  for (const Row& row : rows) {
    CAPTURE(row.name);
    AgentOptions o = Complete();
    row.change(o);
    Status st = o.Validate();
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK(st.message() == row.error);
  }
  // The incarnation is the caller's to derive (from Slurm, or at random for one node).
  AgentOptions last = Complete();
  last.nodes = 4;
  last.node_rank = 3;
  last.incarnation.clear();
  CHECK(last.Validate().ok());
}

}  // namespace
}  // namespace lk::agent
