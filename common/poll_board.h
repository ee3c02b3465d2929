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
// This header is the board's protocol: the file's memory layout and the encodings both sides
// use. The agent writes it (replica_agent/poll_board_writer.h), trainers read it
// (client/poll_board_reader.h); neither includes the other.
//
// Thread- and process-safety: one writer (the agent, under its mutex) and any number of
// trainer processes; every shared field is a lock-free atomic, so the mapping may be shared
// between processes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <lightkeeper/status.h>

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

// Bumped whenever Layout changes, so that a trainer built against another layout falls back
// to the socket instead of misreading the board.
constexpr uint32_t kMagic = 0x4250'4b4c;  // "LKPB"
constexpr uint32_t kVersion = 2;  // 2: commits carry tokens
constexpr size_t kReasonWords = kMaxReason / 8;
constexpr size_t kHashWords = kMaxStateHash / 8;

// The ticket word: gen (30 bits) | state (2 bits) | step (32 bits). One 64-bit atomic, so
// that "which answer, for which step, in which state" changes in one compare-and-swap.
enum State : uint64_t { kEmpty = 0, kWriting = 1, kReady = 2, kTaken = 3 };
constexpr uint32_t kGenMask = (1u << 30) - 1;

inline uint64_t MakeTicket(uint32_t gen, State st, uint32_t step) {
  return (static_cast<uint64_t>(gen & kGenMask) << 34) | (static_cast<uint64_t>(st) << 32) | step;
}
inline uint32_t GenOf(uint64_t t) { return static_cast<uint32_t>(t >> 34); }
inline State StateOf(uint64_t t) { return static_cast<State>((t >> 32) & 3); }
inline uint32_t StepOf(uint64_t t) { return static_cast<uint32_t>(t); }

// A trainer's slot: written by that trainer (and `consumed` by the agent when it answers the
// trainer over the socket). A commit is the hash first, then the step with release: the agent
// reads the step, then the hash, then the step again, and uses the pair only if the step held.
struct alignas(64) Slot {
  std::atomic<uint32_t> consumed;
  std::atomic<uint32_t> peer_wait;
  std::atomic<uint32_t> commit_step;
  std::atomic<uint32_t> hash_len;
  std::atomic<uint64_t> hash[kHashWords];
  std::atomic<uint64_t> tokens;  // written with the hash, before the step
};

// Every field is written by the agent only, except the ticket (trainers CAS READY -> TAKEN) and
// each slot (its trainer). The answer's fields change only while the ticket says WRITING, and
// readers check the ticket again after reading them (a sequence lock), so a torn read is never
// used.
// What a take reads sits in as few cache lines as possible (the ticket, the flag, the numbers
// and the start of the reason in one): a poll comes after tens of milliseconds of inner steps,
// when none of it is cached any more, and each line is a miss.
struct Layout {
  std::atomic<uint32_t> magic;
  std::atomic<uint32_t> version;
  // Bumped by a trainer after a commit, with a futex wake: the agent sleeps on it.
  alignas(64) std::atomic<uint32_t> doorbell;
  alignas(64) std::atomic<uint64_t> ticket;
  std::atomic<uint32_t> closed;
  std::atomic<uint32_t> quorum_id;
  std::atomic<uint32_t> replica_rank;
  std::atomic<uint32_t> replica_world_size;
  std::atomic<uint32_t> max_step;
  std::atomic<uint32_t> reason_len;
  std::atomic<uint64_t> reason[kReasonWords];
  Slot slots[kMaxSlots];
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "the doorbell is a futex word");
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the board is shared between processes: its atomics must be lock-free");

inline Layout* L(void* mem) { return static_cast<Layout*>(mem); }

// Word-wise copies of text into and out of the layout's atomic words (relaxed: the ticket's
// sequence lock orders them).
void StoreText(std::atomic<uint64_t>* words, std::string_view text);
std::string LoadText(const std::atomic<uint64_t>* words, size_t n);
// Bumps the doorbell and wakes every waiter on it (a futex shared between processes).
void Ring(Layout* l);
// Waits until the doorbell moves on from `seen` or `timeout` passes.
void WaitRing(Layout* l, uint32_t seen, std::chrono::milliseconds timeout);
// The latest publication's identity, if the ticket is in state `want`.
std::optional<Ticket> TicketIn(void* mem, State want);
// An error naming the failed call, the path and errno.
Status Errno(const std::string& what, const std::string& path);

}  // namespace lk::board
