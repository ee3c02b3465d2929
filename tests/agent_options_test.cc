// AgentOptions::Validate: a complete set passes, and each option out of range is refused with the
// message of the flag that sets it (replica_agent prints it and exits 2). Here rather than beside
// the agent while its internals are rewritten; it needs only agent.h.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

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
      {"both a gateway and a lighthouse",
       [](AgentOptions& o) {
         o.gateway = "10.0.0.2:29520";
         o.lighthouse = "http://lh.example:29510";
       },
       "--gateway 10.0.0.2:29520 and --lighthouse http://lh.example:29510 exclude each other: an "
       "agent behind a gateway reaches the lighthouse only through it (the gateway has its own "
       "--lighthouse); drop one"},
      {"no workers", [](AgentOptions& o) { o.workers = 0; }, "--workers must be at least 1"},
      {"a certificate without its key", [](AgentOptions& o) { o.tls_cert_file = "/c.pem"; },
       "--tls-cert-file and --tls-key-file go together"},
      {"a key without its certificate", [](AgentOptions& o) { o.tls_key_file = "/k.pem"; },
       "--tls-cert-file and --tls-key-file go together"},
      {"an open port beyond this host", [](AgentOptions& o) { o.serve = "10.1.2.3:8470"; },
       "--serve 10.1.2.3:8470 reaches beyond this host and there is no --token-file: anyone who "
       "reaches it could read the group's live state. Give --token-file, serve on a loopback "
       "address, or pass --insecure-no-auth to serve open on purpose"},
      {"every address, no advertise",
       [](AgentOptions& o) {
         o.serve = "0.0.0.0:0";
         o.token_file = "/token";
       },
       "--serve 0.0.0.0:0 listens on every address of the host, which cannot be given to peers: "
       "add --advertise HOST:PORT, or an interface name (--advertise ib0) whose address peers "
       "reach"},
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
  // The peer port: on loopback open, beyond it with a token or on purpose, on every address
  // with an address to give peers.
  for (auto change : std::vector<std::function<void(AgentOptions&)>>{
           [](AgentOptions& o) { o.serve = "127.0.0.1:0"; },
           [](AgentOptions& o) {
             o.serve = "10.1.2.3:8470";
             o.token_file = "/token";
           },
           [](AgentOptions& o) {
             o.serve = "10.1.2.3:8470";
             o.insecure_no_auth = true;
           },
           [](AgentOptions& o) {
             o.serve = "0.0.0.0:8470";
             o.token_file = "/token";
             o.advertise = "ib0";
           },
           [](AgentOptions& o) {
             o.tls_cert_file = "/c.pem";
             o.tls_key_file = "/k.pem";
           }}) {
    AgentOptions o = Complete();
    change(o);
    CHECK(o.Validate().ok());
  }
  // Where the lighthouse calls go: the gateway (as a URL), else the lighthouse or its default.
  AgentOptions via = Complete();
  via.gateway = "10.0.0.2:29520";
  CHECK(via.Validate().ok());
  CHECK(via.LighthouseUrl() == "http://10.0.0.2:29520");
  via.gateway = "https://gw.site:29520";
  CHECK(via.LighthouseUrl() == "https://gw.site:29520");
  CHECK(Complete().LighthouseUrl() == kDefaultLighthouse);
  via = Complete();
  via.lighthouse = "http://lh:1";
  CHECK(via.LighthouseUrl() == "http://lh:1");
  // The incarnation is the caller's to derive (from Slurm, or at random for one node).
  AgentOptions last = Complete();
  last.nodes = 4;
  last.node_rank = 3;
  last.incarnation.clear();
  CHECK(last.Validate().ok());
}

}  // namespace
}  // namespace lk::agent
