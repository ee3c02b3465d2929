#include "diloco/outer.h"

#include <xxhash.h>

#include <algorithm>

#include <fmt/format.h>

#include <lightkeeper/check.h>
#include "comm/compress.h"
#include "common/float_env.h"

namespace lk::diloco {

// The public OuterCompress names comm's block codecs by the same values.
static_assert(static_cast<int>(OuterCompress::kNone) == static_cast<int>(comm::Codec::kNone) &&
              static_cast<int>(OuterCompress::kBf16) == static_cast<int>(comm::Codec::kBf16) &&
              static_cast<int>(OuterCompress::kInt8) == static_cast<int>(comm::Codec::kInt8) &&
              static_cast<int>(OuterCompress::kInt4) == static_cast<int>(comm::Codec::kInt4));

comm::Codec CodecOf(OuterCompress c) { return static_cast<comm::Codec>(c); }

std::string_view OuterCompressName(OuterCompress codec) { return comm::CodecName(CodecOf(codec)); }

bool ParseOuterCompress(std::string_view name, OuterCompress* out) {
  comm::Codec c;
  if (!comm::ParseCodec(name, &c)) return false;
  *out = static_cast<OuterCompress>(c);
  return true;
}

ShardRange ShardOf(size_t total, uint32_t ranks, uint32_t rank) {
  LK_CHECK(ranks > 0 && rank < ranks) << "rank " << rank << " of " << ranks;
  size_t base = total / ranks, extra = total % ranks;
  size_t begin = rank * base + std::min<size_t>(rank, extra);
  return ShardRange{begin, begin + base + (rank < extra ? 1 : 0)};
}

std::vector<float> TakeShard(std::span<const float> full, ShardRange range) {
  LK_CHECK(range.end <= full.size()) << "shard end " << range.end << " past " << full.size();
  return std::vector<float>(full.begin() + range.begin, full.begin() + range.end);
}

void PlaceShard(std::span<const float> shard, ShardRange range, std::span<float> full) {
  LK_CHECK(shard.size() == range.size() && range.end <= full.size()) << "shard does not fit";
  std::copy(shard.begin(), shard.end(), full.begin() + range.begin);
}

void OuterNesterovStep(std::span<float> global, std::span<float> momentum,
                       std::span<const float> delta, const OuterOptions& options) {
  LK_CHECK(global.size() == momentum.size() && global.size() == delta.size())
      << "outer step sizes " << global.size() << " " << momentum.size() << " " << delta.size();
  FixedFloatEnv env;  // every member computes the same bits whatever its caller's mode
  const float mu = options.momentum, lr = options.lr;
  for (size_t i = 0; i < global.size(); ++i) {
    float m = mu * momentum[i] + delta[i];
    momentum[i] = m + 0.0f;
    float step = options.nesterov ? delta[i] + mu * m : m;
    global[i] = (global[i] - lr * step) + 0.0f;
  }
}

void CanonicalizeZeros(std::span<float> values) {
  for (float& v : values) v = v + 0.0f;
}

std::string StateHash(std::span<const float> values) {
  return fmt::format("{:016x}", XXH3_64bits(values.data(), values.size_bytes()));
}

bool SyncPlan::any_receives() const {
  return std::find(receives.begin(), receives.end(), true) != receives.end();
}

SyncPlan PlanStateSync(const std::vector<MemberState>& members) {
  SyncPlan plan;
  plan.receives.assign(members.size(), false);
  for (uint32_t r = 0; r < members.size(); ++r) {
    const MemberState& m = members[r];
    if (!m.has_state) continue;
    // Strictly better only: the lowest rank wins a tie.
    const bool better = !plan.donor || (plan.donor_fresh && !m.fresh) ||
                        (plan.donor_fresh == m.fresh && m.step > plan.step);
    if (better) {
      plan.step = m.step;
      plan.donor = r;
      plan.donor_fresh = m.fresh;
    }
  }
  if (!plan.donor) return plan;
  for (uint32_t r = 0; r < members.size(); ++r) {
    const MemberState& m = members[r];
    plan.receives[r] =
        r != *plan.donor && (!m.has_state || m.fresh || m.step < plan.step);
  }
  return plan;
}

std::vector<float> EncodeMemberState(const MemberState& self, uint32_t rank, uint32_t world) {
  LK_CHECK(rank < world) << "replica_rank " << rank << " of " << world;
  LK_CHECK(self.step < (1u << 24)) << "step " << self.step << " does not fit a float exactly";
  std::vector<float> v(2 * size_t{world}, 0.0f);
  v[2 * rank] = !self.has_state ? 0.0f : self.fresh ? 2.0f : 1.0f;
  v[2 * rank + 1] = static_cast<float>(self.step);
  return v;
}

std::vector<MemberState> DecodeMemberStates(std::span<const float> summed) {
  std::vector<MemberState> out(summed.size() / 2);
  for (size_t r = 0; r < out.size(); ++r) {
    out[r].has_state = summed[2 * r] > 0.5f;
    out[r].fresh = summed[2 * r] > 1.5f;
    out[r].step = static_cast<uint32_t>(summed[2 * r + 1]);
  }
  return out;
}

void EncodeCount(uint64_t count, std::span<float> limbs) {
  LK_CHECK(limbs.size() == kCountLimbs) << "count limbs " << limbs.size();
  for (size_t i = 0; i < kCountLimbs; ++i) {
    limbs[i] = static_cast<float>((count >> (i * 12)) & 0xfff);  // i * 12 <= 60
  }
}

uint64_t DecodeCount(std::span<const float> limbs) {
  LK_CHECK(limbs.size() == kCountLimbs) << "count limbs " << limbs.size();
  // Each limb is a sum of 12-bit values, so it may carry into the next: add them as 128-bit.
  unsigned __int128 v = 0;
  for (size_t i = 0; i < kCountLimbs; ++i) {
    v += static_cast<unsigned __int128>(static_cast<uint64_t>(std::max(0.0f, limbs[i])))
         << (i * 12);
  }
  return v > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(v);
}

uint64_t DecodeCountMod64(std::span<const float> limbs) {
  LK_CHECK(limbs.size() == kCountLimbs) << "count limbs " << limbs.size();
  uint64_t v = 0;  // unsigned arithmetic wraps modulo 2^64
  for (size_t i = 0; i < kCountLimbs; ++i) {
    v += static_cast<uint64_t>(std::max(0.0f, limbs[i])) << (i * 12);
  }
  return v;
}

std::vector<float> EncodeMemberTokens(uint64_t tokens, uint32_t rank, uint32_t world) {
  LK_CHECK(rank < world) << "replica_rank " << rank << " of " << world;
  std::vector<float> v(kCountLimbs * world, 0.0f);
  EncodeCount(tokens, std::span<float>(v).subspan(kCountLimbs * rank, kCountLimbs));
  return v;
}

std::vector<uint64_t> DecodeMemberTokens(std::span<const float> summed) {
  std::vector<uint64_t> out(summed.size() / kCountLimbs);
  for (size_t r = 0; r < out.size(); ++r) {
    out[r] = DecodeCount(summed.subspan(kCountLimbs * r, kCountLimbs));
  }
  return out;
}

void EncodeShape(const ExchangeShape& self, uint32_t index, std::span<float> out) {
  LK_CHECK((index + 1) * kShapeFloats <= out.size()) << "participant " << index << " of "
                                                      << out.size() / kShapeFloats;
  // codec + 1: a participant that wrote nothing (0) cannot pass for `none`.
  out[index * kShapeFloats] = static_cast<float>(static_cast<uint32_t>(self.codec) + 1);
  out[index * kShapeFloats + 1] = static_cast<float>(self.pieces);
  out[index * kShapeFloats + 2] = static_cast<float>(self.model & 0xfff);
  out[index * kShapeFloats + 3] = static_cast<float>((self.model >> 12) & 0xfff);
}

uint32_t ModelFingerprint(const std::vector<TensorSpec>& specs) {
  std::string text;
  for (const TensorSpec& s : specs) {
    text += s.name;
    text.push_back('\0');
    for (int64_t d : s.shape) text += fmt::format("{},", d);
    text.push_back('\n');
  }
  return static_cast<uint32_t>(XXH3_64bits(text.data(), text.size())) &
         ((1u << kModelFingerprintBits) - 1);
}

std::vector<ExchangeShape> DecodeShapes(std::span<const float> summed) {
  std::vector<ExchangeShape> out(summed.size() / kShapeFloats);
  for (size_t i = 0; i < out.size(); ++i) {
    // Anything but a written codec (a sum of two, a missing entry) decodes out of range, so it
    // differs from every real shape.
    const float c = summed[i * kShapeFloats];
    out[i].codec = static_cast<OuterCompress>(c >= 1 && c <= 4 ? static_cast<uint32_t>(c) - 1
                                                               : UINT32_MAX >> 1);
    const float p = summed[i * kShapeFloats + 1];
    out[i].pieces = p >= 0 && p < 65536 ? static_cast<uint32_t>(p) : 0;
    const float lo = summed[i * kShapeFloats + 2], hi = summed[i * kShapeFloats + 3];
    out[i].model = lo >= 0 && lo < 4096 && hi >= 0 && hi < 4096
                       ? static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 12)
                       : UINT32_MAX;
  }
  return out;
}

namespace {
std::string DescribeShape(const ExchangeShape& s) {
  const uint32_t c = static_cast<uint32_t>(s.codec);
  return fmt::format("{} piece{} of {}", s.pieces, s.pieces == 1 ? "" : "s",
                     c <= 3 ? std::string(OuterCompressName(s.codec)) : "an unknown codec");
}
}  // namespace

Status CheckShapes(std::span<const ExchangeShape> shapes, const ExchangeShape& self) {
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (shapes[i] == self) continue;
    if (shapes[i].codec == self.codec && shapes[i].pieces == self.pieces) {
      return Error(Code::kConflict,
                   "the cross-group exchange differs: participant {} trains another model "
                   "(fingerprint {:06x} of its parameters' names, shapes and order; this one "
                   "{:06x}): every group of a job describes the same parameters in the same order",
                   i, shapes[i].model, self.model);
    }
    return Error(Code::kConflict,
                 "the cross-group exchange differs: participant {} sends {}, this one {} (every "
                 "group of a job needs the same --outer-compress and --outer-fragments)",
                 i, DescribeShape(shapes[i]), DescribeShape(self));
  }
  return Status::Ok();
}

OuterWeights DecideWeights(std::span<const uint64_t> tokens, uint32_t rank) {
  LK_CHECK(rank < tokens.size()) << "replica_rank " << rank << " of " << tokens.size();
  OuterWeights w;
  w.self_tokens = tokens[rank];
  unsigned __int128 all = 0;
  bool every_member_counted = true;
  for (uint64_t t : tokens) {
    all += t;
    every_member_counted = every_member_counted && t > 0;
  }
  w.all_tokens = all > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(all);
  if (!every_member_counted) {
    w.total = static_cast<float>(tokens.size());
    return w;
  }
  w.weighted = true;
  w.self = static_cast<float>(tokens[rank]);
  // The divisor is the sum of the weights as used (each rounded to a float), summed in double
  // in member order: the same float in every member, and the weights sum to it.
  double total = 0;
  for (uint64_t t : tokens) total += static_cast<double>(static_cast<float>(t));
  w.total = static_cast<float>(total);
  return w;
}

void ScaleInPlace(std::span<float> values, float weight) {
  if (weight == 1.0f) return;
  for (float& v : values) v *= weight;
}

void DivideInPlace(std::span<float> values, float total) {
  LK_CHECK(total > 0) << "weights sum to " << total;
  FixedFloatEnv env;
  for (float& v : values) v = v / total + 0.0f;
}

std::vector<float> WeightedMean(const std::vector<std::vector<float>>& deltas,
                                const std::vector<uint64_t>& tokens) {
  LK_CHECK(!deltas.empty() && deltas.size() == tokens.size())
      << deltas.size() << " deltas, " << tokens.size() << " token counts";
  std::vector<float> sum(deltas.front().size(), 0.0f);
  OuterWeights w;
  for (uint32_t r = 0; r < deltas.size(); ++r) {
    LK_CHECK(deltas[r].size() == sum.size()) << "delta " << r << " has another length";
    w = DecideWeights(tokens, r);
    std::vector<float> scaled = deltas[r];
    ScaleInPlace(scaled, w.self);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += scaled[i];
  }
  DivideInPlace(sum, w.total);
  return sum;
}

}  // namespace lk::diloco
