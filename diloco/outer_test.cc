// Unit tests of the DiLoCo outer step's pure parts: sharding, the Nesterov update, the state
// hash and the state-sync plan.
#include <doctest/doctest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/float_env.h"
#include "diloco/outer.h"

namespace lk::diloco {

TEST_CASE("diloco shards cover the vector exactly once, the first ranks one element larger") {
  for (size_t total : {0, 1, 5, 7, 64, 1001}) {
    for (uint32_t ranks : {1u, 2u, 3u, 8u}) {
      size_t next = 0;
      for (uint32_t r = 0; r < ranks; ++r) {
        ShardRange s = ShardOf(total, ranks, r);
        CHECK(s.begin == next);
        CHECK(s.size() == total / ranks + (r < total % ranks ? 1 : 0));
        next = s.end;
      }
      CHECK(next == total);
    }
  }
  CHECK(ShardOf(7, 3, 0) == ShardRange{0, 3});
  CHECK(ShardOf(7, 3, 1) == ShardRange{3, 5});
  CHECK(ShardOf(7, 3, 2) == ShardRange{5, 7});
}

TEST_CASE("diloco take then place of every shard (summed over zeros) rebuilds the vector bit for bit") {
  std::vector<float> full(1001);
  for (size_t i = 0; i < full.size(); ++i) full[i] = std::sin(float(i)) * 1e-3f * float(i % 17);
  // sin(i) * 0 is -0.0 for some i: exactly the value a sum with zeros does not keep, which is why
  // the trainer canonicalises its state first.
  CHECK(std::any_of(full.begin(), full.end(), [](float v) { return v == 0 && std::signbit(v); }));
  CanonicalizeZeros(full);
  for (uint32_t ranks : {1u, 2u, 3u, 4u}) {
    std::vector<float> rebuilt(full.size(), 0.0f);
    for (uint32_t r = 0; r < ranks; ++r) {
      ShardRange s = ShardOf(full.size(), ranks, r);
      std::vector<float> shard = TakeShard(full, s);
      REQUIRE(shard.size() == s.size());
      // What the intra-group all-gather does: each rank's vector is zeros plus its shard, and
      // the vectors are summed.
      std::vector<float> mine(full.size(), 0.0f);
      PlaceShard(shard, s, mine);
      for (size_t i = 0; i < full.size(); ++i) rebuilt[i] += mine[i];
    }
    CHECK(std::memcmp(rebuilt.data(), full.data(), full.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("diloco outer Nesterov step matches the hand-computed SGD(nesterov) update") {
  OuterOptions o;  // lr 0.7, momentum 0.9
  std::vector<float> global = {1.0f, -2.0f, 0.5f};
  std::vector<float> momentum = {0.0f, 0.0f, 0.0f};
  std::vector<float> delta = {0.1f, -0.2f, 0.0f};
  OuterNesterovStep(global, momentum, delta, o);
  // Step 1: m = d; update = d + 0.9 d = 1.9 d; g -= 0.7 * 1.9 d = 1.33 d.
  CHECK(momentum[0] == doctest::Approx(0.1f));
  CHECK(global[0] == doctest::Approx(1.0 - 0.133));
  CHECK(global[1] == doctest::Approx(-2.0 + 0.266));
  CHECK(global[2] == 0.5f);
  // Step 2 with the same delta: m = 0.9 * 0.1 + 0.1 = 0.19; update = 0.1 + 0.9 * 0.19 = 0.271.
  OuterNesterovStep(global, momentum, delta, o);
  CHECK(momentum[0] == doctest::Approx(0.19f));
  CHECK(global[0] == doctest::Approx(1.0 - 0.133 - 0.7 * 0.271));
}

TEST_CASE("diloco outer step with lr 1 and no momentum moves global onto the averaged local weights") {
  // The DiLoCo identity: with delta = global - local, lr 1 and momentum 0 give plain averaging.
  std::vector<float> global = {3.0f, -1.0f};
  std::vector<float> local = {2.5f, -0.5f};
  std::vector<float> momentum(2, 0.0f), delta(2);
  for (size_t i = 0; i < 2; ++i) delta[i] = global[i] - local[i];
  OuterNesterovStep(global, momentum, delta, OuterOptions{1.0f, 0.0f});
  CHECK(global == local);
}

TEST_CASE("diloco outer step without nesterov is heavy-ball momentum: global -= lr * m") {
  std::vector<float> global = {1.0f, -2.0f}, momentum = {0.5f, 1.0f};
  const std::vector<float> delta = {0.25f, -0.75f};
  OuterNesterovStep(global, momentum, delta, OuterOptions{0.5f, 0.5f, false});
  // m = 0.5 * m + delta = {0.5, -0.25}; global -= 0.5 * m (all exact in binary).
  CHECK(momentum == std::vector<float>{0.5f, -0.25f});
  CHECK(global == std::vector<float>{0.75f, -1.875f});
}

TEST_CASE("diloco outer step leaves no negative zero, so sum-with-zeros copies keep every bit") {
  std::vector<float> global = {-0.0f, 0.0f}, momentum = {-0.0f, 0.0f}, delta = {0.0f, -0.0f};
  OuterNesterovStep(global, momentum, delta, OuterOptions{});
  for (float v : global) CHECK(!std::signbit(v));
  for (float v : momentum) CHECK(!std::signbit(v));
  std::vector<float> z = {-0.0f, 1.0f};
  CanonicalizeZeros(z);
  CHECK(!std::signbit(z[0]));
  CHECK(z[1] == 1.0f);
}

namespace {

// The outer step's inputs where every product and sum lands in or near the denormal range (a
// momentum that decayed for hundreds of steps, a pseudo-gradient as small), so the caller's
// floating-point mode decides the bits unless the step fixes it.
struct TinyOuterState {
  std::vector<float> global, momentum, delta;
  TinyOuterState() {
    for (int i = 0; i < 64; ++i) {
      global.push_back(std::ldexp(1.0f + i / 64.0f, -120));
      momentum.push_back(std::ldexp(1.0f + i / 32.0f, -127 - i % 8));
      delta.push_back(std::ldexp(1.0f - i / 128.0f, -128 - i % 5));
    }
  }
};

// The callers' modes: the default, torch.set_flush_denormal(True), and round toward zero.
std::vector<uint64_t> CallerModes() {
  const uint64_t base = FloatControlWord();
  return {WithFlushDenormals(base, false), WithFlushDenormals(base, true),
          WithRoundTowardZero(WithFlushDenormals(base, false))};
}

}  // namespace

TEST_CASE("diloco outer step computes the same bits whatever the caller's floating-point mode" *
          doctest::skip(!FixedFloatEnv::Active())) {
  const uint64_t before = FloatControlWord();
  std::vector<std::vector<float>> globals, momenta, naive;
  for (uint64_t mode : CallerModes()) {
    TinyOuterState st;
    SetFloatControlWord(mode);
    OuterNesterovStep(st.global, st.momentum, st.delta, OuterOptions{0.7f, 0.9f});
    // The same update without the step's own mode, in the caller's: the inputs do tell the
    // modes apart, so the equality below is the step's doing.
    TinyOuterState raw;
    std::vector<float> g = raw.global;
    for (size_t i = 0; i < g.size(); ++i) {
      volatile float m = 0.9f * raw.momentum[i] + raw.delta[i];
      g[i] = g[i] - 0.7f * (raw.delta[i] + 0.9f * m);
    }
    CHECK(FloatMode(FloatControlWord()) == FloatMode(mode));  // the caller's mode is back
    SetFloatControlWord(before);
    globals.push_back(st.global);
    momenta.push_back(st.momentum);
    naive.push_back(g);
  }
  CHECK(naive[0] != naive[1]);
  for (size_t k = 1; k < globals.size(); ++k) {
    INFO("caller mode " << k);
    CHECK(std::memcmp(globals[k].data(), globals[0].data(), globals[0].size() * 4) == 0);
    CHECK(std::memcmp(momenta[k].data(), momenta[0].data(), momenta[0].size() * 4) == 0);
  }
  // Denormal momenta are read as zero: nothing of them survives.
  for (float m : momenta[0]) CHECK((m == 0.0f || std::fabs(m) >= 1.17549435e-38f));
}

TEST_CASE("diloco division by the weights' sum is the same in every caller mode" *
          doctest::skip(!FixedFloatEnv::Active())) {
  const uint64_t before = FloatControlWord();
  std::vector<std::vector<float>> out;
  for (uint64_t mode : CallerModes()) {
    TinyOuterState st;
    SetFloatControlWord(mode);
    DivideInPlace(st.delta, 3.0f);
    SetFloatControlWord(before);
    out.push_back(st.delta);
  }
  for (size_t k = 1; k < out.size(); ++k) {
    INFO("caller mode " << k);
    CHECK(std::memcmp(out[k].data(), out[0].data(), out[0].size() * 4) == 0);
  }
}

TEST_CASE("diloco state hash is XXH3 hex of the bytes: equal for equal bits, different otherwise") {
  std::vector<float> a = {1.0f, 2.0f}, b = {1.0f, 2.0f}, c = {1.0f, std::nextafter(2.0f, 3.0f)};
  CHECK(StateHash(a).size() == 16);
  CHECK(StateHash(a) == StateHash(b));
  CHECK(StateHash(a) != StateHash(c));
}

TEST_CASE("diloco sync plan: the lowest rank at the newest step donates to those behind or empty") {
  SyncPlan p = PlanStateSync({{false, 0}, {true, 5}, {true, 5}, {true, 4}});
  REQUIRE(p.donor.has_value());
  CHECK(*p.donor == 1);
  CHECK(p.step == 5);
  CHECK(p.receives == std::vector<bool>{true, false, false, true});
  CHECK(p.any_receives());

  // The very first start: rank 0 holds the initial weights, the others take them.
  p = PlanStateSync({{true, 0}, {false, 0}, {false, 0}});
  CHECK(*p.donor == 0);
  CHECK(p.receives == std::vector<bool>{false, true, true});

  // Everyone current: nothing moves.
  p = PlanStateSync({{true, 3}, {true, 3}});
  CHECK(*p.donor == 0);
  CHECK(!p.any_receives());

  // Nobody holds state: no donor, and nobody is told to receive.
  p = PlanStateSync({{false, 0}, {false, 7}});
  CHECK(!p.donor.has_value());
  CHECK(!p.any_receives());
}

TEST_CASE("diloco sync plan: fresh start weights never stay apart, whatever the poll said") {
  struct Row {
    const char* name;
    std::vector<MemberState> in;
    uint32_t donor;
    bool donor_fresh;
    std::vector<bool> receives;
  };
  const std::vector<Row> rows = {
      // Two groups that each started from their own weights, both told "no heal" (the heal
      // went to an earlier poll): the lowest replica_rank's weights go to the other.
      {"all fresh at step 0", {{true, 0, true}, {true, 0, true}}, 0, true, {false, true}},
      {"all fresh, three", {{true, 0, true}, {true, 0, true}, {true, 0, true}}, 0, true,
       {false, true, true}},
      // A quorum that already agreed on step 0 (no commit yet) and a fresh joiner that sorts
      // before it: the agreed state wins over the lower rank.
      {"agreed step 0 beats a fresh rank 0", {{true, 0, true}, {true, 0}, {true, 0}}, 1, false,
       {true, false, false}},
      {"agreed newer step", {{true, 0, true}, {true, 4}, {false, 0}}, 1, false,
       {true, false, true}},
      {"fresh and empty", {{false, 0}, {true, 0, true}}, 1, true, {true, false}},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    SyncPlan p = PlanStateSync(row.in);
    REQUIRE(p.donor.has_value());
    CHECK(*p.donor == row.donor);
    CHECK(p.donor_fresh == row.donor_fresh);
    CHECK(p.receives == row.receives);
  }
}

TEST_CASE("diloco member states survive the sum-allreduce encoding") {
  std::vector<float> sum(8, 0.0f);
  std::vector<MemberState> in = {{true, 12}, {false, 0}, {true, 16777215}, {true, 0, true}};
  for (uint32_t r = 0; r < 4; ++r) {
    std::vector<float> v = EncodeMemberState(in[r], r, 4);
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  std::vector<MemberState> out = DecodeMemberStates(sum);
  REQUIRE(out.size() == 4);
  for (size_t r = 0; r < 4; ++r) {
    CHECK(out[r].has_state == in[r].has_state);
    CHECK(out[r].step == in[r].step);
    CHECK(out[r].fresh == in[r].fresh);
  }
}


TEST_CASE("diloco weighted mean: each pseudo-gradient weighs its group's tokens, exactly") {
  // Inputs whose weighted sums and quotient are exact in float32: (1*t0 + 4*t1) / (t0 + t1).
  std::vector<std::vector<float>> deltas = {{1.0f, 2.0f, -0.5f, 0.0f}, {4.0f, 8.0f, 1.5f, 0.0f}};
  std::vector<float> mean = WeightedMean(deltas, {1, 3});
  CHECK(mean == std::vector<float>{3.25f, 6.5f, 1.0f, 0.0f});
  // Twice the tokens of a group weighs it twice: (2*3 + 1*6) / 3 = 4.
  CHECK(WeightedMean({{3.0f}, {6.0f}}, {200, 100}) == std::vector<float>{4.0f});
  // Equal tokens are the plain mean; so is any member without a count (0).
  CHECK(WeightedMean(deltas, {7, 7}) == std::vector<float>{2.5f, 5.0f, 0.5f, 0.0f});
  CHECK(WeightedMean(deltas, {0, 3}) == std::vector<float>{2.5f, 5.0f, 0.5f, 0.0f});
  CHECK(WeightedMean(deltas, {0, 0}) == std::vector<float>{2.5f, 5.0f, 0.5f, 0.0f});
  // Three groups: (1*1 + 2*2 + 4*5) / 8 = 25/8.
  CHECK(WeightedMean({{1.0f}, {2.0f}, {4.0f}}, {1, 2, 5}) == std::vector<float>{3.125f});
  // One member alone with a power-of-two count keeps its pseudo-gradient bit for bit.
  CHECK(WeightedMean({{0.1f, -3.7f}}, {4096}) == std::vector<float>{0.1f, -3.7f});
  // No -0.0 comes out (a later sum with zeros would turn it into +0.0 in some members only).
  std::vector<float> z = WeightedMean({{-0.0f}, {0.0f}}, {1, 1});
  CHECK_FALSE(std::signbit(z[0]));
}

TEST_CASE("diloco weights: every member computes the same divisor, and it is the weights' sum") {
  std::vector<uint64_t> tokens = {1024, 3000, 77};
  OuterWeights w0 = DecideWeights(tokens, 0), w2 = DecideWeights(tokens, 2);
  CHECK(w0.weighted);
  CHECK(w0.self == 1024.0f);
  CHECK(w2.self == 77.0f);
  CHECK(w0.total == 4101.0f);
  CHECK(std::memcmp(&w0.total, &w2.total, sizeof(float)) == 0);
  CHECK(w0.self_tokens == 1024);
  CHECK(w0.all_tokens == 4101);
  OuterWeights plain = DecideWeights(std::vector<uint64_t>{5, 0, 9}, 1);
  CHECK_FALSE(plain.weighted);
  CHECK(plain.self == 1.0f);
  CHECK(plain.total == 3.0f);
  CHECK(plain.all_tokens == 14);
}

TEST_CASE("diloco token counts survive a float sum of up to 4096 of them exactly") {
  for (uint64_t c : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{1} << 24,
                     (uint64_t{1} << 24) + 1, uint64_t{123456789012345}, UINT64_MAX}) {
    std::vector<float> limbs(kCountLimbs);
    EncodeCount(c, limbs);
    CHECK(DecodeCount(limbs) == c);
  }
  // 4096 trainers with the largest limbs: every limb sum is below 2^24, so the float sum is exact.
  const uint64_t big = (uint64_t{1} << 40) - 1;
  std::vector<float> sum(kCountLimbs, 0.0f), one(kCountLimbs);
  EncodeCount(big, one);
  for (uint32_t i = 0; i < kCountSumsMax; ++i) {
    for (size_t k = 0; k < kCountLimbs; ++k) sum[k] += one[k];
  }
  CHECK(DecodeCount(sum) == big * kCountSumsMax);
  // Members write their own limbs only: the sum holds every member's count.
  std::vector<float> a = EncodeMemberTokens(300, 0, 3), b = EncodeMemberTokens(5'000'000'000, 2, 3);
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  CHECK(DecodeMemberTokens(a) == std::vector<uint64_t>{300, 0, 5'000'000'000});
}

TEST_CASE("diloco sums of 64-bit hashes through float limbs wrap modulo 2^64") {
  // Three trainers' row hash sums, summed in the group as limbs: the total is their sum modulo
  // 2^64, where DecodeCount would saturate.
  const std::vector<uint64_t> parts = {UINT64_MAX - 5, 0x8000000000000001ULL,
                                       0x1234567890abcdefULL};
  std::vector<float> sum(kCountLimbs, 0.0f), one(kCountLimbs);
  uint64_t want = 0;
  for (uint64_t p : parts) {
    EncodeCount(p, one);
    for (size_t k = 0; k < kCountLimbs; ++k) sum[k] += one[k];
    want += p;
  }
  CHECK(DecodeCountMod64(sum) == want);
  CHECK(DecodeCount(sum) == UINT64_MAX);
}

TEST_CASE("exchange shapes survive the sum; any difference, or a participant missing, is a conflict") {
  const ExchangeShape int8_4{OuterCompress::kInt8, 4}, int8_1{OuterCompress::kInt8, 1},
      none_4{OuterCompress::kNone, 4};
  auto summed = [](std::vector<std::pair<uint32_t, ExchangeShape>> written, uint32_t n) {
    std::vector<float> sum(kShapeFloats * n, 0.0f);
    for (const auto& [i, shape] : written) {
      std::vector<float> one(kShapeFloats * n, 0.0f);
      EncodeShape(shape, i, one);
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += one[k];
    }
    return DecodeShapes(sum);
  };
  std::vector<ExchangeShape> same = summed({{0, int8_4}, {1, int8_4}, {2, int8_4}}, 3);
  REQUIRE(same.size() == 3);
  CHECK(same[2] == int8_4);
  CHECK(CheckShapes(same, int8_4).ok());
  CHECK(CheckShapes(summed({{0, none_4}, {1, none_4}}, 2), none_4).ok());

  Status pieces = CheckShapes(summed({{0, int8_4}, {1, int8_1}, {2, int8_4}}, 3), int8_4);
  CHECK(pieces.code() == Code::kConflict);
  CHECK(pieces.message().find("participant 1 sends 1 piece of int8, this one 4 pieces of int8") !=
        std::string::npos);
  Status codec = CheckShapes(summed({{0, none_4}, {1, int8_4}}, 2), int8_4);
  CHECK(codec.code() == Code::kConflict);
  CHECK(codec.message().find("participant 0 sends 4 pieces of none") != std::string::npos);
  // A participant that wrote nothing is no `none` of one piece.
  Status missing = CheckShapes(summed({{0, none_4}}, 2), none_4);
  CHECK(missing.code() == Code::kConflict);
  CHECK(missing.message().find("participant 1 sends 0 pieces of an unknown codec") !=
        std::string::npos);
  // Another model (here one tensor's shape differs) is a conflict of its own, named as such.
  const std::vector<TensorSpec> a = {{"w", 0, {4, 3}}, {"b", 12, {3}}};
  const std::vector<TensorSpec> b = {{"w", 0, {3, 4}}, {"b", 12, {3}}};
  const std::vector<TensorSpec> c = {{"b", 0, {3}}, {"w", 3, {4, 3}}};
  CHECK(ModelFingerprint(a) == ModelFingerprint(a));
  CHECK(ModelFingerprint(a) != ModelFingerprint(b));
  CHECK(ModelFingerprint(a) != ModelFingerprint(c));  // the same tensors in another order
  CHECK(ModelFingerprint(a) < (1u << kModelFingerprintBits));
  const ExchangeShape ma{OuterCompress::kInt8, 4, ModelFingerprint(a)},
      mb{OuterCompress::kInt8, 4, ModelFingerprint(b)};
  CHECK(summed({{0, ma}, {1, ma}}, 2)[1] == ma);
  Status model = CheckShapes(summed({{0, ma}, {1, mb}}, 2), ma);
  CHECK(model.code() == Code::kConflict);
  CHECK(model.message().find("participant 1 trains another model") != std::string::npos);
}

}  // namespace lk::diloco
