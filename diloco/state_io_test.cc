// The DiLoCo library's state I/O over the checkpoint library: a group's sharded durable save
// restores every shard and the inner optimizer state bit for bit, under the caller's tensor
// names, into the same or another number of trainers; bad locations and other models fail with
// an error instead of bad state.
#include "diloco/state_io.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "checkpoint/restore.h"
#include "diloco/outer.h"

namespace lk::diloco {
namespace {

std::string FreshDir(const std::string& tag) {
  auto dir = std::filesystem::temp_directory_path() /
             ("lk-diloco-" + tag + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

std::vector<TensorSpec> Params() {
  return {{"emb.weight", 0, {7, 5}}, {"scale", 35, {}}, {"head.bias", 36, {3}}};  // 39 elements
}

std::vector<TensorSpec> Inner() {
  return {{"exp_avg/emb.weight", 0, {7, 5}}, {"step/emb.weight", 35, {}}};  // 36 elements
}

std::vector<float> Ramp(size_t n, float a, float b) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = a * float(i) + b;
  return v;
}

StateIoOptions Options(const std::string& dir, uint32_t rank, uint32_t ranks) {
  return StateIoOptions{dir, "", rank, ranks, Params(), Inner(), 3, {}};
}

OuterState ShardState(const std::vector<float>& global, const std::vector<float>& momentum,
                      uint32_t ranks, uint32_t rank, uint32_t step) {
  ShardLayout l = MakeShardLayout(Params(), ranks, rank);
  OuterState s{step, std::vector<float>(l.shard_numel), std::vector<float>(l.shard_numel)};
  l.Take(global, s.global);
  l.Take(momentum, s.momentum);
  return s;
}

std::vector<float> InnerShard(const std::vector<float>& inner, uint32_t ranks, uint32_t rank,
                              ShardRule rule = ShardRule::kEven) {
  ShardLayout l = MakeShardLayout(Inner(), ranks, rank, rule);
  std::vector<float> s(l.shard_numel);
  l.Take(inner, s);
  return s;
}

TEST_CASE(
    "diloco durable save of a two-trainer group restores each shard and the inner state bit for "
    "bit") {
  const std::string dir = FreshDir("state-io");
  const auto global = Ramp(39, 0.001f, -0.3f), momentum = Ramp(39, -0.0005f, 0.15f);
  const auto inner = Ramp(36, 0.25f, 1.0f);
  std::vector<std::unique_ptr<StateIo>> io;
  for (uint32_t r = 0; r < 2; ++r) io.push_back(MakeCheckpointStateIo(Options(dir, r, 2)));
  // Neither save alone commits: the checkpoint exists only once both shards are written.
  REQUIRE(
      io[0]->SaveDurable(ShardState(global, momentum, 2, 0, 7), InnerShard(inner, 2, 0), {}, 3).ok());
  CHECK_FALSE(io[0]->Restore(dir).ok());
  REQUIRE(
      io[1]->SaveDurable(ShardState(global, momentum, 2, 1, 7), InnerShard(inner, 2, 1), {}, 3).ok());
  for (uint32_t r = 0; r < 2; ++r) {
    auto got = io[r]->Restore(dir);
    REQUIRE_MESSAGE(got.ok(), got.status().ToString());
    OuterState want = ShardState(global, momentum, 2, r, 7);
    CHECK(got->state.step == 7);
    CHECK(StateHash(got->state.global) == StateHash(want.global));
    CHECK(StateHash(got->state.momentum) == StateHash(want.momentum));
    REQUIRE(got->inner.has_value());
    CHECK(StateHash(*got->inner) == StateHash(InnerShard(inner, 2, r)));
  }
  // The checkpoint names its tensors by the caller's names, with their real shapes.
  ckpt::RestoreOptions ro;
  auto raw = ckpt::RestoreLatest(dir, ro);
  REQUIRE(raw.ok());
  REQUIRE(raw->Find("emb.weight") != nullptr);
  CHECK(raw->Find("emb.weight")->shape == std::vector<int64_t>{7, 5});
  CHECK(raw->Find("outer_momentum/head.bias") != nullptr);
  CHECK(raw->Find("inner/step/emb.weight") != nullptr);
  CHECK(raw->Find("inner/step/emb.weight")->shape.empty());
  // Resharded: one trainer restores the whole state the two saved.
  auto one = MakeCheckpointStateIo(Options(dir, 0, 1));
  auto whole = one->Restore(dir);
  REQUIRE(whole.ok());
  CHECK(whole->state.global == global);
  CHECK(whole->state.momentum == momentum);
  REQUIRE(whole->inner.has_value());
  CHECK(*whole->inner == inner);
  // A model of another shape must not load this state.
  StateIoOptions other = Options(dir, 0, 2);
  other.params[0].shape = {5, 7};
  CHECK(MakeCheckpointStateIo(other)->Restore(dir).status().code() == Code::kDataLoss);
  CHECK_FALSE(io[0]->Restore(dir + "/nothing-here").ok());
  // No live directory: publishing is a no-op and peers without a shard server fail cleanly.
  CHECK(io[0]->PublishLive(ShardState(global, momentum, 2, 0, 7)).ok());
  CHECK_FALSE(io[0]->FetchFromPeers({}, 7).ok());
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "diloco inner state cut by torch.chunk's rule restores by rows into the even split and back") {
  // emb.weight's 7 rows over 3 trainers: chunk 3/3/1, even 3/2/2.
  const std::string dir = FreshDir("state-io-chunk");
  const auto global = Ramp(39, 0.01f, -0.1f), momentum = Ramp(39, 0.002f, 0.0f);
  const auto inner = Ramp(36, 0.5f, -3.0f);
  for (uint32_t r = 0; r < 3; ++r) {
    StateIoOptions o = Options(dir, r, 3);
    o.inner_rows = RuleTable(Inner(), 3, ShardRule::kChunk)[r];
    REQUIRE(MakeCheckpointStateIo(o)
                ->SaveDurable(ShardState(global, momentum, 3, r, 5),
                              InnerShard(inner, 3, r, ShardRule::kChunk), {}, 2)
                .ok());
  }
  for (ShardRule rule : {ShardRule::kEven, ShardRule::kChunk}) {
    for (uint32_t ranks : {1u, 2u, 3u}) {
      for (uint32_t r = 0; r < ranks; ++r) {
        CAPTURE(ShardRuleName(rule));
        CAPTURE(ranks);
        CAPTURE(r);
        StateIoOptions o = Options(dir, r, ranks);
        o.inner_rows = RuleTable(Inner(), ranks, rule)[r];
        auto got = MakeCheckpointStateIo(o)->Restore(dir);
        REQUIRE_MESSAGE(got.ok(), got.status().ToString());
        CHECK(got->state.global == ShardState(global, momentum, ranks, r, 5).global);
        REQUIRE(got->inner.has_value());
        CHECK(*got->inner == InnerShard(inner, ranks, r, rule));
      }
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "diloco durable save without inner state restores the outer state and says the inner state is "
    "missing") {
  const std::string dir = FreshDir("state-io-noinner");
  const auto global = Ramp(39, 0.5f, 1.0f), momentum = Ramp(39, 0.0f, 0.0f);
  auto io = MakeCheckpointStateIo(Options(dir, 0, 1));
  REQUIRE(io->SaveDurable(ShardState(global, momentum, 1, 0, 2), {}, {}, 1).ok());
  auto got = io->Restore(dir);
  REQUIRE_MESSAGE(got.ok(), got.status().ToString());
  CHECK(got->state.global == global);
  CHECK_FALSE(got->inner.has_value());
  CHECK(got->inner_missing.find("inner/exp_avg/emb.weight") != std::string::npos);
  std::filesystem::remove_all(dir);
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

// Saves step 4 of a group of three whose ranks 0 and 2 hand extra state and rank 1 none.
void SaveThreeWithExtra(const std::string& dir) {
  const auto global = Ramp(39, 0.01f, 0.0f), momentum = Ramp(39, 0.0f, 0.0f);
  const auto inner = Ramp(36, 1.0f, 0.0f);
  const std::vector<std::string> extra = {"rank0:position=1234", "", "rank2:position=98765"};
  for (uint32_t r = 0; r < 3; ++r) {
    auto io = MakeCheckpointStateIo(Options(dir, r, 3));
    auto bytes = Bytes(extra[r]);
    REQUIRE(io->SaveDurable(ShardState(global, momentum, 3, r, 4), InnerShard(inner, 3, r), bytes,
                            9)
                .ok());
  }
}

std::optional<std::string> ExtraOf(const std::string& dir, uint32_t rank, uint32_t ranks) {
  auto got = MakeCheckpointStateIo(Options(dir, rank, ranks))->Restore(dir);
  REQUIRE_MESSAGE(got.ok(), got.status().ToString());
  if (!got->extra) return std::nullopt;
  return std::string(got->extra->begin(), got->extra->end());
}

TEST_CASE(
    "diloco extra state comes back whole to the rank of the same number, in any group size, and "
    "to no other") {
  const std::string dir = FreshDir("state-io-extra");
  SaveThreeWithExtra(dir);
  // The same size: each rank its own bytes; rank 1 saved none and gets none.
  CHECK(ExtraOf(dir, 0, 3) == "rank0:position=1234");
  CHECK(ExtraOf(dir, 1, 3) == std::nullopt);
  CHECK(ExtraOf(dir, 2, 3) == "rank2:position=98765");
  // Fewer trainers: rank r still gets rank r's bytes, and rank 2's stay unread.
  CHECK(ExtraOf(dir, 0, 2) == "rank0:position=1234");
  CHECK(ExtraOf(dir, 1, 2) == std::nullopt);
  // More trainers: a rank without a counterpart gets nothing.
  CHECK(ExtraOf(dir, 2, 4) == "rank2:position=98765");
  CHECK(ExtraOf(dir, 3, 4) == std::nullopt);
  // The bytes are a tensor of the checkpoint like the weights: in its manifest, checksummed.
  ckpt::RestoreOptions ro;
  ro.layout = {1, 0};
  auto raw = ckpt::RestoreLatest(dir, ro);
  REQUIRE(raw.ok());
  REQUIRE(raw->Find(ExtraStateName(2)) != nullptr);
  CHECK(raw->Find(ExtraStateName(2))->dtype == ckpt::DType::kU8);
  CHECK(raw->Find(ExtraStateName(1)) == nullptr);
  std::filesystem::remove_all(dir);
}

TEST_CASE("diloco extra state that was damaged on disk fails the restore instead of coming back") {
  const std::string dir = FreshDir("state-io-extra-bad");
  SaveThreeWithExtra(dir);
  // Flip one byte of rank 2's extra state inside its shard file.
  std::string shard;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().filename().string().rfind("shard-00002", 0) == 0) shard = e.path().string();
  }
  REQUIRE_FALSE(shard.empty());
  std::string body;
  {
    std::ifstream in(shard, std::ios::binary);
    body.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = body.find("position=98765");
  REQUIRE(at != std::string::npos);
  body[at] ^= 0x20;
  {
    std::ofstream out(shard, std::ios::binary | std::ios::trunc);
    out.write(body.data(), static_cast<std::streamsize>(body.size()));
  }
  auto got = MakeCheckpointStateIo(Options(dir, 2, 3))->Restore(dir);
  CHECK_FALSE(got.ok());
  // Rank 0 reads nothing of rank 2's shard but the rows it needs, which are intact.
  CHECK(ExtraOf(dir, 0, 3) == "rank0:position=1234");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lk::diloco
