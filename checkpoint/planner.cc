#include "checkpoint/planner.h"

#include <algorithm>

#include "checkpoint/format.h"

namespace lk::ckpt {
namespace {

// Adds the reads for target rows `want` (already intersected with the slice) of slice `s`.
void PlanSlice(const Manifest& m, const SliceInfo& s, uint32_t tensor, RowRange want,
               RowRange target, uint64_t row_bytes, uint64_t chunks_per_read,
               std::vector<ReadOp>* reads) {
  const uint64_t c = m.chunk_bytes;
  uint64_t need_begin = static_cast<uint64_t>(want.begin - s.rows.begin) * row_bytes;
  uint64_t need_end = static_cast<uint64_t>(want.end - s.rows.begin) * row_bytes;
  if (need_end <= need_begin) return;
  uint64_t dst_base = static_cast<uint64_t>(want.begin - target.begin) * row_bytes;
  uint64_t k0 = need_begin / c;
  uint64_t k1 = ChunkCount(need_end, c);
  for (uint64_t ka = k0; ka < k1; ka += chunks_per_read) {
    uint64_t kb = std::min(k1, ka + chunks_per_read);
    uint64_t ga = ka * c;
    uint64_t gb = std::min(kb * c, s.length);
    ReadOp r;
    r.file = s.file;
    r.offset = s.offset + ga;
    r.length = gb - ga;
    for (uint64_t k = ka; k < kb; ++k) {
      r.checks.push_back(ChunkCheck{k * c - ga, std::min(c, s.length - k * c), s.chunk_xxh3[k]});
    }
    uint64_t from = std::max(need_begin, ga);
    uint64_t to = std::min(need_end, gb);
    r.copies.push_back(CopyOp{from - ga, tensor, dst_base + (from - need_begin), to - from});
    reads->push_back(std::move(r));
  }
}

// Joins reads that are back to back in one file, so many small tensors cost few requests.
std::vector<ReadOp> Coalesce(std::vector<ReadOp> reads, uint64_t read_bytes_max) {
  std::sort(reads.begin(), reads.end(), [](const ReadOp& a, const ReadOp& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  std::vector<ReadOp> out;
  for (auto& r : reads) {
    if (!out.empty()) {
      ReadOp& p = out.back();
      if (p.file == r.file && p.offset + p.length == r.offset &&
          p.length + r.length <= read_bytes_max) {
        for (auto c : r.checks) {
          c.offset += p.length;
          p.checks.push_back(c);
        }
        for (auto c : r.copies) {
          c.src_offset += p.length;
          p.copies.push_back(c);
        }
        p.length += r.length;
        continue;
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

uint64_t RestorePlan::read_bytes() const {
  uint64_t n = 0;
  for (const auto& r : reads) n += r.length;
  return n;
}

uint64_t RestorePlan::dest_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.bytes;
  return n;
}

Result<RestorePlan> PlanRestore(const Manifest& m, TargetLayout layout, PlanOptions options) {
  if (layout.ranks == 0 || layout.rank >= layout.ranks) {
    return InvalidArgument("target rank {} of {} ranks", layout.rank, layout.ranks);
  }
  if (m.partial) return InvalidArgument("the manifest of step {} lists only some shards", m.step);
  LK_RETURN_IF_ERROR(ValidateManifest(m).WithContext("manifest"));
  uint64_t chunks_per_read = std::max<uint64_t>(1, options.read_bytes_max / m.chunk_bytes);
  RestorePlan plan;
  plan.step = m.step;
  plan.layout = layout;
  std::vector<ReadOp> reads;
  for (const auto& t : m.tensors) {
    auto index = static_cast<uint32_t>(plan.tensors.size());
    RowRange target = TargetRows(t.shape, layout.ranks, layout.rank);
    if (options.target_rows) {
      std::optional<RowRange> chosen = options.target_rows(t, target);
      if (!chosen) continue;
      if (chosen->begin < 0 || chosen->end < chosen->begin || chosen->end > RowsOf(t.shape)) {
        return InvalidArgument("tensor '{}': target rows [{},{}) outside its {} rows", t.name,
                               chosen->begin, chosen->end, RowsOf(t.shape));
      }
      target = *chosen;
    }
    uint64_t row_bytes = RowBytes(t.dtype, t.shape);
    plan.tensors.push_back(TargetTensor{t.name, t.dtype, t.shape, target,
                                        static_cast<uint64_t>(target.rows()) * row_bytes});
    for (const auto& s : t.slices) {
      RowRange want{std::max(s.rows.begin, target.begin), std::min(s.rows.end, target.end)};
      if (want.empty()) continue;
      PlanSlice(m, s, index, want, target, row_bytes, chunks_per_read, &reads);
    }
  }
  plan.reads = Coalesce(std::move(reads), chunks_per_read * m.chunk_bytes);
  return plan;
}

}  // namespace lk::ckpt
