// The lighthouse's edge checks: the names an agent's request carries, the role a bearer token
// has for a job, and the refusal (401 or 403, with a reason code) of a token too weak. The name
// alphabet and the token file's parser are common/http/tokens.h, shared with lk_gateway.
#include "lighthouse/service_impl.h"

namespace lk::lighthouse {

namespace service_internal {

Status ValidAgent(std::string_view job, std::string_view group, std::string_view inc) {
  LK_RETURN_IF_ERROR(ValidName("job", job));
  LK_RETURN_IF_ERROR(ValidName("group_id", group));
  return ValidName("incarnation", inc);
}

}  // namespace service_internal

// The strongest role the request's token has for `job` ("" for no job in particular).
// Every candidate is compared, so the time taken does not depend on which one matched.
Role Service::Impl::RoleFor(const Request& req, const std::string& job, bool* other_job) const {
  if (!tokens.enabled) return Role::kAdmin;
  std::string_view tok = http::BearerToken(req.authorization);
  if (tok.empty()) return Role::kNone;
  bool admin = !tokens.admin.empty() && http::ConstantTimeEquals(tok, tokens.admin);
  bool all = false, mine = false, other = false, read = false;
  for (const auto& t : tokens.any_job) all |= http::ConstantTimeEquals(tok, t);
  for (const auto& t : tokens.read_only) read |= http::ConstantTimeEquals(tok, t);
  for (const auto& [name, list] : tokens.per_job) {
    bool hit = false;
    for (const auto& t : list) hit |= http::ConstantTimeEquals(tok, t);
    if (name == job) mine |= hit;
    else other |= hit;
  }
  if (other_job != nullptr) *other_job = other;
  return admin ? Role::kAdmin
         : all ? Role::kAllJobs
         : mine ? Role::kJob
         : read ? Role::kReadOnly
                : Role::kNone;
}
// The refusal of a request whose token has no role for it (401) or a role too weak (403).
Status Service::Impl::Unauthorized(const Request& req, const std::string& job, Role role) const {
  if (http::BearerToken(req.authorization).empty()) {
    return Refuse(Code::kUnauthenticated, Reason::kTokenMissing,
                  "missing Authorization: Bearer token");
  }
  if (role == Role::kNone) {
    return job.empty() ? Refuse(Code::kUnauthenticated, Reason::kTokenInvalid, "unknown token")
                       : Refuse(Code::kUnauthenticated, Reason::kTokenInvalid,
                                "token not valid for job {}", job);
  }
  return Refuse(Code::kPermissionDenied, Reason::kRoleForbids,
                "this token's role ({}) may not do this", RoleName(role));
}
std::string_view Service::Impl::RoleName(Role r) {
  switch (r) {
    case Role::kNone: return "none";
    case Role::kReadOnly: return "read-only";
    case Role::kJob: return "job";
    case Role::kAllJobs: return "all-jobs";
    case Role::kAdmin: return "admin";
  }
  return "none";
}
// Whether the token may see `job` in /status (every role but a job token for another job).
bool Service::Impl::TokenSeesJob(const Request& req, const std::string& job) const {
  return RoleFor(req, job) != Role::kNone;
}
// A call that acts for `job` (agents' calls, KV, checkpoint registration, watch).
Status Service::Impl::RequireJob(const Request& req, const std::string& job) const {
  Role role = RoleFor(req, job);
  if (role == Role::kJob || role == Role::kAllJobs || role == Role::kAdmin) return Status::Ok();
  return Unauthorized(req, job, role);
}
Result<std::string> Service::Impl::GatewayOf(const Request& req) const {
  if (req.gateway.empty()) return std::string();
  std::string_view v = req.gateway;
  auto space = v.find(' ');
  std::string_view tok = v.substr(0, space);
  std::string site(space == std::string_view::npos ? "" : v.substr(space + 1));
  LK_RETURN_IF_ERROR(ValidName("Lk-Gateway site", site));
  if (!tokens.enabled) return site;  // no auth: every claim is taken, as every token is
  bool known = false;
  for (const auto& t : tokens.gateway) known |= http::ConstantTimeEquals(tok, t);
  if (!known) {
    return Refuse(Code::kUnauthenticated, Reason::kTokenInvalid,
                  "Lk-Gateway credential is no role=gateway token of this lighthouse");
  }
  return site;
}
// A read of `job` that changes nothing (the checkpoint list): the read-only role may.
Status Service::Impl::RequireRead(const Request& req, const std::string& job) const {
  Role role = RoleFor(req, job);
  if (role != Role::kNone) return Status::Ok();
  return Unauthorized(req, job, role);
}
// /metrics covers every job: admin, all-jobs and read-only tokens; a job token is refused.
Status Service::Impl::RequireAllJobsRead(const Request& req) const {
  Role role = RoleFor(req, "");
  if (role == Role::kReadOnly || role == Role::kAllJobs || role == Role::kAdmin) {
    return Status::Ok();
  }
  bool other = false;
  (void)RoleFor(req, "", &other);
  return Unauthorized(req, "", other ? Role::kJob : role);
}
Status Service::Impl::RequireAdmin(const Request& req) const {
  Role role = RoleFor(req, "");
  if (role == Role::kAdmin) return Status::Ok();
  if (tokens.admin.empty()) {
    return Refuse(Code::kPermissionDenied, Reason::kAdminDisabled,
                  "admin calls need --admin-token-file on the lighthouse");
  }
  if (role == Role::kNone) {
    return http::BearerToken(req.authorization).empty()
               ? Refuse(Code::kUnauthenticated, Reason::kTokenMissing, "admin token required")
               : Refuse(Code::kUnauthenticated, Reason::kTokenInvalid, "admin token required");
  }
  return Refuse(Code::kPermissionDenied, Reason::kRoleForbids,
                "admin token required; this token's role is {}", RoleName(role));
}

}  // namespace lk::lighthouse
