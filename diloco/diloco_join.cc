// Joining a quorum: the in-group communicator the first time, the slot communicator, a heal
// in the core's source order, the slot state sync, and the group's agreement on all of it.
#include <algorithm>

#include "common/log.h"
#include "diloco/diloco_impl.h"
#include "diloco/net_bytes.h"

namespace lk::diloco {

using internal::MsSince;

// Pulls this shard from live peers or the durable checkpoint, in the core's order. A failure is
// not fatal: the slot sync then hands this member the donor's state over the communicator.
Status Diloco::Impl::Heal(const client::PollResult& pr) {
  // No quorum has agreed on this process's state yet: it is a new life of the group (a start, a
  // requeue), whose own data position is in its own last durable checkpoint, not in memory.
  const bool new_life = fresh_;
  has_state_ = false;
  for (const HealSource& src :
       PlanHeal(pr.heal, pr.initial, pr.heal_sources, pr.max_step, pr.restore_location)) {
    Result<OuterState> got = Status(Code::kNotFound, "no source");
    std::string from;
    std::optional<std::vector<float>> inner;
    std::optional<std::vector<uint8_t>> extra;
    std::string inner_missing;
    if (src.kind == HealSourceKind::kPeers) {
      from = "peers";
      got = state_io_->FetchFromPeers(src.peers, src.step);
    } else {
      from = "durable " + src.location;
      auto r = state_io_->Restore(src.location);
      if (r.ok()) {
        inner = std::move(r->inner);
        extra = std::move(r->extra);
        inner_missing = r->inner_missing;
        got = std::move(r->state);
      } else {
        got = r.status();
      }
    }
    if (got.ok()) {
      state_ = std::move(*got);
      has_state_ = join_.received = join_.healed = true;
      fresh_ = false;
      join_.heal_source = from;
      join_.inner_from_disk = inner.has_value();
      join_.extra_from_disk = extra.has_value();
      restored_extra_shard_ = std::move(extra);
      if (inner) restored_inner_shard_ = std::move(*inner);
      LK_LOG_INFO("heal_fetched from={} step={} inner_state={}", Q(from), state_.step,
                  Q(src.kind == HealSourceKind::kPeers ? std::string("fresh")
                    : join_.inner_from_disk            ? std::string("restored")
                                                       : "fresh (" + inner_missing + ")"));
      if (src.kind == HealSourceKind::kPeers && new_life) TakeOwnExtra();
      return Status::Ok();
    }
    LK_LOG_WARN(
        "heal_fetch_failed from={} error={} fallback={}", Q(from), Q(got.status().ToString()),
        src.kind == HealSourceKind::kPeers && !pr.restore_location.empty() ? "durable"
                                                                           : "communicator");
  }
  return Status::Ok();
}

// A new life healed from live peers: the weights are the peers', the data position the group's
// own, from its newest durable checkpoint (a requeue's drain saved it). Without one the trainer
// starts its stream where a first start does. A damaged or unreadable one is logged, not fatal.
void Diloco::Impl::TakeOwnExtra() {
  auto own = state_io_->RestoreOwnExtra();
  if (!own.ok()) {
    LK_LOG_WARN("extra_state_unreadable error={}", Q(own.status().ToString()));
    return;
  }
  if (!*own) return;
  LK_LOG_INFO("extra_state_from_own_checkpoint step={} bytes={} healed_step={}", (*own)->step,
              (*own)->bytes.size(), state_.step);
  join_.extra_from_disk = true;
  restored_extra_shard_ = std::move((*own)->bytes);
}

// Every member of the slot tells the others whether it holds state and for which step; the
// members without it (or behind) get the donor's global weights and momentum by a sum-allreduce
// in which only the donor contributes non-zeros: x + 0 == x, so they arrive bit for bit.
Status Diloco::Impl::SyncSlot(const client::PollResult& pr) {
  const uint32_t rank = pr.replica_rank, world = pr.replica_world_size;
  std::vector<float> states =
      EncodeMemberState({has_state_, state_.step, fresh_}, rank, world);
  LK_RETURN_IF_ERROR(slot_comm_->AllReduce(states.data(), states.size(), comm::DType::kFloat32,
                                           comm::ReduceOp::kSum));
  SyncPlan plan = PlanStateSync(DecodeMemberStates(states));
  if (!plan.donor) return Status(Code::kUnavailable, "no member of the quorum holds state");
  if (!plan.any_receives()) return Status::Ok();
  std::vector<float> buf = DonorBuffer(rank == *plan.donor);
  LK_RETURN_IF_ERROR(
      slot_comm_->AllReduce(buf.data(), buf.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
  if (plan.receives[rank]) TakeDonorState(buf, plan, pr);
  return Status::Ok();
}

std::vector<float> Diloco::Impl::DonorBuffer(bool donor) const {
  const size_t n = layout_.shard_numel;
  std::vector<float> buf(2 * n, 0.0f);
  if (donor) {
    std::copy(state_.global.begin(), state_.global.end(), buf.begin());
    std::copy(state_.momentum.begin(), state_.momentum.end(), buf.begin() + n);
  }
  return buf;
}

void Diloco::Impl::TakeDonorState(std::span<const float> buf, const SyncPlan& plan,
                                  const client::PollResult& pr) {
  const size_t n = layout_.shard_numel;
  state_.global.assign(buf.begin(), buf.begin() + n);
  state_.momentum.assign(buf.begin() + n, buf.end());
  state_.step = plan.step;
  has_state_ = true;
  fresh_ = false;
  join_.received = true;
  // From a fresh donor it is the first start's weights, whatever the answer said.
  join_.healed = !pr.initial && !plan.donor_fresh;
  join_.inner_from_disk = false;  // whatever a restore brought is for another step now
  join_.extra_from_disk = false;
  join_.heal_source = fmt::format("replica_rank {}", *plan.donor);
  LK_LOG_INFO("heal_received donor_replica_rank={} step={} quorum_id={} group_sizes={}",
              *plan.donor, plan.step, pr.quorum_id,
              pr.group_sizes.empty() ? std::to_string(o_.group_size)
                                     : fmt::format("{}", fmt::join(pr.group_sizes, ",")));
}

Result<std::optional<MixedPlan>> Diloco::Impl::PlanQuorum(const client::PollResult& pr) const {
  const std::vector<uint32_t>& sizes = pr.group_sizes;
  // Without the sizes the quorum has one group size: the lighthouse refuses the others.
  if (sizes.empty()) return std::optional<MixedPlan>();
  if (sizes.size() != pr.replica_world_size || pr.replica_rank >= sizes.size() ||
      sizes[pr.replica_rank] != o_.group_size ||
      std::find(sizes.begin(), sizes.end(), 0u) != sizes.end()) {
    return Status(Code::kConflict,
                  fmt::format("quorum {} lists group sizes [{}] for {} members, this group of {} "
                              "at replica_rank {}",
                              pr.quorum_id, fmt::join(sizes, ","), pr.replica_world_size,
                              o_.group_size, pr.replica_rank));
  }
  if (!MixedGroupSizes(sizes)) return std::optional<MixedPlan>();
  return std::optional<MixedPlan>(PlanMixed(o_.params, sizes, pr.replica_rank, o_.group_rank));
}

// The slot state sync across layouts: each group holds state when all its trainers hold the same
// step; the donor group's trainers contribute their global weights and momentum, everyone else
// zeros, to a sum over the mesh fragment by fragment, so the receivers get the donor's bits in
// their own layout (x + 0 == x).
Status Diloco::Impl::SyncMixed(const client::PollResult& pr) {
  const MixedPlan& plan = *mixed_;
  std::vector<float> states =
      EncodeMemberState({has_state_, state_.step, fresh_}, plan.mesh_rank, plan.mesh_world);
  LK_RETURN_IF_ERROR(mesh_comm_->AllReduce(states.data(), states.size(), comm::DType::kFloat32,
                                           comm::ReduceOp::kSum));
  const std::vector<MemberState> trainers = DecodeMemberStates(states);
  std::vector<MemberState> groups;
  for (size_t q = 0; q < pr.group_sizes.size(); ++q) {
    groups.push_back(GroupState(std::span(trainers).subspan(plan.group_base[q],
                                                            pr.group_sizes[q])));
  }
  SyncPlan sync = PlanStateSync(groups);
  if (!sync.donor) return Status(Code::kUnavailable, "no group of the quorum holds state");
  if (!sync.any_receives()) return Status::Ok();
  std::vector<float> buf = DonorBuffer(pr.replica_rank == *sync.donor);
  std::vector<comm::ReduceRun> runs = plan.runs;
  std::vector<comm::ReduceRun> momentum = ShiftRuns(plan.runs, layout_.shard_numel);
  runs.insert(runs.end(), momentum.begin(), momentum.end());
  LK_RETURN_IF_ERROR(mesh_comm_->AllReduceRuns(buf, runs, nullptr));
  if (sync.receives[pr.replica_rank]) TakeDonorState(buf, sync, pr);
  return Status::Ok();
}

// Gathers in `out` itself: zeros, this trainer's rows, the in-group sum (the other trainers
// add theirs, x + 0 == x bit for bit); a group of one holds every row, so its shard is the
// whole buffer. A failed sum leaves `out` partial, but then the group is going down.
Status Diloco::Impl::GatherInto(std::span<const float> shard, std::span<float> out) {
  if (o_.sharded) {
    return to_caller_.Apply(shard, out, [this](std::span<float> v) { return GroupSum(v); });
  }
  if (o_.group_size > 1) std::fill(out.begin(), out.end(), 0.0f);
  layout_.Place(shard, out);
  return GroupSum(out);
}

Status Diloco::Impl::LoadGlobal(std::span<float> params) {
  LK_RETURN_IF_ERROR(GatherInto(state_.global, params));
  LK_ASSIGN_OR_RETURN(global_hash_, GlobalHash());
  if (o_.overlap) ov_.global_full.assign(params.begin(), params.end());
  return Status::Ok();
}

Result<std::string> Diloco::Impl::GlobalHash() {
  LK_ASSIGN_OR_RETURN(uint64_t sum,
                      GroupSumU64(RowHashSum(o_.params, layout_, state_.global), true));
  return fmt::format("{:016x}", sum);
}

Status Diloco::Impl::TakeShard(std::span<const float> params, std::span<float> shard) {
  if (o_.sharded) {
    return to_library_.Apply(params, shard, [this](std::span<float> v) { return GroupSum(v); });
  }
  layout_.Take(params, shard);
  return Status::Ok();
}

Status Diloco::Impl::CheckParamSize(size_t given) const {
  if (given == param_numel()) return Status::Ok();
  if (o_.sharded) {
    return InvalidArgument(
        "params has {} elements, but this trainer's rows of the specs (sharded, group rank {} "
        "of {}) have {}",
        given, o_.group_rank, o_.group_size, param_numel());
  }
  return InvalidArgument("params has {} elements, the specs {}", given, layout_.total);
}

Status Diloco::Impl::AgreeOnGroup() {
  // The group's trainers must describe one model (a sharded trainer's rows are cut from it,
  // and the group's layout from all of theirs), all hold it sharded or none, and a sharded
  // group's rows must tile every tensor: one in-group sum of the fingerprint's limbs, the count
  // of sharded trainers and every trainer's rows of every tensor (each at its rank's place),
  // before any state moves. Every trainer sees the same sum and fails alike.
  const size_t np = o_.params.size(), ni = o_.inner_state.size();
  const uint32_t n = o_.group_size;
  std::vector<float> v(3 + static_cast<size_t>(n) * (np + ni) * kRowTableFloatsPerRange, 0.0f);
  v[0] = static_cast<float>(model_fingerprint_ & 0xfff);
  v[1] = static_cast<float>(model_fingerprint_ >> 12);
  v[2] = o_.sharded ? 1.0f : 0.0f;
  const std::span<float> params_table =
      std::span<float>(v).subspan(3, static_cast<size_t>(n) * np * kRowTableFloatsPerRange);
  const std::span<float> inner_table =
      std::span<float>(v).subspan(3 + params_table.size());
  EncodeRows(caller_rows_, o_.group_rank, params_table);
  EncodeRows(inner_rows_, o_.group_rank, inner_table);
  LK_RETURN_IF_ERROR(GroupSum(v).WithContext("the group's model check"));
  const auto fn = static_cast<float>(n);
  if (v[0] != fn * static_cast<float>(model_fingerprint_ & 0xfff) ||
      v[1] != fn * static_cast<float>(model_fingerprint_ >> 12)) {
    group_failed_ = true;  // a configuration error: no later quorum mends it
    return InvalidArgument(
        "the trainers of this group describe different models (this one's parameters have "
        "fingerprint {:06x}): every trainer of a group passes the same specs (names, whole "
        "shapes, order), sharded or not",
        model_fingerprint_);
  }
  if (v[2] != 0.0f && v[2] != fn) {
    group_failed_ = true;
    return InvalidArgument(
        "{} of the {} trainers of this group hold the model sharded and the others whole (this "
        "one: {}): DilocoOptions::sharded is the group's, the same in all of its trainers",
        static_cast<uint32_t>(v[2]), n, o_.sharded ? "sharded" : "whole");
  }
  if (o_.sharded) {
    const RowTable table = DecodeRowTable(params_table, n, np);
    Status st = CheckTiling(o_.params, table);
    if (st.ok()) st = CheckTiling(o_.inner_state, DecodeRowTable(inner_table, n, ni));
    if (!st.ok()) {
      group_failed_ = true;
      return st.WithContext(fmt::format("the rows of this group's {} trainers", n));
    }
    const RowTable even = RuleTable(o_.params, n, ShardRule::kEven);
    to_library_ = PlanRelayout(o_.params, o_.group_rank, table, even);
    to_caller_ = PlanRelayout(o_.params, o_.group_rank, even, table);
    LK_LOG_INFO("shard_rows_agreed layout={} group_size={} elements_moved_per_step={}",
                TableKind(o_.params, table), n, to_library_.moved);
  }
  if (join_rows_) {
    LK_RETURN_IF_ERROR(TakeShard(*join_rows_, state_.global));
    join_rows_.reset();
  }
  return Status::Ok();
}

// The poll answer a join acts on: with the heal of an earlier poll of the same quorum when the
// core says so (OnJoinAnswer: the plan is the session's, not lost to an earlier poll).
client::PollResult Diloco::Impl::WithHeal(const client::PollResult& polled) {
  client::PollResult pr = polled;
  const std::optional<client::PollResult>& h = session_->last_heal();
  if (OnJoinAnswer(proto_, pr.quorum_id, pr.heal,
                   h ? std::optional<uint32_t>(h->quorum_id) : std::nullopt)) {
    pr.heal = true;
    pr.initial = h->initial;
    pr.max_step = h->max_step;
    pr.heal_sources = h->heal_sources;
    pr.restore_location = h->restore_location;
    pr.restore_step = h->restore_step;
    LK_LOG_INFO("heal_from_earlier_poll quorum_id={} max_step={} initial={} sources={}",
                pr.quorum_id, pr.max_step, pr.initial, pr.heal_sources.size());
  }
  return pr;
}

// Joins quorum polled.quorum_id: builds the in-group communicator the first time, rebuilds the
// slot communicator, heals, syncs state across the slot, and agrees with the group's other
// trainers that all of that worked (they must go on, or go back to polling, together).
Status Diloco::Impl::JoinQuorum(const client::PollResult& polled, std::span<float> params,
                                SyncStats* stats) {
  const client::PollResult pr = WithHeal(polled);
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
    if (Status st = AgreeOnGroup(); !st.ok()) {
      // A collective that failed is agreed again on the next quorum's communicator; a
      // configuration the group refused stays refused (group_failed_).
      group_ready_ = false;
      account();
      return st;
    }
  }
  Result<std::optional<MixedPlan>> plan = PlanQuorum(pr);
  if (!plan.ok()) {
    account();
    return plan.status();
  }
  join_.received = join_.healed = join_.inner_from_disk = join_.extra_from_disk = false;
  join_.heal_source.clear();
  // A join that fails leaves this trainer's state as it was before: state fetched for a quorum
  // that then fell apart is not a step this group reached, and the next poll must ask at the
  // step it holds. (A group that was healing to the last step when the others finished would
  // otherwise ask as a finished group, and no catch-up quorum would ever take it.)
  OuterState before = state_;
  const bool had_state = has_state_, was_fresh = fresh_;
  auto roll_back = [&] {
    state_ = std::move(before);
    has_state_ = had_state;
    fresh_ = was_fresh;
    join_.received = join_.healed = join_.inner_from_disk = join_.extra_from_disk = false;
    join_.heal_source.clear();
  };
  if (pr.heal) {
    LK_RETURN_IF_ERROR(Heal(pr));
  } else {
    has_state_ = true;  // the plan says this group's state is current (or the initial one)
  }
  mixed_ = std::move(*plan);
  // A notice since the poll (a drain, or this quorum lost) makes the communicator refuse this
  // rendezvous at once, whether it came before the rendezvous started or during it (see
  // CommManager::AbortQuorum and Close): the members it would wait for are not coming.
  Status st = mixed_ ? mesh_comm_->Reconfigure(pr.quorum_id, mixed_->mesh_rank, mixed_->mesh_world)
                     : slot_comm_->Reconfigure(pr.quorum_id, pr.replica_rank,
                                               pr.replica_world_size);
  if (st.ok()) st = mixed_ ? SyncMixed(pr) : SyncSlot(pr);
  // The group's other trainers may still wait in their own rendezvous for this quorum: telling
  // the lighthouse now, before the group agrees, ends their wait (ReportJoinBeforeAgreement).
  if (ReportJoinBeforeAgreement(st.ok(), o_.group_size, sink_->drain.load(),
                                sink_->lost_quorum_id.load(), pr.quorum_id) &&
      OnReport(proto_, pr.quorum_id)) {
    SendFailed(pr.quorum_id);
  }
  auto all_ok = GroupAgree(st.ok());
  if (!all_ok.ok() || !*all_ok) {
    account();
    roll_back();
    if (!all_ok.ok()) return all_ok.status();
    return st.ok() ? Status(Code::kAborted, "another trainer of the group failed") : st;
  }
  fresh_ = false;  // the quorum holds this state now: its own, or the donor's
  // Whether anyone healed, from where, and at which step everyone now is, must agree across
  // the group.
  std::vector<float> v = {join_.received ? 1.0f : 0.0f, join_.healed ? 1.0f : 0.0f,
                          static_cast<float>(state_.step), join_.inner_from_disk ? 1.0f : 0.0f};
  LK_RETURN_IF_ERROR(GroupSum(v));
  if (v[2] != static_cast<float>(state_.step) * static_cast<float>(o_.group_size)) {
    // Another trainer's word, not this process's invariant: the group goes down with a
    // reason (the agent reports the exit), rather than this process aborting.
    group_failed_ = true;
    return Error(Code::kConflict,
                 "trainers of one group disagree on the step after the join: this one holds "
                 "step {}, the group's steps sum to {} over {} trainers",
                 state_.step, v[2], o_.group_size);
  }
  join_.healed = v[1] > 0;
  join_.inner_action = DecideInner(v[0] > 0, static_cast<uint32_t>(v[3] + 0.5f), o_.group_size);
  if (v[0] > 0) {
    pending_delta_.reset();  // the inner work since the last commit does not reach the model
    ResetResidual();         // ... nor what its encoding dropped
    LK_RETURN_IF_ERROR(LoadGlobal(params));
    healed_since_commit_ = healed_since_commit_ || join_.healed;
    if (join_.inner_action == InnerAction::kRestored && o_.sharded) {
      restored_inner_ = restored_inner_shard_;  // this trainer's rows are all it holds
      LK_LOG_INFO("inner_state_restored step={} hash={}", state_.step,
                  StateHash(restored_inner_));
    } else if (join_.inner_action == InnerAction::kRestored) {
      std::vector<float> full(inner_total_, 0.0f);
      inner_layout_.Place(restored_inner_shard_, full);
      LK_RETURN_IF_ERROR(GroupSum(full));
      restored_inner_ = std::move(full);
      LK_LOG_INFO("inner_state_restored step={} hash={}", state_.step, StateHash(restored_inner_));
    }
  }
  TakeJoinExtra(v[0] > 0);
  account();
  LK_LOG_INFO(
      "quorum_joined quorum_id={} replica_rank={} world={} step={} healed={} "
      "inner_state={} group_sizes={} reason={}",
      pr.quorum_id, pr.replica_rank, pr.replica_world_size, state_.step, join_.healed,
      join_.inner_action == InnerAction::kKeep    ? "kept"
      : join_.inner_action == InnerAction::kReset ? "fresh"
                                                  : "restored",
      mixed_ ? fmt::format("{}", fmt::join(pr.group_sizes, ",")) : std::to_string(o_.group_size),
      Q(pr.reason));
  return Status::Ok();
}

// The extra state goes with the state the join leaves: this rank's bytes from the durable
// checkpoint that state came from, else (a heal from live peers, the slot state sync, this
// group's own state) the caller's latest, since its data position goes on from where it is.
void Diloco::Impl::TakeJoinExtra(bool received) {
  if (!received) return;
  extra_pending_.clear();  // dropped with the pending pseudo-gradient
  if (join_.extra_from_disk && restored_extra_shard_) {
    restored_extra_ = std::move(*restored_extra_shard_);
    extra_committed_ = *restored_extra_;
    LK_LOG_INFO("extra_state_restored step={} bytes={}", state_.step, restored_extra_->size());
  } else {
    restored_extra_.reset();
    extra_committed_ = extra_next_;
  }
  restored_extra_shard_.reset();
}

}  // namespace lk::diloco
