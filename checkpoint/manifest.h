// The manifest as plain structs (the protobuf form lives at the shell edge, manifest_proto.h):
// every tensor's global shape and dtype, which byte range of which shard file holds which rows,
// and a checksum per chunk. Validation and merging are pure so that the planner, the writer's
// commit and `checkpoint verify` share one definition of "a consistent checkpoint".
// Thread-safety: plain values and functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/types.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint64_t kDefaultChunkBytes = uint64_t{4} << 20;

struct SliceInfo {
  uint32_t file = 0;  // index into Manifest::files
  RowRange rows;
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;
  std::vector<uint64_t> chunk_xxh3;  // chunk i: [offset + i * chunk_bytes, ...) clipped
  bool operator==(const SliceInfo&) const = default;
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;     // global
  std::vector<SliceInfo> slices;  // sorted by rows.begin
  bool operator==(const TensorInfo&) const = default;
};

struct ShardFileInfo {
  std::string name;
  uint32_t rank = 0;
  uint64_t size_bytes = 0;
  uint64_t header_bytes = 0;
  uint64_t header_xxh3 = 0;
  bool operator==(const ShardFileInfo&) const = default;
};

struct Manifest {
  uint32_t format_version = kFormatVersion;
  int64_t step = 0;
  uint32_t ranks = 1;
  int64_t created_unix_ms = 0;
  uint64_t chunk_bytes = kDefaultChunkBytes;
  std::vector<ShardFileInfo> files;
  std::vector<TensorInfo> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
  bool partial = false;

  uint64_t data_bytes() const;
  const TensorInfo* Find(std::string_view name) const;
  bool operator==(const Manifest&) const = default;
};

// Checks the manifest against itself: dtypes and shapes sane, slices inside their files and not
// overlapping, lengths equal to rows times row bytes, the right number of chunk checksums, and
// unless `partial`, every tensor's slices tiling all its rows. The reason names the tensor/file.
Status ValidateManifest(const Manifest& m);

// Joins manifests of one step that each list some ranks' files (receipts, or live state served
// by several nodes) into one. The same file named twice must agree bytewise (size and checksums);
// tensors must agree on dtype and shape. The result is marked complete when its slices tile every
// tensor, and validated.
Result<Manifest> MergeManifests(const std::vector<Manifest>& parts);

// Sorts tensors by name and slices by row, for a canonical form.
void Canonicalize(Manifest* m);

}  // namespace lk::ckpt
