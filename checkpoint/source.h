// Where restore reads shard bytes from: a checkpoint directory (pread) or a peer agent's shard
// server (HTTP Range requests). Both answer the same question -- these bytes of that shard file
// -- so one fetcher stripes a plan over any mix of them. Sources do not verify checksums; the
// fetcher does, for every source alike.
// Thread-safety: Read may be called from many threads at once on one source.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint/env.h"
#include "checkpoint/manifest.h"
#include <lightkeeper/clock.h>
#include "common/http/client.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

// Told, while a read is in progress, how many leading bytes of dst have landed so far (called on
// the reading thread). Counts increase, except that a source that starts a read over (a retry)
// counts again from 0; the bytes before the new count must then be treated as not yet landed.
using Landed = std::function<void(uint64_t bytes)>;

class Source {
 public:
  virtual ~Source() = default;
  virtual const std::string& name() const = 0;
  virtual bool Has(const std::string& file) const = 0;
  // Reads exactly [offset, offset + length) of shard file `file` into dst.
  virtual Status Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst) = 0;
  // Read, reporting progress through `landed` so that the caller can check each chunk right
  // after its bytes land, while they are still in cache. A source without finer progress
  // reports once, at the end.
  virtual Status Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst,
                      const Landed& landed) {
    Status st = Read(file, offset, length, dst);
    if (st.ok() && landed) landed(length);
    return st;
  }
};

// A checkpoint directory on a local or shared filesystem.
class FileSource final : public Source {
 public:
  FileSource(Env* env, std::string dir, const Manifest& m);
  const std::string& name() const override { return name_; }
  bool Has(const std::string& file) const override { return files_.count(file) > 0; }
  Status Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst) override;
  using Source::Read;
  // Evicts the shard files from the page cache, so a benchmark reads the disk.
  Status DropCaches();

 private:
  Result<RandomAccessFile*> Open(const std::string& file);

  Env* env_;
  std::string dir_;
  std::string name_;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<RandomAccessFile>> files_;
};

struct PeerOptions {
  std::string prefix = "/v1/shards";  // where the peer mounts its ShardServer
  http::ClientOptions client;
  Millis request_timeout{60'000};  // one Range request (16 MiB by default)
};

// What a peer serves: the newest checkpoint of each of its roots (see ShardServer).
struct ServedCheckpointInfo {
  std::string root;
  std::string dir;
  Manifest manifest;
};
Result<std::vector<ServedCheckpointInfo>> ListPeer(const std::string& url, const PeerOptions& options);

// One peer agent. `files` maps each shard file name this peer may be asked for to the
// "ROOT/DIR" it lives under on that peer.
class PeerSource final : public Source {
 public:
  PeerSource(std::string url, std::map<std::string, std::string> files, PeerOptions options);
  const std::string& name() const override { return url_; }
  bool Has(const std::string& file) const override { return files_.count(file) > 0; }
  Status Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst) override;
  // Reports progress after every read from the socket.
  Status Read(const std::string& file, uint64_t offset, uint64_t length, uint8_t* dst,
              const Landed& landed) override;

 private:
  std::string url_;
  std::map<std::string, std::string> files_;
  PeerOptions options_;
  std::mutex mu_;
  // Idle connections; a reader takes one (or opens one) and gives it back after a good answer.
  std::vector<std::unique_ptr<http::Client>> idle_;
};

}  // namespace lk::ckpt
