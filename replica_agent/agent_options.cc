// AgentOptions::Validate: the refusals of replica_agent's flags, apart from the binary so that
// main stays parse, validate, log, run.
#include "replica_agent/agent.h"

#include "common/http/server.h"

namespace lk::agent {

Status AgentOptions::Validate() const {
  if (job.empty()) return InvalidArgument("--job is required");
  if (group_id.empty()) return InvalidArgument("--group-id is required");
  if (socket.empty()) return InvalidArgument("--socket is required");
  if (nodes == 0) return InvalidArgument("--nodes must be at least 1");
  if (node_rank >= nodes) {
    return InvalidArgument("--node-rank {} must be below --nodes {}", node_rank, nodes);
  }
  if (!gateway.empty() && !lighthouse.empty()) {
    return InvalidArgument(
        "--gateway {} and --lighthouse {} exclude each other: an agent behind a gateway reaches "
        "the lighthouse only through it (the gateway has its own --lighthouse); drop one",
        gateway, lighthouse);
  }
  if (workers == 0) return InvalidArgument("--workers must be at least 1");
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return InvalidArgument("--tls-cert-file and --tls-key-file go together");
  }
  if (serve.empty()) return Status::Ok();
  // The peer port serves the group's live state: open to anyone only on this host or on purpose.
  if (token_file.empty() && !insecure_no_auth && !http::ListensOnLoopback(serve)) {
    return InvalidArgument(
        "--serve {} reaches beyond this host and there is no --token-file: anyone who reaches "
        "it could read the group's live state. Give --token-file, serve on a loopback "
        "address, or pass --insecure-no-auth to serve open on purpose",
        serve);
  }
  // Peers are given the advertised address: an unspecified one (0.0.0.0) reaches nobody.
  if (advertise.empty() && http::ListensOnUnspecified(serve)) {
    return InvalidArgument(
        "--serve {} listens on every address of the host, which cannot be given to peers: add "
        "--advertise HOST:PORT, or an interface name (--advertise ib0) whose address peers "
        "reach",
        serve);
  }
  return Status::Ok();
}

std::string AgentOptions::LighthouseUrl() const {
  if (!gateway.empty()) {
    return gateway.find("://") == std::string::npos ? "http://" + gateway : gateway;
  }
  return lighthouse.empty() ? std::string(kDefaultLighthouse) : lighthouse;
}

}  // namespace lk::agent
