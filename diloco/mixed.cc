#include "diloco/mixed.h"

#include <algorithm>

#include "common/log.h"

namespace lk::diloco {

namespace {

// The first row of rank k in the even row split of `rows` over `ranks` (the checkpoint
// library's split, as MakeShardLayout cuts it): the first rows % ranks ranks hold one more.
int64_t RowBegin(int64_t rows, uint32_t ranks, uint32_t k) {
  const int64_t base = rows / ranks, extra = rows % ranks;
  return k * base + std::min<int64_t>(k, extra);
}

// The rank of that split holding `row` (< rows): the last rank whose first row is at most
// `row`. Ranks that hold no rows all start at `rows`, past it, so the answer holds rows.
uint32_t RankOfRow(int64_t rows, uint32_t ranks, int64_t row) {
  uint32_t lo = 0, hi = ranks - 1;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo + 1) / 2;
    if (RowBegin(rows, ranks, mid) <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace

bool MixedGroupSizes(std::span<const uint32_t> group_sizes) {
  return std::adjacent_find(group_sizes.begin(), group_sizes.end(), std::not_equal_to<>()) !=
         group_sizes.end();
}

MixedPlan PlanMixed(const std::vector<TensorSpec>& specs, std::span<const uint32_t> group_sizes,
                    uint32_t replica_rank, uint32_t group_rank) {
  LK_CHECK(replica_rank < group_sizes.size() && group_rank < group_sizes[replica_rank])
      << "replica_rank " << replica_rank << " group_rank " << group_rank;
  MixedPlan plan;
  for (uint32_t g : group_sizes) {
    LK_CHECK(g > 0) << "a group of no trainers";
    plan.group_base.push_back(plan.mesh_world);
    plan.mesh_world += g;
  }
  plan.mesh_rank = plan.group_base[replica_rank] + group_rank;
  const uint32_t own_size = group_sizes[replica_rank];
  const ShardLayout mine = MakeShardLayout(specs, own_size, group_rank);
  std::vector<uint32_t> sizes(group_sizes.begin(), group_sizes.end());
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  std::vector<size_t> owned(plan.mesh_world, 0);  // elements owned so far, per mesh rank
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    const int64_t rows = s.shape.empty() ? 1 : s.shape[0];
    const size_t row_numel = s.shape.empty() ? 1 : s.numel() / static_cast<size_t>(rows);
    // A scalar is one row, and rank 0 of every split holds it, as MakeShardLayout has it.
    std::vector<int64_t> cuts;
    for (uint32_t g : sizes) {
      for (uint32_t k = 0; k <= g; ++k) cuts.push_back(RowBegin(rows, g, k));
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    const ShardPiece* piece = nullptr;
    for (const ShardPiece& p : mine.pieces) {
      if (p.spec == i) piece = &p;
    }
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const int64_t a = cuts[c], b = cuts[c + 1];
      std::vector<uint32_t> holders;
      uint32_t own_holder = 0;
      for (size_t q = 0; q < group_sizes.size(); ++q) {
        const uint32_t k = RankOfRow(rows, group_sizes[q], a);
        holders.push_back(plan.group_base[q] + k);
        if (q == replica_rank) own_holder = k;
      }
      const size_t begin = s.offset + static_cast<size_t>(a) * row_numel;
      const size_t end = s.offset + static_cast<size_t>(b) * row_numel;
      for (size_t at = begin; at < end; at += kMaxRunElems) {
        const size_t n = std::min(kMaxRunElems, end - at);
        uint32_t owner = holders[0];
        for (uint32_t h : holders) {
          if (owned[h] < owned[owner]) owner = h;
        }
        owned[owner] += n;
        plan.all.push_back({at, at + n, holders, owner});
        if (own_holder != group_rank) continue;
        LK_CHECK(piece != nullptr && a >= piece->row_begin && b <= piece->row_end)
            << "fragment outside this trainer's shard";
        const size_t shard_at =
            piece->shard_offset + static_cast<size_t>(a - piece->row_begin) * row_numel +
            (at - begin);
        plan.runs.push_back(comm::ReduceRun{shard_at, n, holders, owner});
        plan.run_full_begin.push_back(at);
      }
    }
  }
  return plan;
}

std::vector<comm::ReduceRun> ShiftRuns(const std::vector<comm::ReduceRun>& runs, size_t offset) {
  std::vector<comm::ReduceRun> out = runs;
  for (comm::ReduceRun& r : out) r.offset += offset;
  return out;
}

MemberState GroupState(std::span<const MemberState> trainers) {
  if (trainers.empty()) return {};
  MemberState group = trainers[0];
  for (const MemberState& t : trainers) {
    if (!t.has_state || t.step != trainers[0].step) return {};
    group.fresh = group.fresh || t.fresh;  // one trainer's own start weights: the group's too
  }
  return group;
}

}  // namespace lk::diloco
