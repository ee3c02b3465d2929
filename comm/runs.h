// Pure parts of CommManager::AllReduceRuns: checking a member's runs and planning each pair's
// messages. Two members exchange exactly the runs they both hold and one of them owns, in the
// members' common run order, so each side computes the same message from its own list. No I/O,
// no threads.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <lightkeeper/status.h>
#include "comm/comm.h"

namespace lk::comm {

// Each run must lie inside the buffer, be non-empty, not overlap another, list `rank` among its
// holders (ascending, distinct, below `world`) and name one of them as its owner.
Status ValidateRuns(std::span<const ReduceRun> runs, size_t data_size, uint32_t rank,
                    uint32_t world);

struct RunPlan {
  // [peer]: the runs (indices, in order) this member sends to `peer`, their owner, and whose
  // result comes back from it.
  std::vector<std::vector<size_t>> to_owner;
  // [peer]: the runs this member owns that `peer` holds: its copies come in, results go out.
  std::vector<std::vector<size_t>> owned_with;
};
RunPlan PlanRuns(std::span<const ReduceRun> runs, uint32_t rank, uint32_t world);

// Elements in the runs `which` of `runs`.
size_t RunElements(std::span<const ReduceRun> runs, const std::vector<size_t>& which);

// Every message opens with {u32 magic, u32 codec id (0: raw float32), u64 elements}, so that a
// member with another codec or another plan is refused by name rather than read as garbage.
inline constexpr size_t kRunHeaderBytes = 16;
void WriteRunHeader(uint32_t codec_id, uint64_t elements, uint8_t* out);
// kConflict naming both sides when the header is not what this member expects.
Status CheckRunHeader(uint32_t codec_id, std::string_view codec_name, uint64_t elements,
                      const uint8_t* in, size_t from_rank);

}  // namespace lk::comm
