// The overlapped pipeline (DilocoOptions::overlap): the exchange of one step on a thread of its
// own while the caller runs the next inner steps, the stand-in weights meanwhile, the thread's
// own poll for the next quorum, and the landing of the exchange in the next call.
#include <thread>

#include "common/float_env.h"
#include "common/log.h"
#include "diloco/diloco_impl.h"
#include "diloco/net_bytes.h"

namespace lk::diloco {

namespace {

using internal::MsSince;
using Clock = internal::Clock;

}  // namespace

// Overlapped outer steps. Each call lands the exchange the previous call started (the outer
// update to step s+1), and starts the exchange of the inner steps since the previous call (the
// pseudo-gradient of step s+2). The caller's weights for the next inner steps are the outer
// update of step s+1's global weights with this group's own pseudo-gradient standing in for the
// average that is still on the wire (the "eager" correction for the one-step delay): a group
// alone in its quorum, or groups whose pseudo-gradients agree, follow exactly the trajectory of
// the blocking outer step, and the real average replaces the stand-in one call later.
Result<SyncResult> Diloco::Impl::SyncOverlapped(std::span<float> params, uint64_t tokens) {
  LK_ASSIGN_OR_RETURN(uint64_t group_tokens, GroupTokens(tokens));
  // ov_.start: this trainer's rows of the weights these inner steps started from; delta: the
  // pseudo-gradient, start minus where they ended.
  const size_t n = layout_.shard_numel;
  std::vector<float> delta(n);
  ov_.start.resize(n);
  LK_RETURN_IF_ERROR(TakeShard(ov_.base, ov_.start));
  LK_RETURN_IF_ERROR(TakeShard(params, delta));
  for (size_t i = 0; i < n; ++i) delta[i] = ov_.start[i] - delta[i];
  std::optional<SyncResult> landed;
  SyncStats stats;
  if (ov_.in_flight) {
    LK_ASSIGN_OR_RETURN(SyncResult r, LandInFlight(params, SyncStats{}));
    if (r.kind != SyncKind::kCommitted) {
      // A heal or a drain: the inner work since is dropped with the state it was built on.
      ov_.base.assign(params.begin(), params.end());
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
  ov_.stand_in.resize(n);
  for (size_t i = 0; i < n; ++i) ov_.stand_in[i] = delta[i] - (ov_.start[i] - state_.global[i]) / c;
  pending_delta_ = std::move(delta);
  extra_pending_ = extra_next_;
  pending_tokens_ = group_tokens;
  // The same branch in every trainer of the group: one that polled here for a drain it had
  // just heard of would leave while the others gather the stand-in below with it. A drain that
  // comes later is answered to the thread's poll instead, and lands with the next call.
  const bool in_thread =
      PollNextOnThread(proto_, landed.has_value(), held_.joined_unstepped.has_value());
  LK_ASSIGN_OR_RETURN(SyncResult next, StartNext(params, stats, in_thread));
  if (next.kind == SyncKind::kStarted) {
    auto t0 = Clock::now();
    TcpSent b0 = SnapshotTcpSent();
    // ov_.start is free again: it holds the stand-in's momentum, ov_.stand_in its global weights.
    ov_.start.assign(state_.momentum.begin(), state_.momentum.end());
    std::vector<float>& global = ov_.tentative;
    global.assign(state_.global.begin(), state_.global.end());
    OuterNesterovStep(global, ov_.start, ov_.stand_in, o_.outer);
    LK_RETURN_IF_ERROR(GatherInto(global, params));
    next.stats.group_bytes += TcpSentBetween(b0, SnapshotTcpSent());
    next.stats.gather_ms += MsSince(t0);
  }
  ov_.base.assign(params.begin(), params.end());
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
  f->extra = std::move(extra_pending_);
  extra_pending_.clear();
  f->tokens = pending_tokens_;
  f->sum = f->delta;
  f->t0 = Clock::now();
  if (o_.outer_fragments > 1) {
    // The next inner phase is taken to last as long as the last one; the pieces end by about
    // 0.8 of it, so that the last one is not what the next Sync waits for.
    const auto phase = std::chrono::duration_cast<Millis>(ov_.inner_phase);
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
  ov_.in_flight = std::move(f);
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
  const bool mark = ov_.in_flight->session_free.load();
  if (mark) (void)session_->SetPeerWait(true);
  if (ov_.in_flight->pacer) ov_.in_flight->pacer->Hurry();
  ov_.in_flight->thread.join();
  if (mark) (void)session_->SetPeerWait(false);
  stats.wait_ms += MsSince(wait_t0);
  std::unique_ptr<InFlight> f = std::move(ov_.in_flight);
  stats.allreduce_ms += f->ms;
  stats.cross_bytes += f->bytes;
  pending_delta_ = std::move(f->delta);
  extra_pending_ = std::move(f->extra);
  pending_tokens_ = f->tokens;
  if (f->deferred) {
    // The exchange never started: nothing failed, so the quorum is not reported. The group's
    // trainers still agree on the outcome, as in Land (another may have run its exchange),
    // and the pending pseudo-gradient goes through the poll loop here.
    LK_LOG_INFO("outer_exchange_deferred step={} reason={}", state_.step + 1, Q(*f->deferred));
    held_.carried = std::move(f->carried);
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
  LK_RETURN_IF_ERROR(CheckParamSize(params.size()));
  restored_extra_.reset();
  if (!ov_.in_flight) {
    SyncResult r;
    r.kind = SyncKind::kJoined;
    r.step = state_.step;
    r.quorum_id = proto_.ready_quorum_id;
    r.state_hash = StateHash(state_.global);
    return r;
  }
  // Lands into params: the new global weights, without a stand-in step after them.
  LK_ASSIGN_OR_RETURN(SyncResult r, LandInFlight(params, SyncStats{}));
  ov_.base.assign(params.begin(), params.end());
  return r;
}

void Diloco::Impl::AbandonInFlight() {
  if (!ov_.in_flight) return;
  ov_.in_flight->abandon.store(true);
  CrossComm().Abort("the DiLoCo object is closing");
  if (ov_.in_flight->pacer) ov_.in_flight->pacer->Hurry();
  ov_.in_flight->thread.join();
  ov_.in_flight.reset();
}

}  // namespace lk::diloco
