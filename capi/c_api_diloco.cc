// The C API's communicator and DiLoCo outer step, over lk::comm::CommManager and
// lk::diloco::Diloco.
#include <cstddef>
#include <cstring>

#include <lightkeeper/diloco.h>
#include "diloco/param_dtype.h"
#include "diloco/prefixed_store.h"
#include "capi/c_api_internal.h"
#include "client/session_store.h"
#include "comm/comm.h"

using lk::capi::Fail;

struct lk_comm {
  std::shared_ptr<lk::capi::Fanout> fanout;
  std::unique_ptr<lk::client::SessionKvStore> kv;
  std::unique_ptr<lk::diloco::PrefixedStore> store;
  std::unique_ptr<lk::comm::CommManager> comm;
};

struct lk_diloco {
  std::shared_ptr<lk::capi::Fanout> fanout;
  std::unique_ptr<lk::diloco::Diloco> diloco;
  lk_diloco_tokens last_tokens{};  // of the last join or sync
  double last_wait_ms = 0;          // of the last join, sync or flush
};

namespace lk::capi {

void DeliverToDiloco(lk_diloco* d, const client::Notice& n) { d->diloco->HandleNotice(n); }

namespace {

std::vector<diloco::TensorSpec> Specs(const lk_tensor_spec* specs, size_t count) {
  std::vector<diloco::TensorSpec> out;
  for (size_t i = 0; i < count; ++i) {
    diloco::TensorSpec t;
    t.name = specs[i].name ? specs[i].name : "";
    t.offset = specs[i].offset;
    t.shape.assign(specs[i].shape, specs[i].shape + specs[i].ndim);
    out.push_back(std::move(t));
  }
  return out;
}

void CopyTruncated(const std::string& from, char* to, size_t cap) {
  size_t n = std::min(from.size(), cap - 1);
  std::memcpy(to, from.data(), n);
  to[n] = '\0';
}

void FillResult(const diloco::SyncResult& r, lk_diloco_result* out) {
  std::memset(out, 0, sizeof(*out));
  out->kind = static_cast<int>(r.kind == diloco::SyncKind::kCommitted  ? LK_SYNC_COMMITTED
                               : r.kind == diloco::SyncKind::kReceived ? LK_SYNC_RECEIVED
                               : r.kind == diloco::SyncKind::kJoined   ? LK_SYNC_JOINED
                               : r.kind == diloco::SyncKind::kStarted  ? LK_SYNC_STARTED
                                                                       : LK_SYNC_DRAINED);
  out->step = r.step;
  out->quorum_id = r.quorum_id;
  out->replica_rank = r.replica_rank;
  out->replica_world_size = r.replica_world_size;
  out->healed = r.healed ? 1 : 0;
  out->inner = r.inner == diloco::InnerAction::kKeep    ? LK_INNER_KEEP
               : r.inner == diloco::InnerAction::kReset ? LK_INNER_RESET
                                                        : LK_INNER_RESTORED;
  out->saved = r.saved ? 1 : 0;
  out->checkpoint_now = r.checkpoint_now ? 1 : 0;
  CopyTruncated(r.state_hash, out->state_hash, sizeof(out->state_hash));
  CopyTruncated(r.heal_source, out->heal_source, sizeof(out->heal_source));
  CopyTruncated(r.reason, out->reason, sizeof(out->reason));
  const diloco::SyncStats& s = r.stats;
  out->poll_ms = s.poll_ms;
  out->join_ms = s.join_ms;
  out->allreduce_ms = s.allreduce_ms;
  out->gather_ms = s.gather_ms;
  out->publish_ms = s.publish_ms;
  out->commit_ms = s.commit_ms;
  out->outer_ms = s.outer_ms;
  out->cross_bytes = s.cross_bytes;
  out->sync_bytes = s.sync_bytes;
  out->group_bytes = s.group_bytes;
}

enum class Call { kJoin, kSync, kFlush };

bool DTypeOf(int c, diloco::ParamDType* out) {
  switch (c) {
    case LK_DTYPE_FLOAT32: *out = diloco::ParamDType::kFloat32; return true;
    case LK_DTYPE_BFLOAT16: *out = diloco::ParamDType::kBfloat16; return true;
    case LK_DTYPE_FLOAT16: *out = diloco::ParamDType::kFloat16; return true;
    default: return false;
  }
}

bool ShardRuleOf(int c, diloco::ShardRule* out) {
  switch (c) {
    case LK_SHARD_EVEN: *out = diloco::ShardRule::kEven; return true;
    case LK_SHARD_CHUNK: *out = diloco::ShardRule::kChunk; return true;
    default: return false;
  }
}

// One call over a buffer of `dtype`: the float32 overloads for LK_DTYPE_FLOAT32, the 16-bit
// ones otherwise (each refuses a dtype that is not the options').
Result<diloco::SyncResult> Call16Or32(lk_diloco* d, void* params, size_t count, int dtype,
                                      Call call, uint64_t tokens) {
  diloco::ParamDType t;
  if (!DTypeOf(dtype, &t)) return InvalidArgument("unknown parameter dtype {}", dtype);
  if (t == diloco::ParamDType::kFloat32) {
    std::span<float> p(static_cast<float*>(params), count);
    return call == Call::kJoin   ? d->diloco->Join(p)
           : call == Call::kSync ? d->diloco->Sync(p, tokens)
                                 : d->diloco->Flush(p);
  }
  if (t != d->diloco->param_dtype()) {
    return InvalidArgument("the parameter buffer is {} but the options' param_dtype is {}",
                           diloco::ParamDTypeName(t),
                           diloco::ParamDTypeName(d->diloco->param_dtype()));
  }
  std::span<uint16_t> p(static_cast<uint16_t*>(params), count);
  return call == Call::kJoin   ? d->diloco->Join(p)
         : call == Call::kSync ? d->diloco->Sync(p, tokens)
                               : d->diloco->Flush(p);
}

int Run(lk_diloco* d, void* params, size_t count, lk_diloco_result* out, Call call,
        uint64_t tokens = 0, int dtype = LK_DTYPE_FLOAT32) {
  if (params == nullptr && count > 0) return Fail(InvalidArgument("params is NULL"));
  auto r = Call16Or32(d, params, count, dtype, call, tokens);
  if (!r.ok()) return Fail(r.status());
  d->last_tokens = lk_diloco_tokens{};
  d->last_tokens.tokens = r->tokens;
  d->last_tokens.quorum_tokens = r->quorum_tokens;
  d->last_tokens.weighted = r->weighted ? 1 : 0;
  CopyTruncated(r->global_hash, d->last_tokens.global_hash, sizeof(d->last_tokens.global_hash));
  d->last_wait_ms = r->stats.wait_ms;
  if (out != nullptr) FillResult(*r, out);
  return 0;
}

}  // namespace
}  // namespace lk::capi

extern "C" {

lk_comm* lk_comm_create(lk_session* s, const lk_comm_options* options) {
  lk_comm_options o{};
  if (options != nullptr) o = *options;
  lk::comm::Backend backend = lk::comm::Backend::kGloo;
  if (o.backend != nullptr && !lk::comm::ParseBackend(o.backend, &backend)) {
    Fail(lk::InvalidArgument("unknown backend '{}' (gloo or nccl)", o.backend));
    return nullptr;
  }
  lk::comm::CommOptions co;
  co.slot = o.slot;
  if (o.bind_host != nullptr) co.bind_host = o.bind_host;
  if (o.init_timeout_ms > 0) co.init_timeout = lk::Millis(o.init_timeout_ms);
  if (o.op_timeout_ms > 0) co.op_timeout = lk::Millis(o.op_timeout_ms);
  co.device_index = o.device_index;
  auto c = std::make_unique<lk_comm>();
  c->fanout = s->fanout;
  c->kv = std::make_unique<lk::client::SessionKvStore>(s->session->socket_path());
  c->store =
      std::make_unique<lk::diloco::PrefixedStore>(c->kv.get(), o.key_prefix ? o.key_prefix : "");
  auto comm = lk::comm::CommManager::Create(backend, c->store.get(), co);
  if (!comm.ok()) {
    Fail(comm.status());
    return nullptr;
  }
  c->comm = std::move(*comm);
  std::lock_guard lock(s->fanout->mu);
  s->fanout->comms.insert(c.get());
  return c.release();
}

void lk_comm_close(lk_comm* c) {
  if (c == nullptr) return;
  {
    std::lock_guard lock(c->fanout->mu);
    c->fanout->comms.erase(c);
  }
  delete c;
}

int lk_comm_reconfigure(lk_comm* c, uint32_t quorum_id, uint32_t replica_rank,
                        uint32_t world_size) {
  lk::Status st = c->comm->Reconfigure(quorum_id, replica_rank, world_size);
  return st.ok() ? 0 : Fail(st);
}

int lk_comm_allreduce(lk_comm* c, void* data, size_t count, int dtype, int op) {
  if (dtype != LK_DTYPE_FLOAT32 && dtype != LK_DTYPE_BFLOAT16) {
    return Fail(lk::InvalidArgument("unknown dtype {}", dtype));
  }
  if (op != LK_REDUCE_SUM && op != LK_REDUCE_AVG)
    return Fail(lk::InvalidArgument("unknown op {}", op));
  lk::Status st = c->comm->AllReduce(
      data, count,
      dtype == LK_DTYPE_FLOAT32 ? lk::comm::DType::kFloat32 : lk::comm::DType::kBFloat16,
      op == LK_REDUCE_SUM ? lk::comm::ReduceOp::kSum : lk::comm::ReduceOp::kAvg);
  return st.ok() ? 0 : Fail(st);
}

void lk_comm_abort(lk_comm* c, const char* reason) { c->comm->Abort(reason ? reason : "abort"); }

void lk_comm_abort_quorum(lk_comm* c, uint32_t quorum_id, const char* reason) {
  c->comm->AbortQuorum(quorum_id, reason ? reason : "abort");
}

uint32_t lk_comm_quorum_id(const lk_comm* c) { return c->comm->quorum_id(); }

lk_diloco* lk_diloco_create(lk_session* s, const lk_diloco_options* options) {
  return lk_diloco_create_ext(s, options, nullptr);
}

lk_diloco* lk_diloco_create_ext(lk_session* s, const lk_diloco_options* options,
                                const lk_diloco_ext_options* ext) {
  if (options == nullptr) {
    Fail(lk::InvalidArgument("no options"));
    return nullptr;
  }
  const lk_diloco_options& o = *options;
  lk::diloco::DilocoOptions d;
  d.group_rank = o.group_rank;
  d.group_size = o.group_size;
  d.params = lk::capi::Specs(o.params, o.param_count);
  d.inner_state = lk::capi::Specs(o.inner_state, o.inner_state_count);
  if (o.outer_lr > 0) d.outer.lr = o.outer_lr;
  if (o.outer_momentum >= 0) d.outer.momentum = o.outer_momentum;
  d.outer.nesterov = o.nesterov != 0;
  if (o.ckpt_dir != nullptr) d.ckpt_dir = o.ckpt_dir;
  d.ckpt_every = o.ckpt_every;
  if (o.ckpt_keep > 0) d.ckpt_keep = o.ckpt_keep;
  if (o.live_dir != nullptr) d.live_dir = o.live_dir;
  if (o.bind_host != nullptr) d.bind_host = o.bind_host;
  if (o.init_timeout_ms > 0) d.init_timeout = lk::Millis(o.init_timeout_ms);
  if (o.op_timeout_ms > 0) d.op_timeout = lk::Millis(o.op_timeout_ms);
  d.stuck_timeout = lk::Millis(o.stuck_timeout_ms);
  d.own_notices = false;  // the session's fan-out hands them on
  if (ext != nullptr) {
    // A field counts only when the caller's struct reaches past it (see lightkeeper.h).
    auto has = [ext](size_t offset, size_t size) { return ext->struct_size >= offset + size; };
    if (has(offsetof(lk_diloco_ext_options, outer_compress), sizeof(ext->outer_compress)) &&
        ext->outer_compress != nullptr && ext->outer_compress[0] != '\0' &&
        !lk::diloco::ParseOuterCompress(ext->outer_compress, &d.outer_compress)) {
      Fail(lk::InvalidArgument("unknown outer_compress '{}' (none, bf16, int8 or int4)",
                               ext->outer_compress));
      return nullptr;
    }
    if (has(offsetof(lk_diloco_ext_options, overlap), sizeof(ext->overlap))) {
      d.overlap = ext->overlap != 0;
    }
    if (has(offsetof(lk_diloco_ext_options, outer_fragments), sizeof(ext->outer_fragments)) &&
        ext->outer_fragments > 0) {
      d.outer_fragments = ext->outer_fragments;
    }
    if (has(offsetof(lk_diloco_ext_options, extra_state_bytes_max),
            sizeof(ext->extra_state_bytes_max)) &&
        ext->extra_state_bytes_max > 0) {
      d.extra_state_bytes_max = ext->extra_state_bytes_max;
    }
    if (has(offsetof(lk_diloco_ext_options, param_dtype), sizeof(ext->param_dtype)) &&
        !lk::capi::DTypeOf(ext->param_dtype, &d.param_dtype)) {
      Fail(lk::InvalidArgument("unknown param_dtype {} (LK_DTYPE_FLOAT32, LK_DTYPE_BFLOAT16 or "
                               "LK_DTYPE_FLOAT16)",
                               ext->param_dtype));
      return nullptr;
    }
    if (has(offsetof(lk_diloco_ext_options, sharded), sizeof(ext->sharded))) {
      d.sharded = ext->sharded != 0;
    }
    if (has(offsetof(lk_diloco_ext_options, shard_rule), sizeof(ext->shard_rule)) &&
        !lk::capi::ShardRuleOf(ext->shard_rule, &d.shard_rule)) {
      Fail(lk::InvalidArgument("unknown shard_rule {} (LK_SHARD_EVEN or LK_SHARD_CHUNK)",
                               ext->shard_rule));
      return nullptr;
    }
    auto rows_of = [](const int64_t* pairs, size_t count) {
      std::vector<lk::diloco::RowRange> rows;
      for (size_t i = 0; i < count; ++i) rows.push_back({pairs[2 * i], pairs[2 * i + 1]});
      return rows;
    };
    if (has(offsetof(lk_diloco_ext_options, shard_rows), sizeof(ext->shard_rows)) &&
        ext->shard_rows != nullptr) {
      d.shard_rows = rows_of(ext->shard_rows, d.params.size());
    }
    if (has(offsetof(lk_diloco_ext_options, inner_shard_rows), sizeof(ext->inner_shard_rows)) &&
        ext->inner_shard_rows != nullptr) {
      d.inner_shard_rows = rows_of(ext->inner_shard_rows, d.inner_state.size());
    }
  }
  lk::diloco::InnerStateHooks hooks;
  if (o.inner_save != nullptr) {
    hooks.save = [fn = o.inner_save, user = o.inner_save_user](std::span<float> out) {
      if (fn(user, out.data(), out.size()) != 0) {
        return lk::Status(lk::Code::kInternal, "the inner state callback failed");
      }
      return lk::Status::Ok();
    };
  }
  auto made = lk::diloco::Diloco::Create(s->session.get(), std::move(d), std::move(hooks));
  if (!made.ok()) {
    Fail(made.status());
    return nullptr;
  }
  auto out = std::make_unique<lk_diloco>();
  out->fanout = s->fanout;
  out->diloco = std::move(*made);
  std::lock_guard lock(s->fanout->mu);
  s->fanout->dilocos.insert(out.get());
  return out.release();
}

void lk_diloco_close(lk_diloco* d) {
  if (d == nullptr) return;
  {
    std::lock_guard lock(d->fanout->mu);
    d->fanout->dilocos.erase(d);
  }
  delete d;
}

int lk_diloco_join(lk_diloco* d, float* params, size_t count, lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kJoin);
}

int lk_diloco_sync(lk_diloco* d, float* params, size_t count, lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kSync);
}

int lk_diloco_sync_tokens(lk_diloco* d, float* params, size_t count, uint64_t tokens,
                          lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kSync, tokens);
}

int lk_diloco_flush(lk_diloco* d, float* params, size_t count, lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kFlush);
}

int lk_diloco_in_flight(const lk_diloco* d) { return d->diloco->in_flight() ? 1 : 0; }

double lk_diloco_last_wait_ms(const lk_diloco* d) { return d->last_wait_ms; }

const float* lk_diloco_global_weights(const lk_diloco* d, size_t* count) {
  auto s = d->diloco->global_weights();
  if (count != nullptr) *count = s.size();
  return s.data();
}

void lk_diloco_last_tokens(const lk_diloco* d, lk_diloco_tokens* out) {
  if (out != nullptr) *out = d->last_tokens;
}

int lk_diloco_drain_requested(const lk_diloco* d) { return d->diloco->drain_requested() ? 1 : 0; }

void lk_diloco_request_drain(lk_diloco* d) { d->diloco->RequestDrain(); }

int lk_diloco_group_allreduce_sum(lk_diloco* d, float* values, size_t count) {
  lk::Status st = d->diloco->GroupAllReduceSum(std::span<float>(values, count));
  return st.ok() ? 0 : Fail(st);
}

int lk_diloco_finish(lk_diloco* d) {
  lk::Status st = d->diloco->Finish();
  return st.ok() ? 0 : Fail(st);
}

const float* lk_diloco_restored_inner_state(const lk_diloco* d, size_t* count) {
  auto s = d->diloco->restored_inner_state();
  if (count != nullptr) *count = s.size();
  return s.data();
}

int lk_diloco_set_extra_state(lk_diloco* d, const void* data, size_t size) {
  if (data == nullptr && size > 0) return Fail(lk::InvalidArgument("extra state: NULL data"));
  lk::Status st = d->diloco->SetExtraState(
      std::span<const uint8_t>(static_cast<const uint8_t*>(data), data == nullptr ? 0 : size));
  return st.ok() ? 0 : Fail(st);
}

const void* lk_diloco_restored_extra_state(const lk_diloco* d, size_t* size) {
  auto s = d->diloco->restored_extra_state();
  if (size != nullptr) *size = s.size();
  return s.empty() ? nullptr : s.data();
}

uint32_t lk_diloco_step(const lk_diloco* d) { return d->diloco->step(); }
size_t lk_diloco_numel(const lk_diloco* d) { return d->diloco->numel(); }
size_t lk_diloco_shard_numel(const lk_diloco* d) { return d->diloco->shard_numel(); }
size_t lk_diloco_param_numel(const lk_diloco* d) { return d->diloco->param_numel(); }
int lk_diloco_shard_rows(int64_t rows, uint32_t ranks, uint32_t rank, int64_t* begin,
                         int64_t* end) {
  return lk_diloco_shard_rows_rule(rows, ranks, rank, LK_SHARD_EVEN, begin, end);
}

int lk_diloco_shard_rows_rule(int64_t rows, uint32_t ranks, uint32_t rank, int rule,
                              int64_t* begin, int64_t* end) {
  if (begin == nullptr || end == nullptr) return Fail(lk::InvalidArgument("begin or end is NULL"));
  lk::diloco::ShardRule r = lk::diloco::ShardRule::kEven;
  if (!lk::capi::ShardRuleOf(rule, &r)) {
    return Fail(lk::InvalidArgument("unknown shard rule {} (LK_SHARD_EVEN or LK_SHARD_CHUNK)",
                                    rule));
  }
  if (rows < 1 || rank >= ranks) {
    return Fail(lk::InvalidArgument("rows {} must be at least 1 and rank {} below ranks {}", rows,
                                    rank, ranks));
  }
  lk::diloco::TensorSpec spec;
  spec.name = "t";
  spec.shape = {rows};
  const lk::diloco::RowRange got = lk::diloco::ShardRows(spec, ranks, rank, r);
  *begin = got.begin;
  *end = got.end;
  return 0;
}

int lk_diloco_join_typed(lk_diloco* d, void* params, size_t count, int dtype,
                         lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kJoin, 0, dtype);
}

int lk_diloco_sync_typed(lk_diloco* d, void* params, size_t count, int dtype, uint64_t tokens,
                         lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kSync, tokens, dtype);
}

int lk_diloco_flush_typed(lk_diloco* d, void* params, size_t count, int dtype,
                          lk_diloco_result* out) {
  return lk::capi::Run(d, params, count, out, lk::capi::Call::kFlush, 0, dtype);
}

int lk_dtype_convert(const void* in, int in_dtype, void* out, int out_dtype, size_t count) {
  lk::diloco::ParamDType from, to;
  if (!lk::capi::DTypeOf(in_dtype, &from) || !lk::capi::DTypeOf(out_dtype, &to)) {
    return Fail(lk::InvalidArgument("unknown dtype {} or {}", in_dtype, out_dtype));
  }
  if (count > 0 && (in == nullptr || out == nullptr)) return Fail(lk::InvalidArgument("NULL"));
  using lk::diloco::ParamDType;
  if (from == to) {
    if (count > 0) std::memmove(out, in, count * lk::diloco::ParamDTypeBytes(from));
    return 0;
  }
  if (from == ParamDType::kFloat32) {
    lk::diloco::NarrowParams(to, std::span<const float>(static_cast<const float*>(in), count),
                             std::span<uint16_t>(static_cast<uint16_t*>(out), count));
    return 0;
  }
  if (to == ParamDType::kFloat32) {
    lk::diloco::WidenParams(
        from, std::span<const uint16_t>(static_cast<const uint16_t*>(in), count),
        std::span<float>(static_cast<float*>(out), count));
    return 0;
  }
  return Fail(lk::InvalidArgument("no conversion between two 16-bit dtypes"));
}

int lk_diloco_param_dtype(const lk_diloco* d) {
  switch (d->diloco->param_dtype()) {
    case lk::diloco::ParamDType::kBfloat16: return LK_DTYPE_BFLOAT16;
    case lk::diloco::ParamDType::kFloat16: return LK_DTYPE_FLOAT16;
    default: return LK_DTYPE_FLOAT32;
  }
}

uint64_t lk_diloco_outer_state_bytes(const lk_diloco* d) { return d->diloco->outer_state_bytes(); }

}  // extern "C"
