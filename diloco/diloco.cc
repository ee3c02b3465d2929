// The shell of the DiLoCo outer step: it polls, runs the collectives and the state I/O, and
// asks diloco/core.h what to do at each turn. Only this file logs.
#include "diloco/diloco.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>

#include "common/log.h"
#include "diloco/core.h"
#include "diloco/net_bytes.h"
#include "diloco/outer.h"
#include "diloco/prefixed_store.h"
#include "diloco/state_io.h"
#include "replica_agent/client/session.h"
#include "replica_agent/client/session_store.h"
#include "replica_agent/comm/comm.h"

namespace lk::diloco {

namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

Millis Since(Clock::time_point t0) {
  return std::chrono::duration_cast<Millis>(Clock::now() - t0);
}

// The notice callback runs on the session's thread and may outlive the Diloco (the session
// may keep that thread past it), so it reaches the communicator only through this holder.
struct NoticeSink {
  std::mutex mu;
  comm::CommManager* slot = nullptr;  // guarded by mu; cleared before the comm goes away
  std::atomic<bool> drain{false};
};

void Deliver(NoticeSink& sink, const client::Notice& n) {
  if (n.drain) sink.drain = true;
  std::lock_guard lock(sink.mu);
  if (sink.slot == nullptr) return;
  if (n.drain) {
    sink.slot->Abort("drain: " + n.reason);
  } else if (n.lost) {
    sink.slot->AbortQuorum(n.quorum_id, "quorum lost: " + n.reason);
  }
}

}  // namespace

Status DilocoOptions::Validate() const {
  if (group_size == 0 || group_rank >= group_size) {
    return InvalidArgument("group_rank {} must be below group_size {}", group_rank, group_size);
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
  return Status::Ok();
}

class Diloco::Impl {
 public:
  Impl(client::Session* session, DilocoOptions o, InnerStateHooks hooks)
      : session_(session),
        o_(std::move(o)),
        hooks_(std::move(hooks)),
        layout_(MakeShardLayout(o_.params, o_.group_size, o_.group_rank)),
        inner_layout_(MakeShardLayout(o_.inner_state, o_.group_size, o_.group_rank)),
        stuck_timeout_(EffectiveStuckTimeout(o_.stuck_timeout, o_.op_timeout)),
        sink_(std::make_shared<NoticeSink>()) {
    ValidateSpecs(o_.inner_state, &inner_total_).ok();
  }

  ~Impl() {
    std::lock_guard lock(sink_->mu);
    sink_->slot = nullptr;
  }

  Status Init();
  Result<SyncResult> Join(std::span<float> params);
  Result<SyncResult> Sync(std::span<float> params);
  Status GroupSum(std::span<float> v);
  Status Finish();

  bool drain_requested() const { return sink_->drain.load(); }
  void RequestDrain() { sink_->drain = true; }
  void HandleNotice(const client::Notice& n) { Deliver(*sink_, n); }
  std::span<const float> restored_inner() const { return restored_inner_; }
  uint32_t step() const { return state_.step; }
  size_t numel() const { return layout_.total; }
  size_t shard_numel() const { return layout_.shard_numel; }
  size_t inner_numel() const { return inner_total_; }
  std::string hash() const { return StateHash(state_.global); }

 private:
  // One poll and what the core makes of it.
  struct Turn {
    client::PollResult poll;
    PollDecision decision;
  };
  Result<Turn> PollOnce(SyncStats* stats);
  // Acts on the waiting decisions (sleeps, failures); true when the caller polls again.
  Result<bool> Wait(const Turn& turn);
  Result<SyncResult> Drain(const Turn& turn, SyncStats stats);
  // Joins quorum pr.quorum_id; `params` gets the state when the group received some.
  Status JoinQuorum(const client::PollResult& pr, std::span<float> params, SyncStats* stats);
  Status Heal(const client::PollResult& pr);
  Status SyncSlot(const client::PollResult& pr);
  Result<bool> GroupAgree(bool ok);
  // One cross-group attempt with the pending pseudo-gradient: false when it was cut short.
  Result<bool> OuterAttempt(const client::PollResult& pr, std::span<float> params,
                            SyncStats* stats);
  Status LoadGlobal(std::span<float> params);
  Status SaveDurable(uint32_t attempt);
  void MarkBad(uint32_t quorum_id, bool report);
  SyncResult MakeResult(SyncKind kind, const client::PollResult& pr, const SyncStats& stats) const;

  client::Session* session_;
  DilocoOptions o_;
  InnerStateHooks hooks_;
  ShardLayout layout_, inner_layout_;
  size_t inner_total_ = 0;
  Millis stuck_timeout_;
  std::shared_ptr<NoticeSink> sink_;
  // The lighthouse KV through the agent, on a connection of its own (a KV wait never holds up
  // a Poll); each communicator sees it under its own key prefix.
  std::unique_ptr<client::SessionKvStore> kv_;
  std::unique_ptr<PrefixedStore> slot_store_, group_store_;
  std::unique_ptr<comm::CommManager> slot_comm_, group_comm_;
  std::unique_ptr<StateIo> state_io_;
  bool group_ready_ = false;
  bool group_failed_ = false;  // an in-group collective failed: the group is going down
  OuterState state_;
  bool has_state_ = false;       // state_ is valid for state_.step
  bool received_ = false;        // state came from elsewhere in the current quorum
  bool healed_ = false;          // ... and it was a heal, not the first start's initial weights
  bool inner_from_disk_ = false; // ... from a durable checkpoint that held the inner state
  bool healed_since_commit_ = false;
  std::string heal_source_;
  InnerAction inner_action_ = InnerAction::kKeep;
  std::vector<float> restored_inner_;  // full inner buffer of the last durable restore
  std::vector<float> restored_inner_shard_;
  std::optional<std::vector<float>> pending_delta_;
  uint32_t ready_quorum_id_ = 0;
  uint32_t bad_quorum_id_ = 0;
  Clock::time_point bad_since_;
  std::optional<Clock::time_point> drain_wait_since_;
  bool saved_at_last_commit_ = false;
};

Status Diloco::Impl::Init() {
  comm::CommOptions co;
  co.slot = o_.group_rank;
  co.bind_host = o_.bind_host;
  co.init_timeout = o_.init_timeout;
  co.op_timeout = o_.op_timeout;
  kv_ = std::make_unique<client::SessionKvStore>(session_->socket_path());
  slot_store_ = std::make_unique<PrefixedStore>(kv_.get(), "diloco/");
  LK_ASSIGN_OR_RETURN(slot_comm_,
                      comm::CommManager::Create(comm::Backend::kGloo, slot_store_.get(), co));
  if (o_.group_size > 1) {
    // The prefix names the group once its replica_rank is known (the first quorum).
    group_store_ = std::make_unique<PrefixedStore>(kv_.get(), "");
    co.slot = 0;
    LK_ASSIGN_OR_RETURN(group_comm_,
                        comm::CommManager::Create(comm::Backend::kGloo, group_store_.get(), co));
  }
  {
    std::lock_guard lock(sink_->mu);
    sink_->slot = slot_comm_.get();
  }
  if (o_.own_notices) {
    session_->OnNotice([sink = sink_](const client::Notice& n) { Deliver(*sink, n); });
  }
  state_io_ = MakeCheckpointStateIo(StateIoOptions{o_.ckpt_dir, o_.live_dir, o_.group_rank,
                                                   o_.group_size, o_.params, o_.inner_state,
                                                   o_.ckpt_keep});
  state_.global.assign(layout_.shard_numel, 0.0f);
  state_.momentum.assign(layout_.shard_numel, 0.0f);
  return Status::Ok();
}

Status Diloco::Impl::GroupSum(std::span<float> v) {
  if (o_.group_size == 1) return Status::Ok();
  if (!group_ready_) return Status(Code::kInvalidArgument, "the group communicator needs Join first");
  Status st = group_comm_->AllReduce(v.data(), v.size(), comm::DType::kFloat32,
                                     comm::ReduceOp::kSum);
  if (st.ok()) return st;
  group_failed_ = true;
  return st.WithContext("intra-group allreduce");
}

Result<bool> Diloco::Impl::GroupAgree(bool ok) {
  float v = ok ? 1.0f : 0.0f;
  LK_RETURN_IF_ERROR(GroupSum(std::span<float>(&v, 1)));
  return v > static_cast<float>(o_.group_size) - 0.5f;
}

Result<Diloco::Impl::Turn> Diloco::Impl::PollOnce(SyncStats* stats) {
  auto t0 = Clock::now();
  auto pr = session_->Poll(state_.step);
  stats->poll_ms += MsSince(t0);
  if (!pr.ok()) return pr.status().WithContext(fmt::format("poll at step {}", state_.step));
  LocalView local;
  local.ready_quorum_id = ready_quorum_id_;
  local.bad_quorum_id = bad_quorum_id_;
  local.bad_for = Since(bad_since_);
  local.drain_noticed = sink_->drain.load();
  if (local.drain_noticed && !pr->drain && !drain_wait_since_) drain_wait_since_ = Clock::now();
  local.drain_wait_for = drain_wait_since_ ? Since(*drain_wait_since_) : Millis(0);
  local.has_state = has_state_;
  local.can_save = !o_.ckpt_dir.empty();
  local.stuck_timeout = stuck_timeout_;
  PollView view{pr->quorum_id, pr->drain, pr->checkpoint_now};
  return Turn{std::move(*pr), DecidePoll(view, local)};
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
  if (report) (void)session_->Commit(state_.step + 1, false);
}

Result<SyncResult> Diloco::Impl::Drain(const Turn& turn, SyncStats stats) {
  const client::PollResult& pr = turn.poll;
  LK_LOG_INFO("drain step={} checkpoint_now={} reason={}", state_.step, pr.checkpoint_now,
              Q(pr.reason));
  SyncResult r = MakeResult(SyncKind::kDrained, pr, stats);
  r.checkpoint_now = pr.checkpoint_now;
  if (turn.decision.action == PollAction::kDrainSave) {
    if (Status st = SaveDurable(ready_quorum_id_); !st.ok()) {
      LK_LOG_ERROR("drain_save_failed error={}", Q(st.ToString()));
      return st.WithContext("drain save");
    }
    r.saved = true;
  }
  return r;
}

Status Diloco::Impl::SaveDurable(uint32_t attempt) {
  std::vector<float> inner_shard;
  if (hooks_.save && inner_total_ > 0) {
    std::vector<float> inner(inner_total_, 0.0f);
    LK_RETURN_IF_ERROR(hooks_.save(inner).WithContext("inner state for the save"));
    inner_shard.resize(inner_layout_.shard_numel);
    inner_layout_.Take(inner, inner_shard);
    LK_LOG_INFO("inner_state_saved step={} hash={}", state_.step, StateHash(inner));
  }
  LK_RETURN_IF_ERROR(state_io_->SaveDurable(state_, inner_shard, attempt));
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
  return Status::Ok();
}

// Pulls this shard from live peers or the durable checkpoint, in the core's order. A failure is
// not fatal: the slot sync then hands this member the donor's state over the communicator.
Status Diloco::Impl::Heal(const client::PollResult& pr) {
  has_state_ = false;
  for (const HealSource& src : PlanHeal(pr.heal, pr.initial, pr.heal_sources, pr.max_step,
                                        pr.restore_location)) {
    Result<OuterState> got = Status(Code::kNotFound, "no source");
    std::string from;
    std::optional<std::vector<float>> inner;
    std::string inner_missing;
    if (src.kind == HealSourceKind::kPeers) {
      from = "peers";
      got = state_io_->FetchFromPeers(src.peers, src.step);
    } else {
      from = "durable " + src.location;
      auto r = state_io_->Restore(src.location);
      if (r.ok()) {
        inner = std::move(r->inner);
        inner_missing = r->inner_missing;
        got = std::move(r->state);
      } else {
        got = r.status();
      }
    }
    if (got.ok()) {
      state_ = std::move(*got);
      has_state_ = received_ = healed_ = true;
      heal_source_ = from;
      inner_from_disk_ = inner.has_value();
      if (inner) restored_inner_shard_ = std::move(*inner);
      LK_LOG_INFO("heal_fetched from={} step={} inner_state={}", Q(from), state_.step,
                  Q(src.kind == HealSourceKind::kPeers ? std::string("fresh")
                    : inner_from_disk_                 ? std::string("restored")
                                                       : "fresh (" + inner_missing + ")"));
      return Status::Ok();
    }
    LK_LOG_WARN("heal_fetch_failed from={} error={} fallback={}", Q(from),
                Q(got.status().ToString()),
                src.kind == HealSourceKind::kPeers && !pr.restore_location.empty() ? "durable"
                                                                                    : "communicator");
  }
  return Status::Ok();
}

// Every member of the slot tells the others whether it holds state and for which step; the
// members without it (or behind) get the donor's global weights and momentum by a sum-allreduce
// in which only the donor contributes non-zeros: x + 0 == x, so they arrive bit for bit.
Status Diloco::Impl::SyncSlot(const client::PollResult& pr) {
  const uint32_t rank = pr.replica_rank, world = pr.replica_world_size;
  std::vector<float> states = EncodeMemberState({has_state_, state_.step}, rank, world);
  LK_RETURN_IF_ERROR(slot_comm_->AllReduce(states.data(), states.size(), comm::DType::kFloat32,
                                           comm::ReduceOp::kSum));
  SyncPlan plan = PlanStateSync(DecodeMemberStates(states));
  if (!plan.donor) return Status(Code::kUnavailable, "no member of the quorum holds state");
  if (!plan.any_receives()) return Status::Ok();
  const size_t n = layout_.shard_numel;
  std::vector<float> buf(2 * n, 0.0f);
  if (rank == *plan.donor) {
    std::copy(state_.global.begin(), state_.global.end(), buf.begin());
    std::copy(state_.momentum.begin(), state_.momentum.end(), buf.begin() + n);
  }
  LK_RETURN_IF_ERROR(
      slot_comm_->AllReduce(buf.data(), buf.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
  if (plan.receives[rank]) {
    state_.global.assign(buf.begin(), buf.begin() + n);
    state_.momentum.assign(buf.begin() + n, buf.end());
    state_.step = plan.step;
    has_state_ = true;
    received_ = true;
    healed_ = !pr.initial;
    inner_from_disk_ = false;  // whatever a restore brought is for another step now
    heal_source_ = fmt::format("replica_rank {}", *plan.donor);
    LK_LOG_INFO("heal_received donor_replica_rank={} step={} quorum_id={}", *plan.donor,
                plan.step, pr.quorum_id);
  }
  return Status::Ok();
}

Status Diloco::Impl::LoadGlobal(std::span<float> params) {
  std::vector<float> full(layout_.total, 0.0f);
  layout_.Place(state_.global, full);
  LK_RETURN_IF_ERROR(GroupSum(full));
  std::copy(full.begin(), full.end(), params.begin());
  return Status::Ok();
}

// Joins quorum pr.quorum_id: builds the in-group communicator the first time, rebuilds the
// slot communicator, heals, syncs state across the slot, and agrees with the group's other
// trainers that all of that worked (they must go on, or go back to polling, together).
Status Diloco::Impl::JoinQuorum(const client::PollResult& pr, std::span<float> params,
                                SyncStats* stats) {
  auto t0 = Clock::now();
  TcpSent b0 = SnapshotTcpSent();
  auto account = [&] {
    stats->sync_bytes += TcpSentBetween(b0, SnapshotTcpSent());
    stats->join_ms += MsSince(t0);
  };
  if (o_.group_size > 1 && !group_ready_) {
    // Groups of one quorum have distinct replica_ranks, so the prefix is unique within it.
    group_store_->set_prefix(fmt::format("diloco-group{}/", pr.replica_rank));
    Status st = group_comm_->Reconfigure(pr.quorum_id, o_.group_rank, o_.group_size);
    if (!st.ok()) {
      account();
      return st.WithContext("intra-group communicator");
    }
    group_ready_ = true;
  }
  received_ = healed_ = inner_from_disk_ = false;
  heal_source_.clear();
  if (pr.heal) {
    LK_RETURN_IF_ERROR(Heal(pr));
  } else {
    has_state_ = true;  // the plan says this group's state is current (or the initial one)
  }
  Status st = slot_comm_->Reconfigure(pr.quorum_id, pr.replica_rank, pr.replica_world_size);
  if (st.ok()) st = SyncSlot(pr);
  auto all_ok = GroupAgree(st.ok());
  if (!all_ok.ok() || !*all_ok) {
    account();
    if (!all_ok.ok()) return all_ok.status();
    return st.ok() ? Status(Code::kAborted, "another trainer of the group failed") : st;
  }
  // Whether anyone healed, from where, and at which step everyone now is, must agree across
  // the group.
  std::vector<float> v = {received_ ? 1.0f : 0.0f, healed_ ? 1.0f : 0.0f,
                          static_cast<float>(state_.step), inner_from_disk_ ? 1.0f : 0.0f};
  LK_RETURN_IF_ERROR(GroupSum(v));
  LK_CHECK(v[2] == static_cast<float>(state_.step) * o_.group_size)
      << "trainers of one group disagree on the step after healing";
  healed_ = v[1] > 0;
  inner_action_ = DecideInner(v[0] > 0, static_cast<uint32_t>(v[3] + 0.5f), o_.group_size);
  if (v[0] > 0) {
    pending_delta_.reset();  // the inner work since the last commit does not reach the model
    LK_RETURN_IF_ERROR(LoadGlobal(params));
    healed_since_commit_ = healed_since_commit_ || healed_;
    if (inner_action_ == InnerAction::kRestored) {
      std::vector<float> full(inner_total_, 0.0f);
      inner_layout_.Place(restored_inner_shard_, full);
      LK_RETURN_IF_ERROR(GroupSum(full));
      restored_inner_ = std::move(full);
      LK_LOG_INFO("inner_state_restored step={} hash={}", state_.step, StateHash(restored_inner_));
    }
  }
  account();
  LK_LOG_INFO("quorum_joined quorum_id={} replica_rank={} world={} step={} healed={} "
              "inner_state={} reason={}",
              pr.quorum_id, pr.replica_rank, pr.replica_world_size, state_.step, healed_,
              inner_action_ == InnerAction::kKeep    ? "kept"
              : inner_action_ == InnerAction::kReset ? "fresh"
                                                     : "restored",
              Q(pr.reason));
  return Status::Ok();
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
      MarkBad(turn.poll.quorum_id, true);
      continue;
    }
    ready_quorum_id_ = turn.poll.quorum_id;
    SyncResult r = MakeResult(received_ ? SyncKind::kReceived : SyncKind::kJoined, turn.poll, stats);
    r.healed = healed_;
    r.heal_source = heal_source_;
    r.inner = received_ ? inner_action_ : InnerAction::kKeep;
    return r;
  }
}

Result<SyncResult> Diloco::Impl::Sync(std::span<float> params) {
  if (params.size() != layout_.total) {
    return InvalidArgument("params has {} elements, the specs {}", params.size(), layout_.total);
  }
  if (ready_quorum_id_ == 0) return InvalidArgument("Sync before Join");
  if (!pending_delta_) {
    std::vector<float> delta(layout_.shard_numel);
    layout_.Take(params, delta);
    for (size_t i = 0; i < delta.size(); ++i) delta[i] = state_.global[i] - delta[i];
    pending_delta_ = std::move(delta);
  }
  SyncStats stats;
  while (true) {
    LK_ASSIGN_OR_RETURN(Turn turn, PollOnce(&stats));
    const PollAction a = turn.decision.action;
    if (a == PollAction::kDrain || a == PollAction::kDrainSave) return Drain(turn, stats);
    LK_ASSIGN_OR_RETURN(bool again, Wait(turn));
    if (again) continue;
    const client::PollResult& pr = turn.poll;
    if (a == PollAction::kJoin) {
      Status st = JoinQuorum(pr, params, &stats);
      if (!st.ok()) {
        LK_LOG_WARN("quorum_join_failed quorum_id={} error={}", pr.quorum_id, Q(st.ToString()));
        if (group_failed_) return st;
        MarkBad(pr.quorum_id, true);
        continue;
      }
      ready_quorum_id_ = pr.quorum_id;
      if (received_) {
        SyncResult r = MakeResult(SyncKind::kReceived, pr, stats);
        r.healed = healed_;
        r.heal_source = heal_source_;
        r.inner = inner_action_;
        return r;
      }
    }
    LK_ASSIGN_OR_RETURN(bool done, OuterAttempt(pr, params, &stats));
    if (!done) {
      // A drain aborts the allreduce on purpose: the next poll answers it, no failure to report.
      MarkBad(pr.quorum_id, !sink_->drain.load());
      continue;
    }
    SyncResult r = MakeResult(SyncKind::kCommitted, pr, stats);
    r.healed = healed_since_commit_;
    r.saved = saved_at_last_commit_;
    healed_since_commit_ = false;
    return r;
  }
}

Result<bool> Diloco::Impl::OuterAttempt(const client::PollResult& pr, std::span<float> params,
                                        SyncStats* stats) {
  auto t0 = Clock::now();
  std::vector<float> avg = *pending_delta_;
  TcpSent ar_b0 = SnapshotTcpSent();
  // Waiting on the other groups is not this group's stall (the lighthouse's progress timeout).
  (void)session_->SetPeerWait(true);
  Status st = slot_comm_->AllReduce(avg.data(), avg.size(), comm::DType::kFloat32,
                                    comm::ReduceOp::kAvg);
  (void)session_->SetPeerWait(false);
  stats->cross_bytes += TcpSentBetween(ar_b0, SnapshotTcpSent());
  stats->allreduce_ms += MsSince(t0);
  LK_ASSIGN_OR_RETURN(bool all_ok, GroupAgree(st.ok()));
  if (!all_ok) {
    LK_LOG_WARN("outer_step_aborted step={} quorum_id={} error={}", state_.step + 1, pr.quorum_id,
                Q(st.ok() ? std::string("another trainer of the group failed") : st.ToString()));
    return false;
  }
  auto gather_t0 = Clock::now();
  TcpSent gather_b0 = SnapshotTcpSent();
  OuterNesterovStep(state_.global, state_.momentum, avg, o_.outer);
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
  const std::string hash = StateHash(state_.global);
  auto commit_t0 = Clock::now();
  LK_RETURN_IF_ERROR(session_->Commit(state_.step, true, hash).WithContext("commit"));
  stats->commit_ms += MsSince(commit_t0);
  stats->outer_ms = MsSince(t0);
  saved_at_last_commit_ = false;
  if (SaveAfterCommit(state_.step, o_.ckpt_every)) {
    LK_RETURN_IF_ERROR(SaveDurable(pr.quorum_id));
    saved_at_last_commit_ = true;
  }
  return true;
}

Status Diloco::Impl::Finish() {
  // A finished group's leave is a lost member to the others: were it to leave while another
  // member still waits for the last bytes of the final allreduce, that member's step would be
  // aborted with nobody left to heal from. So no member leaves before all have come out of it.
  float done = 1.0f;
  if (Status st = slot_comm_->AllReduce(&done, 1, comm::DType::kFloat32, comm::ReduceOp::kSum);
      !st.ok()) {
    LK_LOG_WARN("final_barrier_failed error={}", Q(st.ToString()));
  }
  // The run's result is the final weights: they are saved durably (and registered) unless the
  // last commit just did, so that a group coming back after every other group finished
  // restores the final step rather than an older checkpoint, and the user has the model.
  if (SaveAtFinish(!o_.ckpt_dir.empty(), has_state_, state_.step, o_.ckpt_every)) {
    if (Status st = SaveDurable(ready_quorum_id_); !st.ok()) {
      LK_LOG_ERROR("final_save_failed step={} error={}", state_.step, Q(st.ToString()));
      return st.WithContext("final save");
    }
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
Result<SyncResult> Diloco::Join(std::span<float> params) { return impl_->Join(params); }
Result<SyncResult> Diloco::Sync(std::span<float> params) { return impl_->Sync(params); }
bool Diloco::drain_requested() const { return impl_->drain_requested(); }
void Diloco::RequestDrain() { impl_->RequestDrain(); }
void Diloco::HandleNotice(const client::Notice& notice) { impl_->HandleNotice(notice); }
Status Diloco::GroupAllReduceSum(std::span<float> values) { return impl_->GroupSum(values); }
Status Diloco::Finish() { return impl_->Finish(); }
std::span<const float> Diloco::restored_inner_state() const { return impl_->restored_inner(); }
uint32_t Diloco::step() const { return impl_->step(); }
size_t Diloco::numel() const { return impl_->numel(); }
size_t Diloco::shard_numel() const { return impl_->shard_numel(); }
size_t Diloco::inner_numel() const { return impl_->inner_numel(); }
std::string Diloco::state_hash() const { return impl_->hash(); }

}  // namespace lk::diloco
