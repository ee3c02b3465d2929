#include "replica_agent/client/poll_board.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <new>

namespace lk::board {

namespace {

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

uint64_t MakeTicket(uint32_t gen, State st, uint32_t step) {
  return (static_cast<uint64_t>(gen & kGenMask) << 34) | (static_cast<uint64_t>(st) << 32) | step;
}
uint32_t GenOf(uint64_t t) { return static_cast<uint32_t>(t >> 34); }
State StateOf(uint64_t t) { return static_cast<State>((t >> 32) & 3); }
uint32_t StepOf(uint64_t t) { return static_cast<uint32_t>(t); }

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

Layout* L(void* mem) { return static_cast<Layout*>(mem); }

void StoreText(std::atomic<uint64_t>* words, std::string_view text) {
  for (size_t w = 0; w * 8 < text.size(); ++w) {
    uint64_t word = 0;
    std::memcpy(&word, text.data() + w * 8, std::min<size_t>(8, text.size() - w * 8));
    words[w].store(word, std::memory_order_relaxed);
  }
}

std::string LoadText(const std::atomic<uint64_t>* words, size_t n) {
  std::string out(n, '\0');
  for (size_t w = 0; w * 8 < n; ++w) {
    uint64_t word = words[w].load(std::memory_order_relaxed);
    std::memcpy(out.data() + w * 8, &word, std::min<size_t>(8, n - w * 8));
  }
  return out;
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is in a mapping shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

void Ring(Layout* l) {
  l->doorbell.fetch_add(1, std::memory_order_release);
  Futex(&l->doorbell, FUTEX_WAKE, INT32_MAX, nullptr);
}

// The latest publication's identity, if the ticket is in state `want`.
std::optional<Ticket> TicketIn(void* mem, State want) {
  uint64_t t = L(mem)->ticket.load(std::memory_order_acquire);
  if (StateOf(t) != want) return std::nullopt;
  return Ticket{GenOf(t), StepOf(t)};
}

Status Errno(const std::string& what, const std::string& path) {
  return Error(Code::kInternal, "{} {}: {}", what, path, std::strerror(errno));
}

}  // namespace

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
  timespec ts{static_cast<time_t>(timeout.count() / 1000), static_cast<long>(timeout.count() % 1000) * 1'000'000};
  Futex(&L(mem_)->doorbell, FUTEX_WAIT, seen, &ts);  // returns at once if it rang since `seen`
}

void Board::RingDoorbell() { Ring(L(mem_)); }

void Board::Close() {
  L(mem_)->closed.store(1, std::memory_order_release);
  Withdraw();
}

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
