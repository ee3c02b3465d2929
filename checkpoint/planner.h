// The restore planner: (manifest, target layout) -> the reads needed, each a whole number of
// checksummed chunks of one shard file, with where every byte lands. It reshards along dim 0:
// a checkpoint written by 4 ranks restores onto 2, 3 or 8 (heterogeneous clusters). The same
// plan drives every source (filesystem or peers), so striping and failover never change what
// is read, only from where.
// Pure: no I/O. Thread-safety: plain values and functions.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/manifest.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

struct TargetLayout {
  uint32_t ranks = 1;
  uint32_t rank = 0;
};

// A chunk inside a read, with its expected checksum; offsets are relative to the read's start.
struct ChunkCheck {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t xxh3 = 0;
};

// Bytes [src_offset, src_offset + length) of a read go to [dst_offset, ...) of target tensor
// `tensor`'s buffer.
struct CopyOp {
  uint64_t src_offset = 0;
  uint32_t tensor = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

struct ReadOp {
  uint32_t file = 0;  // index into Manifest::files
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<ChunkCheck> checks;  // cover [0, length) exactly
  std::vector<CopyOp> copies;
};

struct TargetTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // global
  RowRange rows;
  uint64_t bytes = 0;
};

struct RestorePlan {
  int64_t step = 0;
  TargetLayout layout;
  std::vector<TargetTensor> tensors;  // sorted by name
  std::vector<ReadOp> reads;          // sorted by (file, offset)
  uint64_t read_bytes() const;
  uint64_t dest_bytes() const;
};

struct PlanOptions {
  // Largest single read; reads are whole chunks, so this is rounded down to a chunk multiple
  // (at least one chunk). Large enough for full disk and network speed, small enough to stripe
  // a shard over several sources and to retry cheaply when one of them fails.
  uint64_t read_bytes_max = uint64_t{16} << 20;
  // The rows of tensor `t` this rank restores, when they are not the even split (`even`,
  // TargetRows): e.g. a per-rank tensor that one rank takes whole ({0, RowsOf(t.shape)}) and
  // every other rank leaves out (nullopt: the tensor is in neither the plan nor the restored
  // state). Rows outside the tensor fail the plan. Unset: `even` for every tensor.
  std::function<std::optional<RowRange>(const TensorInfo& t, RowRange even)> target_rows;
};

// Fails when the manifest is partial or inconsistent, or the layout is impossible.
Result<RestorePlan> PlanRestore(const Manifest& m, TargetLayout layout, PlanOptions options = {});

}  // namespace lk::ckpt
