// lightkeeper._native: the compiled part of the Python package, a thin binding of the C API of
// liblightkeeper.so (<lightkeeper/lightkeeper.h>): the session with the agent, the
// cross-group communicator and the DiLoCo outer step. It links no torch: buffers arrive as
// (address, element count, dtype, device), which the pure-Python layer takes from
// tensor.data_ptr(), so one build serves whatever PyTorch the trainer imports.
//
// Every call that may block (poll, commit, KV waits, allreduce, the outer step) releases the
// GIL, so the session's notice thread (which aborts collectives in C++ without Python) and other
// Python threads run meanwhile. Errors raise lightkeeper.errors.Error with the library's reason
// code, or QuorumLost for a collective that a failure notice, a dead peer or its deadline cut
// short.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <lightkeeper/lightkeeper.h>

namespace py = pybind11;

namespace {

const char* CodeName(int code) {
  switch (code) {
    case LK_OK: return "ok";
    case LK_ERR_INVALID_ARGUMENT: return "invalid_argument";
    case LK_ERR_UNAUTHENTICATED: return "unauthenticated";
    case LK_ERR_PERMISSION_DENIED: return "permission_denied";
    case LK_ERR_NOT_FOUND: return "not_found";
    case LK_ERR_CONFLICT: return "conflict";
    case LK_ERR_TOO_LARGE: return "too_large";
    case LK_ERR_DEADLINE_EXCEEDED: return "deadline_exceeded";
    case LK_ERR_UNAVAILABLE: return "unavailable";
    case LK_ERR_ABORTED: return "aborted";
    case LK_ERR_DATA_LOSS: return "data_loss";
    case LK_ERR_RESOURCE_EXHAUSTED: return "resource_exhausted";
    case LK_ERR_INTERNAL: return "internal";
  }
  return "unknown";
}

// lightkeeper.errors' factory of exceptions (error_of: InvalidArgument for invalid_argument,
// else Error) and its QuorumLost type, looked up once at import; they live as long as the
// interpreter (never destroyed, so no Python object outlives it in a static destructor).
py::object* g_error_of = nullptr;
py::object* g_quorum_lost_type = nullptr;

[[noreturn]] void RaiseCode(int code, const std::string& message, bool quorum_lost,
                            const char* reason = "UNSPECIFIED") {
  py::object exc = quorum_lost ? (*g_quorum_lost_type)(CodeName(code), message, reason)
                               : (*g_error_of)(CodeName(code), message, reason);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// The last C API error of this thread (call with the GIL held, right after the failed call).
[[noreturn]] void RaiseLast(bool collective = false) {
  int code = lk_last_error_code();
  // A collective cut short means the quorum is gone: the trainer polls for the next one.
  bool lost = collective && (code == LK_ERR_ABORTED || code == LK_ERR_DEADLINE_EXCEEDED ||
                             code == LK_ERR_UNAVAILABLE);
  RaiseCode(code, lk_last_error(), lost, lk_last_error_reason());
}

[[noreturn]] void RaiseInvalid(const std::string& message) {
  RaiseCode(LK_ERR_INVALID_ARGUMENT, message, false);
}

// Runs `f` (a C API call returning 0 or -1) without the GIL and raises on -1. The error is
// per thread and this thread made the call, so reading it after taking the GIL back is safe.
template <typename F>
void Call(F&& f, bool collective = false) {
  int rc;
  {
    py::gil_scoped_release release;
    rc = f();
  }
  if (rc != 0) RaiseLast(collective);
}

// The answer to a poll, with its strings read out of the C API once.
struct Quorum {
  uint32_t quorum_id = 0, replica_rank = 0, replica_world_size = 0, max_step = 0;
  bool reconfigure = false, heal = false, drain = false, checkpoint_now = false;
  bool initial = false, from_board = false;
  std::vector<std::string> heal_sources;
  std::vector<uint32_t> group_sizes;
  std::string restore_location;
  uint32_t restore_step = 0;
  std::string reason;
};

// What the notice thread has seen. Shared with the C callback through a raw pointer that the
// session's fan-out drops at lk_session_close, which happens before this goes away.
struct NoticeRecord {
  std::mutex mu;
  uint32_t lost_quorum_id = 0;  // the newest quorum a lost notice named
  bool drain = false;
  bool checkpoint_now = false;
  std::string reason;
};

void OnNotice(void* user, const lk_notice* n) {
  auto* rec = static_cast<NoticeRecord*>(user);
  std::lock_guard lock(rec->mu);
  if (n->lost) rec->lost_quorum_id = std::max(rec->lost_quorum_id, n->quorum_id);
  if (n->drain) {
    rec->drain = true;
    rec->checkpoint_now = rec->checkpoint_now || n->checkpoint_now != 0;
  }
  rec->reason = n->reason != nullptr ? n->reason : "";
}

class Session {
 public:
  Session(const std::string& socket, uint32_t group_rank, uint32_t group_size)
      : notices_(std::make_unique<NoticeRecord>()) {
    const char* path = socket.empty() ? nullptr : socket.c_str();
    {
      py::gil_scoped_release release;
      s_ = lk_session_open(path, group_rank, group_size);
    }
    if (s_ == nullptr) RaiseLast();
    lk_session_on_notice_ex(s_, &OnNotice, notices_.get());
  }
  ~Session() { lk_session_close(s_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  Quorum Poll(uint32_t step) {
    raw();  // raises InvalidArgument once closed
    lk_poll_result r{};
    Call([&] { return lk_session_poll(s_, step, &r); });
    Quorum q;
    q.quorum_id = r.quorum_id;
    q.replica_rank = r.replica_rank;
    q.replica_world_size = r.replica_world_size;
    q.max_step = r.max_step;
    q.reconfigure = r.reconfigure != 0;
    q.heal = r.heal != 0;
    q.drain = r.drain != 0;
    q.checkpoint_now = r.checkpoint_now != 0;
    q.initial = r.initial != 0;
    q.from_board = r.from_board != 0;
    q.restore_step = r.restore_step;
    char buf[512];
    for (uint32_t i = 0; i < r.heal_source_count; ++i) {
      if (lk_session_heal_source(s_, i, buf, sizeof(buf)) != 0) RaiseLast();
      q.heal_sources.emplace_back(buf);
    }
    size_t n = 0;
    if (lk_session_poll_group_sizes(s_, nullptr, 0, &n) != 0 || n > 0) {
      q.group_sizes.resize(n);
      if (lk_session_poll_group_sizes(s_, q.group_sizes.data(), n, &n) != 0) RaiseLast();
    }
    if (r.has_restore) q.restore_location = ReadString(lk_session_restore_location);
    q.reason = ReadString(lk_session_poll_reason);
    return q;
  }

  void Commit(uint32_t step, bool ok, const std::string& hash, uint64_t tokens) {
    raw();  // raises InvalidArgument once closed
    Call([&] {
      return lk_session_commit_tokens(s_, step, ok ? 1 : 0, hash.empty() ? nullptr : hash.c_str(),
                                      tokens);
    });
  }
  void Finish() {
    raw();  // raises InvalidArgument once closed
    Call([&] { return lk_session_finish(s_); });
  }
  void SetMixedGroupSizes(bool on) {
    raw();  // raises InvalidArgument once closed
    Call([&] { return lk_session_set_mixed_group_sizes(s_, on ? 1 : 0); });
  }
  void SetPeerWait(bool waiting) {
    raw();  // raises InvalidArgument once closed
    Call([&] { return lk_session_set_peer_wait(s_, waiting ? 1 : 0); });
  }
  void RegisterCheckpoint(uint32_t step, const std::string& location, const std::string& digest) {
    raw();  // raises InvalidArgument once closed
    Call([&] {
      return lk_session_register_checkpoint(s_, step, location.c_str(), digest.c_str());
    });
  }
  void KvPut(uint32_t quorum_id, const std::string& key, const std::string& value) {
    raw();  // raises InvalidArgument once closed
    Call([&] { return lk_kv_put(s_, quorum_id, key.c_str(), value.data(), value.size()); });
  }
  py::bytes KvGet(uint32_t quorum_id, const std::string& key, uint32_t timeout_ms) {
    raw();  // raises InvalidArgument once closed
    std::string buf(64 << 10, '\0');
    size_t len = 0;
    Call([&] { return lk_kv_get(s_, quorum_id, key.c_str(), buf.data(), buf.size(), &len, timeout_ms); });
    if (len > buf.size()) {
      // The key exists now, so the second read answers at once.
      buf.assign(len, '\0');
      Call([&] { return lk_kv_get(s_, quorum_id, key.c_str(), buf.data(), buf.size(), &len, timeout_ms); });
    }
    buf.resize(len);
    return py::bytes(buf);
  }

  py::dict Notices() const {
    std::lock_guard lock(notices_->mu);
    py::dict d;
    d["lost_quorum_id"] = notices_->lost_quorum_id;
    d["drain"] = notices_->drain;
    d["checkpoint_now"] = notices_->checkpoint_now;
    d["reason"] = notices_->reason;
    return d;
  }
  uint32_t LostQuorumId() const {
    std::lock_guard lock(notices_->mu);
    return notices_->lost_quorum_id;
  }
  bool DrainNoticed() const {
    std::lock_guard lock(notices_->mu);
    return notices_->drain;
  }

  // Closes the connection to the agent (Manager.close); later calls raise InvalidArgument.
  // The library's communicators and DiLoCo objects hold the session's pointer, so it refuses
  // while any of them is open instead of leaving them a dangling one.
  void Close() {
    if (s_ == nullptr) return;
    if (users_ > 0) {
      RaiseInvalid("close the session's communicators and DiLoCo objects first (" +
                   std::to_string(users_) + " open)");
    }
    lk_session* s = s_;
    s_ = nullptr;
    py::gil_scoped_release release;
    lk_session_close(s);
  }
  bool closed() const { return s_ == nullptr; }
  int users() const { return users_; }
  void AddUser() { ++users_; }
  void DropUser() { --users_; }

  lk_session* raw() const {
    if (s_ == nullptr) RaiseInvalid("the session is closed (Manager.close())");
    return s_;
  }

 private:
  std::string ReadString(int (*fn)(lk_session*, char*, size_t, size_t*)) {
    size_t len = 0;
    std::string out(256, '\0');
    if (fn(s_, out.data(), out.size(), &len) != 0) {
      if (lk_last_error_code() != LK_ERR_TOO_LARGE) RaiseLast();
      out.assign(len + 1, '\0');
      if (fn(s_, out.data(), out.size(), &len) != 0) RaiseLast();
    }
    out.resize(len);
    return out;
  }

  lk_session* s_ = nullptr;
  int users_ = 0;  // open communicators and DiLoCo objects over it (the GIL guards it)
  std::unique_ptr<NoticeRecord> notices_;
};

int ParseDType(const std::string& name) {
  if (name == "float32") return LK_DTYPE_FLOAT32;
  if (name == "bfloat16") return LK_DTYPE_BFLOAT16;
  RaiseInvalid("allreduce takes float32 or bfloat16, not " + name);
}

int ParseOp(const std::string& name) {
  if (name == "avg") return LK_REDUCE_AVG;
  if (name == "sum") return LK_REDUCE_SUM;
  RaiseInvalid("allreduce op is \"avg\" or \"sum\", not \"" + name + "\"");
}

// A cross-group communicator of one slot over a session; the session's notices abort it.
class Comm {
 public:
  Comm(Session& session, const std::string& backend, uint32_t slot, const std::string& key_prefix,
       const std::string& bind_host, uint32_t init_timeout_ms, uint32_t op_timeout_ms,
       int device_index) {
    lk_comm_options o{};
    o.backend = backend.c_str();
    o.slot = slot;
    o.key_prefix = key_prefix.c_str();
    o.bind_host = bind_host.c_str();
    o.init_timeout_ms = init_timeout_ms;
    o.op_timeout_ms = op_timeout_ms;
    o.device_index = device_index;
    c_ = lk_comm_create(session.raw(), &o);
    if (c_ == nullptr) RaiseLast();
    session_ = &session;
    session_->AddUser();
  }
  ~Comm() { Close(); }
  // Idempotent; later calls raise InvalidArgument (Manager.close closes its communicators).
  void Close() {
    if (c_ == nullptr) return;
    lk_comm* c = c_;
    c_ = nullptr;
    session_->DropUser();
    py::gil_scoped_release release;
    lk_comm_close(c);
  }
  lk_comm* live() const {
    if (c_ == nullptr) RaiseInvalid("the communicator is closed");
    return c_;
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  void Reconfigure(uint32_t quorum_id, uint32_t replica_rank, uint32_t world) {
    live();
    Call([&] { return lk_comm_reconfigure(c_, quorum_id, replica_rank, world); }, true);
  }
  void AllReduce(uintptr_t data, size_t count, const std::string& dtype, const std::string& op) {
    live();
    int dt = ParseDType(dtype), ro = ParseOp(op);
    Call([&] { return lk_comm_allreduce(c_, reinterpret_cast<void*>(data), count, dt, ro); },
         true);
  }
  void Abort(const std::string& reason) { lk_comm_abort(live(), reason.c_str()); }
  void AbortQuorum(uint32_t quorum_id, const std::string& reason) {
    lk_comm_abort_quorum(live(), quorum_id, reason.c_str());
  }
  uint32_t quorum_id() const { return lk_comm_quorum_id(live()); }

 private:
  lk_comm* c_ = nullptr;
  Session* session_ = nullptr;  // kept alive by py::keep_alive
};

// One named tensor of a flat float32 buffer, as Python describes it.
struct Spec {
  std::string name;
  size_t offset = 0;
  std::vector<int64_t> shape;
};

std::vector<lk_tensor_spec> CSpecs(const std::vector<Spec>& specs) {
  std::vector<lk_tensor_spec> out;
  for (const Spec& s : specs) {
    out.push_back(lk_tensor_spec{s.name.c_str(), s.offset, s.shape.data(),
                                 static_cast<uint32_t>(s.shape.size())});
  }
  return out;
}

py::dict ResultDict(const lk_diloco_result& r) {
  static const char* kKinds[] = {"committed", "received", "joined", "drained", "started"};
  static const char* kInner[] = {"keep", "reset", "restored"};
  py::dict d;
  d["kind"] = kKinds[std::clamp(r.kind, 0, 4)];
  d["step"] = r.step;
  d["quorum_id"] = r.quorum_id;
  d["replica_rank"] = r.replica_rank;
  d["replica_world_size"] = r.replica_world_size;
  d["healed"] = r.healed != 0;
  d["inner"] = kInner[std::clamp(r.inner, 0, 2)];
  d["saved"] = r.saved != 0;
  d["checkpoint_now"] = r.checkpoint_now != 0;
  d["state_hash"] = std::string(r.state_hash);
  d["heal_source"] = std::string(r.heal_source);
  d["reason"] = std::string(r.reason);
  py::dict stats;
  stats["poll_ms"] = r.poll_ms;
  stats["join_ms"] = r.join_ms;
  stats["allreduce_ms"] = r.allreduce_ms;
  stats["gather_ms"] = r.gather_ms;
  stats["publish_ms"] = r.publish_ms;
  stats["commit_ms"] = r.commit_ms;
  stats["outer_ms"] = r.outer_ms;
  stats["cross_bytes"] = r.cross_bytes;
  stats["sync_bytes"] = r.sync_bytes;
  stats["group_bytes"] = r.group_bytes;
  d["stats"] = stats;
  return d;
}

// "float32", "bf16" or "fp16" as the C API's LK_DTYPE_*; anything else raises InvalidArgument.
int DTypeCode(const std::string& name) {
  if (name == "float32") return LK_DTYPE_FLOAT32;
  if (name == "bf16") return LK_DTYPE_BFLOAT16;
  if (name == "fp16") return LK_DTYPE_FLOAT16;
  RaiseInvalid("unknown param_dtype '" + name + "' (float32, bf16 or fp16)");
}

int ShardRuleCode(const std::string& name) {
  if (name == "even") return LK_SHARD_EVEN;
  if (name == "chunk") return LK_SHARD_CHUNK;
  RaiseInvalid("unknown shard rule '" + name + "' (even or chunk)");
}

// The DiLoCo outer step of the C++ library. `inner_save(address, count)` (Python) fills the
// float32 buffer at address with the inner optimizer's state before a durable save.
class Diloco {
 public:
  Diloco(Session& session, uint32_t group_rank, uint32_t group_size, std::vector<Spec> params,
         std::vector<Spec> inner_state, std::function<void(uintptr_t, size_t)> inner_save,
         float outer_lr, float outer_momentum, bool nesterov, const std::string& ckpt_dir,
         uint32_t ckpt_every, uint32_t ckpt_keep, const std::string& live_dir,
         const std::string& bind_host, uint32_t init_timeout_ms, uint32_t op_timeout_ms,
         uint32_t stuck_timeout_ms, const std::string& outer_compress, bool overlap,
         uint32_t outer_fragments, uint64_t extra_state_bytes_max,
         const std::string& param_dtype, bool sharded, const std::string& shard_rule,
         const std::vector<std::pair<int64_t, int64_t>>& shard_rows,
         const std::vector<std::pair<int64_t, int64_t>>& inner_shard_rows)
      : dtype_(DTypeCode(param_dtype)),
        params_(std::move(params)), inner_(std::move(inner_state)),
        inner_save_(std::move(inner_save)) {
    std::vector<lk_tensor_spec> p = CSpecs(params_), i = CSpecs(inner_);
    lk_diloco_options o{};
    o.group_rank = group_rank;
    o.group_size = group_size;
    o.params = p.data();
    o.param_count = p.size();
    o.inner_state = i.empty() ? nullptr : i.data();
    o.inner_state_count = i.size();
    if (!i.empty() && inner_save_) {
      o.inner_save = &Diloco::SaveInner;
      o.inner_save_user = this;
    }
    o.outer_lr = outer_lr;
    o.outer_momentum = outer_momentum;
    o.nesterov = nesterov ? 1 : 0;
    o.ckpt_dir = ckpt_dir.c_str();
    o.ckpt_every = ckpt_every;
    o.ckpt_keep = ckpt_keep;
    o.live_dir = live_dir.c_str();
    o.bind_host = bind_host.c_str();
    o.init_timeout_ms = init_timeout_ms;
    o.op_timeout_ms = op_timeout_ms;
    o.stuck_timeout_ms = stuck_timeout_ms;
    lk_diloco_ext_options ext{};
    ext.struct_size = sizeof(ext);
    ext.outer_compress = outer_compress.c_str();
    ext.overlap = overlap ? 1 : 0;
    ext.outer_fragments = outer_fragments;
    ext.extra_state_bytes_max = extra_state_bytes_max;
    ext.param_dtype = dtype_;
    ext.sharded = sharded ? 1 : 0;
    ext.shard_rule = ShardRuleCode(shard_rule);
    std::vector<int64_t> rows, inner_rows;
    for (const auto& [b, e] : shard_rows) rows.insert(rows.end(), {b, e});
    for (const auto& [b, e] : inner_shard_rows) inner_rows.insert(inner_rows.end(), {b, e});
    if (!shard_rows.empty() && shard_rows.size() != params_.size()) {
      RaiseInvalid("shard_rows has " + std::to_string(shard_rows.size()) + " ranges for " +
                   std::to_string(params_.size()) + " parameters");
    }
    if (!inner_shard_rows.empty() && inner_shard_rows.size() != inner_.size()) {
      RaiseInvalid("inner_shard_rows has " + std::to_string(inner_shard_rows.size()) +
                   " ranges for " + std::to_string(inner_.size()) + " inner_state tensors");
    }
    ext.shard_rows = rows.empty() ? nullptr : rows.data();
    ext.inner_shard_rows = inner_rows.empty() ? nullptr : inner_rows.data();
    d_ = lk_diloco_create_ext(session.raw(), &o, &ext);
    if (d_ == nullptr) RaiseLast();
    session_ = &session;
    session_->AddUser();
  }
  ~Diloco() {
    lk_diloco_close(d_);
    if (session_ != nullptr) session_->DropUser();
  }
  Diloco(const Diloco&) = delete;
  Diloco& operator=(const Diloco&) = delete;

  py::dict Join(uintptr_t params, size_t count) {
    lk_diloco_result r{};
    Call([&] {
      return lk_diloco_join_typed(d_, reinterpret_cast<void*>(params), count, dtype_, &r);
    });
    return WithTokens(ResultDict(r));
  }
  // The result's token weights and global hash (lk_diloco_last_tokens).
  py::dict WithTokens(py::dict d) {
    py::dict stats = d["stats"];
    stats["wait_ms"] = lk_diloco_last_wait_ms(d_);
    lk_diloco_tokens t{};
    lk_diloco_last_tokens(d_, &t);
    d["tokens"] = t.tokens;
    d["quorum_tokens"] = t.quorum_tokens;
    d["weighted"] = t.weighted != 0;
    d["global_hash"] = std::string(t.global_hash);
    size_t extra = 0;
    d["extra_state_restored"] = lk_diloco_restored_extra_state(d_, &extra) != nullptr;
    return d;
  }
  py::dict Sync(uintptr_t params, size_t count, uint64_t tokens) {
    lk_diloco_result r{};
    Call([&] {
      return lk_diloco_sync_typed(d_, reinterpret_cast<void*>(params), count, dtype_, tokens, &r);
    });
    return WithTokens(ResultDict(r));
  }
  py::dict Flush(uintptr_t params, size_t count) {
    lk_diloco_result r{};
    Call([&] {
      return lk_diloco_flush_typed(d_, reinterpret_cast<void*>(params), count, dtype_, &r);
    });
    return WithTokens(ResultDict(r));
  }
  bool in_flight() const { return lk_diloco_in_flight(d_) != 0; }
  // A copy, as RestoredInnerState.
  py::bytes GlobalWeights() const {
    size_t count = 0;
    const float* p = lk_diloco_global_weights(d_, &count);
    return py::bytes(reinterpret_cast<const char*>(p), count * sizeof(float));
  }
  void GroupAllReduceSum(uintptr_t values, size_t count) {
    Call([&] { return lk_diloco_group_allreduce_sum(d_, reinterpret_cast<float*>(values), count); },
         true);
  }
  void Finish() {
    Call([&] { return lk_diloco_finish(d_); });
  }
  bool drain_requested() const { return lk_diloco_drain_requested(d_) != 0; }
  void RequestDrain() { lk_diloco_request_drain(d_); }
  // A copy: the library's buffer is valid only until its next call.
  py::bytes RestoredInnerState() const {
    size_t count = 0;
    const float* p = lk_diloco_restored_inner_state(d_, &count);
    return py::bytes(reinterpret_cast<const char*>(p), count * sizeof(float));
  }
  // The bytes are copied by the library before the call returns.
  void SetExtraState(const py::bytes& data) {
    std::string_view v = data;
    Call([&] { return lk_diloco_set_extra_state(d_, v.data(), v.size()); });
  }
  // A copy, or None when the last call restored none.
  py::object RestoredExtraState() const {
    size_t size = 0;
    const void* p = lk_diloco_restored_extra_state(d_, &size);
    if (p == nullptr) return py::none();
    return py::bytes(static_cast<const char*>(p), size);
  }
  uint32_t step() const { return lk_diloco_step(d_); }
  size_t numel() const { return lk_diloco_numel(d_); }
  size_t shard_numel() const { return lk_diloco_shard_numel(d_); }
  size_t param_numel() const { return lk_diloco_param_numel(d_); }
  uint64_t outer_state_bytes() const { return lk_diloco_outer_state_bytes(d_); }

 private:
  // Runs on the trainer's thread inside lk_diloco_sync/finish, which released the GIL.
  static int SaveInner(void* user, float* out, size_t count) {
    auto* self = static_cast<Diloco*>(user);
    py::gil_scoped_acquire acquire;
    try {
      self->inner_save_(reinterpret_cast<uintptr_t>(out), count);
      return 0;
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("lightkeeper inner optimizer state for a durable save");
      return -1;
    }
  }

  int dtype_ = LK_DTYPE_FLOAT32;  // the parameter buffer's (LK_DTYPE_*)
  lk_diloco* d_ = nullptr;
  Session* session_ = nullptr;  // kept alive by py::keep_alive
  std::vector<Spec> params_, inner_;  // the C specs point into these names and shapes
  std::function<void(uintptr_t, size_t)> inner_save_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Lightkeeper's trainer client (compiled part; use the lightkeeper package)";
  py::module_ errors = py::module_::import("lightkeeper.errors");
  g_error_of = new py::object(errors.attr("error_of"));
  g_quorum_lost_type = new py::object(errors.attr("QuorumLost"));
  m.attr("nccl_built") = py::bool_(LK_NCCL_BUILT != 0);

  py::class_<Quorum>(m, "Quorum",
                     "The agent's answer to a poll: the quorum this outer step runs on and what "
                     "the trainer must do before it.")
      .def_readonly("quorum_id", &Quorum::quorum_id)
      .def_readonly("replica_rank", &Quorum::replica_rank)
      .def_readonly("replica_world_size", &Quorum::replica_world_size)
      .def_readonly("max_step", &Quorum::max_step)
      .def_readonly("reconfigure", &Quorum::reconfigure)
      .def_readonly("heal", &Quorum::heal)
      .def_readonly("drain", &Quorum::drain)
      .def_readonly("checkpoint_now", &Quorum::checkpoint_now)
      .def_readonly("initial", &Quorum::initial)
      .def_readonly("heal_sources", &Quorum::heal_sources)
      .def_readonly("group_sizes", &Quorum::group_sizes,
                    "Every member's group size (index = replica_rank) when the quorum's groups "
                    "differ in size; empty when they are all equal or on answers that join "
                    "nothing new.")
      .def_readonly("restore_location", &Quorum::restore_location)
      .def_readonly("restore_step", &Quorum::restore_step)
      .def_readonly("reason", &Quorum::reason)
      .def_readonly("from_board", &Quorum::from_board)
      .def("__repr__", [](const Quorum& q) {
        return "Quorum(quorum_id=" + std::to_string(q.quorum_id) +
               ", replica_rank=" + std::to_string(q.replica_rank) +
               ", replica_world_size=" + std::to_string(q.replica_world_size) +
               ", max_step=" + std::to_string(q.max_step) + ", heal=" + (q.heal ? "True" : "False") +
               ", drain=" + (q.drain ? "True" : "False") + ")";
      });

  py::class_<Session>(m, "Session")
      .def(py::init<const std::string&, uint32_t, uint32_t>(), py::arg("socket"),
           py::arg("group_rank"), py::arg("group_size"))
      .def("poll", &Session::Poll)
      .def("commit", &Session::Commit, py::arg("step"), py::arg("ok"), py::arg("state_hash"),
           py::arg("tokens") = 0)
      .def("finish", &Session::Finish)
      .def("set_peer_wait", &Session::SetPeerWait)
      .def("set_mixed_group_sizes", &Session::SetMixedGroupSizes)
      .def("register_checkpoint", &Session::RegisterCheckpoint)
      .def("kv_put", [](Session& s, uint32_t q, const std::string& k, py::bytes v) {
        s.KvPut(q, k, std::string(v));
      })
      .def("kv_get", &Session::KvGet)
      .def("notices", &Session::Notices)
      .def("lost_quorum_id", &Session::LostQuorumId)
      .def("drain_noticed", &Session::DrainNoticed)
      .def("close", &Session::Close)
      .def_property_readonly("closed", &Session::closed)
      .def_property_readonly("users", &Session::users);

  py::class_<Comm>(m, "Comm")
      .def(py::init<Session&, const std::string&, uint32_t, const std::string&,
                    const std::string&, uint32_t, uint32_t, int>(),
           py::arg("session"), py::arg("backend"), py::arg("slot"), py::arg("key_prefix"),
           py::arg("bind_host"), py::arg("init_timeout_ms"), py::arg("op_timeout_ms"),
           py::arg("device_index") = 0,
           py::keep_alive<1, 2>())  // the session outlives its communicators
      .def("reconfigure", &Comm::Reconfigure)
      .def("allreduce", &Comm::AllReduce)
      .def("abort", &Comm::Abort)
      .def("abort_quorum", &Comm::AbortQuorum)
      .def_property_readonly("quorum_id", &Comm::quorum_id)
      .def("close", &Comm::Close);

  py::class_<Spec>(m, "TensorSpec")
      .def(py::init([](std::string name, size_t offset, std::vector<int64_t> shape) {
             return Spec{std::move(name), offset, std::move(shape)};
           }),
           py::arg("name"), py::arg("offset"), py::arg("shape"))
      .def_readonly("name", &Spec::name)
      .def_readonly("offset", &Spec::offset)
      .def_readonly("shape", &Spec::shape);

  py::class_<Diloco>(m, "Diloco")
      .def(py::init<Session&, uint32_t, uint32_t, std::vector<Spec>, std::vector<Spec>,
                    std::function<void(uintptr_t, size_t)>, float, float, bool,
                    const std::string&, uint32_t, uint32_t, const std::string&,
                    const std::string&, uint32_t, uint32_t, uint32_t, const std::string&,
                    bool, uint32_t, uint64_t, const std::string&, bool, const std::string&,
                    const std::vector<std::pair<int64_t, int64_t>>&,
                    const std::vector<std::pair<int64_t, int64_t>>&>(),
           // Keyword-only after the session: twenty options by position were a trap (two
           // swapped timeouts or counts still type-check).
           py::arg("session"), py::kw_only(), py::arg("group_rank"), py::arg("group_size"),
           py::arg("params"), py::arg("inner_state"), py::arg("inner_save"),
           py::arg("outer_lr") = 0.7f, py::arg("outer_momentum") = 0.9f,
           py::arg("nesterov") = true, py::arg("ckpt_dir") = "", py::arg("ckpt_every") = 0u,
           py::arg("ckpt_keep") = 3u, py::arg("live_dir") = "",
           py::arg("bind_host") = "127.0.0.1", py::arg("init_timeout_ms") = 30000u,
           py::arg("op_timeout_ms") = 120000u, py::arg("stuck_timeout_ms") = 0u,
           py::arg("outer_compress") = "none", py::arg("overlap") = false,
           py::arg("outer_fragments") = 1u,
           py::arg("extra_state_bytes_max") = uint64_t{4} << 20,
           py::arg("param_dtype") = "float32", py::arg("sharded") = false,
           py::arg("shard_rule") = "even",
           py::arg("shard_rows") = std::vector<std::pair<int64_t, int64_t>>(),
           py::arg("inner_shard_rows") = std::vector<std::pair<int64_t, int64_t>>(),
           py::keep_alive<1, 2>())  // the session outlives the DiLoCo object
      .def("join", &Diloco::Join)
      .def("sync", &Diloco::Sync, py::arg("params"), py::arg("count"), py::arg("tokens") = 0)
      .def("flush", &Diloco::Flush)
      .def_property_readonly("in_flight", &Diloco::in_flight)
      .def("global_weights", &Diloco::GlobalWeights)
      .def("group_allreduce_sum", &Diloco::GroupAllReduceSum)
      .def("finish", &Diloco::Finish)
      .def("drain_requested", &Diloco::drain_requested)
      .def("request_drain", &Diloco::RequestDrain)
      .def("restored_inner_state", &Diloco::RestoredInnerState)
      .def("set_extra_state", &Diloco::SetExtraState, py::arg("data"))
      .def("restored_extra_state", &Diloco::RestoredExtraState)
      .def_property_readonly("step", &Diloco::step)
      .def_property_readonly("numel", &Diloco::numel)
      .def_property_readonly("shard_numel", &Diloco::shard_numel)
      .def_property_readonly("param_numel", &Diloco::param_numel)
      .def_property_readonly("outer_state_bytes", &Diloco::outer_state_bytes);

  // The library's rounding between float32 and a 16-bit dtype (lk_dtype_convert), over raw
  // buffers: for tests against torch.
  // A tensor's rows under a shard rule (lk_diloco_shard_rows_rule): "even" or "chunk".
  m.def("shard_rows",
        [](int64_t rows, uint32_t ranks, uint32_t rank, const std::string& rule) {
          int64_t begin = 0, end = 0;
          const int code = ShardRuleCode(rule);
          Call([&] { return lk_diloco_shard_rows_rule(rows, ranks, rank, code, &begin, &end); });
          return py::make_tuple(begin, end);
        },
        py::arg("rows"), py::arg("ranks"), py::arg("rank"), py::arg("rule") = "even");
  m.def("convert_dtype",
        [](uintptr_t in, const std::string& in_dtype, uintptr_t out, const std::string& out_dtype,
           size_t count) {
          const int from = DTypeCode(in_dtype), to = DTypeCode(out_dtype);
          Call([&] {
            return lk_dtype_convert(reinterpret_cast<const void*>(in), from,
                                    reinterpret_cast<void*>(out), to, count);
          });
        },
        py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"),
        py::arg("count"));
}
