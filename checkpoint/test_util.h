// Helpers shared by the checkpoint tests: scratch directories, a small model whose bytes are a
// function of (tensor, step), and checks that a restored state equals that model bitwise.
// Thread-safety: plain functions.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/restore.h"
#include "checkpoint/types.h"
#include "checkpoint/writer.h"

namespace lk::ckpt::testing {

struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// Odd shapes on purpose: rows that do not divide by 2, 3 or 4, a 0-d tensor, several chunks.
inline std::vector<TensorSpec> SmallModel() {
  return {
      {"a.weight", DType::kF32, {37, 19}},   {"b.bias", DType::kBF16, {5}},
      {"c.emb", DType::kF16, {1000, 64}},    {"d.step", DType::kI64, {}},
      {"e.big", DType::kF32, {301, 1024}},   {"f.mask", DType::kU8, {3, 3, 3}},
      {"g.f64", DType::kF64, {7, 2}},        {"h.i32", DType::kI32, {2}},
  };
}

inline uint64_t TensorBytes(const TensorSpec& t) {
  return static_cast<uint64_t>(RowsOf(t.shape)) * RowBytes(t.dtype, t.shape);
}

// The whole tensor at `step`: every byte depends on the tensor, the position and the step.
inline Buffer GlobalBytes(const TensorSpec& t, int64_t step) {
  Buffer b(TensorBytes(t));
  uint64_t seed = std::hash<std::string>()(t.name) ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull);
  for (uint64_t i = 0; i < b.size(); ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    b.data()[i] = static_cast<uint8_t>(seed >> 56);
  }
  return b;
}

inline Snapshot MakeSnapshot(const std::vector<TensorSpec>& model, int64_t step, uint32_t rank,
                             uint32_t ranks, std::string attempt = "0") {
  Snapshot s;
  s.step = step;
  s.rank = rank;
  s.ranks = ranks;
  s.attempt = std::move(attempt);
  s.metadata["model"] = "small";
  for (const auto& t : model) s.Add(t.name, t.dtype, t.shape, ConstBytes::Own(GlobalBytes(t, step)));
  return s;
}

// Every tensor of `state` equals rows [rows.begin, rows.end) of the model at `step`, bitwise.
inline void CheckState(const RestoredState& state, const std::vector<TensorSpec>& model, int64_t step) {
  REQUIRE(state.tensors.size() == model.size());
  for (const auto& t : model) {
    const RestoredTensor* r = state.Find(t.name);
    REQUIRE_MESSAGE(r != nullptr, t.name);
    CHECK(r->dtype == t.dtype);
    CHECK(r->shape == t.shape);
    CHECK(r->rows == TargetRows(t.shape, state.ranks, state.rank));
    Buffer g = GlobalBytes(t, step);
    uint64_t rb = RowBytes(t.dtype, t.shape);
    REQUIRE(r->data.size() == static_cast<uint64_t>(r->rows.rows()) * rb);
    bool same = r->data.size() == 0 ||
                std::memcmp(r->data.data(), g.data() + static_cast<uint64_t>(r->rows.begin) * rb,
                            r->data.size()) == 0;
    CHECK_MESSAGE(same, t.name << " rank " << state.rank << "/" << state.ranks);
  }
}

// A fresh directory under the system temp dir, removed when the object goes.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lk-ckpt-test-XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    REQUIRE(p != nullptr);
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Writes the model at `step` for `ranks` ranks into `root` (each rank's Save in turn).
inline std::string SaveModel(const std::string& root, const std::vector<TensorSpec>& model,
                             int64_t step, uint32_t ranks, uint64_t chunk_bytes = 64 << 10,
                             uint32_t keep = 3) {
  WriterOptions o;
  o.root = root;
  o.chunk_bytes = chunk_bytes;
  o.keep = keep;
  CheckpointWriter w(o);
  std::string dir;
  for (uint32_t r = 0; r < ranks; ++r) {
    auto res = w.Save(MakeSnapshot(model, step, r, ranks));
    REQUIRE_MESSAGE(res.ok(), res.status().ToString());
    CHECK(res->committed == (r + 1 == ranks));
    if (res->committed) dir = res->dir;
  }
  return dir;
}

inline RestoreOptions SmallReads(uint32_t ranks, uint32_t rank) {
  RestoreOptions o;
  o.layout = TargetLayout{ranks, rank};
  o.plan.read_bytes_max = 256 << 10;
  return o;
}

}  // namespace lk::ckpt::testing
