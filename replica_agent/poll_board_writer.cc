#include "replica_agent/poll_board_writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <new>

namespace lk::board {

Result<std::unique_ptr<Board>> Board::Create(const std::string& path) {
  // A board left by an earlier life of this agent is replaced, never reused: its trainers are
  // gone, and a fresh inode means no mapping of theirs can see this one.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("cannot remove old board", path);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot create poll board", path);
  struct stat st {};
  void* mem = MAP_FAILED;
  if (::ftruncate(fd, sizeof(Layout)) == 0 && ::fstat(fd, &st) == 0) {
    mem = ::mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  Status err = mem == MAP_FAILED ? Errno("cannot map poll board", path) : Status::Ok();
  ::close(fd);
  if (!err.ok()) {
    ::unlink(path.c_str());
    return err;
  }
  Layout* l = new (mem) Layout{};
  l->version.store(kVersion, std::memory_order_relaxed);
  l->magic.store(kMagic, std::memory_order_release);
  return std::unique_ptr<Board>(new Board(path, mem, st.st_ino));
}

Board::~Board() { ::munmap(mem_, sizeof(Layout)); }

void Board::Unlink() {
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && st.st_ino == inode_) ::unlink(path_.c_str());
}

void Board::Publish(const Answer& a) {
  Layout* l = L(mem_);
  Withdraw();  // READY -> EMPTY, or it was taken: either way no trainer can change it now
  uint32_t gen = (GenOf(l->ticket.load(std::memory_order_relaxed)) + 1) & kGenMask;
  if (gen == 0) gen = 1;
  l->ticket.store(MakeTicket(gen, kWriting, a.step), std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  l->quorum_id.store(a.quorum_id, std::memory_order_relaxed);
  l->replica_rank.store(a.replica_rank, std::memory_order_relaxed);
  l->replica_world_size.store(a.replica_world_size, std::memory_order_relaxed);
  l->max_step.store(a.max_step, std::memory_order_relaxed);
  size_t n = std::min(a.reason.size(), kMaxReason);
  l->reason_len.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  StoreText(l->reason, std::string_view(a.reason).substr(0, n));
  l->ticket.store(MakeTicket(gen, kReady, a.step), std::memory_order_release);
}

bool Board::Withdraw() {
  Layout* l = L(mem_);
  uint64_t t = l->ticket.load(std::memory_order_acquire);
  while (StateOf(t) == kReady) {
    if (l->ticket.compare_exchange_weak(t, MakeTicket(GenOf(t), kEmpty, StepOf(t)),
                                        std::memory_order_acq_rel, std::memory_order_acquire)) {
      return true;
    }
  }
  return false;
}

std::optional<Ticket> Board::Taken() const { return TicketIn(mem_, kTaken); }

std::optional<Ticket> Board::Ready() const { return TicketIn(mem_, kReady); }

std::optional<Ticket> Board::TakeFor(uint32_t step) {
  Layout* l = L(mem_);
  uint64_t t = l->ticket.load(std::memory_order_acquire);
  while (StateOf(t) == kReady && StepOf(t) == step) {
    if (l->ticket.compare_exchange_weak(t, MakeTicket(GenOf(t), kTaken, step),
                                        std::memory_order_acq_rel, std::memory_order_acquire)) {
      return Ticket{GenOf(t), step};
    }
  }
  if (StateOf(t) == kTaken && StepOf(t) == step) return Ticket{GenOf(t), step};
  return std::nullopt;
}

uint32_t Board::Consumed(uint32_t slot) const {
  return slot < kMaxSlots ? L(mem_)->slots[slot].consumed.load(std::memory_order_acquire) : 0;
}

void Board::SetConsumed(uint32_t slot, uint32_t gen) {
  if (slot < kMaxSlots) L(mem_)->slots[slot].consumed.store(gen, std::memory_order_release);
}

bool Board::PeerWait(uint32_t slot) const {
  return slot < kMaxSlots && L(mem_)->slots[slot].peer_wait.load(std::memory_order_relaxed) != 0;
}

std::optional<Commit> Board::CommitOf(uint32_t slot) const {
  if (slot >= kMaxSlots) return std::nullopt;
  const Slot& s = L(mem_)->slots[slot];
  for (;;) {
    uint32_t step = s.commit_step.load(std::memory_order_acquire);
    if (step == 0) return std::nullopt;
    Commit c;
    c.step = step;
    c.state_hash = LoadText(s.hash, std::min<size_t>(s.hash_len.load(std::memory_order_relaxed), kMaxStateHash));
    c.tokens = s.tokens.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.commit_step.load(std::memory_order_relaxed) == step) return c;
  }
}

uint32_t Board::Doorbell() const { return L(mem_)->doorbell.load(std::memory_order_acquire); }

void Board::WaitDoorbell(uint32_t seen, std::chrono::milliseconds timeout) {
  WaitRing(L(mem_), seen, timeout);
}

void Board::RingDoorbell() { Ring(L(mem_)); }

void Board::Close() {
  L(mem_)->closed.store(1, std::memory_order_release);
  Withdraw();
}

}  // namespace lk::board
