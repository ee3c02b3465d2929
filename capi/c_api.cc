// The C API over lk::client::Session: errors become -1 plus a thread-local message and code.
#include <cstring>

#include "capi/c_api_internal.h"

namespace lk::capi {

namespace {

thread_local std::string g_error;
thread_local int g_code = LK_OK;
thread_local lk::Reason g_reason = lk::Reason::kUnspecified;

// Copies `value` NUL-terminated into buf, or fails with kTooLarge leaving buf as it was.
int CopyOut(const std::string& value, char* buf, size_t cap, size_t* len) {
  if (len != nullptr) *len = value.size();
  if (buf == nullptr || cap <= value.size()) {
    return Fail(Status(Code::kTooLarge, fmt::format("buffer of {} bytes for {} bytes and a NUL",
                                                    cap, value.size())));
  }
  std::memcpy(buf, value.c_str(), value.size() + 1);
  return 0;
}

}  // namespace

int Fail(const Status& st) {
  g_error = st.ToString();
  g_code = static_cast<int>(st.code());
  g_reason = st.reason();
  return -1;
}

void Fanout::Deliver(const client::Notice& n) {
  std::lock_guard lock(mu);
  for (lk_comm* c : comms) {
    if (n.drain) {
      lk_comm_abort(c, ("drain: " + n.reason).c_str());
    } else if (n.lost) {
      lk_comm_abort_quorum(c, n.quorum_id, ("quorum lost: " + n.reason).c_str());
    }
  }
  for (lk_diloco* d : dilocos) DeliverToDiloco(d, n);
  if (fn != nullptr) fn(fn_user, n.quorum_id, n.lost ? 1 : 0, n.drain ? 1 : 0);
  if (ex_fn != nullptr) {
    lk_notice c{n.quorum_id, n.lost ? 1 : 0, n.drain ? 1 : 0, n.checkpoint_now ? 1 : 0,
                n.reason.c_str()};
    ex_fn(ex_user, &c);
  }
}

}  // namespace lk::capi

using lk::capi::Fail;

extern "C" {

const char* lk_last_error(void) { return lk::capi::g_error.c_str(); }
int lk_last_error_code(void) { return lk::capi::g_code; }
const char* lk_last_error_reason(void) {
  // ReasonName's views point into a static table of NUL-terminated literals.
  return lk::ReasonName(lk::capi::g_reason).data();
}

lk_session* lk_session_open(const char* socket_path, uint32_t group_rank, uint32_t group_size) {
  auto s = socket_path ? lk::client::Session::Connect(socket_path, group_rank, group_size)
                       : lk::client::Session::FromEnv(group_rank, group_size);
  if (!s.ok()) {
    Fail(s.status());
    return nullptr;
  }
  auto out = std::make_unique<lk_session>();  // the caller's until lk_session_close
  out->session = std::move(*s);
  out->fanout = std::make_shared<lk::capi::Fanout>();
  // One callback for everything made over this session; it starts the notice thread, which
  // watches the quorum of the last poll.
  out->session->OnNotice(
      [fanout = out->fanout](const lk::client::Notice& n) { fanout->Deliver(n); });
  return out.release();
}

void lk_session_close(lk_session* s) {
  if (s == nullptr) return;
  {
    std::lock_guard lock(s->fanout->mu);
    s->fanout->fn = nullptr;
    s->fanout->ex_fn = nullptr;
    s->fanout->comms.clear();
    s->fanout->dilocos.clear();
  }
  delete s;
}

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
  out->restore_step = r->restore_step;
  out->has_restore = r->restore_location.empty() ? 0 : 1;
  return 0;
}

int lk_session_heal_source(lk_session* s, uint32_t i, char* buf, size_t cap) {
  if (i >= s->last.heal_sources.size()) return Fail(lk::InvalidArgument("no heal source {}", i));
  const std::string& src = s->last.heal_sources[i];
  if (cap <= src.size()) return Fail(lk::InvalidArgument("buffer of {} bytes too small", cap));
  std::memcpy(buf, src.c_str(), src.size() + 1);
  return 0;
}

int lk_session_restore_location(lk_session* s, char* buf, size_t cap, size_t* len) {
  return lk::capi::CopyOut(s->last.restore_location, buf, cap, len);
}

int lk_session_poll_reason(lk_session* s, char* buf, size_t cap, size_t* len) {
  return lk::capi::CopyOut(s->last.reason, buf, cap, len);
}

int lk_session_set_mixed_group_sizes(lk_session* s, int on) {
  if (s == nullptr) return Fail(lk::InvalidArgument("no session"));
  s->session->SetMixedGroupSizes(on != 0);
  return 0;
}

int lk_session_poll_group_sizes(lk_session* s, uint32_t* out, size_t cap, size_t* count) {
  if (s == nullptr) return Fail(lk::InvalidArgument("no session"));
  const std::vector<uint32_t>& sizes = s->last.group_sizes;
  if (count != nullptr) *count = sizes.size();
  if (cap < sizes.size()) {
    return Fail(lk::Status(lk::Code::kTooLarge, fmt::format("room for {} group sizes, {} to give",
                                                            cap, sizes.size())));
  }
  if (!sizes.empty()) std::memcpy(out, sizes.data(), sizes.size() * sizeof(uint32_t));
  return 0;
}

int lk_session_commit(lk_session* s, uint32_t step, int ok, const char* state_hash) {
  lk::Status st = s->session->Commit(step, ok != 0, state_hash ? state_hash : "");
  return st.ok() ? 0 : Fail(st);
}

int lk_session_commit_tokens(lk_session* s, uint32_t step, int ok, const char* state_hash,
                             uint64_t tokens) {
  lk::Status st = s->session->Commit(step, ok != 0, state_hash ? state_hash : "", tokens);
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

int lk_session_register_checkpoint(lk_session* s, uint32_t step, const char* location,
                                   const char* manifest_digest) {
  if (location == nullptr || *location == '\0') {
    return Fail(lk::InvalidArgument("no checkpoint location"));
  }
  lk::Status st =
      s->session->RegisterCheckpoint(step, location, manifest_digest ? manifest_digest : "");
  return st.ok() ? 0 : Fail(st);
}

int lk_kv_put(lk_session* s, uint32_t quorum_id, const char* key, const void* value, size_t len) {
  lk::Status st =
      s->session->KvPut(quorum_id, key, std::string(static_cast<const char*>(value), len));
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
  std::lock_guard lock(s->fanout->mu);
  s->fanout->fn = fn;
  s->fanout->fn_user = user;
}

void lk_session_on_notice_ex(lk_session* s, lk_notice_ex_fn fn, void* user) {
  std::lock_guard lock(s->fanout->mu);
  s->fanout->ex_fn = fn;
  s->fanout->ex_user = user;
}

}  // extern "C"
