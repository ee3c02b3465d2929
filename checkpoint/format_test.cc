// Pure tests: shard header encoding, Range parsing, manifest validation and merging, the planner.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "checkpoint/format.h"
#include "checkpoint/manifest.h"
#include "checkpoint/planner.h"
#include "checkpoint/shard_server.h"

namespace lk::ckpt {
namespace {

ShardHeader TwoTensorHeader() {
  ShardHeader h;
  h.metadata.emplace("lk.step", std::string(1, '7'));
  h.entries.push_back(ShardEntry{"w", DType::kF32, {2, 3}, {5, 3}, RowRange{1, 3}, 0, 24});
  h.entries.push_back(ShardEntry{"s", DType::kI64, {}, {}, RowRange{0, 1}, 24, 32});
  return h;
}

TEST_CASE("shard header round-trips and aligns the data to 4 KiB") {
  ShardHeader h = TwoTensorHeader();
  std::string head = EncodeShardHeader(&h);
  CHECK(head.size() % kHeaderAlignBytes == 0);
  CHECK(h.header_bytes == head.size());
  auto parsed = ParseShardHeader(head, head.size() + 32);
  REQUIRE_MESSAGE(parsed.ok(), parsed.status().ToString());
  REQUIRE(parsed->entries.size() == 2);
  CHECK(parsed->entries[0].name == "w");
  CHECK(parsed->entries[0].rows == RowRange{1, 3});
  CHECK(parsed->entries[0].global_shape == std::vector<int64_t>{5, 3});
  CHECK(parsed->entries[1].dtype == DType::kI64);
  CHECK(parsed->metadata.at("lk.step") == "7");
}

TEST_CASE("shard header parsing rejects truncation - holes and lying lengths") {
  ShardHeader h = TwoTensorHeader();
  std::string head = EncodeShardHeader(&h);
  CHECK(ParseShardHeader(head, head.size() + 31).status().code() == Code::kDataLoss);  // truncated
  CHECK(!ParseShardHeader(head.substr(0, 100), head.size() + 32).ok());
  std::string bad = head;
  bad[0] = '\xff';  // header length beyond the file
  CHECK(!ParseShardHeader(bad, head.size() + 32).ok());
  ShardHeader holes = TwoTensorHeader();
  holes.entries[1].begin = 28;
  holes.entries[1].end = 36;
  std::string h2 = EncodeShardHeader(&holes);
  CHECK(!ParseShardHeader(h2, h2.size() + 36).ok());
}

TEST_CASE("huge page buffers start on a 2 MiB boundary and are usable to their last byte") {
  for (uint64_t size : {uint64_t{0}, uint64_t{100}, (uint64_t{2} << 20) - 1, uint64_t{2} << 20,
                        (uint64_t{5} << 20) + 3}) {
    Buffer b(size, /*huge_pages=*/true);
    CHECK(b.size() == size);
    if (size >= (uint64_t{2} << 20)) CHECK(reinterpret_cast<uintptr_t>(b.data()) % (2 << 20) == 0);
    if (size == 0) continue;
    std::memset(b.data(), 0x5a, size);
    CHECK(b.data()[size - 1] == 0x5a);
    Buffer moved = std::move(b);  // freed once, by the new owner
    CHECK(moved.data()[0] == 0x5a);
  }
}

TEST_CASE("XXH3 fed in pieces equals XXH3 of the whole") {
  std::vector<uint8_t> bytes(1 << 20);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  Xxh3Stream h;
  for (size_t at = 0, piece = 1; at < bytes.size(); at += piece, piece = piece * 3 + 7) {
    h.Update(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  CHECK(h.Digest() == Xxh3(bytes.data(), bytes.size()));
  h.Reset();
  CHECK(h.Digest() == Xxh3(nullptr, 0));
}

TEST_CASE("Range header parsing") {
  struct Case {
    std::string header;
    bool ok;
    uint64_t begin, end;
  } cases[] = {
      {"bytes=0-9", true, 0, 10},    {"bytes=5-", true, 5, 100},   {"bytes=-10", true, 90, 100},
      {"bytes=90-200", true, 90, 100}, {"bytes=100-101", false, 0, 0}, {"bytes=9-3", false, 0, 0},
      {"bytes=0-1,5-6", false, 0, 0}, {"items=0-1", false, 0, 0},   {"bytes=x-1", false, 0, 0},
  };
  for (const auto& c : cases) {
    uint64_t b = 0, e = 0;
    Status st = ParseRange(c.header, 100, &b, &e);
    CHECK_MESSAGE(st.ok() == c.ok, c.header);
    if (c.ok) CHECK_MESSAGE((b == c.begin && e == c.end), c.header);
  }
}

TEST_CASE("even row split gives the first ranks the extra rows") {
  CHECK(EvenRows(10, 4, 0) == RowRange{0, 3});
  CHECK(EvenRows(10, 4, 1) == RowRange{3, 6});
  CHECK(EvenRows(10, 4, 3) == RowRange{8, 10});
  CHECK(EvenRows(2, 3, 2) == RowRange{2, 2});
  CHECK(WriterRows({}, 2, 1).empty());
  CHECK(TargetRows({}, 2, 1) == RowRange{0, 1});
}

// A manifest for `ranks` writers of tensors with these (rows, row_bytes), built by hand.
Manifest HandManifest(uint32_t ranks, std::vector<std::pair<int64_t, int64_t>> tensors,
                      uint64_t chunk_bytes) {
  Manifest m;
  m.ranks = ranks;
  m.chunk_bytes = chunk_bytes;
  std::vector<uint64_t> at(ranks, 4096);
  for (uint32_t r = 0; r < ranks; ++r) m.files.push_back(ShardFileInfo{ShardFileName(r, ranks), r, 0, 4096, 0});
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto [rows, cols] = tensors[i];
    TensorInfo t{fmt::format("t{}", i), DType::kU8, {rows, cols}, {}};
    for (uint32_t r = 0; r < ranks; ++r) {
      RowRange rr = EvenRows(rows, ranks, r);
      if (rr.empty()) continue;
      uint64_t len = static_cast<uint64_t>(rr.rows() * cols);
      std::vector<uint64_t> sums(ChunkCount(len, chunk_bytes), 42);
      t.slices.push_back(SliceInfo{r, rr, at[r], len, sums});
      at[r] += len;
    }
    m.tensors.push_back(std::move(t));
  }
  for (uint32_t r = 0; r < ranks; ++r) m.files[r].size_bytes = at[r];
  return m;
}

TEST_CASE("planner covers every destination byte exactly once with chunk-aligned reads") {
  struct Case {
    uint32_t from, to;
  } cases[] = {{4, 2}, {2, 3}, {1, 4}, {3, 3}, {4, 1}, {2, 5}};
  for (auto c : cases) {
    Manifest m = HandManifest(c.from, {{37, 19}, {1000, 64}, {5, 1}, {2, 7}}, 1000);
    REQUIRE(ValidateManifest(m).ok());
    for (uint32_t rank = 0; rank < c.to; ++rank) {
      auto plan = PlanRestore(m, TargetLayout{c.to, rank}, PlanOptions{4000});
      REQUIRE_MESSAGE(plan.ok(), plan.status().ToString());
      for (size_t ti = 0; ti < plan->tensors.size(); ++ti) {
        std::vector<std::pair<uint64_t, uint64_t>> got;
        for (const auto& r : plan->reads) {
          CHECK(r.length <= 4000);
          uint64_t covered = 0;
          for (const auto& ck : r.checks) {
            CHECK(ck.offset == covered);
            covered += ck.length;
          }
          CHECK(covered == r.length);
          for (const auto& cp : r.copies) {
            CHECK(cp.src_offset + cp.length <= r.length);
            if (cp.tensor == ti) got.emplace_back(cp.dst_offset, cp.dst_offset + cp.length);
          }
        }
        std::sort(got.begin(), got.end());
        uint64_t at = 0;
        for (auto [b, e] : got) {
          CHECK(b == at);
          at = e;
        }
        CHECK_MESSAGE(at == plan->tensors[ti].bytes, c.from << "->" << c.to << " rank " << rank);
      }
    }
  }
}

TEST_CASE("planner reads whole ranks without waste when the layout is unchanged") {
  Manifest m = HandManifest(2, {{1000, 64}}, 4096);
  auto plan = PlanRestore(m, TargetLayout{2, 1}, PlanOptions{1 << 20});
  REQUIRE(plan.ok());
  CHECK(plan->read_bytes() == plan->dest_bytes());
  REQUIRE(plan->reads.size() == 1);
  CHECK(plan->reads[0].file == 1);
}

TEST_CASE("manifest validation names the gap - the overlap and a partial manifest is refused") {
  Manifest m = HandManifest(2, {{10, 4}}, 16);
  CHECK(ValidateManifest(m).ok());
  Manifest gap = m;
  gap.tensors[0].slices.pop_back();
  Status st = ValidateManifest(gap);
  CHECK(!st.ok());
  CHECK(st.message().find("rows [5,10) are in no shard") != std::string::npos);
  gap.partial = true;
  CHECK(ValidateManifest(gap).ok());
  CHECK(!PlanRestore(gap, TargetLayout{1, 0}).ok());
  Manifest overlap = m;
  overlap.tensors[0].slices[1].rows.begin = 4;
  CHECK(!ValidateManifest(overlap).ok());
  Manifest chunks = m;
  chunks.tensors[0].slices[0].chunk_xxh3.pop_back();
  CHECK(!ValidateManifest(chunks).ok());
}

TEST_CASE("merging partial manifests yields the complete one - disagreement is refused") {
  Manifest full = HandManifest(2, {{10, 4}, {3, 3}}, 16);
  Manifest p0 = full, p1 = full;
  p0.partial = p1.partial = true;
  p0.files = {full.files[0]};
  p1.files = {full.files[1]};
  for (auto* p : {&p0, &p1}) {
    for (auto& t : p->tensors) {
      std::vector<SliceInfo> keep;
      for (auto s : t.slices) {
        if (s.file == (p == &p0 ? 0u : 1u)) {
          s.file = 0;
          keep.push_back(s);
        }
      }
      t.slices = keep;
    }
  }
  auto merged = MergeManifests({p1, p0, p1});  // a duplicate source of rank 1 is fine
  REQUIRE_MESSAGE(merged.ok(), merged.status().ToString());
  CHECK(!merged->partial);
  CHECK(merged->files[0].name == full.files[0].name);
  CHECK(merged->tensors[0].slices.size() == 2);
  auto only0 = MergeManifests({p0});
  REQUIRE(only0.ok());
  CHECK(only0->partial);
  Manifest liar = p1;
  liar.tensors[0].slices[0].chunk_xxh3[0] = 7;
  CHECK(!MergeManifests({p0, p1, liar}).ok());
}

}  // namespace
}  // namespace lk::ckpt
