// The cross-group exchange of a quorum whose groups have different sizes (pure). Every group
// cuts each tensor into row shards of its own (MakeShardLayout), so a trainer of a 2-trainer
// group and one of a 3-trainer group hold overlapping but different rows. The fragments of the
// exchange are the rows between any two consecutive shard boundaries of any group in the
// quorum: each fragment lies whole inside one trainer of every group, so the cross-group average
// runs per fragment between the trainers that hold it, in each one's own layout, and no group
// copies its state into another's layout. The quorum's trainers form one communicator (the
// "mesh"): the groups in replica_rank order, each group's trainers in group_rank order.
// Fragments are cut further into runs of at most kMaxRunElems elements, and each run is owned
// (summed, then sent back) by the holder with the fewest elements owned so far, so that the
// work and the bytes spread over the trainers. Every member computes the same plan from the
// same inputs (the specs and the quorum's group sizes), which is what pairs up the messages.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "diloco/core.h"
#include <lightkeeper/diloco.h>
#include "diloco/outer.h"
#include "comm/comm.h"

namespace lk::diloco {

inline constexpr size_t kMaxRunElems = size_t{1} << 18;  // 1 MiB of float32

// True when the quorum's groups do not all have the same number of trainers.
bool MixedGroupSizes(std::span<const uint32_t> group_sizes);

struct MixedPlan {
  uint32_t mesh_rank = 0;
  uint32_t mesh_world = 0;
  std::vector<uint32_t> group_base;  // per replica_rank: the mesh rank of its group_rank 0
  // This trainer's runs over its shard (its ShardLayout order), in the quorum's common order
  // (tensor by tensor, row by row).
  std::vector<comm::ReduceRun> runs;
  // Per run of `runs`: where its first element lies in the whole model's flat buffer (the
  // place every member sees the same, which the exchange in fragments groups runs by).
  std::vector<size_t> run_full_begin;
  // Every run of the quorum, for tests and the simulation: which (replica_rank, group_rank)
  // holds elements [full_begin, full_end) of the flat buffer, and who owns it.
  struct Fragment {
    size_t full_begin = 0;
    size_t full_end = 0;
    std::vector<uint32_t> holders;  // mesh ranks, one per replica_rank
    uint32_t owner = 0;
  };
  std::vector<Fragment> all;
};

// `specs` must have passed ValidateSpecs; group_sizes[q] > 0 is replica_rank q's group size and
// group_rank is below group_sizes[replica_rank].
MixedPlan PlanMixed(const std::vector<TensorSpec>& specs, std::span<const uint32_t> group_sizes,
                    uint32_t replica_rank, uint32_t group_rank);

// The same runs shifted by `offset` elements (the momentum half of a [global, momentum] buffer).
std::vector<comm::ReduceRun> ShiftRuns(const std::vector<comm::ReduceRun>& runs, size_t offset);

// The state a group holds when its trainers report `trainers` (one per trainer): a step only when
// every trainer holds the same one; fresh when any trainer's is.
MemberState GroupState(std::span<const MemberState> trainers);

}  // namespace lk::diloco
