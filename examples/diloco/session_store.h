// A RendezvousStore over the trainer's agent session: the lighthouse KV reached through the
// node agent (LK_AGENT_SOCKET), so a trainer needs no lighthouse address or token of its own.
// Keys get a prefix, so that two communicators of one trainer (the cross-group slot and the
// intra-group one) never read each other's addresses under the same quorum_id.
// Thread-safety: as the Session: one caller at a time (CommManager calls it from Reconfigure,
// on the trainer thread).
#pragma once

#include <string>

#include "replica_agent/client/session.h"
#include "replica_agent/comm/comm.h"

namespace lk::diloco {

class SessionRendezvousStore final : public comm::RendezvousStore {
 public:
  SessionRendezvousStore(client::Session* session, std::string prefix)
      : session_(session), prefix_(std::move(prefix)) {}
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }

  Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) override {
    return session_->KvPut(quorum_id, prefix_ + key, value);
  }
  Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) override {
    return session_->KvGet(quorum_id, prefix_ + key, timeout);
  }

 private:
  client::Session* session_;
  std::string prefix_;
};

}  // namespace lk::diloco
