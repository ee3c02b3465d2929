// The cross-group exchange of the outer step with --outer-compress: the float32 ring
// allreduce, or the encoded allreduce with error feedback (diloco/compress.h).
#include "common/log.h"
#include "diloco/diloco_impl.h"

namespace lk::diloco {

// With a codec, this trainer sends x = values + residual and keeps what the encoding of x
// dropped (x - decoded) for the next step; ErrorFeedback (compress.h) holds it back until the
// step is committed, so that a retry of the same step meets the same residual.
// A quorum of groups of different sizes sums fragment by fragment between the trainers that hold
// each one (diloco/mixed.h), with the same codec and error feedback.
Status Diloco::Impl::CrossAllReduce(std::span<float> values, comm::ReduceOp op) {
  LK_CHECK(!mixed_ || op == comm::ReduceOp::kSum) << "a mixed quorum only sums";
  if (codec_ == nullptr) {
    if (mixed_) return mesh_comm_->AllReduceRuns(values, mixed_->runs, nullptr);
    return slot_comm_->AllReduce(values.data(), values.size(), comm::DType::kFloat32, op);
  }
  feedback_.Apply(state_.step, values);
  std::vector<float> sent(values.begin(), values.end());
  std::vector<float> decoded(values.size());
  Status st = mixed_ ? mesh_comm_->AllReduceRuns(values, mixed_->runs, codec_, decoded)
                     : slot_comm_->AllReduceEncoded(values, *codec_, op, decoded);
  if (st.ok()) feedback_.Stage(state_.step, sent, decoded);
  return st;
}

void Diloco::Impl::ResetResidual() { feedback_.Reset(layout_.shard_numel); }

}  // namespace lk::diloco
