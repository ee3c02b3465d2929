// The RocksDB state store on hostile disk contents: a key or value that is not what this build
// writes (a torn write, another version, a hand edit) is a kDataLoss error naming the key, at
// start, never an exception or an abort; and the lighthouse service refuses to start on it.
#include "lighthouse/state_store.h"

#include <doctest/doctest.h>
#include <rocksdb/db.h>

#include <boost/asio/io_context.hpp>
#include <filesystem>
#include <memory>
#include <string>

#include "common/proto/lightkeeper.pb.h"
#include "lighthouse/memory_state_store.h"
#include "lighthouse/service.h"

namespace lk::lighthouse {
namespace {

// A fresh directory for one RocksDB, removed at the end.
struct Scratch {
  std::string dir;
  Scratch() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lk-test-state-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    dir = tmpl;
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

// Writes raw key/value pairs with RocksDB itself, behind the store's back.
void PutRaw(const std::string& dir, const std::string& key, const std::string& value) {
  rocksdb::Options o;
  o.create_if_missing = true;
  rocksdb::DB* raw = nullptr;
  REQUIRE(rocksdb::DB::Open(o, dir, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  REQUIRE(db->Put(rocksdb::WriteOptions(), key, value).ok());
}

std::string JobValue(const std::string& job) {
  lightkeeper::v1::JobRecord rec;
  rec.set_job(job);
  rec.set_quorum_id(3);
  return rec.SerializeAsString();
}

std::string CheckpointValue(const std::string& job, uint32_t step) {
  lightkeeper::v1::CheckpointInfo info;
  info.set_job(job);
  info.set_step(step);
  info.set_location("/ckpt");
  return info.SerializeAsString();
}

TEST_CASE("state store: what it wrote loads back - the baseline the corrupt cases differ from") {
  Scratch s;
  {
    auto store = OpenRocksDbStore(s.dir);
    REQUIRE(store.ok());
    JobRecordData j;
    j.job = "j";
    j.quorum_id = 4;
    j.committed_step = 9;
    j.tokens = {{"g", 9, 4096, 40960}, {"h", 8, 1ull << 40, (1ull << 40) + 7}};
    j.lives = {{"g", 3, 1, {"g-1", "g-2", "g-4"}, "requeue_refused: denied"}};
    j.lost = true;
    j.force_new = true;
    CheckpointData c{"j", 9, "/ckpt/step-9", "d", "g", 1};
    REQUIRE((*store)->Apply({j}, {c}, {}, {}, {}, true).ok());
    REQUIRE((*store)->PutKv({"j", 4, "nccl/0", "id-bytes"}).ok());
  }
  auto store = OpenRocksDbStore(s.dir);
  REQUIRE(store.ok());
  auto jobs = (*store)->LoadJobs();
  REQUIRE(jobs.ok());
  REQUIRE(jobs->size() == 1);
  CHECK((*jobs)[0].quorum_id == 4);
  // Each group's contribution survives the restart, 64-bit counts included.
  CHECK((*jobs)[0].tokens == std::vector<GroupTokensData>{{"g", 9, 4096, 40960},
                                                          {"h", 8, 1ull << 40, (1ull << 40) + 7}});
  // So do each group's crashes and refused requeues (issue 31's crash cap).
  CHECK((*jobs)[0].lives ==
        std::vector<GroupLivesData>{{"g", 3, 1, {"g-1", "g-2", "g-4"}, "requeue_refused: denied"}});
  // And that the last quorum lost a member or failed: its id is never handed out again.
  CHECK((*jobs)[0].lost);
  CHECK((*jobs)[0].force_new);
  auto ckpts = (*store)->LoadCheckpoints();
  REQUIRE(ckpts.ok());
  REQUIRE(ckpts->size() == 1);
  CHECK((*ckpts)[0].step == 9);
  auto kv = (*store)->LoadKv();
  REQUIRE(kv.ok());
  REQUIRE(kv->size() == 1);
  CHECK((*kv)[0].job == "j");
  CHECK((*kv)[0].quorum_id == 4);
  CHECK((*kv)[0].key == "nccl/0");
  CHECK((*kv)[0].value == "id-bytes");
}

// What a store holds, as one string, for comparing two stores.
std::string Summary(StateStore& store) {
  std::string out;
  auto jobs = store.LoadJobs();
  REQUIRE(jobs.ok());
  for (const auto& j : *jobs) {
    out += fmt::format("job {} q{} s{} r{};", j.job, j.quorum_id, j.committed_step,
                       j.quorum_id_reserved);
  }
  auto groups = store.LoadGroups();
  REQUIRE(groups.ok());
  for (const auto& g : *groups) {
    out += fmt::format("group {}/{} {} g{} left={};", g.job, g.group_id, g.incarnation,
                       g.generation, g.left);
  }
  auto ckpts = store.LoadCheckpoints();
  REQUIRE(ckpts.ok());
  for (const auto& c : *ckpts) out += fmt::format("ckpt {} {} {};", c.job, c.step, c.location);
  auto kv = store.LoadKv();
  REQUIRE(kv.ok());
  for (const auto& e : *kv)
    out += fmt::format("kv {} {} {}={};", e.job, e.quorum_id, e.key, e.value);
  return out;
}

TEST_CASE("state store: the memory store keeps the RocksDB store's contract") {
  Scratch s;
  auto rocks = OpenRocksDbStore(s.dir);
  REQUIRE(rocks.ok());
  auto memory = NewMemoryStateStore();
  std::vector<std::string> seen;
  for (StateStore* store : {rocks->get(), memory.get()}) {
    JobRecordData j, k;
    j.job = "j";
    j.quorum_id = 4;
    j.committed_step = 9;
    k.job = "k";
    k.quorum_id = 1;
    GroupRecordData ga{"j", "a", "a1", 1, 1, false, "", {}};
    GroupRecordData gb{"j", "b", "b1", 2, 1, true, "done", {}};
    GroupRecordData gk{"k", "a", "k1", 1, 1, false, "", {}};
    REQUIRE(store
                ->Apply({j, k},
                        {{"j", 8, "/c8", "d", "a", 1},
                         {"j", 9, "/c9", "d", "a", 2},
                         {"k", 1, "/k1", "d", "a", 3}},
                        {}, {ga, gb, gk}, {}, true)
                .ok());
    for (uint32_t q : {2u, 3u, 4u})
      REQUIRE(store->PutKv({"j", q, fmt::format("x/{}", q), "v"}).ok());
    REQUIRE(store->PutKv({"j", 4, "x/4", "v2"}).ok());  // a put replaces
    REQUIRE(store->PutKv({"k", 1, "y", "w"}).ok());
    REQUIRE(store->DeleteKvBelow("j", 4).ok());
    REQUIRE(store->DeleteCheckpoint("j", 8).ok());
    j.committed_step = 10;
    // Forgetting k drops its groups, checkpoints and KV; b's record is dropped in the same batch.
    REQUIRE(store->Apply({j}, {}, {"k"}, {}, {{"j", "b"}}, false).ok());
    seen.push_back(Summary(*store));
  }
  CHECK(seen[0] == seen[1]);
  CHECK(seen[1] == "job j q4 s10 r0;group j/a a1 g1 left=false;ckpt j 9 /c9;kv j 4 x/4=v2;");
}

TEST_CASE("state store: a corrupt key or value is kDataLoss naming the key - not an exception") {
  enum class Load { kJobs, kCheckpoints, kKv };
  struct Case {
    std::string what, key, value;
    Load load;
  };
  const Case cases[] = {
      // std::stoul threw std::invalid_argument on this one and took the lighthouse down.
      {"kv id not digits", "kv/j/12345abcde/key", "v", Load::kKv},
      {"kv id with a sign", "kv/j/+000000001/key", "v", Load::kKv},
      {"kv id past 32 bits", "kv/j/9999999999/key", "v", Load::kKv},
      {"kv key cut short", "kv/j/00000001", "v", Load::kKv},
      {"kv without separator", "kv/j/0000000001xkey", "v", Load::kKv},
      {"kv without a job", "kv//0000000001/key", "v", Load::kKv},
      {"job value not a record", "job/j", std::string("\xff\xff\xff\x01", 4), Load::kJobs},
      {"job under another job's key", "job/a", JobValue("b"), Load::kJobs},
      {"job name with a slash", "job/a/b", JobValue("a/b"), Load::kJobs},
      {"checkpoint value not a record", "ckpt/j/0000000001", std::string("\x0a\xff", 2),
       Load::kCheckpoints},
      {"checkpoint under another step", "ckpt/j/0000000002", CheckpointValue("j", 1),
       Load::kCheckpoints},
      {"checkpoint key not padded", "ckpt/j/1", CheckpointValue("j", 1), Load::kCheckpoints},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    Scratch s;
    PutRaw(s.dir, c.key, c.value);
    auto store = OpenRocksDbStore(s.dir);
    REQUIRE(store.ok());
    Status st = c.load == Load::kJobs          ? (*store)->LoadJobs().status()
                : c.load == Load::kCheckpoints ? (*store)->LoadCheckpoints().status()
                                               : (*store)->LoadKv().status();
    CHECK(st.code() == Code::kDataLoss);
    CHECK_MESSAGE(st.message().find(c.key) != std::string::npos, st.message());
  }
}

TEST_CASE("state store: the lighthouse service does not start on a corrupt kv key") {
  Scratch s;
  PutRaw(s.dir, "kv/j/12345abcde/key", "v");
  auto store = OpenRocksDbStore(s.dir);
  REQUIRE(store.ok());
  boost::asio::io_context ioc;
  ServiceOptions o;
  o.bind = "127.0.0.1:0";
  Service service(ioc, o, std::move(*store));
  Status st = service.Start();
  CHECK(st.code() == Code::kDataLoss);
  CHECK_MESSAGE(st.message().find("kv/j/12345abcde/key") != std::string::npos, st.message());
}

}  // namespace
}  // namespace lk::lighthouse
