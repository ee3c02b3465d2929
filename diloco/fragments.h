// The outer exchange in fragments (DilocoOptions::outer_fragments): the shard's sum is cut into
// pieces that go on the link one after the other, spread over the next inner steps, so that the
// link carries a steady trickle instead of one burst per outer step (pure). Every member of a
// collective must cut the same pieces: in a quorum of equal groups the members of a slot hold
// shards of the same length, so even cuts (aligned to the codec's blocks) agree; in a mixed
// quorum each trainer holds other rows, so its runs are grouped by their place in the whole
// model, which every member sees the same.
// Thread-safety: pure functions; Pacer is safe to call from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <span>
#include <vector>

#include "comm/comm.h"

namespace lk::diloco {

inline constexpr uint32_t kMaxOuterFragments = 64;

struct Range {
  size_t begin = 0;
  size_t end = 0;
};

// `pieces` consecutive ranges tiling [0, n), each boundary a multiple of `align` (the codec's
// block; 1 without one) except n itself. Some ranges are empty when n is small; every member
// with the same n gets the same ones.
std::vector<Range> FragmentRanges(size_t n, uint32_t pieces, size_t align);

// The runs of a mixed quorum's plan (MixedPlan::runs with their places full_begin in the whole
// model of `total` elements) in `pieces` groups: run i goes to the piece its first element's
// place falls in, total split evenly. Every member puts a run it shares with another member
// into the same piece, so each pair's messages pair up piece by piece.
std::vector<std::vector<comm::ReduceRun>> SplitRuns(std::span<const comm::ReduceRun> runs,
                                                    std::span<const size_t> full_begin,
                                                    size_t total, uint32_t pieces);

// Paces the pieces of one exchange: piece k may start `spacing` x k after the first, or at once
// once Hurry was called (the trainer waits to land the exchange, or it is being abandoned).
class Pacer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Pacer(std::chrono::milliseconds spacing) : spacing_(spacing), start_(Clock::now()) {}
  void WaitTurn(uint32_t k) {
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, start_ + spacing_ * k, [this] { return hurry_; });
  }
  void Hurry() {
    std::lock_guard lock(mu_);
    hurry_ = true;
    cv_.notify_all();
  }
  std::chrono::milliseconds spacing() const { return spacing_; }

 private:
  const std::chrono::milliseconds spacing_;
  const Clock::time_point start_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool hurry_ = false;
};

}  // namespace lk::diloco
