// Table tests of the DiLoCo library's pure decisions: the shard layout over named tensors, what a
// poll answer leads to, the protocol's state between turns (failed and reported quorums, the
// conflict backoff, the drain wait and the agreed drain, the poll answers held for a later
// turn), the heal sources' order, the inner optimizer after a join, the saves.
#include "diloco/core.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

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

TEST_CASE(
    "diloco shard layout: every element in exactly one rank's shard, rows as the checkpoint splits "
    "them") {
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

TEST_CASE(
    "diloco row hash sum: every split of the rows over any number of ranks gives the same hash, "
    "and one changed element changes it") {
  // Short rows (hashed per element) and long ones (hashed per row), a scalar, and a tensor with
  // fewer rows than some groups have trainers.
  std::vector<TensorSpec> specs = {{"e", 0, {7, 20}}, {"w", 140, {5, 3}}, {"s", 155, {}},
                                   {"b", 156, {2}}, {"t", 158, {4, 2, 8}}};
  size_t total = 0;
  REQUIRE(ValidateSpecs(specs, &total).ok());
  std::vector<float> full(total);
  for (size_t i = 0; i < total; ++i) full[i] = 0.25f * static_cast<float>(i) - 3.0f;
  auto hash_over = [&](const std::vector<float>& values, uint32_t ranks) {
    uint64_t sum = 0;
    for (uint32_t r = 0; r < ranks; ++r) {
      ShardLayout l = MakeShardLayout(specs, ranks, r);
      std::vector<float> shard(l.shard_numel);
      l.Take(values, shard);
      sum += RowHashSum(specs, l, shard);
    }
    return sum;
  };
  const uint64_t whole = hash_over(full, 1);
  for (uint32_t ranks : {2u, 3u, 5u, 8u}) {
    CAPTURE(ranks);
    CHECK(hash_over(full, ranks) == whole);
  }
  for (size_t i : {size_t{0}, size_t{139}, size_t{141}, size_t{155}, total - 1}) {
    CAPTURE(i);
    std::vector<float> changed = full;
    changed[i] = std::nextafter(changed[i], 1e9f);
    CHECK(hash_over(changed, 1) != whole);
    CHECK(hash_over(changed, 3) == hash_over(changed, 1));
  }
  // The same values at other places (two rows swapped) hash differently.
  std::vector<float> swapped = full;
  std::swap_ranges(swapped.begin(), swapped.begin() + 20, swapped.begin() + 20);
  CHECK(hash_over(swapped, 1) != whole);
  // The rows ShardRows names are the layout's.
  for (uint32_t ranks : {1u, 3u, 8u}) {
    for (uint32_t r = 0; r < ranks; ++r) {
      ShardLayout l = MakeShardLayout(specs, ranks, r);
      for (const ShardPiece& p : l.pieces) {
        CHECK(ShardRows(specs[p.spec], ranks, r) == RowRange{p.row_begin, p.row_end});
      }
    }
  }
  CHECK(ShardRows(specs[3], 3, 2) == RowRange{2, 2});  // b's two rows: none for rank 2
}

TEST_CASE(
    "diloco shard take then place of every rank's shard into zeros rebuilds the buffer bit for "
    "bit") {
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

TEST_CASE("diloco shard rules: torch.chunk's split beside the even one, both tiling every tensor") {
  TensorSpec w{"w", 0, {10, 2}};
  // torch.chunk(10 rows, 3): 4, 4, 2; the even split: 4, 3, 3.
  CHECK(ShardRows(w, 3, 0, ShardRule::kChunk) == RowRange{0, 4});
  CHECK(ShardRows(w, 3, 1, ShardRule::kChunk) == RowRange{4, 8});
  CHECK(ShardRows(w, 3, 2, ShardRule::kChunk) == RowRange{8, 10});
  CHECK(ShardRows(w, 3, 1) == RowRange{4, 7});
  // torch.chunk(2 rows, 3) leaves the last rank empty, as the even split does; (5, 4): 2, 2, 1, 0.
  CHECK(ShardRows({"b", 0, {2}}, 3, 2, ShardRule::kChunk) == RowRange{2, 2});
  CHECK(ShardRows({"v", 0, {5}}, 4, 3, ShardRule::kChunk) == RowRange{5, 5});
  CHECK(ShardRows({"s", 0, {}}, 4, 0, ShardRule::kChunk) == RowRange{0, 1});
  CHECK(ShardRows({"s", 0, {}}, 4, 1, ShardRule::kChunk) == RowRange{0, 0});
  for (int64_t rows = 1; rows <= 40; ++rows) {
    for (uint32_t ranks = 1; ranks <= 9; ++ranks) {
      for (ShardRule rule : {ShardRule::kEven, ShardRule::kChunk}) {
        int64_t at = 0;
        for (uint32_t k = 0; k < ranks; ++k) {
          const RowRange r = ShardRows({"t", 0, {rows}}, ranks, k, rule);
          CHECK(r.begin == at);
          CHECK(r.end >= r.begin);
          at = r.end;
        }
        CHECK(at == rows);
      }
      if (rows % ranks == 0) {
        for (uint32_t k = 0; k < ranks; ++k) {
          CHECK(ShardRows({"t", 0, {rows}}, ranks, k, ShardRule::kChunk) ==
                ShardRows({"t", 0, {rows}}, ranks, k));
        }
      }
    }
  }
  ShardRule parsed = ShardRule::kEven;
  CHECK(ParseShardRule("chunk", &parsed));
  CHECK(parsed == ShardRule::kChunk);
  CHECK(ShardRuleName(parsed) == "chunk");
  CHECK_FALSE(ParseShardRule("Shard(0)", &parsed));
}

TEST_CASE(
    "diloco row tables: a group's rows must tile every tensor, overlaps and gaps named; the "
    "table survives its in-group sum exactly") {
  const std::vector<TensorSpec> specs = {{"w", 0, {10, 2}}, {"s", 20, {}}};
  RowTable t = RuleTable(specs, 3, ShardRule::kChunk);
  CHECK(CheckTiling(specs, t).ok());
  CHECK(TableKind(specs, t) == "chunk");
  CHECK(TableKind(specs, RuleTable(specs, 3, ShardRule::kEven)) == "even");
  // Any tiling, in any rank order, empty ranks included.
  RowTable any = {{{7, 10}, {0, 0}}, {{0, 7}, {0, 1}}, {{10, 10}, {0, 0}}};
  CHECK(CheckTiling(specs, any).ok());
  CHECK(TableKind(specs, any) == "explicit");
  RowTable overlap = t;
  overlap[1][0] = RowRange{3, 8};  // rank 0 holds [0, 4)
  Status st = CheckTiling(specs, overlap);
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("tensor 'w': rows [3, 8) of group rank 1 overlap rows up to 4 of "
                          "group rank 0") != std::string::npos);
  RowTable gap = t;
  gap[1][0] = RowRange{5, 8};
  st = CheckTiling(specs, gap);
  CHECK(st.message().find("tensor 'w': rows [4, 5) are held by no trainer") != std::string::npos);
  RowTable short_end = t;
  short_end[2][0] = RowRange{8, 9};
  CHECK(CheckTiling(specs, short_end).message().find("rows [9, 10) are held by no trainer") !=
        std::string::npos);
  RowTable twice = t;
  twice[1][1] = RowRange{0, 1};  // the scalar held by ranks 0 and 1
  CHECK(CheckTiling(specs, twice).message().find("tensor 's'") != std::string::npos);
  RowTable past = t;
  past[2][0] = RowRange{8, 11};
  CHECK(CheckTiling(specs, past).message().find("not rows of its 10") != std::string::npos);
  CHECK(CheckRowsWithin(specs, {{0, 11}, {0, 1}}).message().find("tensor 'w'") !=
        std::string::npos);
  CHECK(CheckRowsWithin(specs, {{0, 1}}).message().find("1 row ranges for 2 tensors") !=
        std::string::npos);
  // Through the in-group sum: each trainer writes its own rows, numbers past 2^24 included.
  const std::vector<TensorSpec> big = {{"e", 0, {int64_t{1} << 40, 1}}};
  const RowTable want = {{{0, (int64_t{1} << 33) + 5}},
                         {{(int64_t{1} << 33) + 5, int64_t{1} << 40}}};
  std::vector<float> sum(2 * kRowTableFloatsPerRange, 0.0f);
  for (uint32_t k = 0; k < 2; ++k) {
    std::vector<float> mine(sum.size(), 0.0f);
    EncodeRows(want[k], k, mine);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += mine[i];
  }
  CHECK(DecodeRowTable(sum, 2, 1) == want);
  CHECK(CheckTiling(big, want).ok());
  // What another trainer wrote is checked, not trusted: a limb that is no whole number in
  // range decodes to -1, and the tiling check refuses it.
  std::vector<float> bad = {std::nanf(""), 0.0f, 5.0f, 0.0f, 1e30f, 0.0f, 2.5f, 0.0f};
  const RowTable got = DecodeRowTable(bad, 2, 1);
  CHECK(got[0][0] == RowRange{-1, 5});
  CHECK(got[1][0] == RowRange{-1, -1});
  CHECK(CheckTiling({{"v", 0, {5}}}, got).message().find("group rank 0: tensor 'v': rows [-1, "
                                                          "5) are not rows of its 5") !=
        std::string::npos);
}

TEST_CASE(
    "diloco relayout: every group moves every row from one rule's holder to the other's, bit for "
    "bit, through one sum of the rows that change hands") {
  std::vector<TensorSpec> specs = Specs();
  specs.push_back({"big", 34, {23, 3}});  // 23 rows: neither rule matches the other over 2..8
  const size_t total = 34 + 69;
  std::vector<float> full(total);
  for (size_t i = 0; i < total; ++i) full[i] = static_cast<float>(i) * 0.25f - 9.0f;
  full[3] = -0.0f;  // a signed zero crosses too
  full[40] = -0.0f;
  for (uint32_t ranks = 1; ranks <= 8; ++ranks) {
    for (auto [from, to] : {std::pair{ShardRule::kChunk, ShardRule::kEven},
                            std::pair{ShardRule::kEven, ShardRule::kChunk}}) {
      CAPTURE(ranks);
      CAPTURE(ShardRuleName(from));
      std::vector<RelayoutPlan> plans;
      std::vector<std::vector<float>> src(ranks), dst(ranks), bufs;
      for (uint32_t r = 0; r < ranks; ++r) {
        plans.push_back(PlanRelayout(specs, ranks, r, from, to));
        CHECK(plans[r].moved == plans[0].moved);
        const ShardLayout l = MakeShardLayout(specs, ranks, r, from);
        src[r].resize(l.shard_numel);
        l.Take(full, src[r]);
        dst[r].assign(plans[r].to_numel, 1234.0f);
      }
      if (ranks == 1) CHECK(plans[0].moved == 0);
      // The group's sum, as the communicator would run it: every trainer's buffer added in rank
      // order, handed back to each.
      std::vector<std::vector<float>> seen;
      for (uint32_t r = 0; r < ranks; ++r) {
        auto collect = [&](std::span<float> buf) {
          seen.emplace_back(buf.begin(), buf.end());
          return Status::Ok();
        };
        // First pass: gather each trainer's contribution (the plan fills, then sums).
        REQUIRE(plans[r]
                    .Apply(src[r], dst[r], [&](std::span<float> buf) { return collect(buf); })
                    .ok());
      }
      std::vector<float> summed(plans[0].moved, -0.0f);
      for (const auto& b : seen) {
        for (size_t i = 0; i < summed.size(); ++i) summed[i] += b[i];
      }
      for (uint32_t r = 0; r < ranks; ++r) {
        REQUIRE(plans[r]
                    .Apply(src[r], dst[r],
                           [&](std::span<float> buf) {
                             std::copy(summed.begin(), summed.end(), buf.begin());
                             return Status::Ok();
                           })
                    .ok());
        const ShardLayout l = MakeShardLayout(specs, ranks, r, to);
        std::vector<float> want(l.shard_numel);
        l.Take(full, want);
        REQUIRE(dst[r].size() == want.size());
        CHECK(std::memcmp(dst[r].data(), want.data(), want.size() * sizeof(float)) == 0);
      }
    }
  }
  // An explicit tiling in another rank order moves into the even split the same way.
  const std::vector<TensorSpec> one = {{"big", 0, {23, 3}}};
  const RowTable skew = {{{20, 23}}, {{0, 20}}, {{23, 23}}};
  std::vector<float> whole(69);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i);
  const RowTable even = RuleTable(one, 3, ShardRule::kEven);
  std::vector<std::vector<float>> bufs;
  std::vector<RelayoutPlan> plans;
  for (uint32_t r = 0; r < 3; ++r) {
    plans.push_back(PlanRelayout(one, r, skew, even));
    std::vector<float> buf(plans[r].moved, -0.0f);
    const ShardLayout l = MakeShardLayout(one, skew[r]);
    std::vector<float> src(l.shard_numel);
    l.Take(whole, src);
    for (const RelayoutPlan::Copy& c : plans[r].send) {
      std::copy_n(src.data() + c.from, c.count, buf.data() + c.to);
    }
    bufs.push_back(std::move(buf));
  }
  for (uint32_t r = 0; r < 3; ++r) {
    const ShardLayout l = MakeShardLayout(one, skew[r]);
    std::vector<float> src(l.shard_numel);
    l.Take(whole, src);
    std::vector<float> dst(plans[r].to_numel, 99.0f);
    REQUIRE(plans[r]
                .Apply(src, dst,
                       [&](std::span<float> b) {
                         for (size_t i = 0; i < b.size(); ++i) {
                           b[i] = bufs[0][i] + bufs[1][i] + bufs[2][i];
                         }
                         return Status::Ok();
                       })
                .ok());
    const ShardLayout e = MakeShardLayout(one, even[r]);
    std::vector<float> want(e.shard_numel);
    e.Take(whole, want);
    CHECK(dst == want);
  }
  // Only the rows that change hands move: 23 rows of 3 over 3 trainers, chunk 8/8/7 against even
  // 8/8/7: nothing; over 5, chunk 5/5/5/5/3 against 5/5/5/4/4: row 19 only, rank 3's to rank 4.
  CHECK(PlanRelayout({{"big", 0, {23, 3}}}, 3, 0, ShardRule::kChunk, ShardRule::kEven).moved == 0);
  CHECK(PlanRelayout({{"big", 0, {23, 3}}}, 5, 0, ShardRule::kChunk, ShardRule::kEven).moved ==
        3);
}

TEST_CASE(
    "diloco poll decisions: drain first, then a noticed drain, the failed quorum, a new quorum, a "
    "step") {
  const Millis stuck{1000};
  struct Row {
    const char* what;
    PollView poll;
    LocalView local;
    PollAction want;
  };
  LocalView joined{
      .ready_quorum_id = 4, .has_state = true, .can_save = true, .stuck_timeout = stuck};
  auto with = [&](auto f) {
    LocalView l = joined;
    f(l);
    return l;
  };
  for (const Row& row : std::vector<Row>{
           {"same quorum: step", {4, false, false}, joined, PollAction::kStep},
           {"newer quorum: join", {5, false, false}, joined, PollAction::kJoin},
           {"first quorum: join",
            {1, false, false},
            with([](LocalView& l) {
              l.ready_quorum_id = 0;
              l.has_state = false;
            }),
            PollAction::kJoin},
           {"drain", {4, true, false}, joined, PollAction::kDrain},
           {"drain with checkpoint_now saves", {4, true, true}, joined, PollAction::kDrainSave},
           {"checkpoint_now without a directory does not save",
            {4, true, true},
            with([](LocalView& l) { l.can_save = false; }),
            PollAction::kDrain},
           {"checkpoint_now without state does not save",
            {4, true, true},
            with([](LocalView& l) { l.has_state = false; }),
            PollAction::kDrain},
           {"drain beats a failed quorum",
            {4, true, false},
            with([](LocalView& l) { l.bad_quorum_id = 4; }),
            PollAction::kDrain},
           {"noticed drain: wait for the poll to say so",
            {5, false, false},
            with([](LocalView& l) { l.drain_noticed = true; }),
            PollAction::kWaitForDrain},
           {"noticed drain never answered: give up",
            {5, false, false},
            with([&](LocalView& l) {
              l.drain_noticed = true;
              l.drain_wait_for = stuck + Millis(1);
            }),
            PollAction::kGiveUp},
           {"failed quorum: wait",
            {4, false, false},
            with([](LocalView& l) {
              l.bad_quorum_id = 4;
              l.bad_for = Millis(999);
            }),
            PollAction::kWaitNewQuorum},
           {"failed quorum past the timeout: give up",
            {4, false, false},
            with([](LocalView& l) {
              l.bad_quorum_id = 4;
              l.bad_for = Millis(1001);
            }),
            PollAction::kGiveUp},
           {"a newer quorum after a failed one: join",
            {6, false, false},
            with([](LocalView& l) {
              l.bad_quorum_id = 4;
              l.bad_for = Millis(5000);
            }),
            PollAction::kJoin},
       }) {
    CAPTURE(row.what);
    PollDecision d = DecidePoll(row.poll, row.local);
    CHECK(d.action == row.want);
    CHECK_FALSE(d.reason.empty());
  }
}

const TimePoint kT0 = TimePoint{} + std::chrono::hours(1);

ProtocolState Joined(uint32_t quorum_id) {
  ProtocolState s;
  s.can_save = true;
  s.stuck_timeout = Millis(1000);
  OnJoined(s, quorum_id);
  return s;
}

TEST_CASE("diloco protocol on a poll: the joined quorum, failed quorums and the drain wait") {
  struct Row {
    const char* what;
    ProtocolState before;
    PollView poll;
    bool drain_noticed;
    TimePoint now;
    PollAction want;
    Millis want_repoll;
    std::optional<TimePoint> want_drain_wait_since;
  };
  auto with = [](ProtocolState s, auto f) {
    f(s);
    return s;
  };
  const ProtocolState failed4 = with(Joined(4), [](ProtocolState& s) {
    s.bad_quorum_id = 4;
    s.bad_since = kT0;
  });
  const ProtocolState waiting = with(Joined(4), [](ProtocolState& s) { s.drain_wait_since = kT0; });
  const Millis ms50{50}, ms100{100}, none{0};
  for (const Row& row : std::vector<Row>{
           {"the quorum joined last is a step", Joined(4), {4, false, false}, false, kT0,
            PollAction::kStep, none, std::nullopt},
           {"a quorum not joined yet is joined", Joined(4), {5, false, false}, false, kT0,
            PollAction::kJoin, none, std::nullopt},
           {"before any join every quorum is joined", ProtocolState{}, {1, false, false}, false,
            kT0, PollAction::kJoin, none, std::nullopt},
           {"the failed quorum again: poll again in 100 ms", failed4, {4, false, false}, false,
            kT0 + Millis(1000), PollAction::kWaitNewQuorum, ms100, std::nullopt},
           {"the failed quorum past stuck_timeout from its failure: give up", failed4,
            {4, false, false}, false, kT0 + Millis(1001), PollAction::kGiveUp, none, std::nullopt},
           {"a quorum newer than the failed one is joined", failed4, {5, false, false}, false,
            kT0 + Millis(5000), PollAction::kJoin, none, std::nullopt},
           {"a noticed drain the poll does not answer starts the drain wait now", Joined(4),
            {4, false, false}, true, kT0, PollAction::kWaitForDrain, ms50, kT0},
           {"later polls do not restart the drain wait", waiting, {4, false, false}, true,
            kT0 + Millis(1000), PollAction::kWaitForDrain, ms50, kT0},
           {"a drain not answered past stuck_timeout from the first such poll: give up", waiting,
            {4, false, false}, true, kT0 + Millis(1001), PollAction::kGiveUp, none, kT0},
           {"a noticed drain the poll answers starts no wait", Joined(4), {4, true, false}, true,
            kT0, PollAction::kDrain, none, std::nullopt},
           {"the drain's checkpoint_now with a directory and state: save", Joined(4),
            {4, true, true}, true, kT0, PollAction::kDrainSave, none, std::nullopt},
       }) {
    CAPTURE(row.what);
    ProtocolState s = row.before;
    PollDecision d = OnPoll(s, row.poll, row.drain_noticed, true, row.now);
    CHECK(d.action == row.want);
    CHECK(d.repoll_after == row.want_repoll);
    CHECK_FALSE(d.reason.empty());
    CHECK(s.drain_wait_since == row.want_drain_wait_since);
    CHECK(s.ready_quorum_id == row.before.ready_quorum_id);  // a poll joins nothing
  }
}

TEST_CASE(
    "diloco protocol on a failed quorum: reported once, conflicts back off doubling to 10 s") {
  struct Row {
    const char* what;
    uint32_t reported_before;
    bool conflict;  // the failed attempt's code was kConflict (OnAttemptFailed)
    uint32_t streak_before;
    bool want_report_asked;
    QuorumFailedDecision want;
    uint32_t want_streak;
  };
  for (const Row& row : std::vector<Row>{
           {"a failed quorum is reported", 0, false, 0, true, {true, Millis(0), 0}, 0},
           {"a quorum reported already (before the group agreed) is not reported again", 7,
            false, 0, true, {false, Millis(0), 0}, 0},
           {"a drain's abort is not reported", 0, false, 0, false, {false, Millis(0), 0}, 0},
           {"a failure that is no conflict keeps the streak and does not wait", 0, false, 3, true,
            {true, Millis(0), 0}, 3},
           {"the first conflict waits 100 ms", 0, true, 0, true, {true, Millis(100), 1}, 1},
           {"each conflict in a row doubles the wait", 0, true, 3, true, {true, Millis(800), 4},
            4},
           {"the wait stops at 10 s", 0, true, 7, true, {true, Millis(10'000), 8}, 8},
           {"a long streak still waits 10 s", 0, true, 40, true, {true, Millis(10'000), 41}, 41},
       }) {
    CAPTURE(row.what);
    ProtocolState s = Joined(6);
    s.reported_quorum_id = row.reported_before;
    s.conflict_streak = row.streak_before;
    OnAttemptFailed(s, row.conflict ? Code::kConflict : Code::kUnavailable);
    CHECK(OnQuorumFailed(s, 7, row.want_report_asked, kT0) == row.want);
    CHECK(s.conflict_streak == row.want_streak);
    CHECK_FALSE(s.conflict_seen);  // the backoff is for the attempt that just failed only
    CHECK(s.bad_quorum_id == 7);
    CHECK(s.bad_since == kT0);
    // Once reported, whoever asks next (a later failure of the same quorum) does not report it
    // again; a newer quorum is reported.
    CHECK(OnReport(s, 7) == !row.want_report_asked);
    CHECK_FALSE(OnReport(s, 7));
    CHECK(OnReport(s, 8));
  }
}

TEST_CASE("diloco protocol: a commit ends the conflict streak, the next conflict waits 100 ms") {
  ProtocolState s = Joined(1);
  for (uint32_t q = 2; q < 5; ++q) {
    OnAttemptFailed(s, Code::kConflict);
    (void)OnQuorumFailed(s, q, true, kT0);
  }
  CHECK(s.conflict_streak == 3);
  OnCommitted(s);
  OnAttemptFailed(s, Code::kConflict);
  CHECK(OnQuorumFailed(s, 5, true, kT0) == QuorumFailedDecision{true, Millis(100), 1});
}

TEST_CASE("diloco protocol: a join takes the heal an earlier poll of its quorum got, once") {
  struct Row {
    const char* what;
    uint32_t seen_before;  // the last quorum whose heal a join acted on
    bool heals;            // this answer carries the heal itself
    std::optional<uint32_t> earlier;
    bool want_take;
    uint32_t want_seen;
  };
  for (const Row& row : std::vector<Row>{
           {"the earlier poll of this quorum got its heal: take it", 0, false, 9, true, 9},
           {"the answer heals itself: nothing to take", 0, true, 9, false, 9},
           {"the earlier heal was of another quorum", 0, false, 8, false, 0},
           {"no earlier answer healed", 0, false, std::nullopt, false, 0},
           {"a join of this quorum took its heal already: not twice", 9, false, 9, false, 9},
           {"a join of an older quorum took its heal: this one's is taken", 8, false, 9, true, 9},
       }) {
    CAPTURE(row.what);
    ProtocolState s;
    s.heal_seen_quorum_id = row.seen_before;
    CHECK(OnJoinAnswer(s, 9, row.heals, row.earlier) == row.want_take);
    CHECK(s.heal_seen_quorum_id == row.want_seen);
  }
}

TEST_CASE("diloco protocol: a failed join is reported before the group agrees only when it helps") {
  struct Row {
    const char* what;
    bool join_ok;
    uint32_t group_size;
    bool drain;
    uint32_t lost_quorum_id;
    bool want;
  };
  for (const Row& row : std::vector<Row>{
           {"this trainer's own failure in a group of two: report now", false, 2, false, 0, true},
           {"a join that worked: nothing to report", true, 2, false, 0, false},
           {"a group of one: nobody waits for it", false, 1, false, 0, false},
           {"during a drain the failure is the drain's", false, 2, true, 0, false},
           {"a quorum a notice called lost: the lighthouse knows", false, 2, false, 9, false},
           {"a notice about an older quorum does not count", false, 2, false, 8, true},
       }) {
    CAPTURE(row.what);
    CHECK(ReportJoinBeforeAgreement(row.join_ok, row.group_size, row.drain, row.lost_quorum_id,
                                    9) == row.want);
  }
}

TEST_CASE("diloco protocol: the poll for the next overlapped step runs on the thread only after a "
          "plain landing") {
  struct Row {
    const char* what;
    bool landed;
    bool joined_unstepped;
    bool drain_agreed;
    bool want;
  };
  for (const Row& row : std::vector<Row>{
           {"a commit on the joined quorum, no drain: the thread polls", true, false, false, true},
           {"nothing landed (after a join or a heal): poll here", false, false, false, false},
           {"a quorum joined but not stepped on: its exchange needs no poll", true, true, false,
            false},
           {"the group agreed a drain was noticed: every trainer polls here", true, false, true,
            false},
       }) {
    CAPTURE(row.what);
    ProtocolState s = Joined(3);
    OnLandingAgreed(s, true);
    OnLandingAgreed(s, row.drain_agreed);  // the latest agreement counts
    CHECK(PollNextOnThread(s, row.landed, row.joined_unstepped) == row.want);
  }
}

TEST_CASE("diloco protocol: the held poll answers, joined-but-not-stepped first, then carried") {
  struct Row {
    const char* what;
    std::optional<int> joined, carried;
    bool drain;
    TurnFrom want;
    int want_answer;
    std::optional<int> left_carried;
  };
  for (const Row& row : std::vector<Row>{
           {"nothing held: poll", std::nullopt, std::nullopt, false, TurnFrom::kPoll, 0,
            std::nullopt},
           {"a Sync after a join steps on the joined quorum without polling", 4, std::nullopt,
            false, TurnFrom::kJoinedUnstepped, 4, std::nullopt},
           {"a noticed drain drops the joined quorum: the poll must answer the drain", 4,
            std::nullopt, true, TurnFrom::kPoll, 0, std::nullopt},
           {"the thread's answer is decided on instead of a second poll at the step",
            std::nullopt, 5, false, TurnFrom::kCarried, 5, std::nullopt},
           {"the thread's answer is decided on during a drain too", std::nullopt, 5, true,
            TurnFrom::kCarried, 5, std::nullopt},
           {"the joined quorum goes before a carried answer, which stays", 4, 5, false,
            TurnFrom::kJoinedUnstepped, 4, 5},
           {"with a drain noticed the carried answer goes first", 4, 5, true, TurnFrom::kCarried,
            5, std::nullopt},
       }) {
    CAPTURE(row.what);
    HeldPolls<int> held{row.joined, row.carried};
    int answer = 0;
    CHECK(held.Take(row.drain, &answer) == row.want);
    CHECK(answer == row.want_answer);
    CHECK_FALSE(held.joined_unstepped.has_value());  // good for one turn only
    CHECK(held.carried == row.left_carried);
  }
  CHECK(JoinedUnsteppedDecision().action == PollAction::kStep);
}

TEST_CASE(
    "diloco heal sources: live peers, then the durable checkpoint, none at the first start or "
    "without heal") {
  const std::vector<std::string> peers{"a:1", "b:2"};
  const HealSource from_peers{HealSourceKind::kPeers, peers, 7, ""};
  const HealSource from_disk{HealSourceKind::kDurable, {}, 0, "/ckpt"};
  CHECK(PlanHeal(true, false, peers, 7, "/ckpt") == std::vector<HealSource>{from_peers, from_disk});
  CHECK(PlanHeal(true, false, peers, 7, "") == std::vector<HealSource>{from_peers});
  CHECK(PlanHeal(true, false, {}, 7, "/ckpt") == std::vector<HealSource>{from_disk});
  CHECK(PlanHeal(true, true, peers, 0, "").empty());  // first start: the slot sync
  CHECK(PlanHeal(true, false, {}, 7, "").empty());    // nothing named: the slot sync
  CHECK(PlanHeal(false, false, peers, 7, "/ckpt").empty());
}

TEST_CASE(
    "diloco inner optimizer: kept without new state, resumed only when the whole group restored "
    "it") {
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
