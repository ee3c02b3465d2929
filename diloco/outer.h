// The arithmetic of the DiLoCo outer step: the even split of a flat vector over a group's
// trainers, the outer Nesterov update, the state hash, and who gives state to whom when
// a quorum forms. Pure: no I/O, no threads; the trainer calls it between collectives.
// Thread-safety: plain functions on caller-owned memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <lightkeeper/diloco.h>
#include "comm/compress.h"

namespace lk::diloco {

// The block codec that an OuterCompress names.
comm::Codec CodecOf(OuterCompress c);

// Elements [begin, end) of the flat parameter vector.
struct ShardRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
  bool operator==(const ShardRange&) const = default;
};

// The even split of `total` elements over `ranks`: the first total % ranks ranks hold one more.
// It is the checkpoint library's row split of a 1-D tensor, so a shard saved by rank r of N is
// exactly what rank r of N restores.
ShardRange ShardOf(size_t total, uint32_t ranks, uint32_t rank);

// Copies this rank's shard out of the full vector.
std::vector<float> TakeShard(std::span<const float> full, ShardRange range);
// Writes a shard into its place in a full vector (the rest is left as it is). Placing every
// rank's shard into zeros and summing the vectors is an exact all-gather: x + 0 == x.
void PlaceShard(std::span<const float> shard, ShardRange range, std::span<float> full);


// One outer SGD step with momentum (PyTorch's SGD, no dampening) where the gradient is the
// averaged pseudo-gradient `delta` = global - local. With options.nesterov (the default):
//   m = momentum * m + delta;  global -= lr * (delta + momentum * m)
// without it (heavy ball): m = momentum * m + delta;  global -= lr * m
// Zeros come out as +0, so that a bitwise copy by summing with zeros keeps every bit.
void OuterNesterovStep(std::span<float> global, std::span<float> momentum,
                       std::span<const float> delta, const OuterOptions& options);

// Turns -0.0 into +0.0 (x + 0.0f), which is the only value a sum with zeros would change.
void CanonicalizeZeros(std::span<float> values);

// XXH3-64 of the raw float bytes, as 16 lowercase hex digits.
std::string StateHash(std::span<const float> values);

// What one member of a slot reports when a quorum forms.
struct MemberState {
  bool has_state = false;  // holds valid outer state for `step`
  uint32_t step = 0;
  // Its state is only the weights it was started with (a first join that neither healed nor
  // took anyone's state): no other member holds them, whatever the poll answer said.
  bool fresh = false;
};

// The state transfer of a new quorum. The donor holds the newest state the quorum agrees on: a
// member whose state came from the job (a commit, a heal, a restore, an earlier join) before
// any fresh one, then the newest step, then the lowest replica_rank. Every other member that
// does not hold that same state takes the donor's: one behind it, one without state, and every
// fresh one. So the first quorum's weights come from one member, always, even when every
// member holds weights of step 0 and the poll answers said nobody heals.
struct SyncPlan {
  std::optional<uint32_t> donor;  // none: nobody holds state (the caller fails the quorum)
  uint32_t step = 0;              // the step everyone holds afterwards
  bool donor_fresh = false;       // the donor's are its own start weights (a first start)
  std::vector<bool> receives;     // per replica_rank
  bool any_receives() const;
};
SyncPlan PlanStateSync(const std::vector<MemberState>& members);

// The members' reports travel as floats through a sum-allreduce (each member writes only its own
// two entries): [state_0, step_0, state_1, step_1, ...], state 0 for none, 1 for state, 2 for
// fresh state. Steps stay exact below 2^24.
std::vector<float> EncodeMemberState(const MemberState& self, uint32_t rank, uint32_t world);
std::vector<MemberState> DecodeMemberStates(std::span<const float> summed);

// Token counts travel through float sum-allreduces exactly: a count is cut into kCountLimbs
// limbs of 12 bits, and a sum of up to 4096 such limbs stays below 2^24, where every integer
// is a float. The group's trainers sum their counts this way; the members of a quorum each
// write their group's count at their replica_rank, so the sum is every member's count, exactly.
inline constexpr size_t kCountLimbs = 6;   // 72 bits: any uint64_t
inline constexpr uint32_t kCountSumsMax = 4096;  // counts one sum may add up exactly
void EncodeCount(uint64_t count, std::span<float> limbs);  // limbs.size() == kCountLimbs
uint64_t DecodeCount(std::span<const float> limbs);        // saturates at UINT64_MAX
// The same sum modulo 2^64 (a sum of hashes, RowHashSum, wraps by design).
uint64_t DecodeCountMod64(std::span<const float> limbs);
// [limbs of rank 0, limbs of rank 1, ...] with only `rank`'s filled in.
std::vector<float> EncodeMemberTokens(uint64_t tokens, uint32_t rank, uint32_t world);
std::vector<uint64_t> DecodeMemberTokens(std::span<const float> summed);

// How a participant of the cross-group exchange encodes and cuts its side of it. Participants
// that differ post receives that the others' messages do not fit (and Gloo ends the process on a
// message longer than its receive), so they compare shapes before a byte of payload moves: in
// the same sum-allreduce as the token counts, each writing its own at its index among the
// exchange's participants (replica_rank, or the mesh rank in a quorum of groups of different
// sizes). Small integers: exact as floats.
struct ExchangeShape {
  OuterCompress codec = OuterCompress::kNone;
  uint32_t pieces = 1;  // DilocoOptions::outer_fragments
  uint32_t model = 0;   // ModelFingerprint of the parameters' specs
  bool operator==(const ExchangeShape&) const = default;
};
inline constexpr size_t kShapeFloats = 4;
// 24 bits of XXH3 over the parameters' names, shapes and order (not their offsets' values,
// which follow from them): members that train different models, or the same one described in
// another order, must never average their buffers element by element. Two 12-bit limbs travel
// exactly in a float sum. A sharded trainer gives the whole model's specs, so its fingerprint
// is a replicated trainer's.
inline constexpr uint32_t kModelFingerprintBits = 24;
uint32_t ModelFingerprint(const std::vector<TensorSpec>& specs);
// Writes `self` at `index` into `out` (kShapeFloats per participant), leaving the rest alone.
void EncodeShape(const ExchangeShape& self, uint32_t index, std::span<float> out);
std::vector<ExchangeShape> DecodeShapes(std::span<const float> summed);
// kConflict naming the first participant whose shape is not `self`'s (both described), so every
// participant refuses the same exchange with the same reason; Ok when all agree.
Status CheckShapes(std::span<const ExchangeShape> shapes, const ExchangeShape& self);

// The token weights of the cross-group average: avg = sum_i(t_i * delta_i) / sum_i(t_i). Each
// member scales its pseudo-gradient by `self`, the members sum-allreduce (the same bytes in
// every member), and each divides by `total`, the same float everywhere, so every member ends
// with bitwise-identical weights. A member that reported no tokens (0) makes every member weigh
// 1: a plain average, the right thing for groups that all leave the count out.
struct OuterWeights {
  float self = 1.0f;
  float total = 1.0f;
  bool weighted = false;    // false: the plain average
  uint64_t self_tokens = 0;
  uint64_t all_tokens = 0;  // the quorum's, this outer step
};
OuterWeights DecideWeights(std::span<const uint64_t> tokens, uint32_t rank);
void ScaleInPlace(std::span<float> values, float weight);     // values[i] *= weight
void DivideInPlace(std::span<float> values, float total);     // values[i] /= total
// The whole weighted mean over members given side by side (what the collective computes, for
// tests and simulations): the sum runs in member order, as a ring's reduction order is fixed.
std::vector<float> WeightedMean(const std::vector<std::vector<float>>& deltas,
                                const std::vector<uint64_t>& tokens);

}  // namespace lk::diloco
