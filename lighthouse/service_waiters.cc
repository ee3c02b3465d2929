// The long-poll waiters of /v1/quorum and /v1/watch: each is answered exactly once, by the
// core's effects, its own deadline, or shutdown.
#include "lighthouse/service_impl.h"

namespace lk::lighthouse {

void Service::Impl::AnswerQuorumWaiter(std::map<AgentKey, QuorumWaiter>::iterator it, Response r) {
  it->second.timer->cancel();
  Responder respond = std::move(it->second.respond);
  quorum_waiters.erase(it);
  respond(std::move(r));
}
void Service::Impl::WakeWatchers(const std::string& job) {
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
Response Service::Impl::WatchReply(const WatchResult& w, Format f) {
  pb::WatchResponse resp;
  resp.set_quorum_id(w.quorum_id);
  resp.set_lost(w.lost);
  for (const auto& n : w.notices) ToProto(n, resp.add_notices());
  return http::Reply(resp, f);
}

}  // namespace lk::lighthouse
