// The poll board's reader: a trainer's side of the board (common/poll_board.h has the protocol
// and why the board exists). It takes the answer to its next poll without a round trip, leaves
// its commits in its slot and marks when it waits on the other groups.
// Thread-safety: one View per trainer, used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/poll_board.h"

namespace lk::board {

// A trainer's side.
class View {
 public:
  // Maps the board at `path`; `slot` is what the agent's hello answer gave this trainer.
  static Result<std::unique_ptr<View>> Open(const std::string& path, uint32_t slot);
  ~View();

  // The answer to the poll of `step` if the board has one this trainer has not consumed yet.
  std::optional<Answer> Take(uint32_t step);
  // Leaves the commit of `step` in this trainer's slot and wakes the agent; false (nothing
  // done) for step 0 or a hash over kMaxStateHash bytes. The agent takes it as it takes
  // POST /v1/trainer/commit. The caller commits again only after a poll the agent answered
  // after this commit (Session keeps that order: a step's commit comes after its poll).
  bool Commit(uint32_t step, std::string_view state_hash, uint64_t tokens = 0);
  // Marks this trainer as waiting in (or out of) the cross-group collective. The agent reads
  // it when it heartbeats, which is when the socket's /v1/trainer/phase would take effect too.
  void SetPeerWait(bool waiting);

 private:
  View(void* mem, uint32_t slot) : mem_(mem), slot_(slot) {}
  void* mem_;
  uint32_t slot_;
};

}  // namespace lk::board
