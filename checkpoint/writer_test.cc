// Writer and restore on a real filesystem: round trips, resharding, retention, faults (disk full,
// failing fsync/rename, corrupt, truncated, missing and mismatched shards), async saves, and
// ranks of one group committing from several threads.
#include <doctest/doctest.h>

#include <fstream>
#include <thread>

#include "checkpoint/format.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"

namespace lk::ckpt {
namespace {

using namespace testing;

std::vector<int64_t> Steps(const std::string& root) {
  std::vector<int64_t> out;
  auto refs = ListCommitted(Env::Default(), root);
  REQUIRE(refs.ok());
  for (const auto& r : *refs) out.push_back(r.step);
  std::sort(out.begin(), out.end());
  return out;
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

std::string ReadLatest(const std::string& root) {
  auto s = ReadFileToString(Env::Default(), root + "/LATEST");
  REQUIRE(s.ok());
  return *s;
}

TEST_CASE("a checkpoint restores bitwise onto the layout that wrote it") {
  TempDir tmp;
  auto model = SmallModel();
  for (uint32_t ranks : {1u, 3u}) {
    std::string root = tmp.Sub(fmt::format("r{}", ranks));
    std::string dir = SaveModel(root, model, 5, ranks);
    CHECK(VerifyCheckpoint(Env::Default(), dir).ok());
    CHECK(ReadLatest(root) == "step-000000000005\n");
    for (uint32_t r = 0; r < ranks; ++r) {
      auto state = RestoreLatest(root, SmallReads(ranks, r));
      REQUIRE_MESSAGE(state.ok(), state.status().ToString());
      CHECK(state->step == 5);
      CHECK(state->metadata.at("model") == "small");
      CheckState(*state, model, 5);
    }
  }
}

TEST_CASE("resharding 4->2 - 2->3 - 1->4 restores tensors bitwise equal to the originals") {
  TempDir tmp;
  auto model = SmallModel();
  struct Case {
    uint32_t from, to;
  } cases[] = {{4, 2}, {2, 3}, {1, 4}};
  for (auto c : cases) {
    std::string root = tmp.Sub(fmt::format("from{}", c.from));
    if (!Env::Default()->Exists(root)) SaveModel(root, model, 9, c.from);
    for (uint32_t r = 0; r < c.to; ++r) {
      FetchReport report;
      auto state = RestoreLatest(root, SmallReads(c.to, r), &report);
      REQUIRE_MESSAGE(state.ok(), state.status().ToString());
      CheckState(*state, model, 9);
      CHECK(report.sources.size() == 1);
      CHECK(!report.sources[0].dropped);
    }
  }
}

TEST_CASE("retention keeps the newest K valid checkpoints and removes stale temp dirs") {
  TempDir tmp;
  auto model = SmallModel();
  std::string root = tmp.path();
  for (int64_t step = 1; step <= 4; ++step) SaveModel(root, model, step, 2, 64 << 10, 2);
  CHECK(Steps(root) == std::vector<int64_t>{3, 4});
  // Damage step 4: it no longer counts as valid, so step 3 stays with the new step 5; a partial
  // save of step 4 (a crashed attempt) is removed, one of step 9 (in progress) is kept.
  auto m4 = LoadManifest(Env::Default(), root + "/step-000000000004");
  REQUIRE(m4.ok());
  std::filesystem::resize_file(root + "/step-000000000004/" + m4->files[0].name, 5000);
  std::filesystem::create_directories(root + "/.tmp-step-000000000004-crashed");
  std::filesystem::create_directories(root + "/.tmp-step-000000000009-running");
  SaveModel(root, model, 5, 2, 64 << 10, 2);
  CHECK(Steps(root) == std::vector<int64_t>{3, 4, 5});
  CHECK(!Env::Default()->Exists(root + "/.tmp-step-000000000004-crashed"));
  CHECK(Env::Default()->Exists(root + "/.tmp-step-000000000009-running"));
  SaveModel(root, model, 6, 2, 64 << 10, 2);
  CHECK(Steps(root) == std::vector<int64_t>{5, 6});
}

TEST_CASE("disk full - failing fsync or rename during save: error names the file - previous kept") {
  TempDir tmp;
  auto model = SmallModel();
  std::string root = tmp.path();
  SaveModel(root, model, 1, 1);
  FaultEnv env(Env::Default());
  WriterOptions o;
  o.root = root;
  o.chunk_bytes = 64 << 10;
  o.env = &env;
  struct Fault {
    const char* what;
    std::function<void()> arm;
    Code code;
    std::string names;
  } faults[] = {
      {"ENOSPC", [&] { env.FailWritesAfter(300'000, ".safetensors"); }, Code::kResourceExhausted,
       "shard-00000-of-00001.safetensors"},
      {"fsync", [&] { env.FailSyncs("MANIFEST"); }, Code::kDataLoss, "MANIFEST"},
      {"rename", [&] { env.FailRenames("step-000000000002"); }, Code::kDataLoss, "step-000000000002"},
  };
  for (const auto& f : faults) {
    env.Clear();
    f.arm();
    auto r = CheckpointWriter(o).Save(MakeSnapshot(model, 2, 0, 1, f.what));
    REQUIRE_MESSAGE(!r.ok(), f.what);
    CHECK_MESSAGE(r.status().code() == f.code, r.status().ToString());
    CHECK_MESSAGE(r.status().message().find(f.names) != std::string::npos, r.status().ToString());
    CHECK(Steps(root) == std::vector<int64_t>{1});
    CHECK(ReadLatest(root) == "step-000000000001\n");
    CHECK(VerifyCheckpoint(Env::Default(), root + "/step-000000000001").ok());
    auto state = RestoreLatest(root, SmallReads(1, 0));
    REQUIRE(state.ok());
    CheckState(*state, model, 1);
  }
  CHECK(env.faults_hit() == 3);
  // Once the disk has room again the next save commits and the failed attempts are cleaned up.
  env.Clear();
  auto r = CheckpointWriter(o).Save(MakeSnapshot(model, 2, 0, 1, "retry"));
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  auto names = Env::Default()->ListDir(root);
  REQUIRE(names.ok());
  for (const auto& n : *names) CHECK_MESSAGE(n.rfind(".tmp-", 0) != 0, n);
}

TEST_CASE("a committed checkpoint is never overwritten") {
  TempDir tmp;
  auto model = SmallModel();
  std::string dir = SaveModel(tmp.path(), model, 3, 1);
  auto before = ReadFileToString(Env::Default(), dir + "/MANIFEST");
  WriterOptions o;
  o.root = tmp.path();
  auto r = CheckpointWriter(o).Save(MakeSnapshot(model, 3, 0, 1, "again"));
  CHECK(r.status().code() == Code::kConflict);
  CHECK(*ReadFileToString(Env::Default(), dir + "/MANIFEST") == *before);
}

TEST_CASE("damaged shards are named by verify and restore falls back to the previous checkpoint") {
  TempDir tmp;
  auto model = SmallModel();
  std::string root = tmp.path();
  SaveModel(root, model, 1, 2);
  std::string dir2 = SaveModel(root, model, 2, 2);
  auto m = LoadManifest(Env::Default(), dir2);
  REQUIRE(m.ok());
  std::string shard1 = dir2 + "/" + m->files[1].name;
  SUBCASE("corrupt byte in the data") {
    FlipByte(shard1, m->files[1].size_bytes - 10);
    Status st = VerifyCheckpoint(Env::Default(), dir2);
    CHECK(st.code() == Code::kDataLoss);
    CHECK_MESSAGE(st.message().find(shard1) != std::string::npos, st.ToString());
    CHECK(st.message().find("checksum mismatch") != std::string::npos);
  }
  SUBCASE("truncated shard") {
    std::filesystem::resize_file(shard1, m->files[1].size_bytes - 1);
    Status st = VerifyCheckpoint(Env::Default(), dir2);
    CHECK_MESSAGE(st.message().find(shard1) != std::string::npos, st.ToString());
  }
  SUBCASE("missing shard") {
    std::filesystem::remove(shard1);
    Status st = VerifyCheckpoint(Env::Default(), dir2);
    CHECK(st.code() == Code::kNotFound);
    CHECK_MESSAGE(st.message().find(shard1) != std::string::npos, st.ToString());
  }
  SUBCASE("a shard of another checkpoint: the manifest does not match") {
    std::filesystem::copy_file(root + "/step-000000000001/" + m->files[1].name, shard1,
                               std::filesystem::copy_options::overwrite_existing);
    Status st = VerifyCheckpoint(Env::Default(), dir2);
    CHECK(st.code() == Code::kDataLoss);
    CHECK_MESSAGE(st.message().find(shard1) != std::string::npos, st.ToString());
  }
  SUBCASE("corrupt manifest") {
    FlipByte(dir2 + "/MANIFEST", 20);
    Status st = VerifyCheckpoint(Env::Default(), dir2);
    CHECK(st.code() == Code::kDataLoss);
    CHECK_MESSAGE(st.message().find("MANIFEST") != std::string::npos, st.ToString());
  }
  FetchReport report;
  auto state = RestoreLatest(root, SmallReads(2, 1), &report);
  REQUIRE_MESSAGE(state.ok(), state.status().ToString());
  CHECK(state->step == 1);
  CheckState(*state, model, 1);
  REQUIRE(report.skipped.size() == 1);
  CHECK(report.skipped[0].find("step-000000000002") != std::string::npos);
}

TEST_CASE("async save returns at once - bounds bytes in flight and reports failures in Wait") {
  TempDir tmp;
  auto model = SmallModel();
  uint64_t one = MakeSnapshot(model, 1, 0, 1).bytes();
  FaultEnv env(Env::Default());
  AsyncWriterOptions o;
  o.writer.root = tmp.path();
  o.writer.env = &env;
  o.writer.keep = 2;
  o.bytes_in_flight_max = one + one / 2;  // room for one snapshot, not two
  {
    AsyncCheckpointWriter w(o);
    for (int64_t step = 1; step <= 4; ++step) {
      REQUIRE(w.Save(MakeSnapshot(model, step, 0, 1)).ok());
      CHECK(w.bytes_in_flight() <= o.bytes_in_flight_max);
    }
    CHECK(w.Wait().ok());
    CHECK(w.last_committed_step() == 4);
    CHECK(w.bytes_in_flight() == 0);
    env.FailWritesAfter(1000);
    REQUIRE(w.Save(MakeSnapshot(model, 5, 0, 1)).ok());
    Status st = w.Wait();
    CHECK(st.code() == Code::kResourceExhausted);
    env.Clear();
    REQUIRE(w.Save(MakeSnapshot(model, 6, 0, 1)).ok());
  }  // the destructor drains the queue
  CHECK(Steps(tmp.path()) == std::vector<int64_t>{4, 6});
}

TEST_CASE("ranks of one group saving from several threads commit exactly once") {
  TempDir tmp;
  auto model = SmallModel();
  for (int round = 0; round < 5; ++round) {
    WriterOptions o;
    o.root = tmp.path();
    o.chunk_bytes = 64 << 10;
    CheckpointWriter w(o);
    std::atomic<int> commits{0};
    std::vector<std::thread> ranks;
    for (uint32_t r = 0; r < 4; ++r) {
      ranks.emplace_back([&, r] {
        auto res = w.Save(MakeSnapshot(model, 10 + round, r, 4));
        REQUIRE_MESSAGE(res.ok(), res.status().ToString());
        if (res->committed) ++commits;
      });
    }
    for (auto& t : ranks) t.join();
    CHECK(commits.load() == 1);
    auto state = RestoreLatest(tmp.path(), SmallReads(3, 2));
    REQUIRE(state.ok());
    CHECK(state->step == 10 + round);
    CheckState(*state, model, 10 + round);
  }
}

TEST_CASE("shards of a crashed save attempt are never committed with the retry's") {
  TempDir tmp;
  auto model = SmallModel();
  WriterOptions o;
  o.root = tmp.path();
  CheckpointWriter w(o);
  // Attempt "a": rank 1 saved different data, then the group died before rank 0 saved.
  Snapshot stale = MakeSnapshot(model, 7, 1, 2, "a");
  stale.tensors = MakeSnapshot(model, 99, 1, 2, "a").tensors;
  REQUIRE(w.Save(stale).ok());
  for (uint32_t r = 0; r < 2; ++r) REQUIRE(w.Save(MakeSnapshot(model, 7, r, 2, "b")).ok());
  auto state = RestoreLatest(tmp.path(), SmallReads(1, 0));
  REQUIRE(state.ok());
  CheckState(*state, model, 7);
  CHECK(!Env::Default()->Exists(tmp.Sub(".tmp-step-000000000007-a")));
}

TEST_CASE("snapshots that do not match their shapes are refused before anything is written") {
  TempDir tmp;
  WriterOptions o;
  o.root = tmp.path();
  Snapshot s;
  s.step = 1;
  std::vector<float> v(10);
  s.tensors.push_back(SnapshotTensor{"x", DType::kF32, {4, 3}, RowRange{0, 4}, ConstBytes::Own(v)});
  CHECK(CheckpointWriter(o).Save(s).status().code() == Code::kInvalidArgument);
  CHECK(Steps(tmp.path()).empty());
}

}  // namespace
}  // namespace lk::ckpt
