#include "comm/rendezvous_store.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/http/http.h"

namespace lk::comm {

namespace fs = std::filesystem;

LighthouseKvStore::LighthouseKvStore(std::string url, std::string job, std::string token)
    : url_(std::move(url)), job_(std::move(job)), token_(std::move(token)) {}

Result<http::Client*> LighthouseKvStore::ClientLocked() {
  if (!client_) {
    http::ClientOptions options;
    options.token = token_;
    LK_ASSIGN_OR_RETURN(client_, http::Client::Create(url_, options));
  }
  return client_.get();
}

std::string LighthouseKvStore::Target(uint32_t quorum_id, const std::string& key) const {
  return fmt::format("/v1/kv/{}/{}/{}", job_, quorum_id, http::PercentEncode(key));
}

Status LighthouseKvStore::Put(uint32_t quorum_id, const std::string& key,
                              const std::string& value) {
  std::lock_guard lock(mu_);
  LK_ASSIGN_OR_RETURN(http::Client * c, ClientLocked());
  auto r = c->Do("PUT", Target(quorum_id, key), value, "application/octet-stream");
  if (!r.ok()) return r.status().WithContext(fmt::format("kv put {}", key));
  if (r->status / 100 != 2) {
    return http::StatusFromResponse(*r).WithContext(fmt::format("kv put {}", key));
  }
  return Status::Ok();
}

Result<std::string> LighthouseKvStore::Get(uint32_t quorum_id, const std::string& key,
                                           Millis timeout) {
  std::lock_guard lock(mu_);
  LK_ASSIGN_OR_RETURN(http::Client * c, ClientLocked());
  std::string target = fmt::format("{}?timeout_ms={}", Target(quorum_id, key), timeout.count());
  // The lighthouse answers 504 at timeout_ms; the transport deadline only catches a dead server.
  auto r = c->Do("GET", target, "", "", timeout + Millis(5'000));
  if (!r.ok()) return r.status().WithContext(fmt::format("kv get {}", key));
  if (r->status != 200) {
    return http::StatusFromResponse(*r).WithContext(fmt::format("kv get {}", key));
  }
  return std::move(r->body);
}

FileRendezvousStore::FileRendezvousStore(std::string dir) : dir_(std::move(dir)) {}

std::string FileRendezvousStore::Path(uint32_t quorum_id, const std::string& key) const {
  std::string name;
  for (char ch : key) name += ch == '/' ? std::string("%2F") : std::string(1, ch);
  return fmt::format("{}/{}/{}", dir_, quorum_id, name);
}

Status FileRendezvousStore::Put(uint32_t quorum_id, const std::string& key,
                                const std::string& value) {
  std::string path = Path(quorum_id, key);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec) return Error(Code::kUnavailable, "mkdir for {}: {}", path, ec.message());
  // Written aside and renamed, so that a reader never sees half a value.
  std::string tmp =
      fmt::format("{}.tmp.{}", path, std::hash<std::thread::id>()(std::this_thread::get_id()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out) return Error(Code::kUnavailable, "write {}", tmp);
  }
  fs::rename(tmp, path, ec);
  if (ec) return Error(Code::kUnavailable, "rename to {}: {}", path, ec.message());
  return Status::Ok();
}

Result<std::string> FileRendezvousStore::Get(uint32_t quorum_id, const std::string& key,
                                             Millis timeout) {
  std::string path = Path(quorum_id, key);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::ostringstream ss;
      ss << in.rdbuf();
      return ss.str();
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Error(Code::kDeadlineExceeded, "key {} not put before timeout", key);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<std::unique_ptr<RendezvousStore>> OpenRendezvousStore(const std::string& spec,
                                                             const std::string& job,
                                                             const std::string& token) {
  if (spec.rfind("file:", 0) == 0) {
    return std::unique_ptr<RendezvousStore>(std::make_unique<FileRendezvousStore>(spec.substr(5)));
  }
  if (spec.rfind("http://", 0) == 0 || spec.rfind("https://", 0) == 0 ||
      spec.rfind("unix:", 0) == 0) {
    return std::unique_ptr<RendezvousStore>(std::make_unique<LighthouseKvStore>(spec, job, token));
  }
  return InvalidArgument("rendezvous store '{}' is neither http(s)://, unix: nor file:", spec);
}

}  // namespace lk::comm
