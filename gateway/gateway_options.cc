// GatewayOptions::Validate: the refusals of lk_gateway's flags, apart from the binary so that
// main stays parse, validate, log, run, and a table test can check each one.
#include "common/http/tokens.h"
#include "gateway/gateway.h"

namespace lk::gateway {

Status GatewayOptions::Validate() const {
  if (site.empty()) return InvalidArgument("--site is required (this site's name, e.g. alps)");
  LK_RETURN_IF_ERROR(http::ValidName("--site", site));
  if (lighthouse.empty()) {
    return InvalidArgument("--lighthouse is required (the lighthouse's URL, http://HOST:PORT)");
  }
  if (listen.empty()) return InvalidArgument("--listen is required (HOST:PORT)");
  if (http.tls_cert_file.empty() != http.tls_key_file.empty()) {
    return InvalidArgument("--tls-cert-file and --tls-key-file go together");
  }
  if (relays_max == 0) return InvalidArgument("--relays-max must be at least 1");
  if (http.body_bytes_max == 0) return InvalidArgument("--body-bytes-max must be positive");
  // An open gateway speaks for every job to the lighthouse: only on this host or on purpose.
  if (token_file.empty() && !insecure_no_auth && !http::ListensOnLoopback(listen)) {
    return InvalidArgument(
        "--listen {} reaches beyond this host and there is no --token-file: anyone who reaches "
        "it could act for every job through this gateway. Give --token-file (the jobs it relays "
        "for, 'JOB TOKEN' lines), listen on a loopback address, or pass --insecure-no-auth to "
        "relay open on purpose",
        listen);
  }
  if (!wan_listen.empty() && token_file.empty() && !insecure_no_auth &&
      !http::ListensOnLoopback(wan_listen)) {
    return InvalidArgument(
        "--wan-listen {} reaches beyond this host and there is no --token-file: any gateway "
        "could join this site's rounds. Give --token-file, or pass --insecure-no-auth",
        wan_listen);
  }
  if (!wan_advertise.empty() && wan_listen.empty()) {
    return InvalidArgument("--wan-advertise {} needs --wan-listen (what it advertises)",
                           wan_advertise);
  }
  if (!wan_advertise.empty() && http::ListensOnUnspecified(wan_advertise)) {
    return InvalidArgument(
        "--wan-advertise {} is every address of the host: give the address the other sites "
        "dial",
        wan_advertise);
  }
  if (exchange_bytes_max == 0) return InvalidArgument("--exchange-bytes-max must be positive");
  return Status::Ok();
}

}  // namespace lk::gateway
