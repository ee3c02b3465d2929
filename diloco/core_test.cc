// Table tests of the DiLoCo library's pure decisions: the shard layout over named tensors, what a
// poll answer leads to, the heal sources' order, the inner optimizer after a join, the saves.
#include <doctest/doctest.h>

#include <numeric>

#include "diloco/core.h"

namespace lk::diloco {
namespace {

std::vector<TensorSpec> Specs() {
  // A 5x3 matrix, a scalar, a vector of 2 (fewer rows than some groups have trainers) and a
  // 4x2x2 tensor: 15 + 1 + 2 + 16 = 34 elements.
  return {{"w", 0, {5, 3}}, {"s", 15, {}}, {"b", 16, {2}}, {"t", 18, {4, 2, 2}}};
}

TEST_CASE("diloco specs must tile the buffer in order with unique names and positive dims") {
  size_t total = 0;
  CHECK(ValidateSpecs(Specs(), &total).ok());
  CHECK(total == 34);
  struct Row {
    const char* what;
    std::vector<TensorSpec> specs;
  };
  for (const Row& row : std::vector<Row>{
           {"gap", {{"a", 0, {2}}, {"b", 3, {2}}}},
           {"overlap", {{"a", 0, {2}}, {"b", 1, {2}}}},
           {"not from zero", {{"a", 1, {2}}}},
           {"repeated name", {{"a", 0, {2}}, {"a", 2, {2}}}},
           {"empty name", {{"", 0, {2}}}},
           {"zero dim", {{"a", 0, {2, 0}}}},
       }) {
    CAPTURE(row.what);
    CHECK(ValidateSpecs(row.specs, &total).code() == Code::kInvalidArgument);
  }
}

TEST_CASE("diloco shard layout: every element in exactly one rank's shard, rows as the checkpoint splits them") {
  const auto specs = Specs();
  for (uint32_t ranks : {1u, 2u, 3u, 5u}) {
    CAPTURE(ranks);
    std::vector<int> owners(34, 0);
    size_t sum = 0;
    for (uint32_t r = 0; r < ranks; ++r) {
      ShardLayout l = MakeShardLayout(specs, ranks, r);
      CHECK(l.total == 34);
      sum += l.shard_numel;
      size_t at = 0;
      for (const ShardPiece& p : l.pieces) {
        CHECK(p.shard_offset == at);  // pieces are packed in tensor order
        at += p.count;
        for (size_t i = 0; i < p.count; ++i) owners[p.full_offset + i] += 1;
      }
      CHECK(at == l.shard_numel);
    }
    CHECK(sum == 34);
    for (int o : owners) CHECK(o == 1);
  }
  // Two ranks: w rows [0,3) and [3,5); the scalar on rank 0 only; b one row each; t two rows each.
  ShardLayout r0 = MakeShardLayout(specs, 2, 0), r1 = MakeShardLayout(specs, 2, 1);
  REQUIRE(r0.pieces.size() == 4);
  REQUIRE(r1.pieces.size() == 3);
  CHECK(r0.pieces[0] == ShardPiece{0, 0, 3, 0, 0, 9});
  CHECK(r0.pieces[1] == ShardPiece{1, 0, 1, 15, 9, 1});
  CHECK(r0.pieces[2] == ShardPiece{2, 0, 1, 16, 10, 1});
  CHECK(r0.pieces[3] == ShardPiece{3, 0, 2, 18, 11, 8});
  CHECK(r1.pieces[0] == ShardPiece{0, 3, 5, 9, 0, 6});
  CHECK(r1.pieces[1] == ShardPiece{2, 1, 2, 17, 6, 1});
  CHECK(r1.pieces[2] == ShardPiece{3, 2, 4, 26, 7, 8});
  // Three ranks: b has two rows, so rank 2 holds none of it.
  ShardLayout r2 = MakeShardLayout(specs, 3, 2);
  for (const ShardPiece& p : r2.pieces) CHECK(p.spec != 2);
}

TEST_CASE("diloco shard take then place of every rank's shard into zeros rebuilds the buffer bit for bit") {
  const auto specs = Specs();
  std::vector<float> full(34);
  std::iota(full.begin(), full.end(), -7.5f);
  std::vector<float> rebuilt(34, 0.0f);
  for (uint32_t r = 0; r < 3; ++r) {
    ShardLayout l = MakeShardLayout(specs, 3, r);
    std::vector<float> shard(l.shard_numel), placed(34, 0.0f);
    l.Take(full, shard);
    l.Place(shard, placed);
    for (size_t i = 0; i < 34; ++i) rebuilt[i] += placed[i];
  }
  CHECK(rebuilt == full);
}

TEST_CASE("diloco poll decisions: drain first, then a noticed drain, the failed quorum, a new quorum, a step") {
  const Millis stuck{1000};
  struct Row {
    const char* what;
    PollView poll;
    LocalView local;
    PollAction want;
  };
  LocalView joined{.ready_quorum_id = 4, .has_state = true, .can_save = true, .stuck_timeout = stuck};
  auto with = [&](auto f) {
    LocalView l = joined;
    f(l);
    return l;
  };
  for (const Row& row : std::vector<Row>{
           {"same quorum: step", {4, false, false}, joined, PollAction::kStep},
           {"newer quorum: join", {5, false, false}, joined, PollAction::kJoin},
           {"first quorum: join", {1, false, false}, with([](LocalView& l) { l.ready_quorum_id = 0; l.has_state = false; }), PollAction::kJoin},
           {"drain", {4, true, false}, joined, PollAction::kDrain},
           {"drain with checkpoint_now saves", {4, true, true}, joined, PollAction::kDrainSave},
           {"checkpoint_now without a directory does not save", {4, true, true}, with([](LocalView& l) { l.can_save = false; }), PollAction::kDrain},
           {"checkpoint_now without state does not save", {4, true, true}, with([](LocalView& l) { l.has_state = false; }), PollAction::kDrain},
           {"drain beats a failed quorum", {4, true, false}, with([](LocalView& l) { l.bad_quorum_id = 4; }), PollAction::kDrain},
           {"noticed drain: wait for the poll to say so", {5, false, false}, with([](LocalView& l) { l.drain_noticed = true; }), PollAction::kWaitForDrain},
           {"noticed drain never answered: give up", {5, false, false}, with([&](LocalView& l) { l.drain_noticed = true; l.drain_wait_for = stuck + Millis(1); }), PollAction::kGiveUp},
           {"failed quorum: wait", {4, false, false}, with([](LocalView& l) { l.bad_quorum_id = 4; l.bad_for = Millis(999); }), PollAction::kWaitNewQuorum},
           {"failed quorum past the timeout: give up", {4, false, false}, with([](LocalView& l) { l.bad_quorum_id = 4; l.bad_for = Millis(1001); }), PollAction::kGiveUp},
           {"a newer quorum after a failed one: join", {6, false, false}, with([](LocalView& l) { l.bad_quorum_id = 4; l.bad_for = Millis(5000); }), PollAction::kJoin},
       }) {
    CAPTURE(row.what);
    PollDecision d = DecidePoll(row.poll, row.local);
    CHECK(d.action == row.want);
    CHECK_FALSE(d.reason.empty());
  }
}

TEST_CASE("diloco heal sources: live peers, then the durable checkpoint; none at the first start or without heal") {
  const std::vector<std::string> peers{"a:1", "b:2"};
  const HealSource from_peers{HealSourceKind::kPeers, peers, 7, ""};
  const HealSource from_disk{HealSourceKind::kDurable, {}, 0, "/ckpt"};
  CHECK(PlanHeal(true, false, peers, 7, "/ckpt") == std::vector<HealSource>{from_peers, from_disk});
  CHECK(PlanHeal(true, false, peers, 7, "") == std::vector<HealSource>{from_peers});
  CHECK(PlanHeal(true, false, {}, 7, "/ckpt") == std::vector<HealSource>{from_disk});
  CHECK(PlanHeal(true, true, peers, 0, "").empty());   // first start: the slot sync
  CHECK(PlanHeal(true, false, {}, 7, "").empty());      // nothing named: the slot sync
  CHECK(PlanHeal(false, false, peers, 7, "/ckpt").empty());
}

TEST_CASE("diloco inner optimizer: kept without new state, resumed only when the whole group restored it") {
  CHECK(DecideInner(false, 0, 2) == InnerAction::kKeep);
  CHECK(DecideInner(false, 2, 2) == InnerAction::kKeep);
  CHECK(DecideInner(true, 2, 2) == InnerAction::kRestored);
  CHECK(DecideInner(true, 1, 2) == InnerAction::kReset);  // one trainer got it elsewhere
  CHECK(DecideInner(true, 0, 1) == InnerAction::kReset);  // a heal from live peers
}

TEST_CASE("diloco saves: every K commits, and at finish unless the last commit just saved") {
  CHECK_FALSE(SaveAfterCommit(3, 0));
  CHECK(SaveAfterCommit(4, 2));
  CHECK_FALSE(SaveAfterCommit(5, 2));
  CHECK(SaveAtFinish(true, true, 5, 2));
  CHECK_FALSE(SaveAtFinish(true, true, 4, 2));
  CHECK(SaveAtFinish(true, true, 4, 0));
  CHECK_FALSE(SaveAtFinish(false, true, 5, 0));
  CHECK_FALSE(SaveAtFinish(true, false, 5, 0));
  CHECK(EffectiveStuckTimeout(Millis(0), Millis(1000)) == Millis(61'000));
  CHECK(EffectiveStuckTimeout(Millis(5), Millis(1000)) == Millis(5));
}

}  // namespace
}  // namespace lk::diloco
