// A RendezvousStore that puts a prefix before every key of another store, so that two
// communicators of one trainer (the cross-group slot and the intra-group one) never read each
// other's addresses under the same quorum_id.
// Thread-safety: as the wrapped store; set_prefix only between Reconfigure calls.
#pragma once

#include <string>

#include "comm/comm.h"

namespace lk::diloco {

class PrefixedStore final : public comm::RendezvousStore {
 public:
  PrefixedStore(comm::RendezvousStore* inner, std::string prefix)
      : inner_(inner), prefix_(std::move(prefix)) {}
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }

  Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) override {
    return inner_->Put(quorum_id, prefix_ + key, value);
  }
  Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) override {
    return inner_->Get(quorum_id, prefix_ + key, timeout);
  }

 private:
  comm::RendezvousStore* inner_;
  std::string prefix_;
};

}  // namespace lk::diloco
