#include "checkpoint/store.h"

#include <algorithm>

#include "checkpoint/format.h"
#include "checkpoint/manifest_proto.h"

namespace lk::ckpt {
namespace {

// Compares a shard's own header with what the manifest says about that file.
Status CheckHeaderAgainstManifest(const Manifest& m, uint32_t file, const ShardHeader& h) {
  const auto& f = m.files[file];
  if (h.header_bytes != f.header_bytes) {
    return Error(Code::kDataLoss, "header is {} bytes, the manifest says {}", h.header_bytes,
                 f.header_bytes);
  }
  size_t listed = 0;
  for (const auto& t : m.tensors) {
    for (const auto& s : t.slices) {
      if (s.file != file) continue;
      ++listed;
      auto e = std::find_if(h.entries.begin(), h.entries.end(),
                            [&](const ShardEntry& x) { return x.name == t.name; });
      if (e == h.entries.end()) return Error(Code::kDataLoss, "tensor '{}' is not in the shard", t.name);
      if (e->dtype != t.dtype || e->global_shape != t.shape || e->rows != s.rows ||
          e->begin + h.header_bytes != s.offset || e->end - e->begin != s.length) {
        return Error(Code::kDataLoss, "tensor '{}': the shard header disagrees with the manifest",
                     t.name);
      }
    }
  }
  if (listed != h.entries.size()) {
    return Error(Code::kDataLoss, "the shard holds {} tensors, the manifest lists {}",
                 h.entries.size(), listed);
  }
  return Status::Ok();
}

Status VerifyFile(Env* env, const std::string& dir, const Manifest& m, uint32_t file) {
  const auto& f = m.files[file];
  std::string path = JoinPath(dir, f.name);
  LK_ASSIGN_OR_RETURN(auto rf, env->NewRandomAccessFile(path));
  if (rf->size() != f.size_bytes) {
    return Error(Code::kDataLoss, "{}: {} bytes, the manifest says {}", path, rf->size(), f.size_bytes);
  }
  std::string head(f.header_bytes, '\0');
  LK_RETURN_IF_ERROR(rf->Read(0, head.size(), reinterpret_cast<uint8_t*>(head.data())));
  if (Xxh3(head.data(), head.size()) != f.header_xxh3) {
    return Error(Code::kDataLoss, "{}: header checksum mismatch", path);
  }
  auto h = ParseShardHeader(head, rf->size());
  if (!h.ok()) return h.status().WithContext(path);
  LK_RETURN_IF_ERROR(CheckHeaderAgainstManifest(m, file, *h).WithContext(path));
  Buffer buf(std::min<uint64_t>(uint64_t{64} << 20, std::max<uint64_t>(m.chunk_bytes, 1)));
  uint64_t per_read = std::max<uint64_t>(1, buf.size() / m.chunk_bytes) * m.chunk_bytes;
  if (per_read > buf.size()) buf = Buffer(per_read);
  for (const auto& t : m.tensors) {
    for (const auto& s : t.slices) {
      if (s.file != file) continue;
      for (uint64_t at = 0; at < s.length; at += per_read) {
        uint64_t n = std::min(per_read, s.length - at);
        LK_RETURN_IF_ERROR(rf->Read(s.offset + at, n, buf.data()));
        for (uint64_t c = 0; c < n; c += m.chunk_bytes) {
          uint64_t k = (at + c) / m.chunk_bytes;
          if (Xxh3(buf.data() + c, std::min(m.chunk_bytes, n - c)) != s.chunk_xxh3[k]) {
            return Error(Code::kDataLoss, "{}: tensor '{}' chunk {} (bytes {}..{}) checksum mismatch",
                         path, t.name, k, s.offset + at + c,
                         s.offset + at + std::min(c + m.chunk_bytes, n));
          }
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace

std::string EncodeManifestFile(const Manifest& m) {
  std::string out = SerializeManifest(m);
  uint64_t h = Xxh3(out.data(), out.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h >> (8 * i)) & 0xff));
  return out;
}

Result<Manifest> DecodeManifestFile(std::string_view bytes, const std::string& what) {
  if (bytes.size() < 8) return Error(Code::kDataLoss, "{}: truncated ({} bytes)", what, bytes.size());
  uint64_t want = 0;
  for (int i = 0; i < 8; ++i) {
    want |= uint64_t{static_cast<uint8_t>(bytes[bytes.size() - 8 + i])} << (8 * i);
  }
  std::string_view body = bytes.substr(0, bytes.size() - 8);
  if (Xxh3(body.data(), body.size()) != want) return Error(Code::kDataLoss, "{}: checksum mismatch", what);
  auto m = ParseManifest(body);
  if (!m.ok()) return m.status().WithContext(what);
  Status st = ValidateManifest(*m);
  if (!st.ok()) return Status(Code::kDataLoss, fmt::format("{}: {}", what, st.message()));
  return m;
}

Result<std::vector<CheckpointRef>> ListCommitted(Env* env, const std::string& root) {
  LK_ASSIGN_OR_RETURN(auto names, env->ListDir(root));
  std::vector<CheckpointRef> out;
  for (auto& n : names) {
    int64_t step = ParseStepDirName(n);
    if (step < 0) continue;
    out.push_back(CheckpointRef{step, n, JoinPath(root, n)});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointRef& a, const CheckpointRef& b) { return a.step > b.step; });
  return out;
}

Result<Manifest> LoadManifest(Env* env, const std::string& dir) {
  std::string path = JoinPath(dir, kManifestFile);
  LK_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(env, path));
  return DecodeManifestFile(bytes, path);
}

Status CheckFiles(Env* env, const std::string& dir, const Manifest& m) {
  for (const auto& f : m.files) {
    std::string path = JoinPath(dir, f.name);
    LK_ASSIGN_OR_RETURN(auto rf, env->NewRandomAccessFile(path));
    if (rf->size() != f.size_bytes) {
      return Error(Code::kDataLoss, "{}: {} bytes, the manifest says {}", path, rf->size(),
                   f.size_bytes);
    }
  }
  return Status::Ok();
}

Result<CheckpointRef> FindLatest(Env* env, const std::string& root, std::vector<std::string>* skipped) {
  LK_ASSIGN_OR_RETURN(auto refs, ListCommitted(env, root));
  for (const auto& r : refs) {
    auto m = LoadManifest(env, r.dir);
    Status st = m.ok() ? CheckFiles(env, r.dir, *m) : m.status();
    if (st.ok() && m->step != r.step) {
      st = Error(Code::kDataLoss, "{}: the manifest says step {}", r.dir, m->step);
    }
    if (st.ok()) return r;
    if (skipped != nullptr) skipped->push_back(st.ToString());
  }
  return Error(Code::kNotFound, "no complete checkpoint in {}", root);
}

Status VerifyCheckpoint(Env* env, const std::string& dir, VerifyOptions options) {
  LK_ASSIGN_OR_RETURN(Manifest m, LoadManifest(env, dir));
  for (uint32_t i = 0; i < m.files.size(); ++i) {
    Status st = VerifyFile(env, dir, m, i);
    if (options.on_file) options.on_file(m.files[i].name, st);
    LK_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

}  // namespace lk::ckpt
