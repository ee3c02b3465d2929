// A 16-bit model (DilocoOptions::param_dtype bf16 or fp16) on the float32 outer step: the
// caller's buffer is widened into a float32 staging buffer, the protocol runs on it exactly as
// for a float32 model (the pseudo-gradient is the float32 global weights minus the up-cast
// local weights; the new global weights are float32 and the same in every member), and the
// result is rounded back into the caller's buffer. Rounding is a pure function of the float32
// bits (diloco/param_dtype.h), so equal float32 global weights give equal 16-bit weights in
// every member. diloco/README.md, "16-bit parameters", has the why.
#include "common/log.h"
#include "diloco/diloco_impl.h"
#include "diloco/param_dtype.h"

namespace lk::diloco {

Status Diloco::Impl::CheckDType(ParamDType given) const {
  if (given == o_.param_dtype) return Status::Ok();
  return InvalidArgument("the parameter buffer is {} but DilocoOptions::param_dtype is {}",
                         ParamDTypeName(given), ParamDTypeName(o_.param_dtype));
}

Result<SyncResult> Diloco::Impl::Staged(Call call, std::span<uint16_t> params, uint64_t tokens) {
  if (o_.param_dtype == ParamDType::kFloat32) {
    return InvalidArgument("a 16-bit parameter buffer, but DilocoOptions::param_dtype is float32");
  }
  LK_RETURN_IF_ERROR(CheckParamSize(params.size()));
  // float32 staging of the caller's buffer (the whole model, or its rows when sharded): the
  // outer step's in-group all-gather and the heals write float32 vectors, and keeping this
  // buffer between calls saves its page faults.
  stage_.resize(param_numel());
  WidenParams(o_.param_dtype, params, stage_);
  Result<SyncResult> r = call == Call::kJoin   ? Join(stage_)
                         : call == Call::kSync ? Sync(stage_, tokens)
                                               : Flush(stage_);
  // On an error the caller's weights stay as they were (the staging buffer may hold a
  // half-written state; the next call widens afresh).
  if (!r.ok()) return r;
  NarrowParams(o_.param_dtype, stage_, params);
  // With overlap, the next call measures the inner progress from the weights the caller got:
  // the rounded ones, so that the rounding is not taken for progress.
  if (o_.overlap && ov_.base.size() == params.size()) WidenParams(o_.param_dtype, params, ov_.base);
  return r;
}

uint64_t Diloco::Impl::OuterStateBytes() const {
  auto b = [](const std::vector<float>& v) { return uint64_t{v.capacity()} * sizeof(float); };
  uint64_t n = b(state_.global) + b(state_.momentum) + b(stage_) + feedback_.bytes();
  if (pending_delta_) n += b(*pending_delta_);
  n += b(ov_.base) + b(ov_.global_full) + b(ov_.start) + b(ov_.stand_in) + b(ov_.tentative);
  if (ov_.in_flight) n += b(ov_.in_flight->delta) + b(ov_.in_flight->sum);
  return n;
}

}  // namespace lk::diloco
