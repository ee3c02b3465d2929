#include "client/poll_board_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lk::board {

Result<std::unique_ptr<View>> View::Open(const std::string& path, uint32_t slot) {
  if (slot >= kMaxSlots) return InvalidArgument("poll board slot {} is not below {}", slot, kMaxSlots);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open poll board", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size != static_cast<off_t>(sizeof(Layout))) {
    ::close(fd);
    return Error(Code::kInvalidArgument, "{} is not a poll board of this version ({} bytes, want {})",
                 path, static_cast<long long>(st.st_size), sizeof(Layout));
  }
  void* mem = ::mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mem == MAP_FAILED) return Errno("cannot map poll board", path);
  Layout* l = L(mem);
  if (l->magic.load(std::memory_order_acquire) != kMagic ||
      l->version.load(std::memory_order_relaxed) != kVersion) {
    ::munmap(mem, sizeof(Layout));
    return Error(Code::kInvalidArgument, "{} is not a poll board of version {}", path, kVersion);
  }
  return std::unique_ptr<View>(new View(mem, slot));
}

View::~View() { ::munmap(mem_, sizeof(Layout)); }

bool View::Commit(uint32_t step, std::string_view state_hash, uint64_t tokens) {
  if (step == 0 || state_hash.size() > kMaxStateHash) return false;
  Layout* l = L(mem_);
  Slot& s = l->slots[slot_];
  // The step goes to 0 while the hash changes, so a reader never pairs a new hash with the
  // step before it (the agent has always read the previous commit by now: see Session::Commit).
  s.commit_step.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.hash_len.store(static_cast<uint32_t>(state_hash.size()), std::memory_order_relaxed);
  StoreText(s.hash, state_hash);
  s.tokens.store(tokens, std::memory_order_relaxed);
  s.commit_step.store(step, std::memory_order_release);
  Ring(l);
  return true;
}

void View::SetPeerWait(bool waiting) {
  L(mem_)->slots[slot_].peer_wait.store(waiting ? 1 : 0, std::memory_order_relaxed);
}

std::optional<Answer> View::Take(uint32_t step) {
  Layout* l = L(mem_);
  if (l->closed.load(std::memory_order_acquire)) return std::nullopt;
  uint64_t t = l->ticket.load(std::memory_order_acquire);
  State st = StateOf(t);
  if ((st != kReady && st != kTaken) || StepOf(t) != step) return std::nullopt;
  uint32_t gen = GenOf(t);
  // Consumed already: this is a second poll of the step (the first one's step failed), which
  // needs a new round, so it goes over the socket.
  if (l->slots[slot_].consumed.load(std::memory_order_relaxed) == gen) return std::nullopt;
  Answer a;
  a.step = step;
  a.quorum_id = l->quorum_id.load(std::memory_order_relaxed);
  a.replica_rank = l->replica_rank.load(std::memory_order_relaxed);
  a.replica_world_size = l->replica_world_size.load(std::memory_order_relaxed);
  a.max_step = l->max_step.load(std::memory_order_relaxed);
  a.reason = LoadText(l->reason, std::min<size_t>(l->reason_len.load(std::memory_order_relaxed), kMaxReason));
  // Pairs with the release fence in Publish: if any read above saw a newer publication's
  // data, the ticket read below sees that publication's WRITING (or later) and the answer is
  // dropped.
  std::atomic_thread_fence(std::memory_order_acquire);
  uint64_t taken = MakeTicket(gen, kTaken, step);
  if (st == kReady) {
    // Either this trainer takes it, or another did (or the agent for a socket poller) and the
    // ticket now says TAKEN with the same gen: the data read is the same answer. Anything
    // else (withdrawn, republished) sends the poll over the socket.
    if (!l->ticket.compare_exchange_strong(t, taken, std::memory_order_acq_rel,
                                           std::memory_order_acquire) &&
        t != taken) {
      return std::nullopt;
    }
  } else if (l->ticket.load(std::memory_order_relaxed) != t) {
    return std::nullopt;
  }
  l->slots[slot_].consumed.store(gen, std::memory_order_release);
  return a;
}

}  // namespace lk::board
