// The rendezvous store a trainer's CommManager uses: the lighthouse KV reached through the
// node agent (the trainer needs no lighthouse address or token of its own).
// Thread-safety: as Session; the CommManager calls it from the trainer's thread.
#pragma once

#include "common/http/client.h"
#include "replica_agent/client/session.h"
#include "replica_agent/comm/comm.h"

namespace lk::client {

class SessionKvStore final : public comm::RendezvousStore {
 public:
  // `socket` is the agent's socket; the store keeps its own connection so that a KV wait never
  // shares one with Poll.
  explicit SessionKvStore(std::string socket) : socket_(std::move(socket)) {}

  Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) override {
    LK_RETURN_IF_ERROR(Open());
    return TrainerKvPut(*client_, quorum_id, key, value);
  }

  Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) override {
    LK_RETURN_IF_ERROR(Open());
    return TrainerKvGet(*client_, quorum_id, key, timeout);
  }

 private:
  Status Open() {
    if (client_) return Status::Ok();
    LK_ASSIGN_OR_RETURN(client_, http::Client::Create("unix:" + socket_));
    return Status::Ok();
  }

  std::string socket_;
  std::unique_ptr<http::Client> client_;
};

}  // namespace lk::client
