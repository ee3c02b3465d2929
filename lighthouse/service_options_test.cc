// ServiceOptions::Validate: the defaults pass, and each option out of range is refused with the
// message of the flag that sets it (the lighthouse prints it and exits 2).
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "lighthouse/service.h"

namespace lk::lighthouse {
namespace {

TEST_CASE("service options: the defaults pass, each bad one is refused naming its flag") {
  struct Row {
    const char* name;
    std::function<void(ServiceOptions&)> change;
    std::string error;
  };
  const Row rows[] = {
      {"quorum-id-block 0", [](ServiceOptions& o) { o.quorum_id_block = 0; },
       "--quorum-id-block must be at least 1"},
      {"min-replicas 0", [](ServiceOptions& o) { o.core.min_replicas = 0; },
       "--min-replicas must be at least 1"},
      {"heartbeat-timeout 0", [](ServiceOptions& o) { o.core.heartbeat_timeout = Millis(0); },
       "--heartbeat-timeout-ms must be > 0"},
      {"body-bytes-max 0", [](ServiceOptions& o) { o.http.body_bytes_max = 0; },
       "--body-bytes-max must be > 0"},
      {"request buffer below 64 KiB",
       [](ServiceOptions& o) { o.http.request_buffer_bytes_max = (64 << 10) - 1; },
       "--request-buffer-bytes-max must be at least 65536"},
      {"jobs-max 0", [](ServiceOptions& o) { o.core.jobs_max = 0; },
       "--jobs-max must be at least 1"},
      {"cert without key", [](ServiceOptions& o) { o.http.tls_cert_file = "c.pem"; },
       "--tls-cert-file and --tls-key-file go together"},
      {"key without cert", [](ServiceOptions& o) { o.http.tls_key_file = "k.pem"; },
       "--tls-cert-file and --tls-key-file go together"},
      // No flag sets these: the core's own check speaks.
      {"negative group grace", [](ServiceOptions& o) { o.core.group_grace = Millis(-1); },
       "group_grace must not be negative"},
  };
  CHECK(ServiceOptions().Validate().ok());
  for (const Row& row : rows) {
    CAPTURE(row.name);
    ServiceOptions o;
    row.change(o);
    Status st = o.Validate();
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK(st.message() == row.error);
  }
  ServiceOptions exact;
  exact.http.request_buffer_bytes_max = 64 << 10;
  exact.http.tls_cert_file = "c.pem";
  exact.http.tls_key_file = "k.pem";
  CHECK(exact.Validate().ok());
}

}  // namespace
}  // namespace lk::lighthouse
