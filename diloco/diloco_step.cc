// The blocking outer step: the poll loop that joins quorums until one can be stepped on, the
// cross-group exchange of the pending pseudo-gradient, and its landing (the group's agreement,
// the outer update, the in-group all-gather, publishing, the commit). The overlapped pipeline
// (diloco_overlap.cc) lands its exchanges here too and retries through RunPending.
#include <thread>

#include "common/log.h"
#include "diloco/diloco_impl.h"
#include "diloco/net_bytes.h"

namespace lk::diloco {

namespace {

using internal::MsSince;
using Clock = internal::Clock;

}  // namespace

Result<Diloco::Impl::Turn> Diloco::Impl::PollOnce(SyncStats* stats,
                                                  std::optional<Millis> timeout) {
  auto t0 = Clock::now();
  auto pr = timeout ? session_->Poll(state_.step, *timeout) : session_->Poll(state_.step);
  stats->poll_ms += MsSince(t0);
  if (!pr.ok()) return pr.status().WithContext(fmt::format("poll at step {}", state_.step));
  return Decide(std::move(*pr));
}

Diloco::Impl::Turn Diloco::Impl::Decide(client::PollResult pr) {
  PollView view{pr.quorum_id, pr.drain, pr.checkpoint_now};
  PollDecision d = OnPoll(proto_, view, sink_->drain.load(), has_state_, Clock::now());
  return Turn{std::move(pr), std::move(d)};
}

Result<Diloco::Impl::Turn> Diloco::Impl::NextTurn(SyncStats* stats) {
  client::PollResult held;
  switch (held_.Take(sink_->drain.load(), &held)) {
    case TurnFrom::kJoinedUnstepped:
      return Turn{std::move(held), JoinedUnsteppedDecision()};
    case TurnFrom::kCarried:
      return Decide(std::move(held));
    case TurnFrom::kPoll:
      break;
  }
  return PollOnce(stats);
}

Result<bool> Diloco::Impl::Wait(const Turn& turn) {
  switch (turn.decision.action) {
    case PollAction::kGiveUp:
      LK_LOG_ERROR("stuck quorum_id={} reason={}", turn.poll.quorum_id, Q(turn.decision.reason));
      return Status(Code::kDeadlineExceeded, turn.decision.reason);
    case PollAction::kWaitForDrain:
    case PollAction::kWaitNewQuorum:
      std::this_thread::sleep_for(turn.decision.repoll_after);
      return true;
    default:
      return false;
  }
}

void Diloco::Impl::MarkBad(uint32_t quorum_id, bool report) {
  const QuorumFailedDecision d = OnQuorumFailed(proto_, quorum_id, report, Clock::now());
  // Tells the lighthouse this quorum failed us, so the next round has a new quorum_id.
  if (d.report) SendFailed(quorum_id);
  if (d.backoff > Millis(0)) {
    LK_LOG_WARN("conflict_backoff ms={} attempts={}", d.backoff.count(), d.conflict_attempts);
    (void)DrainNoticedWithin(d.backoff);  // a drain ends the wait
  }
}

void Diloco::Impl::SendFailed(uint32_t quorum_id) {
  (void)session_->ReportFailed(state_.step + 1, quorum_id);
}

Status Diloco::Impl::JoinFailed(const client::PollResult& pr, const Status& st) {
  LK_LOG_WARN("quorum_join_failed quorum_id={} error={}", pr.quorum_id, Q(st.ToString()));
  if (group_failed_) return st;
  NoteFailure(st);
  MarkBad(pr.quorum_id, true);
  return Status::Ok();
}

namespace {
// How long a failed in-group agreement waits for the drain notice that may explain it.
constexpr Millis kDrainGrace{1000};
}  // namespace

Result<SyncResult> Diloco::Impl::Join(std::span<float> params) {
  LK_RETURN_IF_ERROR(CheckParamSize(params.size()));
  if (proto_.ready_quorum_id != 0) return InvalidArgument("Join was called already");
  restored_extra_.reset();
  extra_committed_ = extra_next_;  // what a save before any commit or heal writes
  CanonicalizeZeros(params);
  if (o_.sharded && o_.group_size > 1) {
    // Where the caller's rows are not the even split the rows of the outer state come partly
    // from other trainers of the group: they move once the group has exchanged its rows, at
    // the first join (AgreeOnGroup), where every trainer of the group takes part in the move.
    join_rows_.emplace(params.begin(), params.end());
  } else {
    LK_RETURN_IF_ERROR(TakeShard(params, state_.global));
  }
  SyncStats stats;
  while (true) {
    LK_ASSIGN_OR_RETURN(Turn turn, PollOnce(&stats));
    const PollAction a = turn.decision.action;
    if (a == PollAction::kDrain || a == PollAction::kDrainSave) return Drain(turn, stats);
    LK_ASSIGN_OR_RETURN(bool again, Wait(turn));
    if (again) continue;
    if (Status st = JoinQuorum(turn.poll, params, &stats); !st.ok()) {
      LK_RETURN_IF_ERROR(JoinFailed(turn.poll, st));
      continue;
    }
    OnJoined(proto_, turn.poll.quorum_id);
    held_.joined_unstepped = turn.poll;
    if (o_.overlap) ov_.base.assign(params.begin(), params.end());
    SyncResult r =
        MakeResult(join_.received ? SyncKind::kReceived : SyncKind::kJoined, turn.poll, stats);
    r.healed = join_.healed;
    r.heal_source = join_.heal_source;
    r.inner = join_.received ? join_.inner_action : InnerAction::kKeep;
    // The inner phase before the first Sync starts here: with fragments, that Sync's exchange
    // is paced by it like every later one, instead of going out in one burst.
    if (o_.overlap) ov_.sync_returned = Clock::now();
    return r;
  }
}

Result<uint64_t> Diloco::Impl::GroupSumU64(uint64_t value, bool wrap) {
  if (o_.group_size == 1) return value;
  std::vector<float> limbs(kCountLimbs);
  EncodeCount(value, limbs);
  LK_RETURN_IF_ERROR(GroupSum(limbs));
  return wrap ? DecodeCountMod64(limbs) : DecodeCount(limbs);
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
  const ExchangeShape shape{o_.outer_compress, o_.outer_fragments, model_fingerprint_};
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
  LK_RETURN_IF_ERROR(CheckParamSize(params.size()));
  if (proto_.ready_quorum_id == 0) return InvalidArgument("Sync before Join");
  restored_extra_.reset();
  if (o_.overlap) {
    if (ov_.sync_returned) ov_.inner_phase = Clock::now() - *ov_.sync_returned;
    Result<SyncResult> r = SyncOverlapped(params, tokens);
    ov_.sync_returned = Clock::now();
    return r;
  }
  if (!pending_delta_) {
    // Every trainer of the group comes here once per outer step, so this in-group sum pairs up.
    LK_ASSIGN_OR_RETURN(pending_tokens_, GroupTokens(tokens));
    std::vector<float> delta(layout_.shard_numel);
    LK_RETURN_IF_ERROR(TakeShard(params, delta));
    for (size_t i = 0; i < delta.size(); ++i) delta[i] = state_.global[i] - delta[i];
    pending_delta_ = std::move(delta);
    extra_pending_ = extra_next_;
  }
  return RunPending(params, SyncStats{});
}

Result<std::optional<SyncResult>> Diloco::Impl::NextQuorum(std::span<float> params,
                                                           SyncStats* stats,
                                                           client::PollResult* out) {
  while (true) {
    LK_ASSIGN_OR_RETURN(Turn turn, NextTurn(stats));
    const PollAction a = turn.decision.action;
    if (a == PollAction::kDrain || a == PollAction::kDrainSave) {
      LK_ASSIGN_OR_RETURN(SyncResult drained, Drain(turn, *stats));
      return std::optional<SyncResult>(std::move(drained));
    }
    LK_ASSIGN_OR_RETURN(bool again, Wait(turn));
    if (again) continue;
    const client::PollResult& pr = turn.poll;
    if (a == PollAction::kJoin) {
      if (Status st = JoinQuorum(pr, params, stats); !st.ok()) {
        LK_RETURN_IF_ERROR(JoinFailed(pr, st));
        continue;
      }
      OnJoined(proto_, pr.quorum_id);
      if (join_.received) {
        held_.joined_unstepped = pr;
        SyncResult r = MakeResult(SyncKind::kReceived, pr, *stats);
        r.healed = join_.healed;
        r.heal_source = join_.heal_source;
        r.inner = join_.inner_action;
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
  OnCommitted(proto_);
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
  // The caller's extra state of this pseudo-gradient goes with the step it made.
  extra_committed_ = std::move(extra_pending_);
  extra_pending_.clear();
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

}  // namespace lk::diloco
