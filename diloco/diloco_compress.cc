// The cross-group exchange of the outer step with --outer-compress: the float32 ring
// allreduce, or the encoded allreduce with error feedback (diloco/compress.h).
#include "common/log.h"
#include "diloco/diloco_impl.h"

namespace lk::diloco {

// With a codec, this trainer sends x = values + residual and keeps what the encoding of x
// dropped (x - decoded) as the residual for the next step. That new residual is staged, not
// used at once: the attempt may still be thrown away (another trainer of the group failed, the
// quorum is lost later in the step) and then be retried with the same pseudo-gradient, which
// must meet the same residual again. It takes effect at the next exchange if the step it was
// computed for has been committed by then.
Status Diloco::Impl::CrossAllReduce(std::span<float> values, comm::ReduceOp op) {
  if (codec_ == nullptr) {
    return slot_comm_->AllReduce(values.data(), values.size(), comm::DType::kFloat32, op);
  }
  if (staged_step_) {
    if (*staged_step_ == state_.step) residual_ = std::move(staged_residual_);
    staged_step_.reset();
    staged_residual_.clear();
  }
  if (residual_.size() != values.size()) residual_.assign(values.size(), 0.0f);
  AddResidual(residual_, values);
  std::vector<float> sent_input(values.begin(), values.end());
  std::vector<float> decoded(values.size());
  Status st = slot_comm_->AllReduceEncoded(values, *codec_, op, decoded);
  if (!st.ok()) return st;
  staged_residual_.resize(values.size());
  KeepResidual(sent_input, decoded, staged_residual_);
  staged_step_ = state_.step + 1;
  return Status::Ok();
}

void Diloco::Impl::ResetResidual() {
  residual_.assign(layout_.shard_numel, 0.0f);
  staged_residual_.clear();
  staged_step_.reset();
}

}  // namespace lk::diloco
