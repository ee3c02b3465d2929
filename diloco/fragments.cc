#include "diloco/fragments.h"

#include <algorithm>

#include "common/log.h"

namespace lk::diloco {

std::vector<Range> FragmentRanges(size_t n, uint32_t pieces, size_t align) {
  LK_CHECK(pieces > 0 && align > 0) << "pieces " << pieces << " align " << align;
  std::vector<Range> out(pieces);
  size_t at = 0;
  for (uint32_t k = 0; k < pieces; ++k) {
    size_t end = n;
    if (k + 1 < pieces) {
      end = n / pieces * (k + 1) + n % pieces * (k + 1) / pieces;  // floor(n (k+1) / pieces)
      end = std::max(at, end / align * align);
    }
    out[k] = {at, end};
    at = end;
  }
  return out;
}

std::vector<std::vector<comm::ReduceRun>> SplitRuns(std::span<const comm::ReduceRun> runs,
                                                    std::span<const size_t> full_begin,
                                                    size_t total, uint32_t pieces) {
  LK_CHECK(runs.size() == full_begin.size() && pieces > 0 && total > 0)
      << runs.size() << " runs, " << full_begin.size() << " places";
  std::vector<std::vector<comm::ReduceRun>> out(pieces);
  for (size_t i = 0; i < runs.size(); ++i) {
    // The piece of place p: the largest k with k * total / pieces <= p, in exact integers.
    const size_t k = std::min<size_t>(
        pieces - 1, static_cast<size_t>((static_cast<unsigned __int128>(full_begin[i]) * pieces) / total));
    out[k].push_back(runs[i]);
  }
  return out;
}

}  // namespace lk::diloco
