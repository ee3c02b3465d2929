// The rendezvous store (PUT/GET /v1/kv/JOB/QUORUM_ID/KEY): values scoped to a job's live quorum
// epochs, a GET that waits for its key, and the collection of epochs a new quorum supersedes.
#include "lighthouse/service_impl.h"

namespace lk::lighthouse {

void Service::Impl::HandleKv(const Request& req, Responder respond) {
  Format f = Format::kJson;
  // /v1/kv/JOB/QUORUM_ID/KEY, the key may contain '/'. Route sends the bare "/v1/kv" here too:
  // it names no key, so it is no endpoint (and must not be cut past its end).
  static constexpr std::string_view kPrefix = "/v1/kv/";
  if (!req.path.starts_with(kPrefix)) {
    return respond(http::ErrorReply(
        Refuse(Code::kNotFound, Reason::kNoEndpoint,
               "no endpoint {}; the KV path is /v1/kv/JOB/QUORUM_ID/KEY", req.path),
        f));
  }
  std::string rest = req.path.substr(kPrefix.size());
  auto s1 = rest.find('/');
  auto s2 = s1 == std::string::npos ? std::string::npos : rest.find('/', s1 + 1);
  if (s2 == std::string::npos) {
    return respond(http::ErrorReply(InvalidArgument("KV path is /v1/kv/JOB/QUORUM_ID/KEY"), f));
  }
  std::string job = rest.substr(0, s1);
  std::string qid_text = rest.substr(s1 + 1, s2 - s1 - 1);
  std::string key = rest.substr(s2 + 1);
  Status st = ValidName("job", job);
  if (st.ok()) st = RequireJob(req, job);
  auto qid = ParseU32({{"quorum_id", qid_text}}, "quorum_id", 0);
  if (st.ok() && (!qid.ok() || qid_text.empty())) st = InvalidArgument("bad quorum_id '{}'", qid_text);
  if (st.ok() && (key.empty() || key.size() > kKvKeyBytesMax)) {
    st = InvalidArgument("KV key must be 1..{} bytes", kKvKeyBytesMax);
  }
  if (st.ok()) st = CheckEpoch(job, *qid);
  if (!st.ok()) return respond(http::ErrorReply(st, f));
  auto& epoch = kv[job][*qid];
  if (req.method == "PUT") {
    if (req.body.size() > options.kv_value_bytes_max) {
      return respond(http::ErrorReply(
          Error(Code::kTooLarge, "KV value over {} bytes", options.kv_value_bytes_max), f));
    }
    size_t keys = 0;
    for (const auto& [q, m] : kv[job]) keys += m.size();
    if (!epoch.count(key) && keys >= options.kv_keys_per_job_max) {
      return respond(http::ErrorReply(
          Refuse(Code::kResourceExhausted, Reason::kKvKeysMax, "job {} has {} KV keys (the limit)",
                 job, keys),
          f));
    }
    if (Status ps = store->PutKv({job, *qid, key, req.body}); !ps.ok()) {
      return respond(http::ErrorReply(ps, f));
    }
    epoch[key] = req.body;
    for (auto it = kv_waiters.begin(); it != kv_waiters.end();) {
      if (it->second.job == job && it->second.quorum_id == *qid && it->second.key == key) {
        it->second.timer->cancel();
        Responder r = std::move(it->second.respond);
        it = kv_waiters.erase(it);
        r(http::TextReply(200, "application/octet-stream", req.body));
      } else {
        ++it;
      }
    }
    return respond(http::TextReply(204, "text/plain", ""));
  }
  if (auto it = epoch.find(key); it != epoch.end()) {
    return respond(http::TextReply(200, "application/octet-stream", it->second));
  }
  auto timeout = ParseU32(req.query, "timeout_ms", 30'000);
  if (!timeout.ok()) return respond(http::ErrorReply(timeout.status(), f));
  if (*timeout == 0) {
    return respond(http::ErrorReply(
        Refuse(Code::kNotFound, Reason::kKeyNotFound, "no key {} in quorum {}", key, *qid), f));
  }
  uint64_t id = next_id++;
  auto timer = std::make_unique<asio::steady_timer>(
      ioc, std::min(Millis(*timeout), options.long_poll_max));
  timer->async_wait([self = shared_from_this(), id](const boost::system::error_code& ec) {
    if (ec) return;
    auto it = self->kv_waiters.find(id);
    if (it == self->kv_waiters.end()) return;
    Responder r = std::move(it->second.respond);
    std::string k = it->second.key;
    self->kv_waiters.erase(it);
    r(http::ErrorReply(Refuse(Code::kDeadlineExceeded, Reason::kWaitTimeout,
                              "key {} not put before timeout_ms", k),
                       Format::kJson));
  });
  kv_waiters.emplace(id, KvWaiter{id, job, key, *qid, std::move(respond), std::move(timer)});
}

void Service::Impl::GcKv(const std::string& job, uint32_t quorum_id) {
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
Status Service::Impl::CheckEpoch(const std::string& job, uint32_t quorum_id) const {
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

}  // namespace lk::lighthouse
