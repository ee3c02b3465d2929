// The shell of the DiLoCo outer step (diloco/diloco_impl.h lists its files): the options'
// check, the communicators, the in-group agreements every mechanism uses, and the public face.
// It polls, runs the collectives and the state I/O, and asks diloco/core.h what to do at each
// turn. Only the shell logs.
#include <lightkeeper/diloco.h>

#include <cstdlib>
#include <thread>

#include "common/float_env.h"
#include "common/log.h"
#include "diloco/diloco_impl.h"

namespace lk::diloco {

namespace {

using internal::NoticeSink;
using Clock = internal::Clock;

}  // namespace

void internal::Deliver(NoticeSink& sink, const client::Notice& n) {
  if (n.drain) sink.drain = true;
  std::lock_guard lock(sink.mu);
  // Only this function writes it, under mu; the join reads it without the lock.
  if (n.lost && n.quorum_id > sink.lost_quorum_id.load()) sink.lost_quorum_id = n.quorum_id;
  for (comm::CommManager* c : {sink.slot, sink.mesh}) {
    if (c == nullptr) continue;
    if (n.drain) {
      c->Close("drain: " + n.reason);
    } else if (n.lost) {
      c->AbortQuorum(n.quorum_id, "quorum lost: " + n.reason);
    }
  }
}

uint32_t internal::TestPerturbStep() {
  const char* v = std::getenv("LK_TEST_PERTURB_STEP");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const unsigned long n = std::strtoul(v, &end, 10);
  if (*end != '\0' || n > UINT32_MAX) return 0;
  return static_cast<uint32_t>(n);
}

Status DilocoOptions::Validate() const {
  if (group_size == 0 || group_rank >= group_size) {
    return InvalidArgument("group_rank {} must be below group_size {}", group_rank, group_size);
  }
  if (group_size > kCountSumsMax) {
    return InvalidArgument("group_size {} is above {} (token counts are summed exactly up to it)",
                           group_size, kCountSumsMax);
  }
  size_t total = 0;
  if (params.empty()) return InvalidArgument("no parameters");
  LK_RETURN_IF_ERROR(ValidateSpecs(params, &total).WithContext("params"));
  LK_RETURN_IF_ERROR(ValidateSpecs(inner_state, &total).WithContext("inner_state"));
  if (!(outer.lr > 0) || !(outer.momentum >= 0) || outer.momentum >= 1) {
    return InvalidArgument("the outer lr must be positive and the outer momentum in [0, 1)");
  }
  if (ckpt_every > 0 && ckpt_dir.empty()) return InvalidArgument("ckpt_every needs a ckpt_dir");
  if (ckpt_keep == 0) return InvalidArgument("ckpt_keep must be at least 1");
  if (outer_fragments == 0 || outer_fragments > kMaxOuterFragments) {
    return InvalidArgument("outer_fragments {} is not in [1, {}]", outer_fragments,
                           kMaxOuterFragments);
  }
  if (outer_fragments > 1 && !overlap) {
    return InvalidArgument(
        "outer_fragments {} needs overlap: the fragments are spread over the inner steps that "
        "run while the exchange is in flight",
        outer_fragments);
  }
  if (OuterCompress parsed; !ParseOuterCompress(OuterCompressName(outer_compress), &parsed)) {
    return InvalidArgument("unknown outer_compress {}", static_cast<int>(outer_compress));
  }
  if (ShardRule parsed; !ParseShardRule(ShardRuleName(shard_rule), &parsed)) {
    return InvalidArgument("unknown shard_rule {}", static_cast<int>(shard_rule));
  }
  if (!sharded && (!shard_rows.empty() || !inner_shard_rows.empty())) {
    return InvalidArgument("shard_rows needs sharded: a replicated trainer holds every row");
  }
  if (!shard_rows.empty()) {
    LK_RETURN_IF_ERROR(CheckRowsWithin(params, shard_rows).WithContext("shard_rows"));
    if (group_size == 1) {
      LK_RETURN_IF_ERROR(CheckTiling(params, {shard_rows}).WithContext("a group of one"));
    }
    if (inner_shard_rows.empty() && !inner_state.empty()) {
      return InvalidArgument(
          "shard_rows needs inner_shard_rows too: this trainer's rows of each of the {} "
          "inner_state tensors",
          inner_state.size());
    }
  }
  if (!inner_shard_rows.empty()) {
    if (shard_rows.empty()) return InvalidArgument("inner_shard_rows needs shard_rows");
    LK_RETURN_IF_ERROR(
        CheckRowsWithin(inner_state, inner_shard_rows).WithContext("inner_shard_rows"));
    if (group_size == 1) {
      LK_RETURN_IF_ERROR(
          CheckTiling(inner_state, {inner_shard_rows}).WithContext("a group of one"));
    }
  }
  if (ParamDType parsed; !ParseParamDType(ParamDTypeName(param_dtype), &parsed)) {
    return InvalidArgument("unknown param_dtype {}", static_cast<int>(param_dtype));
  }
  if (extra_state_bytes_max > kExtraStateBytesLimit) {
    return InvalidArgument("extra_state_bytes_max {} is above {} bytes", extra_state_bytes_max,
                           kExtraStateBytesLimit);
  }
  return Status::Ok();
}

Status Diloco::Impl::Init() {
  comm::CommOptions co;
  co.slot = o_.group_rank;
  co.bind_host = o_.bind_host;
  co.init_timeout = o_.init_timeout;
  co.op_timeout = o_.op_timeout;
  // The encoded exchange sends every chunk straight to its owner (see comm.h).
  co.full_mesh = o_.outer_compress != OuterCompress::kNone;
  // The fragment-wise exchange averages with groups of any trainer count, so this group may
  // share quorums with groups of other sizes (the lighthouse's size rule is for trainers that
  // only know an exchange over equal layouts). Behind a site gateway it runs over Gloo between
  // trainers, which the sites cannot reach: there the group keeps to quorums of its own size,
  // and a group of another size is refused GROUP_SIZE_MISMATCH instead of timing out.
  session_->SetMixedGroupSizes(session_->gateway().url.empty());
  kv_ = std::make_unique<client::SessionKvStore>(session_->socket_path());
  slot_store_ = std::make_unique<PrefixedStore>(kv_.get(), "diloco/");
  // Behind a site gateway the cross-group exchange goes through it: the other sites' trainers
  // cannot be reached from here. The groups of a mixed-size quorum and the group's own
  // collectives stay on Gloo, inside the site.
  comm::Backend cross = comm::Backend::kGloo;
  if (const auto& gw = session_->gateway(); !gw.url.empty()) {
    cross = comm::Backend::kGateway;
    comm::CommOptions gco = co;
    gco.gateway_url = gw.url;
    gco.gateway_token = gw.token;
    gco.gateway_ca_file = gw.ca_file;
    gco.job = gw.job;
    co = gco;
  }
  LK_ASSIGN_OR_RETURN(slot_comm_, comm::CommManager::Create(cross, slot_store_.get(), co));
  // Quorums of groups of different sizes run their cross-group collectives on one communicator
  // over all their trainers, connected pairwise (AllReduceRuns sends to each fragment's owner).
  mesh_store_ = std::make_unique<PrefixedStore>(kv_.get(), "diloco-mesh/");
  comm::CommOptions mesh_co = co;
  mesh_co.slot = 0;
  mesh_co.full_mesh = true;
  LK_ASSIGN_OR_RETURN(mesh_comm_,
                      comm::CommManager::Create(comm::Backend::kGloo, mesh_store_.get(), mesh_co));
  if (o_.group_size > 1) {
    // The prefix names the group once its replica_rank is known (the first quorum).
    group_store_ = std::make_unique<PrefixedStore>(kv_.get(), "");
    co.slot = 0;
    co.full_mesh = false;
    // A trainer waits in the group's agreement while another trainer of the group may still be
    // in its cross-group rendezvous (up to init_timeout) and the collective after it.
    co.op_timeout = o_.op_timeout + o_.init_timeout;
    LK_ASSIGN_OR_RETURN(group_comm_,
                        comm::CommManager::Create(comm::Backend::kGloo, group_store_.get(), co));
  }
  {
    std::lock_guard lock(sink_->mu);
    sink_->slot = slot_comm_.get();
    sink_->mesh = mesh_comm_.get();
  }
  if (o_.own_notices) {
    session_->OnNotice([sink = sink_](const client::Notice& n) { internal::Deliver(*sink, n); });
  }
  state_io_ =
      MakeCheckpointStateIo(StateIoOptions{o_.ckpt_dir, o_.live_dir, o_.group_rank, o_.group_size,
                                           o_.params, o_.inner_state, o_.ckpt_keep,
                                           o_.sharded ? inner_rows_ : std::vector<RowRange>()});
  state_.global.assign(layout_.shard_numel, 0.0f);
  state_.momentum.assign(layout_.shard_numel, 0.0f);
  if (o_.outer_compress != OuterCompress::kNone) {
    codec_storage_.emplace(CodecOf(o_.outer_compress));
    codec_ = &*codec_storage_;
  }
  ResetResidual();
  return Status::Ok();
}

Status Diloco::Impl::GroupSum(std::span<float> v) {
  if (o_.group_size == 1) return Status::Ok();
  if (!group_ready_)
    return Status(Code::kInvalidArgument, "the group communicator needs Join first");
  Status st =
      group_comm_->AllReduce(v.data(), v.size(), comm::DType::kFloat32, comm::ReduceOp::kSum);
  if (st.ok()) return st;
  group_failed_ = true;
  return st.WithContext("intra-group allreduce");
}

Result<bool> Diloco::Impl::GroupAgree(bool ok, bool* drain) {
  float v[2] = {ok ? 1.0f : 0.0f, sink_->drain.load() ? 1.0f : 0.0f};
  LK_RETURN_IF_ERROR(GroupSum(std::span<float>(v, drain ? 2 : 1)));
  if (drain) *drain = v[1] > 0.5f;
  return v[0] > static_cast<float>(o_.group_size) - 0.5f;
}

Result<bool> Diloco::Impl::AgreeLanding(bool ok) {
  bool drain = false;  // left false when the agreement fails
  Result<bool> all_ok = GroupAgree(ok, &drain);
  OnLandingAgreed(proto_, drain);
  return all_ok;
}

bool Diloco::Impl::DrainNoticedWithin(Millis grace) const {
  const auto until = Clock::now() + grace;
  while (!sink_->drain.load()) {
    const auto now = Clock::now();
    if (now >= until) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(Millis(5), until - now));
  }
  return true;
}

SyncResult Diloco::Impl::MakeResult(SyncKind kind, const client::PollResult& pr,
                                    const SyncStats& stats) const {
  SyncResult r;
  r.kind = kind;
  r.step = state_.step;
  r.quorum_id = pr.quorum_id;
  r.replica_rank = pr.replica_rank;
  r.replica_world_size = pr.replica_world_size;
  r.state_hash = StateHash(state_.global);
  // A received state was loaded (LoadGlobal), so its whole-model hash is known too.
  if (kind == SyncKind::kCommitted || kind == SyncKind::kReceived) r.global_hash = global_hash_;
  r.reason = pr.reason;
  r.extra_state_restored = restored_extra_.has_value();
  r.stats = stats;
  return r;
}

Result<std::unique_ptr<Diloco>> Diloco::Create(client::Session* session, DilocoOptions options,
                                               InnerStateHooks hooks) {
  if (session == nullptr) return InvalidArgument("no session");
  LK_RETURN_IF_ERROR(options.Validate());
  if (options.group_rank != session->group_rank() || options.group_size != session->group_size()) {
    return InvalidArgument("group rank/size {}/{} differ from the session's {}/{}",
                           options.group_rank, options.group_size, session->group_rank(),
                           session->group_size());
  }
  auto impl = std::make_unique<Impl>(session, std::move(options), std::move(hooks));
  LK_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Diloco>(new Diloco(std::move(impl)));
}

Diloco::Diloco(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Diloco::~Diloco() = default;
// The calls that compute on the shared state do so in a fixed floating-point mode, whatever the
// caller's thread has set (common/float_env.h): every member must end with the same bits.
Result<SyncResult> Diloco::Join(std::span<float> params) {
  LK_RETURN_IF_ERROR(impl_->CheckDType(ParamDType::kFloat32));
  FixedFloatEnv env;
  return impl_->Join(params);
}
Result<SyncResult> Diloco::Sync(std::span<float> params) { return Sync(params, 0); }
Result<SyncResult> Diloco::Sync(std::span<float> params, uint64_t tokens) {
  LK_RETURN_IF_ERROR(impl_->CheckDType(ParamDType::kFloat32));
  FixedFloatEnv env;
  return impl_->Sync(params, tokens);
}
Result<SyncResult> Diloco::Flush(std::span<float> params) {
  LK_RETURN_IF_ERROR(impl_->CheckDType(ParamDType::kFloat32));
  FixedFloatEnv env;
  return impl_->Flush(params);
}
Result<SyncResult> Diloco::Join(std::span<uint16_t> params) {
  FixedFloatEnv env;
  return impl_->Staged(Impl::Call::kJoin, params, 0);
}
Result<SyncResult> Diloco::Sync(std::span<uint16_t> params) { return Sync(params, 0); }
Result<SyncResult> Diloco::Sync(std::span<uint16_t> params, uint64_t tokens) {
  FixedFloatEnv env;
  return impl_->Staged(Impl::Call::kSync, params, tokens);
}
Result<SyncResult> Diloco::Flush(std::span<uint16_t> params) {
  FixedFloatEnv env;
  return impl_->Staged(Impl::Call::kFlush, params, 0);
}
bool Diloco::in_flight() const { return impl_->in_flight(); }
std::span<const float> Diloco::global_weights() const { return impl_->global_weights(); }
bool Diloco::drain_requested() const { return impl_->drain_requested(); }
void Diloco::RequestDrain() { impl_->RequestDrain(); }
void Diloco::HandleNotice(const client::Notice& notice) { impl_->HandleNotice(notice); }
Status Diloco::GroupAllReduceSum(std::span<float> values) {
  FixedFloatEnv env;
  return impl_->GroupSum(values);
}
Status Diloco::Finish() {
  FixedFloatEnv env;
  return impl_->Finish();
}
std::span<const float> Diloco::restored_inner_state() const { return impl_->restored_inner(); }
Status Diloco::SetExtraState(std::span<const uint8_t> bytes) { return impl_->SetExtraState(bytes); }
std::span<const uint8_t> Diloco::restored_extra_state() const { return impl_->restored_extra(); }
uint32_t Diloco::step() const { return impl_->step(); }
size_t Diloco::numel() const { return impl_->numel(); }
size_t Diloco::shard_numel() const { return impl_->shard_numel(); }
size_t Diloco::inner_numel() const { return impl_->inner_numel(); }
size_t Diloco::param_numel() const { return impl_->param_numel(); }
std::string Diloco::state_hash() const { return impl_->hash(); }
ParamDType Diloco::param_dtype() const { return impl_->param_dtype(); }
uint64_t Diloco::outer_state_bytes() const { return impl_->OuterStateBytes(); }

}  // namespace lk::diloco
