// The poll board: a small file the agent maps into memory next to its socket and its trainers
// map too, through which the answer to a trainer's next poll travels without a round trip.
//
// Why: when nothing changed, the answer to the poll of step s is known long before the trainers
// ask (the agent asked the lighthouse ahead, while they ran their inner steps). Over the Unix
// socket the poll still costs a round trip into an idle agent, whose wake-up alone is 100 us to
// 1 ms on a busy machine. From the board it costs a few atomic loads.
//
// The rule the board keeps is the one the socket's local barrier kept: every trainer of a node
// gets the same answer for a step. The answer goes up as READY; the first trainer that wants
// it turns it into TAKEN with a compare-and-swap, and from then on it stands for every trainer
// of the node, even if its quorum is lost a moment later (they all fail that step and poll
// again). The agent can withdraw a READY answer (the quorum lost a member, a drain began) with
// the same compare-and-swap, so exactly one of the two wins. Trainers never wait on the board:
// whatever they do not find there they ask over the socket.
//
// The board holds only the answers of the unchanged case (no reconfigure, no heal, no drain);
// every other answer goes over the socket as before.
//
// The other way, each trainer has a slot: what it consumed, its "waiting on the other groups"
// mark, and its last commit (step, state hash and the group's tokens). After writing a commit it bumps the board's
// doorbell and wakes it as a futex; the agent sleeps on the doorbell and applies the commit as
// it applies one that came over the socket.
//
// Thread- and process-safety: one writer (the agent, under its mutex) and any number of
// trainer processes; every shared field is a lock-free atomic, so the mapping may be shared
// between processes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace lk::board {

struct Answer {
  uint32_t step = 0;
  uint32_t quorum_id = 0;
  uint32_t replica_rank = 0;
  uint32_t replica_world_size = 0;
  uint32_t max_step = 0;
  std::string reason;  // cut at kMaxReason bytes
};

constexpr size_t kMaxReason = 248;
constexpr size_t kMaxStateHash = 128;  // as on the socket's /v1/trainer/commit

// A trainer's commit of an outer step, left in its slot.
struct Commit {
  uint32_t step = 0;
  std::string state_hash;
  uint64_t tokens = 0;  // the group's tokens in this outer step (0: not reported)
};
constexpr uint32_t kMaxSlots = 256;  // trainers per node that can use the board

// A published answer's identity: `gen` goes up with every publication (never 0).
struct Ticket {
  uint32_t gen = 0;
  uint32_t step = 0;
};

// The agent's side: creates the file (replacing any left by an earlier life) and removes it
// on destruction.
class Board {
 public:
  static Result<std::unique_ptr<Board>> Create(const std::string& path);
  ~Board();

  const std::string& path() const { return path_; }

  // Publishes the answer to the poll of `a.step`. The caller has withdrawn or seen taken any
  // answer published before.
  void Publish(const Answer& a);
  // Withdraws a READY answer; true if there was one. Nothing else changes: an answer that a
  // trainer took first stands (see Taken).
  bool Withdraw();
  // The answer that trainers took, if the latest one was taken.
  std::optional<Ticket> Taken() const;
  // The answer up and not taken yet, if any.
  std::optional<Ticket> Ready() const;
  // Takes the READY answer for `step` on behalf of a trainer that polls over the socket, so
  // that it stands for the node as if that trainer had taken it itself.
  std::optional<Ticket> TakeFor(uint32_t step);
  // The gen of the last answer the trainer in `slot` consumed (from the board or the socket).
  uint32_t Consumed(uint32_t slot) const;
  void SetConsumed(uint32_t slot, uint32_t gen);
  // Whether the trainer in `slot` said it waits in the cross-group collective.
  bool PeerWait(uint32_t slot) const;
  // The last commit the trainer in `slot` left on the board, if any.
  std::optional<Commit> CommitOf(uint32_t slot) const;
  // The doorbell trainers ring after a commit: read it, look at the slots, then wait until it
  // moves on from what was read (or `timeout` passes).
  uint32_t Doorbell() const;
  void WaitDoorbell(uint32_t seen, std::chrono::milliseconds timeout);
  // Wakes a WaitDoorbell (the agent's own way to stop its waiting thread).
  void RingDoorbell();
  // From now on trainers go through the socket (the agent drains or exits); withdraws a
  // READY answer.
  void Close();
  // Removes the file if it is still this board's (a later agent on the same socket path may
  // have replaced it). Trainers that mapped it keep their mapping.
  void Unlink();

 private:
  Board(std::string path, void* mem, uint64_t inode) : path_(std::move(path)), mem_(mem), inode_(inode) {}
  std::string path_;
  void* mem_;
  uint64_t inode_;
};

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
