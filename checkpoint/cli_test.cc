// The `checkpoint` CLI through the real lk_checkpoint_tool binary (exit codes, inspect, verify,
// reshard), and a shard read back by an independent Python reader (json + numpy).
#include <doctest/doctest.h>

#include <boost/json.hpp>
#include <cstdio>
#include <fstream>
#include <sys/wait.h>

#include "checkpoint/format.h"
#include "checkpoint/store.h"
#include "checkpoint/test_util.h"

namespace lk::ckpt {
namespace {

using namespace testing;

struct Run {
  int code = -1;
  std::string output;
};

Run Shell(const std::string& cmd) {
  Run r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Tool() {
  const char* bin = std::getenv("LK_BIN_DIR");
  REQUIRE_MESSAGE(bin != nullptr, "LK_BIN_DIR is not set (run through ctest)");
  return std::string(bin) + "/lk_checkpoint_tool";
}

TEST_CASE("checkpoint verify exits 0 on a good checkpoint and 1 naming the damaged file") {
  TempDir tmp;
  std::string dir = SaveModel(tmp.path(), SmallModel(), 4, 2);
  Run ok = Shell(Tool() + " verify " + tmp.path());
  CHECK_MESSAGE(ok.code == 0, ok.output);
  CHECK(ok.output.find("verified " + dir) != std::string::npos);
  auto m = LoadManifest(Env::Default(), dir);
  REQUIRE(m.ok());
  std::string shard = dir + "/" + m->files[1].name;
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(m->files[1].header_bytes + 3));
    f.put('\x7f');
  }
  Run bad = Shell(Tool() + " verify " + dir);
  CHECK(bad.code == 1);
  CHECK_MESSAGE(bad.output.find(shard) != std::string::npos, bad.output);
  Run usage = Shell(Tool() + " verify");
  CHECK(usage.code == 2);
  Run unknown = Shell(Tool() + " frobnicate");
  CHECK(unknown.code == 2);
  Run missing = Shell(Tool() + " verify " + tmp.Sub("nope"));
  CHECK(missing.code == 1);
}

TEST_CASE("checkpoint inspect prints the manifest for people and as JSON") {
  TempDir tmp;
  std::string dir = SaveModel(tmp.path(), SmallModel(), 4, 2);
  Run text = Shell(Tool() + " inspect " + dir);
  REQUIRE_MESSAGE(text.code == 0, text.output);
  CHECK(text.output.find("step 4") != std::string::npos);
  CHECK(text.output.find("writer ranks 2") != std::string::npos);
  CHECK(text.output.find("tensor e.big F32 [301,1024] [0,151)@shard-00000-of-00002") !=
        std::string::npos);
  Run json = Shell(Tool() + " inspect --json " + dir);
  REQUIRE_MESSAGE(json.code == 0, json.output);
  boost::system::error_code ec;
  auto v = boost::json::parse(json.output, ec);
  REQUIRE_MESSAGE(!ec, json.output);
  CHECK(v.at("ranks").as_int64() == 2);
  CHECK(v.at("tensors").as_array().size() == SmallModel().size());
}

TEST_CASE("checkpoint reshard writes a valid checkpoint for N ranks with equal tensors") {
  TempDir tmp;
  auto model = SmallModel();
  SaveModel(tmp.Sub("four"), model, 8, 4);
  Run r = Shell(Tool() + " reshard " + tmp.Sub("four") + " --ranks 3 --out " + tmp.Sub("three"));
  REQUIRE_MESSAGE(r.code == 0, r.output);
  std::string dir = tmp.Sub("three") + "/step-000000000008";
  CHECK(VerifyCheckpoint(Env::Default(), dir).ok());
  auto m = LoadManifest(Env::Default(), dir);
  REQUIRE(m.ok());
  CHECK(m->ranks == 3);
  CHECK(m->files.size() == 3);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    auto state = RestoreFromDir(dir, SmallReads(3, rank));
    REQUIRE(state.ok());
    CheckState(*state, model, 8);
  }
  Run again = Shell(Tool() + " reshard " + tmp.Sub("four") + " --ranks 3 --out " + tmp.Sub("three"));
  CHECK(again.code == 1);  // never overwrites
}

std::string FindPythonWithNumpy() {
  for (const char* py : {"/usr/bin/python3", "python3"}) {
    if (Shell(std::string(py) + " -c 'import numpy'").code == 0) return py;
  }
  FAIL("no python3 with numpy (scripts/install-deps.sh installs python3-numpy)");
  return "";
}

TEST_CASE("a shard written here is read by an independent Python reader (json + numpy)") {
  TempDir tmp;
  // Values a reader can check exactly: small integers and quarters in every float dtype.
  const int kRows = 6;
  std::vector<float> f32(kRows * 4);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<float>(i) * 0.25f - 1.0f;
  std::vector<uint16_t> bf16(kRows * 3);
  for (size_t i = 0; i < bf16.size(); ++i) {
    float x = static_cast<float>(i) - 7.0f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bf16[i] = static_cast<uint16_t>(bits >> 16);
  }
  std::vector<_Float16> f16(kRows * 2);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = static_cast<_Float16>(static_cast<float>(i) * 0.5f);
  std::vector<int64_t> i64 = {-5, int64_t{1} << 40, 7, 0, 9, -1};
  std::vector<uint8_t> u8(kRows * 4);
  for (size_t i = 0; i < u8.size(); ++i) u8[i] = static_cast<uint8_t>(i * 10);
  std::vector<double> f64 = {3.5};
  WriterOptions o;
  o.root = tmp.path();
  CheckpointWriter w(o);
  for (uint32_t r = 0; r < 2; ++r) {
    Snapshot s;
    s.step = 12;
    s.rank = r;
    s.ranks = 2;
    s.Add("f32", DType::kF32, {kRows, 4}, ConstBytes::Own(f32));
    s.Add("bf16", DType::kBF16, {kRows, 3}, ConstBytes::Own(bf16));
    s.Add("f16", DType::kF16, {kRows, 2}, ConstBytes::Own(f16));
    s.Add("i64", DType::kI64, {kRows}, ConstBytes::Own(i64));
    s.Add("u8", DType::kU8, {kRows, 2, 2}, ConstBytes::Own(u8));
    s.Add("f64", DType::kF64, {}, ConstBytes::Own(f64));
    REQUIRE(w.Save(s).ok());
  }
  std::string dir = tmp.path() + "/step-000000000012";
  std::string py = FindPythonWithNumpy();
  // lk_test passes LK_SOURCE_DIR; fall back to the path compiled in (see CMakeLists.txt).
  const char* src = std::getenv("LK_SOURCE_DIR");
  std::string script = std::string(src != nullptr ? src : LK_CHECKPOINT_SOURCE_DIR) +
                       "/checkpoint/testdata/read_safetensors.py";
  std::string s0 = dir + "/shard-00000-of-00002.safetensors", s1 = dir + "/shard-00001-of-00002.safetensors";
  Run r = Shell(py + " " + script + " " + s0 + " " + s1);
  REQUIRE_MESSAGE(r.code == 0, r.output);
  boost::system::error_code ec;
  auto v = boost::json::parse(r.output, ec);
  REQUIRE_MESSAGE(!ec, r.output);
  auto value = [](const boost::json::value& x) { return x.is_double() ? x.as_double() : static_cast<double>(x.to_number<int64_t>()); };
  for (const auto& [path, rank] : {std::pair{s1, 1u}, std::pair{s0, 0u}}) {
    const auto& shard = v.at(path).as_object();
    CHECK(shard.at("data_start").as_int64() % 4096 == 0);
    CHECK(shard.at("metadata").at("lk.step").as_string() == "12");
    const auto& t = shard.at("tensors").as_object();
    RowRange rows = EvenRows(kRows, 2, rank);
    CHECK(t.at("f32").at("shape").as_array().size() == 2);
    CHECK(t.at("f32").at("shape").as_array()[0].as_int64() == rows.rows());
    CHECK(shard.at("metadata").at("lk.rows.f32").as_string() == fmt::format("{},{}", rows.begin, rows.end));
    auto check = [&](const char* name, int per_row, auto expect) {
      const auto& vals = t.at(name).at("values").as_array();
      REQUIRE(vals.size() == static_cast<size_t>(rows.rows() * per_row));
      for (size_t i = 0; i < vals.size(); ++i) {
        size_t g = static_cast<size_t>(rows.begin * per_row) + i;
        CHECK_MESSAGE(value(vals[i]) == expect(g), name << "[" << g << "]");
      }
    };
    check("f32", 4, [](size_t g) { return g * 0.25 - 1.0; });
    check("bf16", 3, [](size_t g) { return static_cast<double>(g) - 7.0; });
    check("f16", 2, [](size_t g) { return g * 0.5; });
    check("i64", 1, [&](size_t g) { return static_cast<double>(i64[g]); });
    check("u8", 4, [](size_t g) { return static_cast<double>(g * 10 % 256); });
    if (rank == 0) {
      CHECK(value(t.at("f64").at("values").as_array()[0]) == 3.5);
    } else {
      CHECK(!t.contains("f64"));  // a 0-d tensor is stored once, by rank 0
    }
  }
}

}  // namespace
}  // namespace lk::ckpt
