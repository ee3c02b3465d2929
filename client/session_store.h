// The agent's KV as a trainer reaches it, and the rendezvous store a trainer's CommManager uses: the lighthouse KV reached through the
// node agent (the trainer needs no lighthouse address or token of its own).
// Thread-safety: as Session; the CommManager calls it from the trainer's thread.
#pragma once

#include <lightkeeper/session.h>

#include "comm/comm.h"
#include "common/http/client.h"

namespace lk::client {

// The agent's rendezvous KV over one of its socket connections (Session and SessionKvStore
// each keep their own, so that a waiting GET never holds up a poll).
Status TrainerKvPut(http::Client& agent, uint32_t quorum_id, const std::string& key,
                    const std::string& value);
Result<std::string> TrainerKvGet(http::Client& agent, uint32_t quorum_id, const std::string& key,
                                 Millis timeout);

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
