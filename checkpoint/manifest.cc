#include "checkpoint/manifest.h"

#include <algorithm>

#include "checkpoint/format.h"

namespace lk::ckpt {
namespace {

Status ValidateTensor(const Manifest& m, const TensorInfo& t, bool partial,
                      std::vector<std::vector<std::pair<uint64_t, uint64_t>>>* extents) {
  for (int64_t d : t.shape) {
    if (d < 0) return InvalidArgument("tensor '{}' has a negative dimension", t.name);
  }
  // The whole tensor's bytes must fit 64 bits; then so do a row's and every slice's, and the
  // products below cannot wrap.
  if (!CheckedBytes(t.dtype, t.shape.data(), t.shape.size())) {
    return InvalidArgument("tensor '{}': its shape does not fit 64 bits of bytes", t.name);
  }
  uint64_t row_bytes = RowBytes(t.dtype, t.shape);
  int64_t rows = RowsOf(t.shape);
  int64_t at = 0;
  for (const auto& s : t.slices) {
    if (s.file >= m.files.size()) return InvalidArgument("tensor '{}' names file #{}", t.name, s.file);
    const auto& f = m.files[s.file];
    if (s.rows.begin < at || s.rows.end <= s.rows.begin || s.rows.end > rows) {
      return InvalidArgument("tensor '{}': slice rows [{},{}) overlap or leave the tensor", t.name,
                             s.rows.begin, s.rows.end);
    }
    if (!partial && s.rows.begin != at) {
      return InvalidArgument("tensor '{}': rows [{},{}) are in no shard", t.name, at, s.rows.begin);
    }
    at = s.rows.end;
    std::optional<uint64_t> slice_bytes = CheckedMul(static_cast<uint64_t>(s.rows.rows()), row_bytes);
    if (!slice_bytes || s.length != *slice_bytes) {
      return InvalidArgument("tensor '{}' in {}: {} bytes for {} rows of {} bytes", t.name, f.name,
                             s.length, s.rows.rows(), row_bytes);
    }
    // Written so that nothing wraps: offset + length may not fit 64 bits.
    if (s.offset < f.header_bytes || s.length > f.size_bytes || s.offset > f.size_bytes - s.length) {
      return InvalidArgument("tensor '{}': {} bytes at {} lie outside the data of {}", t.name,
                             s.length, s.offset, f.name);
    }
    if (s.chunk_xxh3.size() != ChunkCount(s.length, m.chunk_bytes)) {
      return InvalidArgument("tensor '{}' in {}: {} checksums for {} chunks", t.name, f.name,
                             s.chunk_xxh3.size(), ChunkCount(s.length, m.chunk_bytes));
    }
    (*extents)[s.file].emplace_back(s.offset, s.offset + s.length);
  }
  if (!partial && at != rows) {
    return InvalidArgument("tensor '{}': rows [{},{}) are in no shard", t.name, at, rows);
  }
  return Status::Ok();
}

}  // namespace

uint64_t Manifest::data_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) {
    for (const auto& s : t.slices) n += s.length;
  }
  return n;
}

const TensorInfo* Manifest::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

void Canonicalize(Manifest* m) {
  std::sort(m->tensors.begin(), m->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  for (auto& t : m->tensors) {
    std::sort(t.slices.begin(), t.slices.end(),
              [](const SliceInfo& a, const SliceInfo& b) { return a.rows.begin < b.rows.begin; });
  }
}

Status ValidateManifest(const Manifest& m) {
  if (m.format_version != kFormatVersion) {
    return InvalidArgument("format version {} (this build reads {})", m.format_version, kFormatVersion);
  }
  if (m.ranks == 0) return InvalidArgument("zero writer ranks");
  if (m.chunk_bytes == 0) return InvalidArgument("zero chunk size");
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name[0] == '.') {
      return InvalidArgument("file name '{}' is not a plain name", f.name);
    }
    if (f.header_bytes < 8 || f.header_bytes > f.size_bytes) {
      return InvalidArgument("{}: header of {} bytes in a {}-byte file", f.name, f.header_bytes,
                             f.size_bytes);
    }
    for (size_t j = 0; j < i; ++j) {
      if (m.files[j].name == f.name) return InvalidArgument("{} is listed twice", f.name);
    }
  }
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> extents(m.files.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (i > 0 && m.tensors[i - 1].name >= m.tensors[i].name) {
      return InvalidArgument("tensors are not sorted by unique name at '{}'", m.tensors[i].name);
    }
    LK_RETURN_IF_ERROR(ValidateTensor(m, m.tensors[i], m.partial, &extents));
  }
  for (size_t f = 0; f < extents.size(); ++f) {
    auto& e = extents[f];
    std::sort(e.begin(), e.end());
    for (size_t i = 1; i < e.size(); ++i) {
      if (e[i].first < e[i - 1].second) {
        return InvalidArgument("{}: two slices share bytes at {}", m.files[f].name, e[i].first);
      }
    }
  }
  return Status::Ok();
}

Result<Manifest> MergeManifests(const std::vector<Manifest>& parts) {
  if (parts.empty()) return InvalidArgument("nothing to merge");
  Manifest out;
  out.step = parts[0].step;
  out.ranks = parts[0].ranks;
  out.chunk_bytes = parts[0].chunk_bytes;
  std::map<std::string, TensorInfo> tensors;
  for (const auto& p : parts) {
    if (p.step != out.step || p.ranks != out.ranks || p.chunk_bytes != out.chunk_bytes) {
      return InvalidArgument("parts disagree: step {} ranks {} chunk {} against step {} ranks {} chunk {}",
                             p.step, p.ranks, p.chunk_bytes, out.step, out.ranks, out.chunk_bytes);
    }
    out.created_unix_ms = std::max(out.created_unix_ms, p.created_unix_ms);
    for (const auto& [k, v] : p.metadata) out.metadata.emplace(k, v);
    std::vector<uint32_t> remap(p.files.size());
    std::vector<bool> seen_before(p.files.size(), false);
    for (size_t i = 0; i < p.files.size(); ++i) {
      const auto& f = p.files[i];
      auto it = std::find_if(out.files.begin(), out.files.end(),
                             [&](const ShardFileInfo& g) { return g.name == f.name; });
      if (it == out.files.end()) {
        remap[i] = static_cast<uint32_t>(out.files.size());
        out.files.push_back(f);
        continue;
      }
      if (it->size_bytes != f.size_bytes || it->header_xxh3 != f.header_xxh3) {
        return InvalidArgument("two sources hold different {}", f.name);
      }
      remap[i] = static_cast<uint32_t>(it - out.files.begin());
      seen_before[i] = true;
    }
    for (const auto& t : p.tensors) {
      auto [it, fresh] = tensors.emplace(t.name, TensorInfo{t.name, t.dtype, t.shape, {}});
      if (!fresh && (it->second.dtype != t.dtype || it->second.shape != t.shape)) {
        return InvalidArgument("tensor '{}' has two dtypes or shapes", t.name);
      }
      for (auto s : t.slices) {
        if (s.file >= p.files.size()) {
          return InvalidArgument("tensor '{}' names file #{} of a part with {} files", t.name,
                                 s.file, p.files.size());
        }
        bool dup = seen_before[s.file];
        s.file = remap[s.file];
        if (dup) {
          // The same file from a second source: its slices must be the ones we already have.
          auto& have = it->second.slices;
          bool same = std::any_of(have.begin(), have.end(), [&](const SliceInfo& h) {
            return h.file == s.file && h.rows == s.rows && h.offset == s.offset &&
                   h.chunk_xxh3 == s.chunk_xxh3;
          });
          if (!same) return InvalidArgument("two sources list different slices of {}", t.name);
          continue;
        }
        it->second.slices.push_back(std::move(s));
      }
    }
  }
  for (auto& [name, t] : tensors) out.tensors.push_back(std::move(t));
  // Order files by rank so indices do not depend on which source answered first.
  std::vector<ShardFileInfo> before = out.files;
  std::sort(out.files.begin(), out.files.end(), [](const ShardFileInfo& a, const ShardFileInfo& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.name < b.name;
  });
  std::map<std::string, uint32_t> index;
  for (size_t i = 0; i < out.files.size(); ++i) index[out.files[i].name] = static_cast<uint32_t>(i);
  for (auto& t : out.tensors) {
    for (auto& s : t.slices) s.file = index.at(before[s.file].name);
  }
  Canonicalize(&out);
  out.partial = true;
  LK_RETURN_IF_ERROR(ValidateManifest(out));
  Manifest complete = out;
  complete.partial = false;
  if (ValidateManifest(complete).ok()) out.partial = false;
  return out;
}

}  // namespace lk::ckpt
