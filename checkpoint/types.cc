#include "checkpoint/types.h"

#include <sys/mman.h>

#include <algorithm>

#include <lightkeeper/check.h>

namespace lk::ckpt {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  uint32_t bytes;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8},  {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},  {DType::kI8, "I8", 1},   {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};

}  // namespace

std::string_view DTypeName(DType dtype) { return kDTypes[static_cast<int>(dtype)].name; }
uint32_t DTypeBytes(DType dtype) { return kDTypes[static_cast<int>(dtype)].bytes; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

namespace {
constexpr uint64_t kHugePageBytes = uint64_t{2} << 20;
}  // namespace

Buffer::Buffer(uint64_t size, bool huge_pages) : size_(size) {
  if (huge_pages && size >= kHugePageBytes) {
    // Rounded to 4 KiB pages only: the kernel backs each whole 2 MiB of the mapping with a huge
    // page and the rest with small ones, so no buffer grows by more than a small page.
    uint64_t len = (size + 4095) / 4096 * 4096;
    // One huge page more than needed, then the unaligned head and tail are given back, so the
    // buffer starts on a huge page boundary.
    void* p = ::mmap(nullptr, len + kHugePageBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      auto base = reinterpret_cast<uintptr_t>(p);
      uintptr_t aligned = (base + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
      if (aligned > base) ::munmap(p, aligned - base);
      uint64_t tail = base + len + kHugePageBytes - (aligned + len);
      if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + len), tail);
      // Only a hint: without huge pages (disabled, or none free) the buffer works as before.
      ::madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);
      data_ = std::unique_ptr<uint8_t[], BufferFree>(reinterpret_cast<uint8_t*>(aligned),
                                                     BufferFree{len});
      return;
    }
  }
  data_ = std::unique_ptr<uint8_t[], BufferFree>(new uint8_t[size], BufferFree{0});
}

Buffer Buffer::Borrow(uint8_t* data, uint64_t size) {
  Buffer b;
  b.data_ = std::unique_ptr<uint8_t[], BufferFree>(data, BufferFree{0, /*borrowed=*/true});
  b.size_ = size;
  return b;
}

void BufferFree::operator()(uint8_t* p) const {
  if (borrowed) return;
  if (mapped_bytes > 0) {
    ::munmap(p, mapped_bytes);
  } else {
    delete[] p;
  }
}

ConstBytes ConstBytes::Copy(const void* data, uint64_t size) {
  Buffer b(size);
  if (size > 0) std::memcpy(b.data(), data, size);
  return Own(std::move(b));
}

ConstBytes ConstBytes::Own(Buffer buffer) {
  auto p = std::make_shared<const Buffer>(std::move(buffer));
  return ConstBytes{p->data(), p->size(), p};
}

int64_t RowsOf(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

uint64_t RowBytes(DType dtype, const std::vector<int64_t>& shape) {
  uint64_t n = DTypeBytes(dtype);
  for (size_t i = 1; i < shape.size(); ++i) n *= static_cast<uint64_t>(shape[i]);
  return n;
}

std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

std::optional<uint64_t> CheckedBytes(DType dtype, const int64_t* dims, size_t count) {
  // A zero dimension empties the tensor whatever the others say, so it is looked for first:
  // [0, 2^40, 2^40] holds no bytes and is not an overflow.
  for (size_t i = 0; i < count; ++i) {
    if (dims[i] < 0) return std::nullopt;
    if (dims[i] == 0) return 0;
  }
  std::optional<uint64_t> n = DTypeBytes(dtype);
  for (size_t i = 0; i < count && n; ++i) n = CheckedMul(*n, static_cast<uint64_t>(dims[i]));
  return n;
}

RowRange EvenRows(int64_t rows, uint32_t ranks, uint32_t rank) {
  LK_CHECK(ranks > 0 && rank < ranks) << "rank " << rank << " of " << ranks;
  int64_t base = rows / ranks;
  int64_t extra = rows % ranks;
  int64_t r = rank;
  int64_t begin = r * base + std::min<int64_t>(r, extra);
  return RowRange{begin, begin + base + (r < extra ? 1 : 0)};
}

RowRange WriterRows(const std::vector<int64_t>& shape, uint32_t ranks, uint32_t rank) {
  if (shape.empty()) return rank == 0 ? RowRange{0, 1} : RowRange{0, 0};
  return EvenRows(shape[0], ranks, rank);
}

RowRange TargetRows(const std::vector<int64_t>& shape, uint32_t ranks, uint32_t rank) {
  if (shape.empty()) return RowRange{0, 1};
  return EvenRows(shape[0], ranks, rank);
}

uint64_t Snapshot::bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.data.size;
  return n;
}

void Snapshot::Add(std::string name, DType dtype, std::vector<int64_t> shape, ConstBytes data) {
  RowRange rows = WriterRows(shape, ranks, rank);
  uint64_t row_bytes = RowBytes(dtype, shape);
  // A caller may pass the whole tensor; keep only this rank's rows, still without a copy.
  if (data.size == static_cast<uint64_t>(RowsOf(shape)) * row_bytes && rows.rows() != RowsOf(shape)) {
    data.data += static_cast<uint64_t>(rows.begin) * row_bytes;
    data.size = static_cast<uint64_t>(rows.rows()) * row_bytes;
  }
  if (rows.empty()) return;
  tensors.push_back(SnapshotTensor{std::move(name), dtype, std::move(shape), rows, std::move(data)});
}

const RestoredTensor* RestoredState::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const RestoredTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

uint64_t RestoredState::bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.data.size();
  return n;
}

}  // namespace lk::ckpt
