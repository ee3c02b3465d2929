// The poll board's writer: the agent's side of the board (common/poll_board.h has the protocol
// and why the board exists). It creates the file, publishes and withdraws answers, and reads
// what trainers left in their slots.
// Thread-safety: one writer (the agent, under its mutex); any number of trainer processes read
// and take through client/poll_board_reader.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/poll_board.h"

namespace lk::board {

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

}  // namespace lk::board
