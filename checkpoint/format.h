// The shard file format: safetensors (an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and data_offsets, then the tensor bytes with no holes), so
// that standard tools read a shard. Lightkeeper adds, in the header's __metadata__, the global
// row range of each slice ("lk.rows.NAME" = "BEGIN,END") and the step and rank, and pads the
// header with spaces so tensor data starts on a 4 KiB boundary (large aligned reads).
// Also the XXH3-64 chunk checksums the manifest carries.
// Pure: no I/O. Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/types.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

inline constexpr uint64_t kHeaderAlignBytes = 4096;
// A header longer than this is not a shard we wrote (and not a sane safetensors file).
inline constexpr uint64_t kHeaderBytesMax = uint64_t{100} << 20;

struct ShardEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // the local (slice) shape, as safetensors readers expect
  std::vector<int64_t> global_shape;
  RowRange rows;               // global rows along dim 0 held here
  uint64_t begin = 0;          // data_offsets, relative to the start of the data
  uint64_t end = 0;
};

struct ShardHeader {
  std::map<std::string, std::string> metadata;
  std::vector<ShardEntry> entries;  // in data order
  uint64_t header_bytes = 0;        // where the data starts in the file
  uint64_t data_bytes() const { return entries.empty() ? 0 : entries.back().end; }
};

// Encodes the 8-byte length, the JSON and the padding. Entries must be in data order with no
// holes; sets header->header_bytes.
std::string EncodeShardHeader(ShardHeader* header);
// Reads the JSON length from the first 8 bytes of a shard.
Result<uint64_t> ParseHeaderLength(std::string_view first8, uint64_t file_size);
// Parses the prefix of a shard (the 8 bytes and the JSON) and checks that the data offsets cover
// [0, file_size - header_bytes) without holes or overlap.
Result<ShardHeader> ParseShardHeader(std::string_view prefix, uint64_t file_size);

uint64_t Xxh3(const void* data, uint64_t size);
// XXH3-64 fed in pieces; Digest equals Xxh3 over the pieces' concatenation. Lets a reader check a
// chunk piece by piece as its bytes arrive, while each piece is still in cache.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void Reset();
  void Update(const void* data, uint64_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t, kept out of this header
};
// Checksums of consecutive `chunk_bytes` chunks of [data, data + size); the last may be short.
std::vector<uint64_t> ChunkHashes(const uint8_t* data, uint64_t size, uint64_t chunk_bytes);
inline uint64_t ChunkCount(uint64_t size, uint64_t chunk_bytes) {
  // Not (size + chunk_bytes - 1) / chunk_bytes: that wraps for sizes a manifest may claim.
  return size / chunk_bytes + (size % chunk_bytes != 0 ? 1 : 0);
}

// "shard-00003-of-00004.safetensors"
std::string ShardFileName(uint32_t rank, uint32_t ranks);
// "step-000000000042"
std::string StepDirName(int64_t step);
// The step of a committed checkpoint directory name, or -1.
int64_t ParseStepDirName(std::string_view name);

}  // namespace lk::ckpt
