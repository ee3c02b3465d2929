// RendezvousStore implementations. LighthouseKvStore talks to the lighthouse KV directly over
// HTTP (what trainers use when they reach the lighthouse themselves; the agent relays the same
// calls otherwise). FileRendezvousStore keeps keys as files in a directory shared by processes on
// one host: benchmarks use it to time the communicator without the lighthouse in the loop.
// Thread-safety: both are safe to call from any thread. LighthouseKvStore serialises its calls
// on one connection, so a long Get delays a concurrent Put; CommManager only calls it from the
// Reconfigure thread.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "common/http/client.h"
#include "comm/comm.h"

namespace lk::comm {

class LighthouseKvStore final : public RendezvousStore {
 public:
  // `url` is the lighthouse ("http://HOST:PORT"), `job` the job name, `token` its bearer token
  // (empty when the lighthouse runs without tokens).
  LighthouseKvStore(std::string url, std::string job, std::string token);
  Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) override;
  Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) override;

 private:
  Result<http::Client*> ClientLocked();
  std::string Target(uint32_t quorum_id, const std::string& key) const;

  const std::string url_;
  const std::string job_;
  const std::string token_;
  std::mutex mu_;
  std::unique_ptr<http::Client> client_;  // guarded by mu_, made on first use
};

class FileRendezvousStore final : public RendezvousStore {
 public:
  explicit FileRendezvousStore(std::string dir);
  Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) override;
  Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) override;

 private:
  std::string Path(uint32_t quorum_id, const std::string& key) const;
  const std::string dir_;
};

// Makes a store from "http://HOST:PORT" (the lighthouse KV of `job`) or "file:DIR".
Result<std::unique_ptr<RendezvousStore>> OpenRendezvousStore(const std::string& spec,
                                                             const std::string& job,
                                                             const std::string& token);

}  // namespace lk::comm
