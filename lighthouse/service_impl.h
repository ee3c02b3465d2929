// Private to the lighthouse service: the state behind Service, shared by service.cc (lifecycle,
// effects, waiters) and service_routes.cc (request handlers).
// Thread-safety: everything here runs on the service's one io_context thread.
#pragma once

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "common/flags.h"
#include "common/http/auth.h"
#include "common/http/codec.h"
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

constexpr size_t kNameBytesMax = 128;
constexpr size_t kKvKeyBytesMax = 256;

// Job, group and incarnation names go into RocksDB keys, logs and metric labels: keep them to a
// safe alphabet, and never '/', which separates key parts.
inline Status ValidName(std::string_view what, std::string_view v, size_t max = kNameBytesMax) {
  if (v.empty()) return InvalidArgument("{} is missing", what);
  if (v.size() > max) return InvalidArgument("{} is longer than {} bytes", what, max);
  for (char c : v) {
    bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
              c == ':' || c == '@' || c == '+';
    if (!ok) return InvalidArgument("{} '{}' has a character outside [A-Za-z0-9-_.:@+]", what, v);
  }
  return Status::Ok();
}

inline Status ValidAgent(std::string_view job, std::string_view group, std::string_view inc) {
  LK_RETURN_IF_ERROR(ValidName("job", job));
  LK_RETURN_IF_ERROR(ValidName("group_id", group));
  return ValidName("incarnation", inc);
}

using http::ParseU32;

// What a bearer token may do. Read-only sees every job's /status and /metrics and changes
// nothing; a job token speaks for its one job; an all-jobs token for every job; admin for all.
enum class Role { kNone, kReadOnly, kJob, kAllJobs, kAdmin };

struct Tokens {
  bool enabled = false;
  std::vector<std::string> any_job;
  std::vector<std::string> read_only;
  std::map<std::string, std::vector<std::string>> per_job;
  std::string admin;
};

// The token file, one token per line (blank lines and '#' comments skipped):
//   TOKEN                 an all-jobs token
//   JOB TOKEN             a token for JOB only
//   role=read-only TOKEN  a read-only token (/status and /metrics of every job)
//   role=all-jobs TOKEN   the same as a bare TOKEN
// "role=" cannot start a job name ('=' is outside the name alphabet), so the forms never clash.
inline Result<Tokens> LoadTokens(const std::string& token_file, const std::string& admin_file) {
  Tokens t;
  if (!admin_file.empty()) {
    LK_ASSIGN_OR_RETURN(t.admin, ReadTokenFile(admin_file));
    t.enabled = true;
  }
  if (token_file.empty()) return t;
  LK_ASSIGN_OR_RETURN(std::string text, ReadTokenFile(token_file));
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::istringstream fields(line);
    std::string a, b, extra;
    fields >> a >> b >> extra;
    if (a.empty() || a[0] == '#') continue;
    if (!extra.empty()) return InvalidArgument("token file {} line {}: more than two fields", token_file, n);
    if (b.empty()) {
      t.any_job.push_back(a);
    } else if (a.rfind("role=", 0) == 0) {
      if (a == "role=read-only") {
        t.read_only.push_back(b);
      } else if (a == "role=all-jobs") {
        t.any_job.push_back(b);
      } else {
        return InvalidArgument("token file {} line {}: unknown {} (read-only or all-jobs)",
                               token_file, n, a);
      }
    } else {
      Status name = ValidName("job", a);
      if (!name.ok()) return name.WithContext(fmt::format("token file {} line {}", token_file, n));
      t.per_job[a].push_back(b);
    }
  }
  t.enabled = true;
  return t;
}

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

  // ---- auth ----

  // The strongest role the request's token has for `job` ("" for no job in particular).
  // Every candidate is compared, so the time taken does not depend on which one matched.
  Role RoleFor(const Request& req, const std::string& job, bool* other_job = nullptr) const {
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
  Status Unauthorized(const Request& req, const std::string& job, Role role) const {
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

  static std::string_view RoleName(Role r) {
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
  bool TokenSeesJob(const Request& req, const std::string& job) const {
    return RoleFor(req, job) != Role::kNone;
  }

  // A call that acts for `job` (agents' calls, KV, checkpoint registration, watch).
  Status RequireJob(const Request& req, const std::string& job) const {
    Role role = RoleFor(req, job);
    if (role == Role::kJob || role == Role::kAllJobs || role == Role::kAdmin) return Status::Ok();
    return Unauthorized(req, job, role);
  }

  // A read of `job` that changes nothing (the checkpoint list): the read-only role may.
  Status RequireRead(const Request& req, const std::string& job) const {
    Role role = RoleFor(req, job);
    if (role != Role::kNone) return Status::Ok();
    return Unauthorized(req, job, role);
  }

  // /metrics covers every job: admin, all-jobs and read-only tokens; a job token is refused.
  Status RequireAllJobsRead(const Request& req) const {
    Role role = RoleFor(req, "");
    if (role == Role::kReadOnly || role == Role::kAllJobs || role == Role::kAdmin) {
      return Status::Ok();
    }
    bool other = false;
    (void)RoleFor(req, "", &other);
    return Unauthorized(req, "", other ? Role::kJob : role);
  }

  Status RequireAdmin(const Request& req) const {
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

  // ---- effects ----

  void ApplyEffects(Effects& fx) {
    Persist(fx);
    TimePoint now = Now();
    std::map<std::string, TimePoint> round_start;
    std::map<const void*, std::shared_ptr<const std::string>> members_wire;
    for (auto& [key, answer] : fx.answers) {
      auto it = quorum_waiters.find(key);
      if (it == quorum_waiters.end()) continue;
      auto [rs, inserted] = round_start.emplace(key.job, it->second.since);
      if (!inserted && it->second.since < rs->second) rs->second = it->second.since;
      AnswerQuorumWaiter(it, QuorumReply(answer, it->second.format, it->second.compact, &members_wire));
    }
    for (auto& [key, status] : fx.rejections) {
      auto it = quorum_waiters.find(key);
      if (it == quorum_waiters.end()) continue;
      AnswerQuorumWaiter(it, http::ErrorReply(status, it->second.format));
    }
    for (const auto& issued : fx.issued) {
      metrics.CountQuorum(issued.job, issued.changed);
      if (auto rs = round_start.find(issued.job); rs != round_start.end()) {
        metrics.ObserveFormation(now - rs->second);
      }
      if (issued.changed) {
        GcKv(issued.job, issued.quorum_id);
        fx.watch_wakeups.insert(issued.job);
      }
    }
    for (const auto& job : fx.divergences) metrics.CountDivergence(job);
    for (const auto& job : fx.watch_wakeups) WakeWatchers(job);
    // State changes at info; the per-step routine (every ask, every unchanged re-issue) at
    // debug, so that a healthy run logs a line per membership change, not per group and step.
    for (const auto& e : fx.events) {
      bool routine = e.rfind("quorum_ask ", 0) == 0 ||
                     (e.rfind("quorum_issued ", 0) == 0 && e.find(" changed=false") != std::string::npos) ||
                     e.rfind("quorum_wait ", 0) == 0 || e.rfind("commit ", 0) == 0;
      if (routine) LK_LOG_DEBUG("{}", e);
      else LK_LOG_INFO("{}", e);
    }
    ArmTick();
  }

  void Persist(Effects& fx) {
    if (fx.persist_jobs.empty() && fx.persist_checkpoints.empty() && fx.forget_jobs.empty() &&
        fx.drop_checkpoints.empty() && fx.persist_groups.empty() && fx.drop_groups.empty()) {
      return;
    }
    // Only an id beyond the job's synced reservation (and checkpoint registrations, and
    // forgetting a job) must reach the disk before anyone hears of it: the record then reserves
    // the next quorum_id_block ids, synced. Everything else rides along unsynced, which survives
    // a process kill; a machine crash can lose it, but never lets an id be handed out twice,
    // because a restart continues above the synced reservation.
    // Group records carry generations and retired incarnations: synced, so that a restart
    // never hands a generation out twice nor revives a replaced life (they change only when a
    // group starts a new life or leaves, not per step).
    bool sync = !fx.persist_checkpoints.empty() || !fx.forget_jobs.empty() ||
                !fx.persist_groups.empty();
    for (auto& j : fx.persist_jobs) {
      uint32_t& reserved = reserved_quorum_id[j.job];
      if (j.quorum_id > reserved) {
        uint64_t top = uint64_t{j.quorum_id} + std::max<uint32_t>(options.quorum_id_block, 1) - 1;
        reserved = static_cast<uint32_t>(std::min<uint64_t>(top, UINT32_MAX));
        sync = true;
      }
      j.quorum_id_reserved = reserved;
    }
    Status st = store->Apply(fx.persist_jobs, fx.persist_checkpoints, fx.forget_jobs,
                             fx.persist_groups, fx.drop_groups, sync);
    // A lighthouse that cannot persist must not answer: it stops, and a restart resumes from
    // what was synced. Answering would hand out a quorum_id that a restart could reissue.
    LK_CHECK(st.ok()) << "persist failed: " << st.ToString();
    for (const auto& job : fx.forget_jobs) {
      reserved_quorum_id.erase(job);
      kv.erase(job);
      metrics.ForgetJob(job);
    }
    for (const auto& c : fx.drop_checkpoints) {
      // Registry entries pushed out by newer ones; a failure only leaves a stale record that
      // the next start's Load bounds again.
      if (Status ds = store->DeleteCheckpoint(c.job, c.step); !ds.ok()) {
        LK_LOG_WARN("checkpoint_drop_failed job={} step={} error={}", c.job, c.step, Q(ds.ToString()));
      }
    }
  }

  // One issue answers every member with the same member list: in binary protobuf the list is
  // encoded once and appended to each answer's own fields (concatenated protobuf encodings
  // merge, and repeated fields append), instead of n encodings of n members.
  static Response QuorumReply(const QuorumAnswer& answer, Format f, bool compact,
                              std::map<const void*, std::shared_ptr<const std::string>>* members_wire) {
    pb::QuorumResponse resp;
    bool shared_tail = f == Format::kProto && answer.members_shared;
    if (!answer.members_shared || (!compact && !shared_tail)) {
      ToProto(answer, &resp);
      return http::Reply(resp, f);
    }
    // The member's own fields; the members follow as donors only (compact) or as a shared tail.
    const auto& members = *answer.members_shared;
    QuorumAnswer own = answer;
    own.members_shared.reset();
    own.members.clear();
    ToProto(own, &resp);
    resp.set_replica_world_size(static_cast<uint32_t>(members.size()));
    AddGroupSizes(answer, members, &resp);
    if (compact) {
      for (uint32_t r : answer.source_ranks) {
        if (r < members.size()) ToProto(members[r], resp.add_sources());
      }
      return http::Reply(resp, f);
    }
    auto [it, fresh] = members_wire->emplace(&members, nullptr);
    if (fresh) {
      pb::QuorumResponse only_members;
      for (const auto& m : members) ToProto(m, only_members.add_members());
      it->second = std::make_shared<const std::string>(only_members.SerializeAsString());
    }
    Response r = http::Reply(resp, f);
    // The member list goes out as a shared tail: n answers, one copy in memory.
    r.body_tail = it->second;
    return r;
  }

  void AnswerQuorumWaiter(std::map<AgentKey, QuorumWaiter>::iterator it, Response r) {
    it->second.timer->cancel();
    Responder respond = std::move(it->second.respond);
    quorum_waiters.erase(it);
    respond(std::move(r));
  }

  void WakeWatchers(const std::string& job) {
    for (auto it = watchers.begin(); it != watchers.end();) {
      if (it->second.job != job) {
        ++it;
        continue;
      }
      auto r = core.Watch(job, it->second.quorum_id);
      if (r.ok() && !r->lost) {
        ++it;
        continue;
      }
      Response resp = r.ok() ? WatchReply(*r, it->second.format)
                             : http::ErrorReply(r.status(), it->second.format);
      it->second.timer->cancel();
      Responder respond = std::move(it->second.respond);
      it = watchers.erase(it);
      respond(std::move(resp));
    }
  }

  static Response WatchReply(const WatchResult& w, Format f) {
    pb::WatchResponse resp;
    resp.set_quorum_id(w.quorum_id);
    resp.set_lost(w.lost);
    for (const auto& n : w.notices) ToProto(n, resp.add_notices());
    return http::Reply(resp, f);
  }

  // One timer for every timeout in the core, armed at the core's next deadline; a timer that
  // fires early just re-arms, so requests never need to cancel it.
  void ArmTick() {
    if (stopping) return;
    auto next = core.NextDeadline();
    if (!next) return;
    if (tick_armed && *tick_armed <= *next) return;
    tick_armed = *next;
    tick_timer.expires_at(*next);
    tick_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec) return;
      self->tick_armed.reset();
      Effects fx;
      self->core.Tick(self->Now(), &fx);
      self->ApplyEffects(fx);
    });
  }

  // ---- rendezvous KV ----

  void GcKv(const std::string& job, uint32_t quorum_id) {
    uint32_t keep_from = quorum_id > options.kv_epochs_kept ? quorum_id - options.kv_epochs_kept : 0;
    auto jit = kv.find(job);
    if (jit != kv.end()) {
      jit->second.erase(jit->second.begin(), jit->second.lower_bound(keep_from));
    }
    Status st = store->DeleteKvBelow(job, keep_from);
    if (!st.ok()) LK_LOG_WARN("kv_gc_failed job={} error={}", job, Q(st.ToString()));
    // Waiters on collected epochs will never see their key: answer them now.
    for (auto it = kv_waiters.begin(); it != kv_waiters.end();) {
      if (it->second.job == job && it->second.quorum_id < keep_from) {
        it->second.timer->cancel();
        Responder respond = std::move(it->second.respond);
        uint32_t qid = it->second.quorum_id;
        it = kv_waiters.erase(it);
        respond(http::ErrorReply(Refuse(Code::kConflict, Reason::kEpochSuperseded,
                                        "quorum {} of job {} is superseded", qid, job),
                                 Format::kJson));
      } else {
        ++it;
      }
    }
  }

  // Checks that `quorum_id` is a live rendezvous epoch of `job`.
  Status CheckEpoch(const std::string& job, uint32_t quorum_id) const {
    auto w = core.Watch(job, 0);
    if (!w.ok()) return w.status();
    uint32_t current = w->quorum_id;
    if (quorum_id > current) {
      return Refuse(Code::kConflict, Reason::kEpochNotYet,
                    "quorum {} of job {} does not exist yet (current {})", quorum_id, job, current);
    }
    if (current - quorum_id > options.kv_epochs_kept) {
      return Refuse(Code::kConflict, Reason::kEpochSuperseded,
                    "quorum {} of job {} is superseded (current {})", quorum_id, job, current);
    }
    return Status::Ok();
  }

  // ---- lifecycle ----

  Status Start() {
    auto t = LoadTokens(options.token_file, options.admin_token_file);
    if (!t.ok()) return t.status();
    tokens = std::move(*t);
    auto t0 = Now();
    LK_ASSIGN_OR_RETURN(auto jobs, store->LoadJobs());
    LK_ASSIGN_OR_RETURN(auto ckpts, store->LoadCheckpoints());
    LK_ASSIGN_OR_RETURN(auto groups, store->LoadGroups());
    LK_ASSIGN_OR_RETURN(auto kvs, store->LoadKv());
    for (const auto& j : jobs) reserved_quorum_id[j.job] = std::max(j.quorum_id, j.quorum_id_reserved);
    size_t njobs = jobs.size(), nckpts = ckpts.size(), ngroups = groups.size();
    LK_RETURN_IF_ERROR(core.Load(std::move(jobs), std::move(ckpts), Now(), std::move(groups)));
    for (auto& e : kvs) kv[e.job][e.quorum_id][e.key] = std::move(e.value);
    LK_LOG_INFO("state_loaded jobs={} groups={} checkpoints={} kv_entries={} load_ms={}", njobs,
                ngroups, nckpts, kvs.size(), ToMillis(Now() - t0));
    server = std::make_unique<http::Server>(
        ioc, options.http, [self = shared_from_this()](Request&& req, Responder respond) {
          self->Route(std::move(req), std::move(respond));
        });
    LK_RETURN_IF_ERROR(server->Listen(options.bind));
    LK_LOG_INFO("listening address={}", server->LocalAddress());
    ArmTick();
    return Status::Ok();
  }

  void Shutdown() {
    if (stopping) return;
    stopping = true;
    tick_timer.cancel();
    if (server) server->Stop();
    Status st(Code::kUnavailable, "lighthouse shutting down", Reason::kShuttingDown);
    size_t n = quorum_waiters.size() + watchers.size() + kv_waiters.size();
    while (!quorum_waiters.empty()) {
      AnswerQuorumWaiter(quorum_waiters.begin(),
                         http::ErrorReply(st, quorum_waiters.begin()->second.format));
    }
    for (auto& [id, w] : watchers) {
      w.timer->cancel();
      w.respond(http::ErrorReply(st, w.format));
    }
    watchers.clear();
    for (auto& [id, w] : kv_waiters) {
      w.timer->cancel();
      w.respond(http::ErrorReply(st, Format::kJson));
    }
    kv_waiters.clear();
    LK_LOG_INFO("shutdown waiters_answered={}", n);
  }

  void Route(Request&& req, Responder respond);
  void HandleHeartbeat(const Request& req, Responder respond);
  void HandleQuorum(const Request& req, Responder respond);
  void RunPendingEvaluations();
  void HandleLeave(const Request& req, Responder respond);
  void HandleCommit(const Request& req, Responder respond);
  void HandleWatch(const Request& req, Responder respond);
  void HandleKv(const Request& req, Responder respond);
  void HandleCheckpoints(const Request& req, Responder respond);
  void HandleStatus(const Request& req, Responder respond);
  void HandleAdmin(const Request& req, Responder respond);
};

}  // namespace lk::lighthouse
