// Private to the lighthouse service: the state behind Service and the declarations its parts
// share. Each concern lives in a file of its own:
//   service.cc          lifecycle: load the state, listen, answer every waiter at shutdown
//   service_routes.cc   the HTTP routes: decode and check at the edge, call the core
//   service_tokens.cc   the token file, roles and the refusals of a token too weak
//   service_effects.cc  the core's effects applied in order (persist, answers, log), the tick
//   service_waiters.cc  the long-poll waiters of /v1/quorum and /v1/watch
//   service_kv.cc       the rendezvous store: its route, epochs and collection
// Thread-safety: everything here runs on the service's one io_context thread.
#pragma once

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <map>
#include <optional>
#include <set>

#include "common/http/auth.h"
#include "common/http/codec.h"
#include "common/http/tokens.h"
#include "common/log.h"
#include "lighthouse/convert.h"
#include "lighthouse/dashboard.h"
#include "lighthouse/metrics.h"
#include "lighthouse/service.h"

namespace lk::lighthouse {

namespace asio = boost::asio;
namespace pb = lightkeeper::v1;
using http::Format;
using http::Request;
using http::Responder;
using http::Response;

namespace service_internal {

using http::kNameBytesMax;
constexpr size_t kKvKeyBytesMax = 256;

using http::ValidName;
Status ValidAgent(std::string_view job, std::string_view group, std::string_view inc);

using http::ParseU32;

// What a bearer token may do. Read-only sees every job's /status and /metrics and changes
// nothing; a job token speaks for its one job; an all-jobs token for every job; admin for all.
enum class Role { kNone, kReadOnly, kJob, kAllJobs, kAdmin };

using http::Tokens;
using http::LoadTokens;

}  // namespace service_internal

using namespace service_internal;  // NOLINT


struct Service::Impl : std::enable_shared_from_this<Service::Impl> {
  struct QuorumWaiter {
    uint64_t id;
    Responder respond;
    Format format;
    TimePoint since;
    std::unique_ptr<asio::steady_timer> timer;
    bool compact = false;  // answer without the member list
  };
  struct Watcher {
    uint64_t id;
    std::string job;
    uint32_t quorum_id;
    Responder respond;
    Format format;
    std::unique_ptr<asio::steady_timer> timer;
  };
  struct KvWaiter {
    uint64_t id;
    std::string job, key;
    uint32_t quorum_id;
    Responder respond;
    std::unique_ptr<asio::steady_timer> timer;
  };

  asio::io_context& ioc;
  ServiceOptions options;
  std::unique_ptr<StateStore> store;
  LighthouseCore core;
  Tokens tokens;
  std::unique_ptr<http::Server> server;
  asio::steady_timer tick_timer;
  std::optional<TimePoint> tick_armed;
  Metrics metrics;
  TimePoint started = SystemClock::Get().Now();
  bool stopping = false;
  uint64_t next_id = 1;
  std::map<std::string, uint32_t> reserved_quorum_id;  // per job: synced reservation (see Persist)
  std::map<AgentKey, QuorumWaiter> quorum_waiters;
  std::set<std::string> pending_evaluations;  // jobs with asks not yet decided on
  std::map<uint64_t, Watcher> watchers;
  std::map<uint64_t, KvWaiter> kv_waiters;
  // job -> quorum_id -> key -> value
  std::map<std::string, std::map<uint32_t, std::map<std::string, std::string>>> kv;

  Impl(asio::io_context& c, ServiceOptions o, std::unique_ptr<StateStore> s)
      : ioc(c), options(std::move(o)), store(std::move(s)), core(options.core), tick_timer(c) {}

  TimePoint Now() const { return SystemClock::Get().Now(); }

  // ---- auth (service_tokens.cc) ----
  // The strongest role the request's token has for `job` ("" for no job in particular).
  Role RoleFor(const Request& req, const std::string& job, bool* other_job = nullptr) const;
  Status Unauthorized(const Request& req, const std::string& job, Role role) const;
  static std::string_view RoleName(Role r);
  bool TokenSeesJob(const Request& req, const std::string& job) const;
  Status RequireJob(const Request& req, const std::string& job) const;
  // The site an lk_gateway vouches for in the request's Lk-Gateway header ("TOKEN SITE"), ""
  // when there is none; a credential that is no role=gateway token is refused (TOKEN_INVALID),
  // so no agent can claim a gateway it is not behind.
  Result<std::string> GatewayOf(const Request& req) const;
  Status RequireRead(const Request& req, const std::string& job) const;
  Status RequireAllJobsRead(const Request& req) const;
  Status RequireAdmin(const Request& req) const;

  // ---- effects (service_effects.cc) ----
  void ApplyEffects(Effects& fx);
  void Persist(Effects& fx);
  static Response QuorumReply(const QuorumAnswer& answer, Format f, bool compact,
                              std::map<const void*, std::shared_ptr<const std::string>>* members_wire);
  void ArmTick();

  // ---- waiters (service_waiters.cc) ----
  void AnswerQuorumWaiter(std::map<AgentKey, QuorumWaiter>::iterator it, Response r);
  void WakeWatchers(const std::string& job);
  static Response WatchReply(const WatchResult& w, Format f);

  // ---- rendezvous KV (service_kv.cc) ----
  void HandleKv(const Request& req, Responder respond);
  void GcKv(const std::string& job, uint32_t quorum_id);
  Status CheckEpoch(const std::string& job, uint32_t quorum_id) const;

  // ---- lifecycle (service.cc) ----
  Status Start();
  void Shutdown();

  // ---- routes (service_routes.cc) ----
  void Route(Request&& req, Responder respond);
  void HandleHeartbeat(const Request& req, Responder respond);
  void HandleQuorum(const Request& req, Responder respond);
  void RunPendingEvaluations();
  void HandleLeave(const Request& req, Responder respond);
  void HandleEvent(const Request& req, Responder respond);
  void HandleCommit(const Request& req, Responder respond);
  void HandleWatch(const Request& req, Responder respond);
  void HandleCheckpoints(const Request& req, Responder respond);
  void HandleStatus(const Request& req, Responder respond);
  void HandleAdmin(const Request& req, Responder respond);
};

}  // namespace lk::lighthouse
