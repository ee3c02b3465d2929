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

PlanOptions ReadMax(uint64_t read_bytes_max) {
  PlanOptions o;
  o.read_bytes_max = read_bytes_max;
  return o;
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
      auto plan = PlanRestore(m, TargetLayout{c.to, rank}, ReadMax(4000));
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
  auto plan = PlanRestore(m, TargetLayout{2, 1}, ReadMax(1 << 20));
  REQUIRE(plan.ok());
  CHECK(plan->read_bytes() == plan->dest_bytes());
  REQUIRE(plan->reads.size() == 1);
  CHECK(plan->reads[0].file == 1);
}

TEST_CASE("planner takes the rows target_rows chooses - leaves out a tensor it declines") {
  Manifest m = HandManifest(3, {{30, 8}, {9, 4}}, 16);
  PlanOptions o;
  o.read_bytes_max = 1 << 20;
  // t0 whole to rank 1 only; t1 the even split.
  o.target_rows = [](const TensorInfo& t, RowRange even) -> std::optional<RowRange> {
    if (t.name != "t0") return even;
    return std::nullopt;
  };
  auto skipped = PlanRestore(m, TargetLayout{2, 0}, o);
  REQUIRE(skipped.ok());
  REQUIRE(skipped->tensors.size() == 1);
  CHECK(skipped->tensors[0].name == "t1");
  CHECK(skipped->tensors[0].rows == RowRange{0, 5});
  o.target_rows = [](const TensorInfo& t, RowRange even) -> std::optional<RowRange> {
    return t.name == "t0" ? RowRange{0, 30} : even;
  };
  auto whole = PlanRestore(m, TargetLayout{2, 1}, o);
  REQUIRE(whole.ok());
  REQUIRE(whole->tensors.size() == 2);
  CHECK(whole->tensors[0].rows == RowRange{0, 30});
  CHECK(whole->tensors[0].bytes == 30 * 8);
  uint64_t t0_bytes = 0;  // read from all three writers' files
  for (const auto& r : whole->reads) {
    for (const auto& c : r.copies) t0_bytes += c.tensor == 0 ? c.length : 0;
  }
  CHECK(t0_bytes == 30 * 8);
  o.target_rows = [](const TensorInfo&, RowRange) -> std::optional<RowRange> {
    return RowRange{0, 31};
  };
  auto bad = PlanRestore(m, TargetLayout{1, 0}, o);
  CHECK(bad.status().message().find("outside its 30 rows") != std::string::npos);
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

namespace lk::ckpt {
namespace {

// A safetensors prefix (8-byte length + JSON) of `json`, unpadded.
std::string RawHeader(const std::string& json) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json;
}

TEST_CASE("shard header: shapes whose bytes overflow - offsets past the file - bad rows are refused") {
  struct Case {
    std::string what, json;
    uint64_t data_bytes;  // the file holds the header and this many bytes
    std::string reason;
  } cases[] = {
      // 2^32 * 2^32 * 4 bytes wraps to 0: before the check it passed as an empty tensor.
      {"product of dims wraps", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
       0, "does not fit 64 bits"},
      {"product with the dtype size wraps", R"({"w":{"dtype":"U8","shape":[4611686018427387904,4],"data_offsets":[0,0]}})",
       0, "does not fit 64 bits"},
      {"dim past int64", R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}})",
       0, "too large"},
      {"negative dim", R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", 0, "negative"},
      {"end past the file", R"({"w":{"dtype":"U8","shape":[9223372036854775807],"data_offsets":[0,9223372036854775807]}})",
       16, "past the"},
      {"offsets backwards", R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[4,2]}})", 4, "do not hold"},
      {"rows that overflow", R"({"__metadata__":{"lk.rows.w":"-9223372036854775808,9223372036854775807","lk.shape.w":"[4]"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
       2, "not a row range"},
      {"rows backwards", R"({"__metadata__":{"lk.rows.w":"3,1","lk.shape.w":"[4]"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
       2, "not a row range"},
      {"global shape that overflows", R"({"__metadata__":{"lk.rows.w":"0,2","lk.shape.w":"[4,9223372036854775807]"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
       2, "does not fit 64 bits"},
      {"rows not a number", R"({"__metadata__":{"lk.rows.w":"0,99999999999999999999","lk.shape.w":"[4]"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
       2, "not an integer"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    std::string head = RawHeader(c.json);
    auto h = ParseShardHeader(head, head.size() + c.data_bytes);
    REQUIRE(!h.ok());
    CHECK(h.status().code() == Code::kDataLoss);
    CHECK_MESSAGE(h.status().message().find(c.reason) != std::string::npos, h.status().message());
  }
  // A header length that claims more than the file (or than any sane header) is refused before
  // anything is read.
  std::string huge(8, '\xff');
  CHECK(ParseShardHeader(huge, UINT64_MAX).status().code() == Code::kDataLoss);
  // A zero among huge dims is an empty tensor, not an overflow.
  std::string zero = RawHeader(R"({"w":{"dtype":"F64","shape":[0,9223372036854775807,9223372036854775807],"data_offsets":[0,0]}})");
  CHECK(ParseShardHeader(zero, zero.size()).ok());
}

TEST_CASE("manifest validation: offsets - lengths and chunk counts that overflow are refused") {
  // One file, one U8 tensor; each case breaks one field so that a wrapping sum would pass.
  auto base = [] {
    Manifest m;
    m.chunk_bytes = 16;
    m.files.push_back(ShardFileInfo{"shard-00000-of-00001.safetensors", 0, 4096 + 32, 4096, 0});
    m.tensors.push_back(TensorInfo{"t", DType::kU8, {8, 4}, {SliceInfo{0, RowRange{0, 8}, 4096, 32, {1, 2}}}});
    return m;
  };
  REQUIRE(ValidateManifest(base()).ok());

  Manifest wrap_offset = base();  // offset + length wraps to 24, inside the file
  wrap_offset.tensors[0].slices[0].offset = UINT64_MAX - 7;
  Status st = ValidateManifest(wrap_offset);
  CHECK_MESSAGE(st.message().find("outside the data") != std::string::npos, st.message());

  Manifest wrap_rows = base();  // 2^62 rows of 8 * 4 bytes: rows * row_bytes wraps to 0
  wrap_rows.tensors[0].shape = {int64_t{1} << 62, 8};
  wrap_rows.tensors[0].dtype = DType::kF32;
  wrap_rows.tensors[0].slices[0] = SliceInfo{0, RowRange{0, int64_t{1} << 59}, 4096, 0, {}};
  wrap_rows.partial = true;
  st = ValidateManifest(wrap_rows);
  CHECK_MESSAGE(st.message().find("does not fit 64 bits") != std::string::npos, st.message());

  Manifest wrap_chunks = base();  // (length + chunk - 1) / chunk wraps to 0 checksums
  wrap_chunks.chunk_bytes = (uint64_t{1} << 63) + 1;
  wrap_chunks.files[0].size_bytes = (uint64_t{1} << 63) + 4096;
  wrap_chunks.tensors[0].shape = {int64_t{1} << 62, 2};
  wrap_chunks.tensors[0].slices[0] = SliceInfo{0, RowRange{0, int64_t{1} << 62}, 4096, uint64_t{1} << 63, {}};
  st = ValidateManifest(wrap_chunks);
  CHECK_MESSAGE(st.message().find("0 checksums for 1 chunks") != std::string::npos, st.message());
  CHECK(ChunkCount(UINT64_MAX, 2) == (UINT64_MAX / 2) + 1);

  Manifest negative = base();
  negative.tensors[0].shape = {8, -4};
  CHECK(!ValidateManifest(negative).ok());
  Manifest past = base();  // a slice longer than its file
  past.files[0].size_bytes = 4096 + 16;
  CHECK(!ValidateManifest(past).ok());
}

}  // namespace
}  // namespace lk::ckpt
