#include "checkpoint/source.h"

#include <strings.h>

#include <cstring>

#include "checkpoint/manifest_proto.h"

namespace lk::ckpt {

FileSource::FileSource(Env* env, std::string dir, const Manifest& m)
    : env_(env), dir_(std::move(dir)), name_("file:" + dir_) {
  for (const auto& f : m.files) files_[f.name] = nullptr;
}

Result<RandomAccessFile*> FileSource::Open(const std::string& file) {
  std::lock_guard lock(mu_);
  auto it = files_.find(file);
  if (it == files_.end()) return Error(Code::kNotFound, "{} is not in {}", file, dir_);
  if (!it->second) {
    LK_ASSIGN_OR_RETURN(it->second, env_->NewRandomAccessFile(JoinPath(dir_, file)));
  }
  return it->second.get();
}

Status FileSource::Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst) {
  LK_ASSIGN_OR_RETURN(RandomAccessFile * f, Open(file));
  return f->Read(offset, length, dst);
}

Status FileSource::DropCaches() {
  std::vector<std::string> names;
  {
    std::lock_guard lock(mu_);
    for (const auto& [n, f] : files_) names.push_back(n);
  }
  for (const auto& n : names) {
    LK_ASSIGN_OR_RETURN(RandomAccessFile * f, Open(n));
    f->DropCache();
  }
  return Status::Ok();
}

Result<std::vector<ServedCheckpointInfo>> ListPeer(const std::string& url, const PeerOptions& options) {
  LK_ASSIGN_OR_RETURN(auto client, http::Client::Create(url, options.client));
  LK_ASSIGN_OR_RETURN(http::Response r,
                      client->Do("GET", options.prefix + "/checkpoints", "", "", options.request_timeout));
  LK_RETURN_IF_ERROR(http::StatusFromResponse(r).WithContext(url));
  pb::ServedCheckpoints served;
  if (!served.ParseFromString(r.body)) return Error(Code::kDataLoss, "{}: checkpoint list does not parse", url);
  std::vector<ServedCheckpointInfo> out;
  for (const auto& c : served.checkpoints()) {
    auto m = FromProto(c.manifest());
    if (!m.ok()) return m.status().WithContext(url);
    LK_RETURN_IF_ERROR(ValidateManifest(*m).WithContext(fmt::format("{} {}/{}", url, c.root(), c.dir())));
    out.push_back(ServedCheckpointInfo{c.root(), c.dir(), std::move(*m)});
  }
  return out;
}

PeerSource::PeerSource(std::string url, std::map<std::string, std::string> files, PeerOptions options)
    : url_(std::move(url)), files_(std::move(files)), options_(std::move(options)) {}

Status PeerSource::Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst) {
  return Read(file, offset, length, dst, nullptr);
}

Status PeerSource::Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst,
                        const Landed& landed) {
  auto where = files_.find(file);
  if (where == files_.end()) return Error(Code::kNotFound, "{} does not hold {}", url_, file);
  std::unique_ptr<http::Client> client;
  {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      client = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (!client) {
    LK_ASSIGN_OR_RETURN(client, http::Client::Create(url_, options_.client));
  }
  std::string target = fmt::format("{}/files/{}/{}", options_.prefix, where->second, file);
  std::string range = fmt::format("bytes={}-{}", offset, offset + length - 1);
  // The body lands straight in dst: no copy between the socket and the caller's buffer.
  uint64_t got = 0;
  LK_ASSIGN_OR_RETURN(
      http::Response r,
      client->GetInto(target, dst, length, &got, options_.request_timeout, "Range", range, landed));
  if (r.status != 206) {
    Status st = http::StatusFromResponse(r);
    if (st.ok()) st = Error(Code::kUnavailable, "HTTP {} instead of 206", r.status);
    return st.WithContext(fmt::format("{}{} {}", url_, target, range));
  }
  if (got != length) {
    return Error(Code::kDataLoss, "{}{} {}: {} bytes instead of {}", url_, target, range, got,
                 length);
  }
  // The checksums would catch bytes from the wrong place too, but this names the fault.
  std::string want = fmt::format("bytes {}-{}/", offset, offset + length - 1);
  bool range_ok = false;
  for (const auto& [k, v] : r.headers) {
    if (strcasecmp(k.c_str(), "Content-Range") == 0) range_ok = v.rfind(want, 0) == 0;
  }
  if (!range_ok) {
    return Error(Code::kDataLoss, "{}{} {}: the answer's Content-Range is not {}...", url_, target,
                 range, want);
  }
  std::lock_guard lock(mu_);
  idle_.push_back(std::move(client));
  return Status::Ok();
}

}  // namespace lk::ckpt
