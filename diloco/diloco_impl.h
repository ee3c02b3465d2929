// The inside of lk::diloco::Diloco (diloco/diloco.h): its state and the steps of the outer
// protocol, one file per mechanism: diloco.cc (options, communicators, the public face),
// diloco_step.cc (the poll loop and the blocking outer step), diloco_overlap.cc (the overlapped
// exchange on its own thread), diloco_save.cc (durable saves, drain and finish), diloco_join.cc
// (joining a quorum: heal, slot state sync, the group's agreement), diloco_compress.cc (the
// cross-group exchange) and diloco_param16.cc (a 16-bit model staged through float32). The
// protocol's own state and rules are diloco/core.h's (ProtocolState, HeldPolls): this class
// holds one of each and acts on their decisions. Internal to the library.
// Thread-safety: as Diloco; the NoticeSink is shared with the session's notice thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/compress.h"
#include "diloco/core.h"
#include <lightkeeper/diloco.h>
#include "diloco/fragments.h"
#include "diloco/mixed.h"
#include "diloco/outer.h"
#include "diloco/prefixed_store.h"
#include "diloco/state_io.h"
#include <lightkeeper/session.h>
#include "client/session_store.h"
#include "comm/comm.h"

namespace lk::diloco {

namespace internal {

using Clock = std::chrono::steady_clock;

inline double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The notice callback runs on the session's thread and may outlive the Diloco (the session
// may keep that thread past it), so it reaches the communicator only through this holder.
struct NoticeSink {
  std::mutex mu;
  comm::CommManager* slot = nullptr;  // guarded by mu; cleared before the comm goes away
  comm::CommManager* mesh = nullptr;  // the same for the communicator of mixed quorums
  std::atomic<bool> drain{false};
  // The newest quorum_id a notice said was lost: a failed join about it needs no report.
  std::atomic<uint32_t> lost_quorum_id{0};
};

// Aborts the slot collective on a lost quorum or a drain and notes a drain (any thread).
void Deliver(NoticeSink& sink, const client::Notice& n);

// A test hook (diloco/README.md, "Test hooks"): $LK_TEST_PERTURB_STEP=N makes this trainer
// change one element of its shard of the global weights once, after the outer update of step N
// and before its commit, as a silent fault would, so that the lighthouse's divergence check
// and the heal it leads to run for real. 0 (unset or not a number): off, and free.
uint32_t TestPerturbStep();

}  // namespace internal

class Diloco::Impl {
  using Clock = internal::Clock;
  using NoticeSink = internal::NoticeSink;

 public:
  Impl(client::Session* session, DilocoOptions o, InnerStateHooks hooks)
      : session_(session),
        o_(std::move(o)),
        hooks_(std::move(hooks)),
        layout_(MakeShardLayout(o_.params, o_.group_size, o_.group_rank)),
        caller_rows_(CallerRows(o_, o_.params, o_.shard_rows)),
        inner_rows_(CallerRows(o_, o_.inner_state, o_.inner_shard_rows)),
        caller_layout_(MakeShardLayout(o_.params, caller_rows_)),
        inner_layout_(MakeShardLayout(o_.inner_state, inner_rows_)),
        sink_(std::make_shared<NoticeSink>()),
        perturb_step_(internal::TestPerturbStep()) {
    ValidateSpecs(o_.inner_state, &inner_total_).ok();
    if (o_.group_size == 1) {
      // A group of one holds every row (Validate checked it): nothing moves.
      const RowTable whole = RuleTable(o_.params, 1, ShardRule::kEven);
      to_library_ = PlanRelayout(o_.params, 0, {caller_rows_}, whole);
      to_caller_ = PlanRelayout(o_.params, 0, whole, {caller_rows_});
    }
    model_fingerprint_ = ModelFingerprint(o_.params);
    proto_.can_save = !o_.ckpt_dir.empty();
    proto_.stuck_timeout = EffectiveStuckTimeout(o_.stuck_timeout, o_.op_timeout);
  }

  ~Impl() {
    AbandonInFlight();
    std::lock_guard lock(sink_->mu);
    sink_->slot = nullptr;
    sink_->mesh = nullptr;
  }

  Status Init();
  Result<SyncResult> Join(std::span<float> params);
  Result<SyncResult> Sync(std::span<float> params, uint64_t tokens);
  Result<SyncResult> Flush(std::span<float> params);
  // A 16-bit model's calls (diloco_param16.cc): the same protocol on the float32 staging
  // buffer, widened from the caller's buffer before and rounded back into it after.
  enum class Call { kJoin, kSync, kFlush };
  Result<SyncResult> Staged(Call call, std::span<uint16_t> params, uint64_t tokens);
  // The refusal of a buffer whose dtype is not DilocoOptions::param_dtype (ok when it is).
  Status CheckDType(ParamDType given) const;
  uint64_t OuterStateBytes() const;
  ParamDType param_dtype() const { return o_.param_dtype; }
  bool in_flight() const { return ov_.in_flight != nullptr; }
  std::span<const float> global_weights() const { return ov_.global_full; }
  Status GroupSum(std::span<float> v);
  Status Finish();

  bool drain_requested() const { return sink_->drain.load(); }
  void RequestDrain() { sink_->drain = true; }
  void HandleNotice(const client::Notice& n) { internal::Deliver(*sink_, n); }
  std::span<const float> restored_inner() const { return restored_inner_; }
  Status SetExtraState(std::span<const uint8_t> bytes);
  std::span<const uint8_t> restored_extra() const {
    return restored_extra_ ? std::span<const uint8_t>(*restored_extra_)
                           : std::span<const uint8_t>();
  }
  uint32_t step() const { return state_.step; }
  size_t numel() const { return layout_.total; }
  size_t shard_numel() const { return layout_.shard_numel; }
  // The caller's buffers: the whole model, or its rows only (DilocoOptions::sharded).
  size_t param_numel() const { return o_.sharded ? caller_layout_.shard_numel : layout_.total; }
  size_t inner_numel() const { return o_.sharded ? inner_layout_.shard_numel : inner_total_; }
  std::string hash() const { return StateHash(state_.global); }

 private:
  // One poll and what the core makes of it.
  struct Turn {
    client::PollResult poll;
    PollDecision decision;
  };
  // timeout: how long the agent may hold the poll; none: the session's default.
  Result<Turn> PollOnce(SyncStats* stats, std::optional<Millis> timeout = std::nullopt);
  // The core's decision on a poll answer, in this trainer's current view.
  Turn Decide(client::PollResult pr);
  // The next turn: the answer the core holds for it (HeldPolls), else a poll.
  Result<Turn> NextTurn(SyncStats* stats);
  // Acts on the waiting decisions (sleeps, failures); true when the caller polls again.
  Result<bool> Wait(const Turn& turn);
  // A failed join of pr.quorum_id: an error when the group is going down, else the quorum is
  // marked failed and the caller polls again.
  Status JoinFailed(const client::PollResult& pr, const Status& st);
  Result<SyncResult> Drain(const Turn& turn, SyncStats stats);
  // Joins quorum pr.quorum_id; `params` gets the state when the group received some.
  Status JoinQuorum(const client::PollResult& polled, std::span<float> params, SyncStats* stats);
  client::PollResult WithHeal(const client::PollResult& polled);
  Status Heal(const client::PollResult& pr);
  Status SyncSlot(const client::PollResult& pr);
  // SyncSlot for a quorum of groups of different sizes: the same plan over whole groups, the
  // donor group's state carried to the others fragment by fragment on the mesh.
  Status SyncMixed(const client::PollResult& pr);
  // The state sync's buffer, [global shard, momentum shard]: this trainer's state when it is the
  // donor, zeros otherwise; and a receiver's taking of the summed buffer.
  std::vector<float> DonorBuffer(bool donor) const;
  void TakeDonorState(std::span<const float> buf, const SyncPlan& plan,
                      const client::PollResult& pr);
  // The plan of quorum pr.quorum_id when its groups differ in size (none when they do not), or
  // an error when the answer's sizes do not fit this trainer.
  Result<std::optional<MixedPlan>> PlanQuorum(const client::PollResult& pr) const;
  // The communicator of the cross-group collectives of the joined quorum.
  comm::CommManager& CrossComm() { return mixed_ ? *mesh_comm_ : *slot_comm_; }
  // Whether every trainer of the group is ok; with `drain`, also whether any of them had
  // noticed a drain by then (one collective either way), so that they all take the same branch.
  Result<bool> GroupAgree(bool ok, bool* drain = nullptr);
  // The group's agreement on the outcome of an exchange, run (Land) or deferred by the thread's
  // poll (LandInFlight). One trainer's thread can run the exchange while another's defers it
  // (their polls are answered at different instants), so both paths must run this same
  // collective, with the drain flag (ProtocolState::drain_agreed): an allreduce of one float in
  // one trainer beside two in the other waits until the op timeout.
  Result<bool> AgreeLanding(bool ok);
  // Whether a drain is noticed now or within `grace`. A trainer of the group that left on a
  // drain makes the others' next in-group collective fail, possibly before their own notice of
  // the same drain arrived (the agent answers the polls first, then the notices): waiting a
  // moment tells that drain from a trainer that died. The conflict backoff sleeps with it too:
  // a drain ends either wait.
  bool DrainNoticedWithin(Millis grace) const;
  // Polls (or takes the quorum joined by the last call) and joins until this trainer stands in
  // a quorum it can step on, whose answer goes to *out; or returns the result the caller hands
  // back instead: a drain, or state received from elsewhere (kReceived).
  Result<std::optional<SyncResult>> NextQuorum(std::span<float> params, SyncStats* stats,
                                               client::PollResult* out);
  // Polls and joins until the pending pseudo-gradient is committed (or dropped by a heal or a
  // drain): the blocking outer step, and the retry of an overlapped one that was cut short.
  Result<SyncResult> RunPending(std::span<float> params, SyncStats stats);
  // One cross-group attempt with the pending pseudo-gradient: false when it was cut short.
  Result<bool> OuterAttempt(const client::PollResult& pr, std::span<float> params,
                            SyncStats* stats);
  // The cross-group half of an attempt (any thread; only the cross communicator, the codec and
  // the error feedback): the members' token weights and the weighted sum of `sum` in place.
  Result<OuterWeights> Exchange(const client::PollResult& pr, uint64_t tokens,
                                std::vector<float>& sum, Pacer* pacer = nullptr);
  // The rest, on the trainer's thread: the group's agreement that every trainer's exchange
  // succeeded, the outer update, the in-group all-gather into `params`, publishing, the commit
  // and the saves. false when a trainer's exchange failed.
  Result<bool> Land(const client::PollResult& pr, const Result<OuterWeights>& w,
                    std::vector<float>& sum, std::span<float> params, SyncStats* stats,
                    Clock::time_point t0);
  SyncResult CommittedResult(const client::PollResult& pr, const SyncStats& stats);
  // Overlap (see DilocoOptions::overlap). The exchange in flight: its quorum, its inputs (kept
  // for a retry) and, once the thread is done, its outcome.
  struct InFlight {
    client::PollResult pr;
    std::vector<float> delta;
    uint64_t tokens = 0;
    std::vector<float> sum;
    Result<OuterWeights> weights = Status(Code::kAborted, "not run");
    Clock::time_point t0;
    double ms = 0;
    uint64_t bytes = 0;
    std::unique_ptr<Pacer> pacer;  // with outer_fragments > 1
    std::vector<uint8_t> extra;    // the caller's extra state that goes with `delta`
    // Poll for the step's quorum on the thread first (the main thread goes on with the inner
    // steps meanwhile). When the answer is anything but a step on the joined quorum, the
    // exchange does not start: `deferred` says why, and `carried` holds the answer for the
    // main thread to act on when it lands this (a second poll at the same step would tell the
    // agent that the step failed).
    bool poll_first = false;
    std::atomic<bool> abandon{false};
    // False while the thread may use session_ (its poll): the session is not thread-safe.
    std::atomic<bool> session_free{true};
    std::optional<std::string> deferred;
    std::optional<client::PollResult> carried;
    std::thread thread;
  };
  Result<SyncResult> SyncOverlapped(std::span<float> params, uint64_t tokens);
  // Starts the exchange of the pending pseudo-gradient on quorum `pr`.
  // With poll_first, `pr` only stands in until the thread's poll answers (see InFlight).
  void StartInFlight(const client::PollResult& pr, bool poll_first = false);
  // The in-flight thread's poll for its quorum: true when the exchange may run on raw->pr.
  bool PollInFlight(InFlight* raw);
  // Waits for the exchange in flight and commits it, or retries it (RunPending) when it was cut
  // short; params get the new global weights.
  Result<SyncResult> LandInFlight(std::span<float> params, SyncStats stats);
  // Polls until the pending pseudo-gradient's exchange is started (kStarted) or the group got
  // state from elsewhere (kReceived) or drains (kDrained).
  // `in_thread`: the group just committed on its joined quorum, so the poll for the next step
  // can wait on the exchange's thread instead of this one (where the answer is a plain step,
  // which it is unless membership changed, the faster groups do not idle for the slower).
  Result<SyncResult> StartNext(std::span<float> params, SyncStats stats, bool in_thread = false);
  // Aborts the exchange in flight and joins its thread (the Diloco is going away).
  void AbandonInFlight();
  // The cross-group reduction of `values` in place (diloco_compress.cc): the float32 ring for
  // kNone, else the encoded allreduce with this trainer's error feedback.
  // With `pacer`, in outer_fragments pieces, each started at its turn (see fragments.h).
  Status CrossAllReduce(std::span<float> values, comm::ReduceOp op, Pacer* pacer = nullptr);
  // One collective over `values` (or, in a mixed quorum, over `runs` of it); `decoded` gets
  // what this trainer's own encoding decodes to when there is a codec, and `result_residual` is
  // the owner's error feedback on the result (the communicator's result_feedback).
  Status CrossPiece(std::span<float> values, std::span<const comm::ReduceRun> runs,
                    comm::ReduceOp op, std::span<float> decoded,
                    std::span<float> result_residual);
  // Drops the error-feedback residuals: the state came from elsewhere (diloco_compress.cc).
  void ResetResidual();
  // The members' token counts of this attempt (one small sum-allreduce) and the weights.
  Result<OuterWeights> AgreeWeights(const client::PollResult& pr, uint64_t tokens);
  // `value` summed over the group's trainers, exactly (one in-group sum of kCountLimbs limbs):
  // saturating for a count (the group's tokens), modulo 2^64 with `wrap` (a sum of hashes).
  Result<uint64_t> GroupSumU64(uint64_t value, bool wrap);
  Result<uint64_t> GroupTokens(uint64_t tokens) { return GroupSumU64(tokens, false); }
  Status LoadGlobal(std::span<float> params);
  // The in-group all-gather of a shard in this trainer's layout into the caller's buffer `out`
  // (when sharded: the shard's rows moved into the caller's, to_caller_).
  Status GatherInto(std::span<const float> shard, std::span<float> out);
  // This trainer's rows of the caller's buffer `params` into `shard` (the even split). A
  // sharded caller's rows off the even split move inside the group (to_library_): then every
  // trainer of the group calls it at the same point, as the in-group sums.
  Status TakeShard(std::span<const float> params, std::span<float> shard);
  // At the first join of a group of several: the group's trainers check that they describe one
  // model and, when sharded, exchange their rows and check that they tile it (the relayout
  // plans follow from them); then the weights Join took are moved into the even split.
  Status AgreeOnGroup();
  // The refusal of a caller's buffer of the wrong length (ok when it fits).
  Status CheckParamSize(size_t given) const;
  // The global_hash of the global weights: this trainer's rows hashed (RowHashSum), summed over
  // the group; the same in every member whatever its layout.
  Result<std::string> GlobalHash();
  // Saves the state durably and registers it; false when this step was committed to the
  // group's root already (an earlier life of the group), which is no failure.
  Result<bool> SaveDurable(uint32_t attempt);
  // quorum_id failed this trainer: the core's decision on it (a report, a conflict's backoff).
  void MarkBad(uint32_t quorum_id, bool report);
  void NoteFailure(const Status& st) { OnAttemptFailed(proto_, st.code()); }
  // Tells the lighthouse (through the agent) that quorum_id failed this trainer.
  void SendFailed(uint32_t quorum_id);
  SyncResult MakeResult(SyncKind kind, const client::PollResult& pr, const SyncStats& stats) const;

  client::Session* session_;
  DilocoOptions o_;
  InnerStateHooks hooks_;
  // This trainer's rows of each tensor of params and inner_state in the caller's buffers: the
  // even split unless sharded, else DilocoOptions::shard_rows or the rows of shard_rule.
  static std::vector<RowRange> CallerRows(const DilocoOptions& o,
                                          const std::vector<TensorSpec>& specs,
                                          const std::vector<RowRange>& given) {
    if (o.sharded && !given.empty()) return given;
    std::vector<RowRange> rows;
    for (const TensorSpec& s : specs) {
      rows.push_back(ShardRows(s, o.group_size, o.group_rank,
                               o.sharded ? o.shard_rule : ShardRule::kEven));
    }
    return rows;
  }
  // layout_: this trainer's rows of the outer state (the even split, in every group);
  // caller_layout_ and inner_layout_: its rows of the caller's parameter and inner-state
  // buffers (caller_rows_ and inner_rows_).
  ShardLayout layout_;
  std::vector<RowRange> caller_rows_, inner_rows_;
  ShardLayout caller_layout_, inner_layout_;
  // The moves between the caller's rows and the outer state's (made when the group has
  // exchanged its trainers' rows at the first join; identity copies when they agree).
  RelayoutPlan to_library_, to_caller_;
  // The caller's rows that Join took, until the group has exchanged its rows (AgreeOnGroup).
  std::optional<std::vector<float>> join_rows_;
  size_t inner_total_ = 0;
  uint32_t model_fingerprint_ = 0;  // ModelFingerprint(o_.params)
  std::shared_ptr<NoticeSink> sink_;
  // The lighthouse KV through the agent, on a connection of its own (a KV wait never holds up
  // a Poll); each communicator sees it under its own key prefix.
  std::unique_ptr<client::SessionKvStore> kv_;
  std::unique_ptr<PrefixedStore> slot_store_, group_store_, mesh_store_;
  // slot_comm_: the trainers of this group_rank in every group, when all groups have this
  // group's size; mesh_comm_: every trainer of the quorum, when the sizes differ (diloco/mixed.h).
  std::unique_ptr<comm::CommManager> slot_comm_, group_comm_, mesh_comm_;
  std::optional<MixedPlan> mixed_;  // of the joined quorum, when its groups differ in size
  std::unique_ptr<StateIo> state_io_;
  bool group_ready_ = false;
  bool group_failed_ = false;  // an in-group collective failed: the group is going down
  OuterState state_;
  bool has_state_ = false;        // state_ is valid for state_.step
  // state_ is only the weights Join was called with: no quorum has agreed on them yet, so the
  // first join's state sync hands this member the donor's whatever the poll said (SyncPlan).
  bool fresh_ = true;
  uint32_t perturb_step_ = 0;  // internal::TestPerturbStep(); 0 once done
  // What the join of the current quorum brought (diloco_join.cc), for its SyncResult.
  struct JoinOutcome {
    bool received = false;         // state came from elsewhere in the current quorum
    bool healed = false;           // ... and it was a heal, not the first start's initial weights
    bool inner_from_disk = false;  // ... from a durable checkpoint that held the inner state
    bool extra_from_disk = false;  // ... from a durable checkpoint that held this rank's extra
    std::string heal_source;
    InnerAction inner_action = InnerAction::kKeep;
  };
  JoinOutcome join_;
  void TakeOwnExtra();
  bool healed_since_commit_ = false;
  std::vector<float> restored_inner_;  // full inner buffer of the last durable restore
  std::vector<float> restored_inner_shard_;
  // The trainer's extra state (Diloco::SetExtraState): the bytes that go with the weights of the
  // next Sync (extra_next_), with the pending pseudo-gradient (extra_pending_; an exchange in
  // flight carries its own, InFlight::extra), and with state_ (extra_committed_: what durable
  // saves write). A commit moves the pending bytes to committed, as it moves the weights; state
  // taken from elsewhere takes the restored bytes when a durable restore brought this rank's,
  // else the caller's latest (its own data position goes on from where it is).
  std::vector<uint8_t> extra_next_, extra_pending_, extra_committed_;
  std::optional<std::vector<uint8_t>> restored_extra_shard_;  // the join's durable restore
  std::optional<std::vector<uint8_t>> restored_extra_;        // handed out by this call
  // Moves the extra state after a join that received state (or not) and logs a restore.
  void TakeJoinExtra(bool received);
  std::optional<std::vector<float>> pending_delta_;
  uint64_t pending_tokens_ = 0;  // the group's tokens behind pending_delta_
  OuterWeights last_weights_;    // of the last committed step
  std::string global_hash_;      // GlobalHash() of the global weights of the last landing
  // The protocol's state (quorums joined, failed and reported, the conflict streak, the drain
  // wait and the group's agreed drain flag) and the poll answers held for a later turn: the
  // quorum joined by the last call and not stepped on yet, and the answer the in-flight thread
  // got and did not act on (InFlight::carried). diloco/core.h says what each one is for.
  ProtocolState proto_;
  HeldPolls<client::PollResult> held_;
  // The poll answer of the quorum the last commit ran on.
  client::PollResult last_step_pr_;
  bool saved_at_last_commit_ = false;
  // The encoded exchange (see CrossAllReduce) and this trainer's error feedback.
  comm::ChunkCodec* codec_ = nullptr;  // points at codec_storage_ unless outer_compress is none
  std::optional<comm::BlockCodec> codec_storage_;
  comm::ErrorFeedback feedback_;
  // The overlapped pipeline's state (diloco_overlap.cc); empty without overlap.
  struct Overlap {
    // The exchange in flight: its thread touches only the cross communicator, codec_ and
    // feedback_, which nothing else touches until it is joined.
    std::unique_ptr<InFlight> in_flight;
    // When the last Sync returned, and how long the inner steps between the two Syncs before
    // this one took (what the fragments of the next exchange are spread over).
    std::optional<Clock::time_point> sync_returned;
    Clock::duration inner_phase{};
    // The weights the last call gave the caller, from which the inner progress of the next
    // call is measured.
    std::vector<float> base;
    std::vector<float> global_full;  // the whole global weights of the last LoadGlobal
    // Scratch of one shard each, kept so that no outer step pays for fresh pages.
    std::vector<float> start, stand_in, tentative;
  };
  Overlap ov_;
  // A 16-bit model's float32 staging buffer (the whole flat parameter vector), allocated at
  // the first call; empty for a float32 model (diloco/README.md, "16-bit parameters").
  std::vector<float> stage_;
};

}  // namespace lk::diloco
