// The service's lifecycle: load the durable state into the core, listen, and at shutdown answer
// every waiter; the rest of the shell is in the files service_impl.h lists.
#include "lighthouse/service.h"

#include "lighthouse/service_impl.h"

namespace lk::lighthouse {

Status ServiceOptions::Validate() const {
  if (quorum_id_block == 0) return InvalidArgument("--quorum-id-block must be at least 1");
  if (core.min_replicas == 0) return InvalidArgument("--min-replicas must be at least 1");
  if (core.heartbeat_timeout.count() <= 0) {
    return InvalidArgument("--heartbeat-timeout-ms must be > 0");
  }
  if (http.body_bytes_max == 0) return InvalidArgument("--body-bytes-max must be > 0");
  if (http.request_buffer_bytes_max < (64 << 10)) {
    return InvalidArgument("--request-buffer-bytes-max must be at least 65536");
  }
  if (core.jobs_max == 0) return InvalidArgument("--jobs-max must be at least 1");
  if (http.tls_cert_file.empty() != http.tls_key_file.empty()) {
    return InvalidArgument("--tls-cert-file and --tls-key-file go together");
  }
  return core.Validate();
}

Status Service::Impl::Start() {
  if (options.token_file.empty() && !http::ListensOnLoopback(options.bind)) {
    if (!options.insecure_no_auth) {
      return InvalidArgument(
          "--bind {} reaches beyond this host and there is no --token-file: anyone who reaches "
          "the port could join, commit and read every job. Give --token-file (README: "
          "Security), bind a loopback address, or pass --insecure-no-auth to run open on "
          "purpose",
          options.bind);
    }
    LK_LOG_WARN("lighthouse_open reason=insecure_no_auth bind={} detail={}", options.bind,
                Q("no --token-file: every request from anyone is accepted"));
  }
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
void Service::Impl::Shutdown() {
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

Service::Service(asio::io_context& ioc, ServiceOptions options, std::unique_ptr<StateStore> store)
    : impl_(std::make_shared<Impl>(ioc, [&] {
        // The service reads answers' members from the shared list, so the core need not copy
        // the member list into every answer (n copies of n members at 1,024 groups).
        options.core.answer_members_inline = false;
        return std::move(options);
      }(), std::move(store))) {}

Service::~Service() = default;

Status Service::Start() { return impl_->Start(); }

std::string Service::address() const {
  return impl_->server ? impl_->server->LocalAddress() : "";
}

http::Handler Service::handler() const {
  return [impl = impl_](http::Request&& req, http::Responder respond) {
    impl->Route(std::move(req), std::move(respond));
  };
}

void Service::Shutdown() { impl_->Shutdown(); }

}  // namespace lk::lighthouse
