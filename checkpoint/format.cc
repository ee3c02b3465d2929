#include "checkpoint/format.h"

#include <xxhash.h>
#if defined(__x86_64__)
// libxxhash's dispatch entry points pick SSE2, AVX2 or AVX-512 at run time: the plain ones are
// built for baseline x86-64, and checksums took about a tenth of a peer recovery's CPU.
// Including this header makes the XXH3_64bits* calls below use them; the hashes are the same.
#include <xxh_x86dispatch.h>
#endif

#include <boost/json.hpp>
#include <charconv>

#include <lightkeeper/check.h>

namespace lk::ckpt {
namespace {

namespace json = boost::json;

std::string JsonString(std::string_view s) { return json::serialize(json::string_view(s.data(), s.size())); }

std::string ShapeJson(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += fmt::format("{}{}", i ? "," : "", shape[i]);
  return out + "]";
}

Result<int64_t> ParseInt(std::string_view s) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return InvalidArgument("'{}' is not an integer", s);
  return v;
}

Result<std::vector<int64_t>> ShapeFromJson(const json::value* v) {
  if (v == nullptr || !v->is_array()) return InvalidArgument("shape is not an array");
  std::vector<int64_t> shape;
  for (const auto& d : v->as_array()) {
    if (!d.is_int64() && !d.is_uint64()) return InvalidArgument("shape holds a non-integer");
    if (d.is_uint64() && d.as_uint64() > static_cast<uint64_t>(INT64_MAX)) {
      return InvalidArgument("dimension {} is too large", d.as_uint64());
    }
    int64_t x = d.is_int64() ? d.as_int64() : static_cast<int64_t>(d.as_uint64());
    if (x < 0) return InvalidArgument("negative dimension {}", x);
    shape.push_back(x);
  }
  return shape;
}

Result<uint64_t> OffsetFromJson(const json::value& v) {
  if (v.is_uint64()) return v.as_uint64();
  if (v.is_int64() && v.as_int64() >= 0) return static_cast<uint64_t>(v.as_int64());
  return InvalidArgument("data_offsets holds a non-integer");
}

Status ParseEntry(const std::string& name, const json::value& v, ShardEntry* e) {
  if (!v.is_object()) return InvalidArgument("tensor '{}' is not an object", name);
  const auto& o = v.as_object();
  e->name = name;
  const json::value* dt = o.if_contains("dtype");
  if (dt == nullptr || !dt->is_string()) return InvalidArgument("tensor '{}' has no dtype", name);
  auto dtype = ParseDType(std::string_view(dt->as_string()));
  if (!dtype) return InvalidArgument("tensor '{}' has unknown dtype {}", name, std::string_view(dt->as_string()));
  e->dtype = *dtype;
  LK_ASSIGN_OR_RETURN(e->shape, ShapeFromJson(o.if_contains("shape")));
  const json::value* off = o.if_contains("data_offsets");
  if (off == nullptr || !off->is_array() || off->as_array().size() != 2) {
    return InvalidArgument("tensor '{}' has no data_offsets pair", name);
  }
  LK_ASSIGN_OR_RETURN(e->begin, OffsetFromJson(off->as_array()[0]));
  LK_ASSIGN_OR_RETURN(e->end, OffsetFromJson(off->as_array()[1]));
  std::optional<uint64_t> bytes = CheckedBytes(e->dtype, e->shape.data(), e->shape.size());
  if (!bytes) return InvalidArgument("tensor '{}': shape {} does not fit 64 bits of bytes", name, ShapeJson(e->shape));
  uint64_t want = *bytes;
  if (e->end < e->begin || e->end - e->begin != want) {
    return InvalidArgument("tensor '{}': data_offsets [{},{}) do not hold {} bytes", name, e->begin,
                           e->end, want);
  }
  return Status::Ok();
}

// Our metadata: "lk.rows.NAME" = "BEGIN,END" and "lk.shape.NAME" = "[d0,d1,...]" (the global
// shape). Shards written by other tools have neither: the slice is then the whole tensor.
Status ApplyRowMetadata(ShardHeader* h) {
  for (auto& e : h->entries) {
    e.global_shape = e.shape;
    e.rows = RowRange{0, RowsOf(e.shape)};
    auto rows = h->metadata.find("lk.rows." + e.name);
    auto shape = h->metadata.find("lk.shape." + e.name);
    if (rows == h->metadata.end() || shape == h->metadata.end()) continue;
    auto comma = rows->second.find(',');
    if (comma == std::string::npos) return InvalidArgument("lk.rows.{} is malformed", e.name);
    LK_ASSIGN_OR_RETURN(e.rows.begin, ParseInt(std::string_view(rows->second).substr(0, comma)));
    LK_ASSIGN_OR_RETURN(e.rows.end, ParseInt(std::string_view(rows->second).substr(comma + 1)));
    // Checked before rows() is taken: END - BEGIN of two arbitrary int64 can overflow.
    if (e.rows.begin < 0 || e.rows.end < e.rows.begin) {
      return InvalidArgument("lk.rows.{} = '{}' is not a row range", e.name, rows->second);
    }
    boost::system::error_code ec;
    json::value sv = json::parse(shape->second, ec);
    if (ec) return InvalidArgument("lk.shape.{} is malformed", e.name);
    LK_ASSIGN_OR_RETURN(e.global_shape, ShapeFromJson(&sv));
    if (!CheckedBytes(e.dtype, e.global_shape.data(), e.global_shape.size())) {
      return InvalidArgument("lk.shape.{} does not fit 64 bits of bytes", e.name);
    }
    bool local_ok = e.shape.size() == e.global_shape.size() &&
                    (e.shape.empty() ? e.rows == RowRange{0, 1} : e.shape[0] == e.rows.rows()) &&
                    e.rows.begin >= 0 && e.rows.end <= RowsOf(e.global_shape);
    for (size_t i = 1; local_ok && i < e.shape.size(); ++i) local_ok = e.shape[i] == e.global_shape[i];
    if (!local_ok) return InvalidArgument("tensor '{}': rows and shapes disagree", e.name);
  }
  return Status::Ok();
}

}  // namespace

std::string EncodeShardHeader(ShardHeader* header) {
  std::string j = "{\"__metadata__\":{";
  auto meta = header->metadata;
  for (const auto& e : header->entries) {
    meta["lk.rows." + e.name] = fmt::format("{},{}", e.rows.begin, e.rows.end);
    meta["lk.shape." + e.name] = ShapeJson(e.global_shape);
  }
  bool first = true;
  for (const auto& [k, v] : meta) {
    j += fmt::format("{}{}:{}", first ? "" : ",", JsonString(k), JsonString(v));
    first = false;
  }
  j += "}";
  for (const auto& e : header->entries) {
    j += fmt::format(",{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                     JsonString(e.name), DTypeName(e.dtype), ShapeJson(e.shape), e.begin, e.end);
  }
  j += "}";
  // Pad with spaces (valid JSON whitespace, allowed by the safetensors spec) so data is aligned.
  uint64_t total = 8 + j.size();
  total = (total + kHeaderAlignBytes - 1) / kHeaderAlignBytes * kHeaderAlignBytes;
  j.append(total - 8 - j.size(), ' ');
  std::string out(8, '\0');
  uint64_t n = j.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  header->header_bytes = total;
  return out + j;
}

Result<uint64_t> ParseHeaderLength(std::string_view first8, uint64_t file_size) {
  if (first8.size() < 8 || file_size < 8) return Error(Code::kDataLoss, "shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(first8[i])} << (8 * i);
  if (n > kHeaderBytesMax || n > file_size - 8) {
    return Error(Code::kDataLoss, "header length {} does not fit the {}-byte file", n, file_size);
  }
  return n;
}

Result<ShardHeader> ParseShardHeader(std::string_view prefix, uint64_t file_size) {
  LK_ASSIGN_OR_RETURN(uint64_t n, ParseHeaderLength(prefix, file_size));
  if (prefix.size() < 8 + n) return Error(Code::kDataLoss, "header cut short");
  boost::system::error_code ec;
  json::value v = json::parse(json::string_view(prefix.data() + 8, n), ec);
  if (ec || !v.is_object()) return Error(Code::kDataLoss, "header is not a JSON object");
  ShardHeader h;
  h.header_bytes = 8 + n;
  for (const auto& kv : v.as_object()) {
    std::string key(kv.key());
    if (key == "__metadata__") {
      if (!kv.value().is_object()) return Error(Code::kDataLoss, "__metadata__ is not an object");
      for (const auto& m : kv.value().as_object()) {
        if (!m.value().is_string()) return Error(Code::kDataLoss, "metadata value is not a string");
        h.metadata[std::string(m.key())] = std::string(m.value().as_string());
      }
      continue;
    }
    ShardEntry e;
    Status st = ParseEntry(key, kv.value(), &e);
    if (!st.ok()) return Status(Code::kDataLoss, st.message());
    h.entries.push_back(std::move(e));
  }
  std::sort(h.entries.begin(), h.entries.end(),
            [](const ShardEntry& a, const ShardEntry& b) { return a.begin < b.begin; });
  uint64_t at = 0;
  for (const auto& e : h.entries) {
    if (e.begin != at) return Error(Code::kDataLoss, "tensor '{}' leaves a hole or overlaps", e.name);
    // Also keeps header_bytes + at below from wrapping (header_bytes <= file_size here).
    if (e.end > file_size - h.header_bytes) {
      return Error(Code::kDataLoss, "tensor '{}' ends at data offset {}, past the {}-byte file",
                   e.name, e.end, file_size);
    }
    at = e.end;
  }
  if (h.header_bytes + at != file_size) {
    return Error(Code::kDataLoss, "header describes {} bytes but the file has {}",
                 h.header_bytes + at, file_size);
  }
  Status st = ApplyRowMetadata(&h);
  if (!st.ok()) return Status(Code::kDataLoss, st.message());
  return h;
}

uint64_t Xxh3(const void* data, uint64_t size) { return XXH3_64bits(data, size); }

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  LK_CHECK(state_ != nullptr) << "XXH3_createState failed";
  Reset();
}
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Update(const void* data, uint64_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
uint64_t Xxh3Stream::Digest() const {
  return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_));
}

std::vector<uint64_t> ChunkHashes(const uint8_t* data, uint64_t size, uint64_t chunk_bytes) {
  std::vector<uint64_t> out;
  out.reserve(ChunkCount(size, chunk_bytes));
  for (uint64_t at = 0; at < size; at += chunk_bytes) {
    out.push_back(Xxh3(data + at, std::min(chunk_bytes, size - at)));
  }
  return out;
}

std::string ShardFileName(uint32_t rank, uint32_t ranks) {
  return fmt::format("shard-{:05}-of-{:05}.safetensors", rank, ranks);
}

std::string StepDirName(int64_t step) { return fmt::format("step-{:012}", step); }

int64_t ParseStepDirName(std::string_view name) {
  if (name.size() != 17 || name.substr(0, 5) != "step-") return -1;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(name.data() + 5, name.data() + name.size(), v);
  if (ec != std::errc() || p != name.data() + name.size()) return -1;
  return v;
}

}  // namespace lk::ckpt
