// Durable saves: the save itself (with the inner optimizer's state) and its registration with
// the lighthouse, the drain's answer (with the save it may ask for), and the finish (the last
// exchange landed, the quorum's barrier, the final save, the goodbye).
#include <filesystem>

#include "common/log.h"
#include "diloco/diloco_impl.h"

namespace lk::diloco {

Result<SyncResult> Diloco::Impl::Drain(const Turn& turn, SyncStats stats) {
  const client::PollResult& pr = turn.poll;
  LK_LOG_INFO("drain step={} checkpoint_now={} reason={}", state_.step, pr.checkpoint_now,
              Q(pr.reason));
  SyncResult r = MakeResult(SyncKind::kDrained, pr, stats);
  r.checkpoint_now = pr.checkpoint_now;
  if (turn.decision.action == PollAction::kDrainSave) {
    if (Result<bool> st = SaveDurable(proto_.ready_quorum_id); !st.ok()) {
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
    std::vector<float> inner(inner_numel(), 0.0f);
    LK_RETURN_IF_ERROR(hooks_.save(inner).WithContext("inner state for the save"));
    inner_shard.resize(inner_layout_.shard_numel);
    if (o_.sharded) {
      inner_shard = inner;  // the hook filled this trainer's rows only
    } else {
      inner_layout_.Take(inner, inner_shard);
    }
    LK_LOG_INFO("inner_state_saved step={} hash={}", state_.step, StateHash(inner));
  }
  if (!extra_committed_.empty()) {
    LK_LOG_INFO("extra_state_saved step={} bytes={}", state_.step, extra_committed_.size());
  }
  bool written = true;
  if (Status st = state_io_->SaveDurable(state_, inner_shard, extra_committed_, attempt);
      !st.ok()) {
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

Status Diloco::Impl::Finish() {
  if (ov_.in_flight) {
    // The last step's exchange lands before the barrier (which runs on the same communicator).
    std::vector<float> scratch = ov_.base;
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
    Result<bool> written = SaveDurable(proto_.ready_quorum_id);
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

Status Diloco::Impl::SetExtraState(std::span<const uint8_t> bytes) {
  if (bytes.size() > o_.extra_state_bytes_max) {
    return InvalidArgument(
        "extra state of {} bytes is over the bound of {} bytes (DilocoOptions::"
        "extra_state_bytes_max); keep it to a data position and generator states",
        bytes.size(), o_.extra_state_bytes_max);
  }
  extra_next_.assign(bytes.begin(), bytes.end());
  return Status::Ok();
}

}  // namespace lk::diloco
