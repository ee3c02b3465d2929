// Each of the agent's listeners carries its own routes. The Unix socket carries the trainer API
// (agent_routes.cc) and answers only processes of the agent's own uid, identified by the kernel
// (SO_PEERCRED), never by what a request says. --serve, reachable from other sites, carries
// only what peers need: /healthz, /v1/agent/status and the shard reads of a heal, the last two
// with the job's bearer token. Every refusal carries
// its reason code (ErrorResponse.code: NO_PEER_CREDENTIALS, PEER_UID_MISMATCH,
// NOT_ON_THIS_LISTENER, TOKEN_MISSING, TOKEN_INVALID, WORKERS_BUSY, AGENT_EXITING); the same
// word starts the prose reason, for people reading logs.
//   GET  /healthz                 both listeners, no token: "ok"
//   GET  /v1/agent/status         both listeners; on --serve with the token
//   GET  /v1/shards/...           --serve only, with the token (checkpoint/shard_server.h)
//   POST /v1/trainer/checkpoint   socket: register a durable checkpoint at the lighthouse
//   PUT/GET /v1/trainer/kv/QUORUM_ID/KEY   socket: the lighthouse rendezvous KV
#include <unistd.h>

#include "common/http/auth.h"
#include "replica_agent/agent_impl.h"

namespace lk::agent {

namespace {

bool IsTrainerPath(const std::string& p) { return p.rfind("/v1/trainer/", 0) == 0; }

}  // namespace

int Agent::Impl::PeerPid(const http::Request& req) {
  return req.credentials ? req.credentials->pid : 0;
}

void Agent::Impl::TrainerRoute(http::Request&& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  const std::string& p = req.path;
  // The socket file is mode 0600, but a descriptor can be handed on (or the mode changed by
  // someone): every request's peer is checked, not only the file's.
  if (!req.credentials) {
    return respond(
        http::ErrorReply(Error(Code::kPermissionDenied,
                               "no_peer_credentials: the trainer API is on the Unix socket")
                             .WithReason(Reason::kNoPeerCredentials),
                         f));
  }
  uint32_t uid = static_cast<uint32_t>(::geteuid());
  if (req.credentials->uid != uid) {
    LK_LOG_WARN("trainer_request_refused reason=peer_uid_mismatch peer_uid={} peer_pid={} path={}",
                req.credentials->uid, req.credentials->pid, Q(p));
    return respond(http::ErrorReply(
        Error(Code::kPermissionDenied, "peer_uid_mismatch: uid {} may not use the agent of uid {}",
              req.credentials->uid, uid)
            .WithReason(Reason::kPeerUidMismatch),
        f));
  }
  if (p == "/healthz") return respond(http::TextReply(200, "text/plain", "ok\n"));
  if (p == "/v1/agent/status" && req.method == "GET") return HandleStatus(req, respond);
  bool post = req.method == "POST";
  if (p == "/v1/trainer/hello" && post) return HandleHello(req, respond);
  if (p == "/v1/trainer/poll" && post) return HandlePoll(req, respond);
  if (p == "/v1/trainer/goodbye" && post) return HandleGoodbye(req, respond);
  if (p == "/v1/trainer/checkpoint" && post) return HandleCheckpoint(req, respond);
  if (p == "/v1/trainer/phase" && post) return HandlePhase(req, respond);
  if (p == "/v1/trainer/commit" && post) return HandleCommit(req, respond);
  if (p == "/v1/trainer/notice" && req.method == "GET") return HandleNotice(req, respond);
  if (p.rfind("/v1/trainer/kv/", 0) == 0 && (req.method == "GET" || req.method == "PUT")) {
    return HandleKv(req, respond);
  }
  LK_LOG_WARN("trainer_request_rejected path={} method={}", Q(p), req.method);
  respond(http::ErrorReply(
      Refuse(Code::kNotFound, Reason::kNoEndpoint, "no endpoint {} {}", req.method, p), f));
}

Status Agent::Impl::CheckPeerToken(const http::Request& req) const {
  // Without a token the agent runs open, as a lighthouse without --token-file does (it warned
  // at start).
  if (token.empty()) return Status::Ok();
  std::string_view given = http::BearerToken(req.authorization);
  if (given.empty()) {
    return Error(Code::kUnauthenticated, "token_missing: send Authorization: Bearer <job token>")
        .WithReason(Reason::kTokenMissing);
  }
  if (!http::ConstantTimeEquals(given, token)) {
    return Error(Code::kPermissionDenied, "token_wrong: not this job's token")
        .WithReason(Reason::kTokenInvalid);
  }
  return Status::Ok();
}

void Agent::Impl::PeerRoute(http::Request&& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  const std::string& p = req.path;
  if (p == "/healthz") return respond(http::TextReply(200, "text/plain", "ok\n"));
  bool status = p == "/v1/agent/status" && req.method == "GET";
  bool shards = shard_server && p.rfind("/v1/shards", 0) == 0;
  if (!status && !shards) {
    // The trainer API is not here at all (not "forbidden"): nothing on this port can register a
    // trainer, a checkpoint or a rendezvous key.
    LK_LOG_WARN("peer_request_rejected reason=not_on_this_listener peer={} path={} method={}",
                req.peer, Q(p), req.method);
    std::string hint = IsTrainerPath(p) ? " (the trainer API is on the agent's Unix socket)" : "";
    return respond(http::ErrorReply(
        Error(Code::kNotFound, "not_on_this_listener: no endpoint {} {}{}", req.method, p, hint)
            .WithReason(Reason::kNotOnThisListener),
        f));
  }
  if (Status st = CheckPeerToken(req); !st.ok()) {
    LK_LOG_WARN("peer_request_refused peer={} path={} error={}", req.peer, Q(p), Q(st.message()));
    return respond(http::ErrorReply(st, f));
  }
  if (status) return HandleStatus(req, respond);
  shard_server->Handle(std::move(req), std::move(respond));
}

void Agent::Impl::OffThread(std::string route, std::function<void()> run,
                            http::Responder respond, http::Format f) {
  auto shared = std::make_shared<http::Responder>(std::move(respond));
  auto guarded = [route = std::move(route), run = std::move(run), shared] {
    try {
      run();
    } catch (const std::exception& e) {
      (*shared)(http::HandlerThrew("worker", route, e.what()));
    } catch (...) {
      (*shared)(http::HandlerThrew("worker", route, "unknown exception"));
    }
  };
  WorkerPool::Task task{
      std::move(guarded), [shared, f] {
        (*shared)(
            http::ErrorReply(Error(Code::kUnavailable, "agent_exiting: the agent is stopping")
                                 .WithReason(Reason::kAgentExiting),
                             f));
      }};
  if (workers->Submit(task)) return;
  LK_LOG_WARN("trainer_request_refused reason=workers_busy queue_max={}", workers->queue_max());
  (*shared)(http::ErrorReply(
      Error(Code::kUnavailable, "workers_busy: {} lighthouse calls already queued; retry",
            workers->queue_max())
          .WithReason(Reason::kWorkersBusy),
      f));
}

void Agent::Impl::HandleCheckpoint(const http::Request& req, http::Responder respond) {
  http::Format f = http::ReplyFormat(req);
  pb::CheckpointInfo in;
  Status st = http::Decode(req.body, http::BodyFormat(req.content_type), &in);
  if (st.ok() && in.location().empty()) st = InvalidArgument("location is missing");
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  in.set_job(options.job);
  in.set_group_id(options.group_id);
  // The lighthouse call may wait on a retry; it runs off the io thread.
  auto shared = std::make_shared<http::Responder>(respond);
  OffThread(
      req.path, [self = shared_from_this(), in, f, shared] {
        // Reports the node made before (the commit of this step, usually) reach the lighthouse
        // first, so that it judges the registration against them.
        self->AwaitOnIo([&] { return self->outbox.empty() || self->outbox_failing; },
                        std::chrono::steady_clock::now() + Millis(10'000));
        bool away = self->OnIo([&] { return !self->outbox.empty(); }).value_or(true);
        Status st;
        pb::CheckpointInfo out;
        if (!away) {
          auto client = self->LighthouseClient();
          st = client->Call("POST", "/v1/checkpoints", in, &out, Millis(10'000));
          away = st.code() == Code::kUnavailable || st.code() == Code::kDeadlineExceeded;
        }
        if (away) {
          // The lighthouse is away: the checkpoint is durable already, and the agent owns the
          // registration from here (the outbox delivers it after the reports before it). The
          // trainer's call succeeds.
          std::string waiting = self->OnIo([&] {
                                      Report r;
                                      r.kind = ReportKind::kCheckpoint;
                                      r.step = in.step();
                                      r.body = in.SerializeAsString();
                                      self->QueueReport(std::move(r));
                                      return self->outbox.Summary();
                                    })
                                    .value_or("");
          LK_LOG_INFO("checkpoint_registration_queued step={} location={} {}", in.step(),
                      Q(in.location()), waiting);
          return (*shared)(http::Reply(in, f));
        }
        if (!st.ok()) return (*shared)(http::ErrorReply(st, f));
        LK_LOG_INFO("checkpoint_registered step={} location={}", in.step(), Q(in.location()));
        (*shared)(http::Reply(out, f));
      },
      [shared](http::Response r) { (*shared)(std::move(r)); }, f);
}

void Agent::Impl::HandleKv(const http::Request& req, http::Responder respond) {
  // /v1/trainer/kv/QID/KEY -> /v1/kv/JOB/QID/KEY on the lighthouse, off the io thread because
  // a GET waits for the key. The path arrived percent-decoded: it is encoded again, or a key
  // with '?' or '#' would be cut short there and one with a space refused.
  constexpr std::string_view kPrefix = "/v1/trainer/kv/";
  if (!req.path.starts_with(kPrefix)) {  // the route checked it; never a substr past the end
    return respond(http::ErrorReply(Error(Code::kNotFound, "no endpoint {}", req.path),
                                    http::Format::kJson));
  }
  std::string_view rest = std::string_view(req.path).substr(kPrefix.size());
  std::string target = "/v1/kv/" + http::PercentEncode(options.job) + "/" + http::PercentEncodePath(rest);
  auto q = req.query.find("timeout_ms");
  if (q != req.query.end()) target += "?timeout_ms=" + http::PercentEncode(q->second);
  auto shared = std::make_shared<http::Responder>(respond);
  OffThread(
      req.path, [self = shared_from_this(), method = req.method, body = req.body, target, shared] {
        auto client = self->LighthouseClient();
        auto r = client->Do(method, target, body, "application/octet-stream", Millis(35'000));
        if (!r.ok()) return (*shared)(http::ErrorReply(r.status(), http::Format::kJson));
        (*shared)(std::move(*r));
      },
      [shared](http::Response r) { (*shared)(std::move(r)); }, http::Format::kJson);
}

void Agent::Impl::HandleStatus(const http::Request& req, http::Responder respond) {
  (void)req;
  SyncBoard();
  auto ready = board ? board->Ready() : std::nullopt;
  const AgentState& s = core->state();
  const bool fetched = s.ask.kind == Ask::Kind::kFetched;
  const auto& handed = s.board.handed;
  std::string body = fmt::format(
      "{{\"job\":\"{}\",\"group_id\":\"{}\",\"incarnation\":\"{}\",\"node_rank\":{},"
      "\"quorum_id\":{},\"committed_step\":{},\"trainers\":{},\"phase\":\"{}\",\"draining\":{},"
      "\"ahead_quorum_id\":{},\"ahead_step\":{},\"board\":{},\"board_ready_step\":{},"
      "\"board_taken_step\":{},\"outbox_pending\":{},\"outbox_dropped\":{}}}",
      options.job, options.group_id, options.incarnation, options.node_rank,
      s.quorum ? s.quorum->quorum_id : 0, s.committed_step, s.trainers.size(),
      PhaseName(core->ReportedPhase()), s.draining ? "true" : "false",
      fetched ? s.ask.fetched->quorum_id : 0, fetched ? s.ask.step : 0, board ? "true" : "false",
      ready ? static_cast<int64_t>(ready->step) : -1,
      handed ? static_cast<int64_t>(handed->step) : -1, outbox.size(), outbox.dropped());
  respond(http::TextReply(200, http::kJsonType, body));
}

}  // namespace lk::agent
