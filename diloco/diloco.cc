// The shell of the DiLoCo outer step: it polls, runs the collectives and the state I/O, and
// asks diloco/core.h what to do at each turn. Only the shell logs. Joining a quorum is in
// diloco_join.cc.
#include <lightkeeper/diloco.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "common/float_env.h"
#include "common/log.h"
#include "diloco/diloco_impl.h"
#include "diloco/net_bytes.h"

namespace lk::diloco {

namespace {

using internal::MsSince;
using internal::NoticeSink;
using internal::Since;
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
  // only know an exchange over equal layouts).
  session_->SetMixedGroupSizes(true);
  kv_ = std::make_unique<client::SessionKvStore>(session_->socket_path());
  slot_store_ = std::make_unique<PrefixedStore>(kv_.get(), "diloco/");
  LK_ASSIGN_OR_RETURN(slot_comm_,
                      comm::CommManager::Create(comm::Backend::kGloo, slot_store_.get(), co));
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
                                           o_.params, o_.inner_state, o_.ckpt_keep});
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
  drain_agreed_ = false;
  return GroupAgree(ok, &drain_agreed_);
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

Result<Diloco::Impl::Turn> Diloco::Impl::PollOnce(SyncStats* stats,
                                                  std::optional<Millis> timeout) {
  auto t0 = Clock::now();
  auto pr = timeout ? session_->Poll(state_.step, *timeout) : session_->Poll(state_.step);
  stats->poll_ms += MsSince(t0);
  if (!pr.ok()) return pr.status().WithContext(fmt::format("poll at step {}", state_.step));
  return Decide(std::move(*pr));
}

Diloco::Impl::Turn Diloco::Impl::Decide(client::PollResult pr) {
  LocalView local;
  local.ready_quorum_id = ready_quorum_id_;
  local.bad_quorum_id = bad_quorum_id_;
  local.bad_for = Since(bad_since_);
  local.drain_noticed = sink_->drain.load();
  if (local.drain_noticed && !pr.drain && !drain_wait_since_) drain_wait_since_ = Clock::now();
  local.drain_wait_for = drain_wait_since_ ? Since(*drain_wait_since_) : Millis(0);
  local.has_state = has_state_;
  local.can_save = !o_.ckpt_dir.empty();
  local.stuck_timeout = stuck_timeout_;
  PollView view{pr.quorum_id, pr.drain, pr.checkpoint_now};
  PollDecision d = DecidePoll(view, local);
  return Turn{std::move(pr), std::move(d)};
}

Result<bool> Diloco::Impl::Wait(const Turn& turn) {
  switch (turn.decision.action) {
    case PollAction::kGiveUp:
      LK_LOG_ERROR("stuck quorum_id={} reason={}", turn.poll.quorum_id, Q(turn.decision.reason));
      return Status(Code::kDeadlineExceeded, turn.decision.reason);
    case PollAction::kWaitForDrain:
      std::this_thread::sleep_for(Millis(50));  // the next poll answers the drain
      return true;
    case PollAction::kWaitNewQuorum:
      std::this_thread::sleep_for(Millis(100));
      return true;
    default:
      return false;
  }
}

void Diloco::Impl::MarkBad(uint32_t quorum_id, bool report) {
  bad_quorum_id_ = quorum_id;
  bad_since_ = Clock::now();
  // Tells the lighthouse this quorum failed us, so the next round has a new quorum_id.
  if (report) ReportFailed(quorum_id);
  if (conflict_seen_) BackOffAfterConflict();
}

namespace {
constexpr Millis kConflictBackoffMin{100};
constexpr Millis kConflictBackoffMax{10000};
// How long a failed in-group agreement waits for the drain notice that may explain it.
constexpr Millis kDrainGrace{1000};
}  // namespace

// Without it a misconfigured job forms and fails a quorum about twenty times a second, each a
// new quorum id, a communicator rebuild and a warning in every trainer, for as long as nobody
// looks. Backing off lets the lighthouse and the logs rest, and lets groups that agree form a
// quorum without the one that backs off when --min-replicas allows. A drain ends the wait.
void Diloco::Impl::BackOffAfterConflict() {
  conflict_seen_ = false;
  const uint32_t doublings = std::min<uint32_t>(conflict_streak_, 16);
  ++conflict_streak_;
  const Millis wait =
      std::min(kConflictBackoffMax, kConflictBackoffMin * (int64_t{1} << doublings));
  LK_LOG_WARN("conflict_backoff ms={} attempts={}", wait.count(), conflict_streak_);
  (void)DrainNoticedWithin(wait);
}

void Diloco::Impl::ReportFailed(uint32_t quorum_id) {
  if (reported_quorum_id_ == quorum_id) return;
  reported_quorum_id_ = quorum_id;
  (void)session_->ReportFailed(state_.step + 1, quorum_id);
}

Result<SyncResult> Diloco::Impl::Drain(const Turn& turn, SyncStats stats) {
  const client::PollResult& pr = turn.poll;
  LK_LOG_INFO("drain step={} checkpoint_now={} reason={}", state_.step, pr.checkpoint_now,
              Q(pr.reason));
  SyncResult r = MakeResult(SyncKind::kDrained, pr, stats);
  r.checkpoint_now = pr.checkpoint_now;
  if (turn.decision.action == PollAction::kDrainSave) {
    if (Result<bool> st = SaveDurable(ready_quorum_id_); !st.ok()) {
      LK_LOG_ERROR("drain_save_failed error={}", Q(st.status().ToString()));
      return st.status().WithContext("drain save");
    }
    r.saved = true;
  }
  return r;
}

Result<bool> Diloco::Impl::SaveDurable(uint32_t attempt) {
  std::vector<float> inner_shard;
  if (hooks_.save && inner_total_ > 0) {
    std::vector<float> inner(inner_total_, 0.0f);
    LK_RETURN_IF_ERROR(hooks_.save(inner).WithContext("inner state for the save"));
    inner_shard.resize(inner_layout_.shard_numel);
    inner_layout_.Take(inner, inner_shard);
    LK_LOG_INFO("inner_state_saved step={} hash={}", state_.step, StateHash(inner));
  }
  bool written = true;
  if (Status st = state_io_->SaveDurable(state_, inner_shard, attempt); !st.ok()) {
    if (st.code() != Code::kConflict) return st;
    // This group's root already holds a committed checkpoint of this step: an earlier life of
    // the group got there before this one came back (restored or healed to it). Every member's
    // global weights at a committed step are the same, so the step is saved; a committed
    // checkpoint is never overwritten, and it is registered again below all the same.
    LK_LOG_INFO("checkpoint_exists step={} detail={}", state_.step, Q(st.message()));
    written = false;
  }
  // Tells the lighthouse (through the agent) where this group's durable checkpoints are, so
  // that a job whose groups all lost their live state restores the newest one. Rank 0 speaks
  // for the group; the location is the checkpoint root, whose LATEST names the newest step.
  if (o_.group_rank == 0) {
    std::error_code ec;
    auto root = std::filesystem::absolute(o_.ckpt_dir, ec).string();
    if (Status st = session_->RegisterCheckpoint(state_.step, root, ""); !st.ok()) {
      LK_LOG_WARN("checkpoint_register_failed step={} error={}", state_.step, Q(st.ToString()));
    }
  }
  return written;
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
  r.stats = stats;
  return r;
}

Result<SyncResult> Diloco::Impl::Join(std::span<float> params) {
  if (params.size() != layout_.total) {
    return InvalidArgument("params has {} elements, the specs {}", params.size(), layout_.total);
  }
  if (ready_quorum_id_ != 0) return InvalidArgument("Join was called already");
  CanonicalizeZeros(params);
  layout_.Take(params, state_.global);
  SyncStats stats;
  while (true) {
    LK_ASSIGN_OR_RETURN(Turn turn, PollOnce(&stats));
    const PollAction a = turn.decision.action;
    if (a == PollAction::kDrain || a == PollAction::kDrainSave) return Drain(turn, stats);
    LK_ASSIGN_OR_RETURN(bool again, Wait(turn));
    if (again) continue;
    Status st = JoinQuorum(turn.poll, params, &stats);
    if (!st.ok()) {
      LK_LOG_WARN("quorum_join_failed quorum_id={} error={}", turn.poll.quorum_id,
                  Q(st.ToString()));
      if (group_failed_) return st;
      NoteFailure(st);
      MarkBad(turn.poll.quorum_id, true);
      continue;
    }
    ready_quorum_id_ = turn.poll.quorum_id;
    joined_unstepped_ = turn.poll;
    if (o_.overlap) base_.assign(params.begin(), params.end());
    SyncResult r =
        MakeResult(received_ ? SyncKind::kReceived : SyncKind::kJoined, turn.poll, stats);
    r.healed = healed_;
    r.heal_source = heal_source_;
    r.inner = received_ ? inner_action_ : InnerAction::kKeep;
    // The inner phase before the first Sync starts here: with fragments, that Sync's exchange
    // is paced by it like every later one, instead of going out in one burst.
    if (o_.overlap) sync_returned_ = Clock::now();
    return r;
  }
}

Result<uint64_t> Diloco::Impl::GroupTokens(uint64_t tokens) {
  if (o_.group_size == 1) return tokens;
  std::vector<float> limbs(kCountLimbs);
  EncodeCount(tokens, limbs);
  LK_RETURN_IF_ERROR(GroupSum(limbs));
  return DecodeCount(limbs);
}

Result<OuterWeights> Diloco::Impl::AgreeWeights(const client::PollResult& pr,
                                                uint64_t tokens) {
  // On the mesh every trainer of a group takes part, and group_rank 0 speaks for the group.
  const uint64_t mine = mixed_ && o_.group_rank != 0 ? 0 : tokens;
  std::vector<float> counts = EncodeMemberTokens(mine, pr.replica_rank, pr.replica_world_size);
  // Then every participant's shape of the exchange (see ExchangeShape), checked before it.
  const size_t token_floats = counts.size();
  const uint32_t index = mixed_ ? mixed_->mesh_rank : pr.replica_rank;
  const uint32_t participants = mixed_ ? mixed_->mesh_world : pr.replica_world_size;
  const ExchangeShape shape{o_.outer_compress, o_.outer_fragments};
  counts.resize(token_floats + kShapeFloats * participants, 0.0f);
  EncodeShape(shape, index, std::span<float>(counts).subspan(token_floats));
  LK_RETURN_IF_ERROR(CrossComm().AllReduce(counts.data(), counts.size(), comm::DType::kFloat32,
                                           comm::ReduceOp::kSum));
  LK_RETURN_IF_ERROR(
      CheckShapes(DecodeShapes(std::span<const float>(counts).subspan(token_floats)), shape));
  counts.resize(token_floats);
  return DecideWeights(DecodeMemberTokens(counts), pr.replica_rank);
}

Result<SyncResult> Diloco::Impl::Sync(std::span<float> params, uint64_t tokens) {
  if (params.size() != layout_.total) {
    return InvalidArgument("params has {} elements, the specs {}", params.size(), layout_.total);
  }
  if (ready_quorum_id_ == 0) return InvalidArgument("Sync before Join");
  if (o_.overlap) {
    if (sync_returned_) inner_phase_ = Clock::now() - *sync_returned_;
    Result<SyncResult> r = SyncOverlapped(params, tokens);
    sync_returned_ = Clock::now();
    return r;
  }
  if (!pending_delta_) {
    // Every trainer of the group comes here once per outer step, so this in-group sum pairs up.
    LK_ASSIGN_OR_RETURN(pending_tokens_, GroupTokens(tokens));
    std::vector<float> delta(layout_.shard_numel);
    layout_.Take(params, delta);
    for (size_t i = 0; i < delta.size(); ++i) delta[i] = state_.global[i] - delta[i];
    pending_delta_ = std::move(delta);
  }
  return RunPending(params, SyncStats{});
}

Result<std::optional<SyncResult>> Diloco::Impl::NextQuorum(std::span<float> params,
                                                           SyncStats* stats,
                                                           client::PollResult* out) {
  while (true) {
    Turn turn;
    if (joined_unstepped_ && !sink_->drain.load()) {
      turn = Turn{std::move(*joined_unstepped_), {PollAction::kStep, "joined in the last call"}};
    } else if (carried_poll_) {
      turn = Decide(std::move(*carried_poll_));
      carried_poll_.reset();
    } else {
      LK_ASSIGN_OR_RETURN(turn, PollOnce(stats));
    }
    joined_unstepped_.reset();
    const PollAction a = turn.decision.action;
    if (a == PollAction::kDrain || a == PollAction::kDrainSave) {
      LK_ASSIGN_OR_RETURN(SyncResult drained, Drain(turn, *stats));
      return std::optional<SyncResult>(std::move(drained));
    }
    LK_ASSIGN_OR_RETURN(bool again, Wait(turn));
    if (again) continue;
    const client::PollResult& pr = turn.poll;
    if (a == PollAction::kJoin) {
      Status st = JoinQuorum(pr, params, stats);
      if (!st.ok()) {
        LK_LOG_WARN("quorum_join_failed quorum_id={} error={}", pr.quorum_id, Q(st.ToString()));
        if (group_failed_) return st;
        NoteFailure(st);
        MarkBad(pr.quorum_id, true);
        continue;
      }
      ready_quorum_id_ = pr.quorum_id;
      if (received_) {
        joined_unstepped_ = pr;
        SyncResult r = MakeResult(SyncKind::kReceived, pr, *stats);
        r.healed = healed_;
        r.heal_source = heal_source_;
        r.inner = inner_action_;
        return std::optional<SyncResult>(std::move(r));
      }
    }
    *out = std::move(turn.poll);
    return std::optional<SyncResult>();
  }
}

Result<SyncResult> Diloco::Impl::RunPending(std::span<float> params, SyncStats stats) {
  while (true) {
    client::PollResult pr;
    LK_ASSIGN_OR_RETURN(std::optional<SyncResult> early, NextQuorum(params, &stats, &pr));
    if (early) return std::move(*early);
    LK_ASSIGN_OR_RETURN(bool done, OuterAttempt(pr, params, &stats));
    if (done) {
      last_step_pr_ = pr;
      return CommittedResult(pr, stats);
    }
    // A drain aborts the allreduce on purpose: the next poll answers it, no failure to report.
    MarkBad(pr.quorum_id, !sink_->drain.load());
  }
}

SyncResult Diloco::Impl::CommittedResult(const client::PollResult& pr, const SyncStats& stats) {
  conflict_streak_ = 0;
  SyncResult r = MakeResult(SyncKind::kCommitted, pr, stats);
  r.healed = healed_since_commit_;
  r.saved = saved_at_last_commit_;
  r.tokens = last_weights_.self_tokens;
  r.quorum_tokens = last_weights_.all_tokens;
  r.weighted = last_weights_.weighted;
  healed_since_commit_ = false;
  return r;
}

Result<OuterWeights> Diloco::Impl::Exchange(const client::PollResult& pr, uint64_t tokens,
                                            std::vector<float>& sum, Pacer* pacer) {
  // Token-weighted: this shard scaled by its group's weight, summed (compressed when
  // outer_compress says so), divided by the weights' sum (diloco/outer.h DecideWeights: the same
  // divisor in every member). The token counts themselves always travel as exact float32.
  LK_ASSIGN_OR_RETURN(OuterWeights w, AgreeWeights(pr, tokens));
  ScaleInPlace(sum, w.self);
  LK_RETURN_IF_ERROR(CrossAllReduce(sum, comm::ReduceOp::kSum, pacer));
  return w;
}

Result<bool> Diloco::Impl::OuterAttempt(const client::PollResult& pr, std::span<float> params,
                                        SyncStats* stats) {
  auto t0 = Clock::now();
  std::vector<float> sum = *pending_delta_;
  TcpSent ar_b0 = SnapshotTcpSent();
  // Waiting on the other groups is not this group's stall (the lighthouse's progress timeout).
  (void)session_->SetPeerWait(true);
  Result<OuterWeights> w = Exchange(pr, pending_tokens_, sum);
  (void)session_->SetPeerWait(false);
  stats->cross_bytes += TcpSentBetween(ar_b0, SnapshotTcpSent());
  stats->allreduce_ms += MsSince(t0);
  return Land(pr, w, sum, params, stats, t0);
}

Result<bool> Diloco::Impl::Land(const client::PollResult& pr, const Result<OuterWeights>& w,
                                std::vector<float>& sum, std::span<float> params,
                                SyncStats* stats, Clock::time_point t0) {
  Result<bool> agreed = AgreeLanding(w.ok());
  // A drain reaches the group's trainers through their own polls and notices, not at one
  // instant: a trainer whose poll already said drain leaves while another is still in this
  // step's exchange, and the group's agreement then finds it gone. The step is not committed,
  // nothing is lost, and the next poll answers the drain here too (with the save it may ask
  // for), so this is the drain, not a failure.
  if (!agreed.ok() && !DrainNoticedWithin(kDrainGrace)) return agreed.status();
  if (agreed.ok() && !w.ok()) NoteFailure(w.status());
  if (!agreed.ok() || !*agreed) {
    const std::string error = !agreed.ok() ? "draining: " + agreed.status().ToString()
                              : w.ok()     ? std::string("another trainer of the group failed")
                                           : w.status().ToString();
    LK_LOG_WARN("outer_step_aborted step={} quorum_id={} overlapped={} error={}", state_.step + 1,
                pr.quorum_id, o_.overlap, Q(error));
    return false;
  }
  auto gather_t0 = Clock::now();
  TcpSent gather_b0 = SnapshotTcpSent();
  DivideInPlace(sum, w->total);
  last_weights_ = *w;
  OuterNesterovStep(state_.global, state_.momentum, sum, o_.outer);
  if (perturb_step_ != 0 && perturb_step_ == state_.step + 1 && !state_.global.empty()) {
    perturb_step_ = 0;
    state_.global[0] += 0.001f;
    LK_LOG_WARN("test_perturbed step={} group_rank={} (LK_TEST_PERTURB_STEP)", state_.step + 1,
                o_.group_rank);
  }
  LK_RETURN_IF_ERROR(LoadGlobal(params));
  stats->group_bytes += TcpSentBetween(gather_b0, SnapshotTcpSent());
  stats->gather_ms += MsSince(gather_t0);
  state_.step += 1;
  pending_delta_.reset();
  auto publish_t0 = Clock::now();
  // Published before the commit: once the lighthouse hears of this step, peers may fetch it.
  if (Status p = state_io_->PublishLive(state_); !p.ok()) {
    LK_LOG_WARN("publish_live_failed step={} error={}", state_.step, Q(p.ToString()));
  }
  stats->publish_ms += MsSince(publish_t0);
  // The lighthouse compares the commits' hashes across groups (its divergence check), so the
  // commit carries the hash of the whole global weights, which is the same in every trainer
  // whatever its group's layout, not this trainer's shard hash.
  auto commit_t0 = Clock::now();
  LK_RETURN_IF_ERROR(
      session_->Commit(state_.step, true, global_hash_, w->self_tokens).WithContext("commit"));
  stats->commit_ms += MsSince(commit_t0);
  stats->outer_ms = MsSince(t0);
  saved_at_last_commit_ = false;
  if (SaveAfterCommit(state_.step, o_.ckpt_every)) {
    LK_RETURN_IF_ERROR(SaveDurable(pr.quorum_id).status());
    saved_at_last_commit_ = true;
  }
  return true;
}

// Overlapped outer steps. Each call lands the exchange the previous call started (the outer
// update to step s+1), and starts the exchange of the inner steps since the previous call (the
// pseudo-gradient of step s+2). The caller's weights for the next inner steps are the outer
// update of step s+1's global weights with this group's own pseudo-gradient standing in for the
// average that is still on the wire (the "eager" correction for the one-step delay): a group
// alone in its quorum, or groups whose pseudo-gradients agree, follow exactly the trajectory of
// the blocking outer step, and the real average replaces the stand-in one call later.
Result<SyncResult> Diloco::Impl::SyncOverlapped(std::span<float> params, uint64_t tokens) {
  LK_ASSIGN_OR_RETURN(uint64_t group_tokens, GroupTokens(tokens));
  // start_: this trainer's rows of the weights these inner steps started from; delta: the
  // pseudo-gradient, start minus where they ended.
  const size_t n = layout_.shard_numel;
  std::vector<float> delta(n);
  start_.resize(n);
  layout_.Take(base_, start_);
  layout_.Take(params, delta);
  for (size_t i = 0; i < n; ++i) delta[i] = start_[i] - delta[i];
  std::optional<SyncResult> landed;
  SyncStats stats;
  if (in_flight_) {
    LK_ASSIGN_OR_RETURN(SyncResult r, LandInFlight(params, SyncStats{}));
    if (r.kind != SyncKind::kCommitted) {
      // A heal or a drain: the inner work since is dropped with the state it was built on.
      base_.assign(params.begin(), params.end());
      return r;
    }
    stats = r.stats;
    landed = std::move(r);
  }
  // The stand-in, corrected by what the last one missed. These inner steps started from the
  // last stand-in step, which missed the global weights that landed now by E = start - global
  // = -c (last stand-in - last average), c = lr (1 + momentum) for Nesterov (lr for heavy
  // ball): the outer step's amplification of this group's deviation from the average. The
  // pseudo-gradient of these steps carries about E again (more where the inner steps converge
  // fully), so without a correction E grows by c > 1 per step; subtracting E / c, i.e. adding
  // the last stand-in's miss to this one (error feedback), leaves E at most as large as it was
  // for every curvature while c < 2, and its average over the groups at zero, so the global
  // trajectory is the blocking one to first order (BENCHMARKS.md, "Overlapped outer steps",
  // has the loss). A group alone has E == 0 exactly and trains bit for bit as without overlap.
  const float c = o_.outer.lr * (o_.outer.nesterov ? 1.0f + o_.outer.momentum : 1.0f);
  stand_in_.resize(n);
  for (size_t i = 0; i < n; ++i) stand_in_[i] = delta[i] - (start_[i] - state_.global[i]) / c;
  pending_delta_ = std::move(delta);
  pending_tokens_ = group_tokens;
  // The same branch in every trainer of the group: one that polled here for a drain it had
  // just heard of would leave while the others gather the stand-in below with it. A drain that
  // comes later is answered to the thread's poll instead, and lands with the next call.
  const bool in_thread = landed.has_value() && !joined_unstepped_ && !drain_agreed_;
  LK_ASSIGN_OR_RETURN(SyncResult next, StartNext(params, stats, in_thread));
  if (next.kind == SyncKind::kStarted) {
    auto t0 = Clock::now();
    TcpSent b0 = SnapshotTcpSent();
    // start_ is free again: it holds the stand-in's momentum, stand_in_ its global weights.
    start_.assign(state_.momentum.begin(), state_.momentum.end());
    std::vector<float>& global = tentative_;
    global.assign(state_.global.begin(), state_.global.end());
    OuterNesterovStep(global, start_, stand_in_, o_.outer);
    LK_RETURN_IF_ERROR(GatherInto(global, params));
    next.stats.group_bytes += TcpSentBetween(b0, SnapshotTcpSent());
    next.stats.gather_ms += MsSince(t0);
  }
  base_.assign(params.begin(), params.end());
  if (!landed || next.kind != SyncKind::kStarted) return next;
  landed->stats = next.stats;
  return *landed;
}

Result<SyncResult> Diloco::Impl::StartNext(std::span<float> params, SyncStats stats,
                                           bool in_thread) {
  if (in_thread) {
    StartInFlight(last_step_pr_, true);
    return MakeResult(SyncKind::kStarted, last_step_pr_, stats);
  }
  client::PollResult pr;
  LK_ASSIGN_OR_RETURN(std::optional<SyncResult> early, NextQuorum(params, &stats, &pr));
  if (early) {
    if (early->kind == SyncKind::kDrained) pending_delta_.reset();
    return std::move(*early);
  }
  StartInFlight(pr);
  return MakeResult(SyncKind::kStarted, pr, stats);
}

void Diloco::Impl::StartInFlight(const client::PollResult& pr, bool poll_first) {
  auto f = std::make_unique<InFlight>();
  f->pr = pr;
  f->poll_first = poll_first;
  f->session_free.store(!poll_first);
  f->delta = std::move(*pending_delta_);
  pending_delta_.reset();
  f->tokens = pending_tokens_;
  f->sum = f->delta;
  f->t0 = Clock::now();
  if (o_.outer_fragments > 1) {
    // The next inner phase is taken to last as long as the last one; the pieces end by about
    // 0.8 of it, so that the last one is not what the next Sync waits for.
    const auto phase = std::chrono::duration_cast<Millis>(inner_phase_);
    f->pacer = std::make_unique<Pacer>(phase * 4 / (5 * o_.outer_fragments));
  }
  InFlight* raw = f.get();
  f->thread = std::thread([this, raw] {
    FixedFloatEnv env;  // as the calls of the training thread (Diloco::Sync)
    // Other traffic of this process (the in-group gradient averages of the inner steps) runs
    // meanwhile, so the bytes counted here are an upper bound of the exchange's.
    if (raw->poll_first) {
      const bool go = PollInFlight(raw);
      raw->session_free.store(true);
      if (!go) {
        raw->ms = MsSince(raw->t0);
        return;
      }
    }
    TcpSent b0 = SnapshotTcpSent();
    raw->weights = Exchange(raw->pr, raw->tokens, raw->sum, raw->pacer.get());
    raw->bytes = TcpSentBetween(b0, SnapshotTcpSent());
    raw->ms = MsSince(raw->t0);
  });
  in_flight_ = std::move(f);
}

bool Diloco::Impl::PollInFlight(InFlight* raw) {
  // In slices, so that a closing Diloco (AbandonInFlight) need not wait for the other groups.
  constexpr Millis kSlice{2000};
  // A long wait says so now and then: without it a thread waiting on a quorum that never
  // forms and one whose answer was lost look alike in the logs.
  constexpr Millis kNoteEvery{10000};
  const auto t0 = Clock::now();
  auto next_note = t0 + kNoteEvery;
  while (!raw->abandon.load()) {
    SyncStats ignored;
    Result<Turn> t = PollOnce(&ignored, kSlice);
    if (!t.ok()) {
      if (t.status().code() == Code::kDeadlineExceeded) {
        if (Clock::now() >= next_note) {
          next_note += kNoteEvery;
          LK_LOG_INFO("outer_poll_waiting step={} quorum_id={} waited_ms={:.0f}",
                      state_.step + 1, raw->pr.quorum_id, MsSince(t0));
        }
        continue;
      }
      raw->deferred = t.status().ToString();
      return false;
    }
    if (t->decision.action != PollAction::kStep) {
      raw->deferred = t->decision.reason;
      raw->carried = std::move(t->poll);
      return false;
    }
    raw->pr = std::move(t->poll);
    return true;
  }
  raw->deferred = "the DiLoCo object is closing";
  return false;
}

Result<SyncResult> Diloco::Impl::LandInFlight(std::span<float> params, SyncStats stats) {
  auto wait_t0 = Clock::now();
  // Blocked on the other groups from here: not this group's stall. Fragments still waiting
  // for their turn go now. While the thread still polls for the quorum, the wait is left
  // unmarked, as a poll of the blocking path is.
  const bool mark = in_flight_->session_free.load();
  if (mark) (void)session_->SetPeerWait(true);
  if (in_flight_->pacer) in_flight_->pacer->Hurry();
  in_flight_->thread.join();
  if (mark) (void)session_->SetPeerWait(false);
  stats.wait_ms += MsSince(wait_t0);
  std::unique_ptr<InFlight> f = std::move(in_flight_);
  stats.allreduce_ms += f->ms;
  stats.cross_bytes += f->bytes;
  pending_delta_ = std::move(f->delta);
  pending_tokens_ = f->tokens;
  if (f->deferred) {
    // The exchange never started: nothing failed, so the quorum is not reported. The group's
    // trainers still agree on the outcome, as in Land (another may have run its exchange),
    // and the pending pseudo-gradient goes through the poll loop here.
    LK_LOG_INFO("outer_exchange_deferred step={} reason={}", state_.step + 1, Q(*f->deferred));
    carried_poll_ = std::move(f->carried);
    LK_ASSIGN_OR_RETURN(bool all_ok, AgreeLanding(false));
    (void)all_ok;
    return RunPending(params, stats);
  }
  LK_ASSIGN_OR_RETURN(bool done, Land(f->pr, f->weights, f->sum, params, &stats, f->t0));
  if (done) {
    last_step_pr_ = f->pr;
    return CommittedResult(f->pr, stats);
  }
  MarkBad(f->pr.quorum_id, !sink_->drain.load());
  return RunPending(params, stats);
}

Result<SyncResult> Diloco::Impl::Flush(std::span<float> params) {
  if (params.size() != layout_.total) {
    return InvalidArgument("params has {} elements, the specs {}", params.size(), layout_.total);
  }
  if (!in_flight_) {
    SyncResult r;
    r.kind = SyncKind::kJoined;
    r.step = state_.step;
    r.quorum_id = ready_quorum_id_;
    r.state_hash = StateHash(state_.global);
    return r;
  }
  // Lands into params: the new global weights, without a stand-in step after them.
  LK_ASSIGN_OR_RETURN(SyncResult r, LandInFlight(params, SyncStats{}));
  base_.assign(params.begin(), params.end());
  return r;
}

void Diloco::Impl::AbandonInFlight() {
  if (!in_flight_) return;
  in_flight_->abandon.store(true);
  CrossComm().Abort("the DiLoCo object is closing");
  if (in_flight_->pacer) in_flight_->pacer->Hurry();
  in_flight_->thread.join();
  in_flight_.reset();
}

Status Diloco::Impl::Finish() {
  if (in_flight_) {
    // The last step's exchange lands before the barrier (which runs on the same communicator).
    std::vector<float> scratch = base_;
    Result<SyncResult> landed = Flush(scratch);
    if (!landed.ok()) return landed.status().WithContext("landing the last exchange");
    const SyncResult& r = *landed;
    if (r.kind == SyncKind::kCommitted) {
      LK_LOG_INFO("outer_committed step={} quorum_id={} hash={} at=finish", r.step, r.quorum_id,
                  r.state_hash);
    }
  }
  // A finished group's leave is a lost member to the others: were it to leave while another
  // member still waits for the last bytes of the final allreduce, that member's step would be
  // aborted with nobody left to heal from. So no member leaves before all have come out of it.
  float done = 1.0f;
  if (Status st = CrossComm().AllReduce(&done, 1, comm::DType::kFloat32, comm::ReduceOp::kSum);
      !st.ok()) {
    LK_LOG_WARN("final_barrier_failed error={}", Q(st.ToString()));
  }
  // The run's result is the final weights: they are saved durably (and registered) unless the
  // last commit just did, so that a group coming back after every other group finished
  // restores the final step rather than an older checkpoint, and the user has the model.
  if (SaveAtFinish(!o_.ckpt_dir.empty(), has_state_, state_.step, o_.ckpt_every)) {
    Result<bool> written = SaveDurable(ready_quorum_id_);
    if (!written.ok()) {
      LK_LOG_ERROR("final_save_failed step={} error={}", state_.step,
                   Q(written.status().ToString()));
      return written.status().WithContext("final save");
    }
    // An earlier life of the group finished here before this one came back and caught up from
    // the final checkpoint: the run's result is saved already.
    if (!*written) LK_LOG_INFO("final_save_exists step={}", state_.step);
  }
  LK_LOG_INFO("trainer_done step={} hash={}", state_.step, StateHash(state_.global));
  // Without the goodbye the agent would take this exit for a crash and fail the group.
  return session_->Finish().WithContext("finish");
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
  FixedFloatEnv env;
  return impl_->Join(params);
}
Result<SyncResult> Diloco::Sync(std::span<float> params) {
  FixedFloatEnv env;
  return impl_->Sync(params, 0);
}
Result<SyncResult> Diloco::Sync(std::span<float> params, uint64_t tokens) {
  FixedFloatEnv env;
  return impl_->Sync(params, tokens);
}
Result<SyncResult> Diloco::Flush(std::span<float> params) {
  FixedFloatEnv env;
  return impl_->Flush(params);
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
uint32_t Diloco::step() const { return impl_->step(); }
size_t Diloco::numel() const { return impl_->numel(); }
size_t Diloco::shard_numel() const { return impl_->shard_numel(); }
size_t Diloco::inner_numel() const { return impl_->inner_numel(); }
std::string Diloco::state_hash() const { return impl_->hash(); }

}  // namespace lk::diloco
