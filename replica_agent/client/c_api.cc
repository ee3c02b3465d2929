// The C API over lk::client::Session: errors become -1 plus a thread-local message.
#include <cstring>

#include "replica_agent/client/lightkeeper.h"
#include "replica_agent/client/session.h"

struct lk_session {
  std::unique_ptr<lk::client::Session> session;
  lk::client::PollResult last;
};

namespace {

thread_local std::string g_error;

int Fail(const lk::Status& st) {
  g_error = st.ToString();
  return -1;
}

}  // namespace

extern "C" {

lk_session* lk_session_open(const char* socket_path, uint32_t group_rank, uint32_t group_size) {
  auto s = socket_path ? lk::client::Session::Connect(socket_path, group_rank, group_size)
                       : lk::client::Session::FromEnv(group_rank, group_size);
  if (!s.ok()) {
    Fail(s.status());
    return nullptr;
  }
  auto* out = new lk_session;  // owned by the caller until lk_session_close
  out->session = std::move(*s);
  return out;
}

void lk_session_close(lk_session* s) { delete s; }

int lk_session_poll(lk_session* s, uint32_t step, lk_poll_result* out) {
  auto r = s->session->Poll(step);
  if (!r.ok()) return Fail(r.status());
  s->last = *r;
  out->quorum_id = r->quorum_id;
  out->replica_rank = r->replica_rank;
  out->replica_world_size = r->replica_world_size;
  out->max_step = r->max_step;
  out->reconfigure = r->reconfigure;
  out->heal = r->heal;
  out->drain = r->drain;
  out->initial = r->initial;
  out->checkpoint_now = r->checkpoint_now;
  out->heal_source_count = static_cast<uint32_t>(r->heal_sources.size());
  out->from_board = r->from_board;
  return 0;
}

int lk_session_heal_source(lk_session* s, uint32_t i, char* buf, size_t cap) {
  if (i >= s->last.heal_sources.size()) return Fail(lk::InvalidArgument("no heal source {}", i));
  const std::string& src = s->last.heal_sources[i];
  if (cap <= src.size()) return Fail(lk::InvalidArgument("buffer of {} bytes too small", cap));
  std::memcpy(buf, src.c_str(), src.size() + 1);
  return 0;
}

int lk_session_commit(lk_session* s, uint32_t step, int ok, const char* state_hash) {
  lk::Status st = s->session->Commit(step, ok != 0, state_hash ? state_hash : "");
  return st.ok() ? 0 : Fail(st);
}

int lk_session_set_peer_wait(lk_session* s, int waiting) {
  lk::Status st = s->session->SetPeerWait(waiting != 0);
  return st.ok() ? 0 : Fail(st);
}

int lk_session_finish(lk_session* s) {
  lk::Status st = s->session->Finish();
  return st.ok() ? 0 : Fail(st);
}

int lk_kv_put(lk_session* s, uint32_t quorum_id, const char* key, const void* value, size_t len) {
  lk::Status st = s->session->KvPut(quorum_id, key,
                                    std::string(static_cast<const char*>(value), len));
  return st.ok() ? 0 : Fail(st);
}

int lk_kv_get(lk_session* s, uint32_t quorum_id, const char* key, void* buf, size_t cap,
              size_t* len, uint32_t timeout_ms) {
  auto r = s->session->KvGet(quorum_id, key, lk::Millis(timeout_ms));
  if (!r.ok()) return Fail(r.status());
  *len = r->size();
  std::memcpy(buf, r->data(), std::min(cap, r->size()));
  return 0;
}

void lk_session_on_notice(lk_session* s, lk_notice_fn fn, void* user) {
  s->session->OnNotice([fn, user](const lk::client::Notice& n) {
    fn(user, n.quorum_id, n.lost ? 1 : 0, n.drain ? 1 : 0);
  });
}

const char* lk_last_error(void) { return g_error.c_str(); }

}  // extern "C"
