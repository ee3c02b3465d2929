// The lighthouse's HTTP routes: each decodes and checks its input at the edge, calls the core,
// and hands the effects to ApplyEffects. Bad input is answered with a 4xx and a reason, logged
// once, and never reaches the core.
#include "lighthouse/service_impl.h"

namespace lk::lighthouse {

namespace {

// Wraps a Responder so that every answer is counted by endpoint and code, and every 4xx/5xx is
// logged once with its reason.
Responder Counted(Metrics* metrics, std::string endpoint, std::string peer, Responder respond) {
  return [metrics, endpoint = std::move(endpoint), peer = std::move(peer),
          respond = std::move(respond)](Response r) {
    metrics->CountRequest(endpoint, r.status);
    if (r.status >= 400 && r.status != 504) {
      LK_LOG_WARN("request_rejected endpoint={} peer={} status={} body={}", endpoint, peer,
                  r.status, Q(r.body.substr(0, 300)));
    }
    respond(std::move(r));
  };
}

// The endpoints counted by name in the metrics. At namespace scope, not a function's static:
// built before main and destroyed after everything registered later at exit, so a thread that
// still answers a request while the process exits (the route fuzzers' lighthouse) never sees it
// destroyed.
const std::set<std::string> kKnownEndpoints = {
    "/v1/heartbeat", "/v1/quorum", "/v1/leave", "/v1/commit", "/v1/event", "/v1/watch", "/v1/kv",
    "/v1/checkpoints", "/status", "/metrics", "/healthz", "/", "/v1/admin/drain",
    "/v1/admin/forget"};

template <class Msg>
Status DecodeAs(const Request& req, Msg* msg) {
  return http::Decode(req.body, http::BodyFormat(req.content_type), msg);
}

}  // namespace

void Service::Impl::Route(Request&& req, Responder respond) {
  const std::string& p = req.path;
  std::string endpoint = p.rfind("/v1/kv/", 0) == 0 ? "/v1/kv" : p;
  if (!kKnownEndpoints.count(endpoint)) endpoint = "other";
  respond = Counted(&metrics, endpoint, req.peer, std::move(respond));
  Format f = http::ReplyFormat(req);
  if (stopping) {
    return respond(
        http::ErrorReply(Status(Code::kUnavailable, "shutting down", Reason::kShuttingDown), f));
  }
  auto method_is = [&](std::string_view m) { return req.method == m; };
  auto wrong_method = [&] {
    respond(http::ErrorReply(Refuse(Code::kInvalidArgument, Reason::kMethodNotAllowed,
                                    "{} does not accept {}", p, req.method),
                             f));
  };
  if (p == "/healthz") return respond(http::TextReply(200, "text/plain", "ok\n"));
  if (p == "/") {
    return respond(http::TextReply(200, "text/html; charset=utf-8", std::string(DashboardHtml())));
  }
  if (p == "/status") return method_is("GET") ? HandleStatus(req, respond) : wrong_method();
  if (p == "/metrics") {
    if (!method_is("GET")) return wrong_method();
    if (Status st = RequireAllJobsRead(req); !st.ok()) return respond(http::ErrorReply(st, f));
    return respond(http::TextReply(200, "text/plain; version=0.0.4",
                                   metrics.Render(core.View(Now()),
                                                  std::chrono::duration<double>(Now() - started).count(),
                                                  server->connections())));
  }
  if (p == "/v1/watch") return method_is("GET") ? HandleWatch(req, respond) : wrong_method();
  if (endpoint == "/v1/kv") {
    return method_is("GET") || method_is("PUT") ? HandleKv(req, respond) : wrong_method();
  }
  if (p == "/v1/checkpoints") {
    return method_is("GET") || method_is("POST") ? HandleCheckpoints(req, respond) : wrong_method();
  }
  if (!method_is("POST")) {
    if (endpoint == "other") {
      return respond(http::ErrorReply(
          Refuse(Code::kNotFound, Reason::kNoEndpoint, "no endpoint {}", p), f));
    }
    return wrong_method();
  }
  if (p == "/v1/heartbeat") return HandleHeartbeat(req, respond);
  if (p == "/v1/quorum") return HandleQuorum(req, respond);
  if (p == "/v1/leave") return HandleLeave(req, respond);
  if (p == "/v1/commit") return HandleCommit(req, respond);
  if (p == "/v1/event") return HandleEvent(req, respond);
  if (p == "/v1/admin/drain" || p == "/v1/admin/forget") return HandleAdmin(req, respond);
  respond(http::ErrorReply(Refuse(Code::kNotFound, Reason::kNoEndpoint, "no endpoint {}", p), f));
}

void Service::Impl::HandleHeartbeat(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  pb::HeartbeatRequest in;
  Status st = DecodeAs(req, &in);
  if (st.ok()) st = ValidAgent(in.job(), in.group_id(), in.incarnation());
  if (st.ok()) st = RequireJob(req, in.job());
  Result<std::string> gateway = st.ok() ? GatewayOf(req) : Result<std::string>(st);
  if (!gateway.ok()) return respond(http::ErrorReply(gateway.status(), f));
  HeartbeatInput hb{in.job(),   in.group_id(), in.incarnation(), in.node_rank(), in.nodes(),
                    in.step(),  in.phase(),    in.address(),     in.generation()};
  Effects fx;
  auto r = core.OnHeartbeat(hb, Now(), &fx);
  if (!r.ok()) return respond(http::ErrorReply(r.status(), f));
  core.NoteGateway(in.job(), in.group_id(), in.incarnation(), *gateway);
  pb::HeartbeatResponse out;
  out.set_quorum_id(r->quorum_id);
  out.set_drain(r->drain);
  out.set_committed_step(r->committed_step);
  out.set_generation(r->generation);
  out.set_revived_from(r->revived_from);
  for (const auto& n : r->notices) ToProto(n, out.add_notices());
  // A round is open when an agent of this job waits in POST /v1/quorum (a joiner, or a member
  // that saw the quorum lose someone) or the current quorum lost a member: the group should
  // ask at its next outer-step boundary instead of going on with the quorum it has.
  auto w = quorum_waiters.lower_bound(AgentKey{in.job(), "", "", 0});
  bool open_round = w != quorum_waiters.end() && w->first.job == in.job();
  if (!open_round) {
    auto watch = core.Watch(in.job(), r->quorum_id);
    open_round = watch.ok() && watch->lost;
  }
  out.set_round_pending(open_round);
  ApplyEffects(fx);
  respond(http::Reply(out, f));
}

void Service::Impl::HandleQuorum(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  pb::QuorumRequest in;
  Status st = DecodeAs(req, &in);
  if (st.ok()) st = ValidAgent(in.job(), in.group_id(), in.incarnation());
  if (st.ok()) st = RequireJob(req, in.job());
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  AgentKey key{in.job(), in.group_id(), in.incarnation(), in.node_rank()};
  if (auto old = quorum_waiters.find(key); old != quorum_waiters.end()) {
    AnswerQuorumWaiter(old, http::ErrorReply(Status(Code::kConflict,
                                                    "superseded by a newer request of this agent",
                                                    Reason::kRequestSuperseded),
                                             old->second.format));
  }
  Millis wait = in.timeout_ms() == 0 ? options.quorum_wait_default : Millis(in.timeout_ms());
  wait = std::min(wait, options.long_poll_max);
  uint64_t id = next_id++;
  auto timer = std::make_unique<asio::steady_timer>(ioc, wait);
  timer->async_wait([self = shared_from_this(), key, id](const boost::system::error_code& ec) {
    if (ec) return;
    auto it = self->quorum_waiters.find(key);
    if (it == self->quorum_waiters.end() || it->second.id != id) return;
    self->core.OnJoinTimeout(key);
    self->AnswerQuorumWaiter(
        it, http::ErrorReply(Status(Code::kDeadlineExceeded,
                                    "quorum not ready before timeout_ms; ask again",
                                    Reason::kWaitTimeout),
                             it->second.format));
  });
  quorum_waiters.emplace(key, QuorumWaiter{id, std::move(respond), f, Now(), std::move(timer), in.compact()});
  JoinInput join{in.job(),         in.group_id(), in.incarnation(), in.node_rank(),
                 in.nodes(),       in.step(),     in.shrink_only(), !in.fresh(),
                 in.address(),     in.generation(), in.group_size(),
                 in.mixed_group_sizes(), in.on_quorum_id()};
  Effects fx;
  st = core.OnJoin(join, Now(), &fx, /*evaluate=*/false);
  if (!st.ok()) {
    auto it = quorum_waiters.find(key);
    if (it != quorum_waiters.end() && it->second.id == id) {
      AnswerQuorumWaiter(it, http::ErrorReply(st, f));
    }
    return;
  }
  ApplyEffects(fx);
  // The decision runs once the io loop has handled every request it read in this batch: a
  // burst of n asks then costs one decision, not n (each scans all groups of the job).
  if (pending_evaluations.insert(in.job()).second && pending_evaluations.size() == 1) {
    asio::post(ioc, [self = shared_from_this()] { self->RunPendingEvaluations(); });
  }
}

void Service::Impl::RunPendingEvaluations() {
  std::set<std::string> jobs;
  jobs.swap(pending_evaluations);
  for (const auto& job : jobs) {
    Effects fx;
    core.EvaluateJob(job, Now(), &fx);
    ApplyEffects(fx);
  }
}

void Service::Impl::HandleLeave(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  pb::LeaveRequest in;
  Status st = DecodeAs(req, &in);
  if (st.ok()) st = ValidAgent(in.job(), in.group_id(), in.incarnation());
  if (st.ok()) st = RequireJob(req, in.job());
  if (st.ok() && in.reason().size() > 256) st = InvalidArgument("reason is longer than 256 bytes");
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  Effects fx;
  st = core.OnLeave(in.job(), in.group_id(), in.incarnation(),
                    in.reason().empty() ? "unspecified" : in.reason(), Now(), &fx,
                    in.generation());
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  ApplyEffects(fx);
  pb::LeaveResponse out;
  if (auto w = core.Watch(in.job(), 0); w.ok()) out.set_quorum_id(w->quorum_id);
  respond(http::Reply(out, f));
}

void Service::Impl::HandleEvent(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  pb::GroupEventRequest in;
  Status st = DecodeAs(req, &in);
  if (st.ok()) st = ValidAgent(in.job(), in.group_id(), in.incarnation());
  if (st.ok()) st = RequireJob(req, in.job());
  std::optional<GroupEventKind> kind;
  if (st.ok()) {
    kind = ParseGroupEvent(in.event());
    if (!kind) {
      st = InvalidArgument("unknown event {} (trainer_crashed or requeue_refused)",
                           Q(in.event()));
    }
  }
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  Effects fx;
  auto r = core.OnGroupEvent({in.job(), in.group_id(), in.incarnation(), *kind, in.detail()},
                             Now(), &fx);
  if (!r.ok()) return respond(http::ErrorReply(r.status(), f));
  ApplyEffects(fx);
  pb::GroupEventResponse out;
  out.set_crashes(r->crashes);
  out.set_requeue_refusals(r->requeue_refusals);
  respond(http::Reply(out, f));
}

void Service::Impl::HandleCommit(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  pb::CommitRequest in;
  Status st = DecodeAs(req, &in);
  if (st.ok()) st = ValidAgent(in.job(), in.group_id(), in.incarnation());
  if (st.ok()) st = RequireJob(req, in.job());
  if (st.ok() && in.state_hash().size() > 128) st = InvalidArgument("state_hash longer than 128");
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  CommitInput c{in.job(),  in.group_id(), in.incarnation(), in.node_rank(), in.quorum_id(),
                in.step(), !in.failed(), in.state_hash(), in.tokens()};
  Effects fx;
  auto r = core.OnCommit(c, Now(), &fx);
  if (!r.ok()) return respond(http::ErrorReply(r.status(), f));
  ApplyEffects(fx);
  pb::CommitResponse out;
  out.set_diverged(*r);
  out.set_committed_step(core.CommittedStep(in.job()));
  respond(http::Reply(out, f));
}

void Service::Impl::HandleWatch(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  auto job_it = req.query.find("job");
  std::string job = job_it == req.query.end() ? "" : job_it->second;
  Status st = ValidName("job", job);
  if (st.ok()) st = RequireJob(req, job);
  auto qid = ParseU32(req.query, "quorum_id", 0);
  auto timeout = ParseU32(req.query, "timeout_ms", 30'000);
  if (st.ok() && !qid.ok()) st = qid.status();
  if (st.ok() && !timeout.ok()) st = timeout.status();
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  auto w = core.Watch(job, *qid);
  if (!w.ok()) return respond(http::ErrorReply(w.status(), f));
  if (w->lost || *timeout == 0) return respond(WatchReply(*w, f));
  uint64_t id = next_id++;
  auto timer = std::make_unique<asio::steady_timer>(
      ioc, std::min(Millis(*timeout), options.long_poll_max));
  timer->async_wait([self = shared_from_this(), id](const boost::system::error_code& ec) {
    if (ec) return;
    auto it = self->watchers.find(id);
    if (it == self->watchers.end()) return;
    auto r = self->core.Watch(it->second.job, it->second.quorum_id);
    Response resp = r.ok() ? WatchReply(*r, it->second.format)
                           : http::ErrorReply(r.status(), it->second.format);
    Responder respond = std::move(it->second.respond);
    self->watchers.erase(it);
    respond(std::move(resp));
  });
  watchers.emplace(id, Watcher{id, job, *qid, std::move(respond), f, std::move(timer)});
}

void Service::Impl::HandleCheckpoints(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  if (req.method == "GET") {
    auto it = req.query.find("job");
    std::string job = it == req.query.end() ? "" : it->second;
    Status st = ValidName("job", job);
    if (st.ok()) st = RequireRead(req, job);
    if (st.ok() && !core.HasJob(job)) {
      st = Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", job);
    }
    if (!st.ok()) return respond(http::ErrorReply(st, f));
    pb::CheckpointList out;
    for (const auto& c : core.Checkpoints(job)) ToProto(c, out.add_checkpoints());
    return respond(http::Reply(out, f));
  }
  pb::CheckpointInfo in;
  Status st = DecodeAs(req, &in);
  if (st.ok()) st = ValidName("job", in.job());
  if (st.ok()) st = RequireJob(req, in.job());
  if (st.ok() && in.location().empty()) st = InvalidArgument("location is missing");
  if (st.ok() && in.location().size() > 4096) st = InvalidArgument("location over 4096 bytes");
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  CheckpointData c = FromProto(in);
  if (c.created_unix_s == 0) {
    c.created_unix_s = static_cast<uint32_t>(
        std::chrono::duration_cast<std::chrono::seconds>(
            std::chrono::system_clock::now().time_since_epoch()).count());
  }
  Effects fx;
  st = core.OnRegisterCheckpoint(c, &fx);
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  ApplyEffects(fx);
  pb::CheckpointInfo out;
  ToProto(c, &out);
  respond(http::Reply(out, f));
}

void Service::Impl::HandleStatus(const Request& req, Responder respond) {
  Format f = req.accept.find("protobuf") != std::string::npos ? Format::kProto : Format::kJson;
  // Any role may read /status; a token that is none of them is refused (it sees no job, and
  // an empty answer would read as "no jobs").
  bool other_job = false;
  if (tokens.enabled && RoleFor(req, "", &other_job) == Role::kNone && !other_job) {
    return respond(http::ErrorReply(Unauthorized(req, "", Role::kNone), f));
  }
  auto want = req.query.find("job");
  pb::StatusResponse out;
  out.set_uptime_s(std::chrono::duration<double>(Now() - started).count());
  for (const auto& v : core.View(Now())) {
    if (want != req.query.end() && want->second != v.job) continue;
    // A job token sees its own jobs only; jobs never see each other.
    if (!TokenSeesJob(req, v.job)) continue;
    ToProto(v, out.add_jobs());
  }
  respond(http::Reply(out, f));
}

void Service::Impl::HandleAdmin(const Request& req, Responder respond) {
  Format f = http::ReplyFormat(req);
  if (Status st = RequireAdmin(req); !st.ok()) return respond(http::ErrorReply(st, f));
  Effects fx;
  Status st;
  if (req.path == "/v1/admin/drain") {
    pb::DrainRequest in;
    st = DecodeAs(req, &in);
    if (st.ok()) st = ValidName("job", in.job());
    if (st.ok()) st = ValidName("group_id", in.group_id());
    if (st.ok()) st = core.Drain(in.job(), in.group_id(), Now(), &fx);
  } else {
    pb::ForgetRequest in;
    st = DecodeAs(req, &in);
    if (st.ok()) st = ValidName("job", in.job());
    if (st.ok()) st = core.Forget(in.job(), &fx);
    if (st.ok()) {
      // Waiters of a forgotten job would otherwise wait for nothing.
      for (auto it = quorum_waiters.begin(); it != quorum_waiters.end();) {
        auto next = std::next(it);
        if (it->first.job == in.job()) {
          AnswerQuorumWaiter(it, http::ErrorReply(Refuse(Code::kNotFound, Reason::kJobForgotten,
                                                         "job {} was forgotten", in.job()),
                                                  it->second.format));
        }
        it = next;
      }
      fx.watch_wakeups.insert(in.job());
    }
  }
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  ApplyEffects(fx);
  respond(http::Reply(pb::Empty(), f));
}

}  // namespace lk::lighthouse
