#include "lighthouse/divergence.h"

#include <map>

namespace lk::lighthouse {

const char* RuleName(ReferenceRule rule) {
  switch (rule) {
    case ReferenceRule::kNone: return "none";
    case ReferenceRule::kMajority: return "majority";
    case ReferenceRule::kMost: return "most";
    case ReferenceRule::kTieLowestRank: return "tie_lowest_replica_rank";
  }
  return "none";
}

DivergenceVerdict JudgeStateHashes(const std::vector<std::string>& hashes) {
  struct Count {
    size_t members = 0;
    uint32_t first_rank = 0;
  };
  std::map<std::string, Count> counts;
  size_t reported = 0;
  for (uint32_t r = 0; r < hashes.size(); ++r) {
    if (hashes[r].empty()) continue;
    ++reported;
    auto [it, inserted] = counts.try_emplace(hashes[r], Count{0, r});
    ++it->second.members;
  }
  DivergenceVerdict v;
  v.off.assign(hashes.size(), false);
  const std::string* best = nullptr;
  const Count* best_count = nullptr;
  size_t holding_best = 0;  // how many hashes share the largest count
  for (const auto& [hash, c] : counts) {
    const bool more = best_count == nullptr || c.members > best_count->members;
    const bool same = !more && c.members == best_count->members;
    if (more) {
      holding_best = 1;
    } else if (same) {
      ++holding_best;
    }
    if (more || (same && c.first_rank < best_count->first_rank)) {
      best = &hash;
      best_count = &c;
    }
  }
  if (best == nullptr) return v;
  if (best_count->members * 2 > hashes.size()) {
    v.rule = ReferenceRule::kMajority;
  } else if (reported < hashes.size()) {
    return v;
  } else {
    v.rule = holding_best > 1 ? ReferenceRule::kTieLowestRank : ReferenceRule::kMost;
  }
  v.reference = *best;
  v.reference_rank = best_count->first_rank;
  for (size_t r = 0; r < hashes.size(); ++r) {
    v.off[r] = !hashes[r].empty() && hashes[r] != v.reference;
  }
  return v;
}

}  // namespace lk::lighthouse
