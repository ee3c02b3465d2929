// The safetensors shard header parser. Input: 8 bytes of file size (little endian), then the
// file's first bytes (the 8-byte header length and the JSON). Invariants: a parse either fails
// with kDataLoss or gives tensors that tile the data exactly, inside the file, each holding the
// bytes its dtype and shape need; and encoding what was read (EncodeShardHeader) parses back to
// the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "checkpoint/format.h"
#include <lightkeeper/check.h>

namespace {

using lk::ckpt::ShardEntry;
using lk::ckpt::ShardHeader;

bool SameEntry(const ShardEntry& a, const ShardEntry& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
         a.global_shape == b.global_shape && a.rows == b.rows && a.begin == b.begin &&
         a.end == b.end;
}

// Metadata other than the row and shape keys of the tensors, which the encoder writes itself.
std::map<std::string, std::string> OwnMetadata(const ShardHeader& h) {
  auto m = h.metadata;
  for (const auto& e : h.entries) {
    m.erase("lk.rows." + e.name);
    m.erase("lk.shape." + e.name);
  }
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t file_size = 0;
  for (int i = 0; i < 8; ++i) file_size |= uint64_t{data[i]} << (8 * i);
  std::string_view prefix(reinterpret_cast<const char*>(data + 8), size - 8);
  auto h = lk::ckpt::ParseShardHeader(prefix, file_size);
  if (!h.ok()) {
    LK_CHECK(h.status().code() == lk::Code::kDataLoss) << h.status().ToString();
    return 0;
  }
  LK_CHECK(h->header_bytes >= 8 && h->header_bytes <= file_size) << h->header_bytes;
  uint64_t at = 0;
  for (const auto& e : h->entries) {
    LK_CHECK(e.begin == at && e.end >= e.begin) << e.name;
    auto bytes = lk::ckpt::CheckedBytes(e.dtype, e.shape.data(), e.shape.size());
    LK_CHECK(bytes && *bytes == e.end - e.begin) << e.name << ": bytes disagree with the shape";
    LK_CHECK(e.rows.begin >= 0 && e.rows.begin <= e.rows.end) << e.name;
    at = e.end;
  }
  LK_CHECK(h->header_bytes + at == file_size) << "the data does not end the file";

  ShardHeader copy = *h;
  std::string head = lk::ckpt::EncodeShardHeader(&copy);
  auto back = lk::ckpt::ParseShardHeader(head, copy.header_bytes + copy.data_bytes());
  LK_CHECK(back.ok()) << "an encoded header does not parse: " << back.status().ToString();
  LK_CHECK(back->entries.size() == h->entries.size()) << "tensors lost in a round trip";
  for (size_t i = 0; i < h->entries.size(); ++i) {
    LK_CHECK(SameEntry(back->entries[i], h->entries[i]))
        << "tensor '" << h->entries[i].name << "' changed in a round trip";
  }
  LK_CHECK(OwnMetadata(*back) == OwnMetadata(*h)) << "metadata changed in a round trip";
  return 0;
}
