// The cross-group exchange of the outer step with --outer-compress: the float32 ring
// allreduce, or the encoded allreduce with error feedback (comm/compress.h); with
// --outer-fragments, in pieces paced over the inner steps (diloco/fragments.h).
#include "common/log.h"
#include "diloco/diloco_impl.h"

namespace lk::diloco {

Status Diloco::Impl::CrossPiece(std::span<float> values, std::span<const comm::ReduceRun> runs,
                                comm::ReduceOp op, std::span<float> decoded,
                                std::span<float> result_residual) {
  if (mixed_) return mesh_comm_->AllReduceRuns(values, runs, codec_, decoded, result_residual);
  if (codec_ == nullptr) {
    return slot_comm_->AllReduce(values.data(), values.size(), comm::DType::kFloat32, op);
  }
  return slot_comm_->AllReduceEncoded(values, *codec_, op, decoded, result_residual);
}

// With a codec, this trainer sends x = values + residual and keeps what the encoding of x
// dropped (x - decoded) for the next step, and as the owner of a chunk of the result it keeps
// what the result's encoding dropped in the same way (two-way error feedback); ErrorFeedback
// (compress.h) holds both back until the step is committed, so that a retry of the same step
// meets the same residuals. They are applied once to the whole shard and staged once when every
// piece arrived, so the pieces of an exchange in fragments see the same feedback as one exchange
// would.
// A quorum of groups of different sizes sums fragment by fragment between the trainers that hold
// each one (diloco/mixed.h), with the same codec and error feedback.
Status Diloco::Impl::CrossAllReduce(std::span<float> values, comm::ReduceOp op, Pacer* pacer) {
  LK_CHECK(!mixed_ || op == comm::ReduceOp::kSum) << "a mixed quorum only sums";
  std::vector<float> sent, decoded;
  std::span<float> result;
  if (codec_ != nullptr) {
    feedback_.Apply(state_.step, values);
    sent.assign(values.begin(), values.end());
    decoded.resize(values.size());
    result = feedback_.result();
  }
  // The pieces follow the options alone, paced or not: a retry of an aborted overlapped step
  // runs blocking (no pacer) in the survivors while a member that just joined starts the same
  // step overlapped, and both must cut the same pieces. Unpaced, the pieces go back to back.
  const uint32_t pieces = o_.outer_fragments;
  const auto t0 = internal::Clock::now();
  Status st;
  if (mixed_ && pieces == 1) {
    st = CrossPiece(values, mixed_->runs, op, decoded, result);
  } else if (mixed_) {
    // Every member takes part in every piece, holding runs in it or not (see AllReduceRuns).
    std::vector<std::vector<comm::ReduceRun>> split =
        SplitRuns(mixed_->runs, mixed_->run_full_begin, layout_.total, pieces);
    for (uint32_t k = 0; k < pieces && st.ok(); ++k) {
      if (pacer) pacer->WaitTurn(k);
      st = CrossPiece(values, split[k], op, decoded, result);
    }
  } else {
    // The members of a slot hold shards of one length, so they cut the same pieces; an empty
    // piece is empty for all of them.
    const size_t align = codec_ ? codec_->block_elems() : 1;
    std::vector<Range> ranges = FragmentRanges(values.size(), pieces, align);
    for (uint32_t k = 0; k < pieces && st.ok(); ++k) {
      const Range r = ranges[k];
      if (r.begin == r.end) continue;
      if (pacer) pacer->WaitTurn(k);
      auto part = [&](std::span<float> s) {
        return s.empty() ? s : s.subspan(r.begin, r.end - r.begin);
      };
      st = CrossPiece(part(values), {}, op, part(decoded), part(result));
    }
  }
  if (st.ok() && codec_ != nullptr) feedback_.Stage(state_.step, sent, decoded);
  if (st.ok() && pieces > 1) {
    LK_LOG_INFO("exchange_fragments pieces={} spacing_ms={} step={} ms={:.1f}", pieces,
                pacer ? pacer->spacing().count() : 0, state_.step + 1, internal::MsSince(t0));
  }
  return st;
}

// Only a codec uses the residuals: without one they would be two shards of zeros held for
// nothing (outer_state_bytes counts what is held).
void Diloco::Impl::ResetResidual() {
  feedback_.Reset(codec_ != nullptr ? layout_.shard_numel : 0);
}

}  // namespace lk::diloco
