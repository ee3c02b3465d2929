// The trainer's state I/O over the checkpoint library: a group's sharded durable save restores
// every shard bit for bit, and bad locations fail with an error instead of bad state.
#include <doctest/doctest.h>

#include <filesystem>
#include <unistd.h>

#include "examples/diloco/outer.h"
#include "examples/diloco/state_io.h"

namespace lk::diloco {
namespace {

std::string FreshDir(const std::string& tag) {
  std::string dir = "/tmp/lk-diloco-" + tag + "-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

OuterState ShardState(const std::vector<float>& global, const std::vector<float>& momentum,
                      uint32_t ranks, uint32_t rank, uint32_t step) {
  ShardRange s = ShardOf(global.size(), ranks, rank);
  return OuterState{step, TakeShard(global, s), TakeShard(momentum, s)};
}

TEST_CASE("diloco durable save of a two-trainer group restores each shard bit for bit") {
  const std::string dir = FreshDir("state-io");
  std::vector<float> global(1001), momentum(1001);
  for (size_t i = 0; i < global.size(); ++i) {
    global[i] = 0.001f * float(i) - 0.3f;
    momentum[i] = -0.5f * global[i];
  }
  std::vector<std::unique_ptr<StateIo>> io;
  for (uint32_t r = 0; r < 2; ++r) {
    io.push_back(MakeCheckpointStateIo(StateIoOptions{dir, "", r, 2, global.size()}));
  }
  // Neither save alone commits: the checkpoint exists only once both shards are written.
  REQUIRE(io[0]->SaveDurable(ShardState(global, momentum, 2, 0, 7), 3).ok());
  CHECK_FALSE(io[0]->Restore(dir).ok());
  REQUIRE(io[1]->SaveDurable(ShardState(global, momentum, 2, 1, 7), 3).ok());
  for (uint32_t r = 0; r < 2; ++r) {
    auto got = io[r]->Restore(dir);
    REQUIRE_MESSAGE(got.ok(), got.status().ToString());
    OuterState want = ShardState(global, momentum, 2, r, 7);
    CHECK(got->step == 7);
    CHECK(StateHash(got->global) == StateHash(want.global));
    CHECK(StateHash(got->momentum) == StateHash(want.momentum));
  }
  // A model of another size must not load this state.
  auto other = MakeCheckpointStateIo(StateIoOptions{dir, "", 0, 2, 1000});
  CHECK_FALSE(other->Restore(dir).ok());
  CHECK_FALSE(io[0]->Restore(dir + "/nothing-here").ok());
  // No live directory: publishing is a no-op and peers without a shard server fail cleanly.
  CHECK(io[0]->PublishLive(ShardState(global, momentum, 2, 0, 7)).ok());
  CHECK_FALSE(io[0]->FetchFromPeers({}, 7).ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lk::diloco
