// Plain values shared by the checkpoint core and shell: dtypes, byte buffers, row ranges, the
// snapshot a trainer hands to the writer and the state a restore hands back. No torch types: a
// trainer copies its tensors into (or lends) plain byte buffers.
// Thread-safety: plain values. ConstBytes may be shared across threads (its bytes are read-only).
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lk::ckpt {

enum class DType : uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// The safetensors name ("F32", "BF16", ...).
std::string_view DTypeName(DType dtype);
std::optional<DType> ParseDType(std::string_view name);
uint32_t DTypeBytes(DType dtype);

// Owned bytes that are not zero-filled on allocation (a 2 GiB restore should not memset first).
// With `huge_pages`, a buffer of 2 MiB or more is mapped on a 2 MiB boundary and asked for
// transparent huge pages: the first write to a fresh 4 KiB page costs a page fault, and filling
// restored tensors from the network spent about a quarter of its CPU in those faults. Restore
// asks for it; it is off by default because saves from huge-page snapshots measured slower.
struct BufferFree {
  uint64_t mapped_bytes = 0;  // 0: allocated with new[]
  bool borrowed = false;      // the caller's memory: nothing to free
  void operator()(uint8_t* p) const;
};

class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(uint64_t size, bool huge_pages = false);
  // A view of memory the caller owns and keeps alive for as long as the Buffer (a restore into
  // a trainer's existing tensors).
  static Buffer Borrow(uint8_t* data, uint64_t size);
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  uint64_t size() const { return size_; }

 private:
  std::unique_ptr<uint8_t[], BufferFree> data_;
  uint64_t size_ = 0;
};

// Read-only bytes that keep their owner alive, so a snapshot can lend memory the trainer owns
// (pinned host buffers, a vector) without a copy.
struct ConstBytes {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  std::shared_ptr<const void> owner;

  static ConstBytes Copy(const void* data, uint64_t size);
  static ConstBytes Own(Buffer buffer);
  template <typename T>
  static ConstBytes Own(std::vector<T> v) {
    auto p = std::make_shared<const std::vector<T>>(std::move(v));
    return ConstBytes{reinterpret_cast<const uint8_t*>(p->data()), p->size() * sizeof(T), p};
  }
};

// Rows [begin, end) along dim 0.
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t rows() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool operator==(const RowRange&) const = default;
};

// Rows along dim 0 of a tensor of `shape`; a 0-d tensor counts as one row.
int64_t RowsOf(const std::vector<int64_t>& shape);
// Bytes of one row: the product of shape[1:] times the dtype size.
uint64_t RowBytes(DType dtype, const std::vector<int64_t>& shape);
// The dtype size times the product of `dims` (a 0 among them makes it 0), or nullopt when a
// dimension is negative or the product does not fit 64 bits. Parsers of shapes that came from
// a file or a peer use this before any product: RowBytes would wrap.
std::optional<uint64_t> CheckedBytes(DType dtype, const int64_t* dims, size_t count);
// a * b, or nullopt when it does not fit 64 bits.
std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b);
// The even split of `rows` over `ranks`: the first rows % ranks ranks get one more row.
RowRange EvenRows(int64_t rows, uint32_t ranks, uint32_t rank);
// Rows a writer rank stores by default: the even split; a 0-d tensor is stored by rank 0 only.
RowRange WriterRows(const std::vector<int64_t>& shape, uint32_t ranks, uint32_t rank);
// Rows a restoring rank receives: the even split; a 0-d tensor is replicated to every rank.
RowRange TargetRows(const std::vector<int64_t>& shape, uint32_t ranks, uint32_t rank);

// One tensor slice handed to the writer: rows [rows.begin, rows.end) of a tensor of global
// shape `shape`, row-major, data.size == rows.rows() * RowBytes(dtype, shape).
struct SnapshotTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  RowRange rows;
  ConstBytes data;
};

// What one rank saves for one step.
struct Snapshot {
  int64_t step = 0;
  uint32_t rank = 0;
  uint32_t ranks = 1;
  // Distinguishes save attempts of the same step (e.g. the quorum id): every rank of one save
  // must pass the same value, and a retry after a crash must pass a new one, so that shards of
  // a crashed attempt are never committed together with shards of the retry.
  std::string attempt = "0";
  std::vector<SnapshotTensor> tensors;
  std::map<std::string, std::string> metadata;

  uint64_t bytes() const;
  // Adds the slice this rank holds by default (WriterRows), copying nothing.
  void Add(std::string name, DType dtype, std::vector<int64_t> shape, ConstBytes full_or_slice);
};

struct RestoredTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // global
  RowRange rows;               // the rows this rank holds
  Buffer data;
};

struct RestoredState {
  int64_t step = 0;
  uint32_t ranks = 1;  // the target layout
  uint32_t rank = 0;
  std::map<std::string, std::string> metadata;
  std::vector<RestoredTensor> tensors;  // sorted by name
  const RestoredTensor* Find(std::string_view name) const;
  uint64_t bytes() const;
};

}  // namespace lk::ckpt
