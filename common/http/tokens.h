// The token file every Lightkeeper daemon that checks bearer tokens reads (the lighthouse, and
// lk_gateway for the jobs it relays), and the name alphabet of jobs, groups and incarnations:
// one parser, so that a file means the same to every process that reads it.
// Thread-safety: pure functions over plain values.
#pragma once

#include <lightkeeper/status.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace lk::http {

constexpr size_t kNameBytesMax = 128;

// Job, group and incarnation names go into RocksDB keys, logs and metric labels: keep them to a
// safe alphabet ([A-Za-z0-9-_.:@+]), and never '/', which separates key parts.
Status ValidName(std::string_view what, std::string_view v, size_t max = kNameBytesMax);

// The tokens of a token file, by role. `enabled` is false when no file was given (auth off).
struct Tokens {
  bool enabled = false;
  std::vector<std::string> any_job;
  std::vector<std::string> read_only;
  std::map<std::string, std::vector<std::string>> per_job;
  // lk_gateway credentials (role=gateway): they vouch for the site in a call's Lk-Gateway
  // header and may do nothing else (no job, no read).
  std::vector<std::string> gateway;
  std::string admin;
};

// Reads the job token file and the admin token file (either may be empty; both empty leaves
// auth off). The token file has one token per line (blank lines and '#' comments skipped):
//   TOKEN                 an all-jobs token
//   JOB TOKEN             a token for JOB only
//   role=read-only TOKEN  a read-only token (/status and /metrics of every job)
//   role=all-jobs TOKEN   the same as a bare TOKEN
//   role=gateway TOKEN    an lk_gateway's credential (Tokens::gateway)
// "role=" cannot start a job name ('=' is outside the name alphabet), so the forms never clash.
Result<Tokens> LoadTokens(const std::string& token_file, const std::string& admin_file);

}  // namespace lk::http
