#include "common/poll_board.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

namespace lk::board {

namespace {

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is in a mapping shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

}  // namespace

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

void Ring(Layout* l) {
  l->doorbell.fetch_add(1, std::memory_order_release);
  Futex(&l->doorbell, FUTEX_WAKE, INT32_MAX, nullptr);
}

void WaitRing(Layout* l, uint32_t seen, std::chrono::milliseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000), static_cast<long>(timeout.count() % 1000) * 1'000'000};
  Futex(&l->doorbell, FUTEX_WAIT, seen, &ts);  // returns at once if it rang since `seen`
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

}  // namespace lk::board
