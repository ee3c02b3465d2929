#include "comm/runs.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace lk::comm {

namespace {

constexpr uint32_t kRunMagic = 0x31524b4c;  // "LKR1"
static_assert(std::endian::native == std::endian::little, "headers are little-endian");

}  // namespace

Status ValidateRuns(std::span<const ReduceRun> runs, size_t data_size, uint32_t rank,
                    uint32_t world) {
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < runs.size(); ++i) {
    const ReduceRun& r = runs[i];
    if (r.count == 0 || r.offset > data_size || r.count > data_size - r.offset) {
      return InvalidArgument("run {} [{}, +{}) is empty or outside the buffer of {}", i, r.offset,
                             r.count, data_size);
    }
    if (r.holders.empty() || !std::is_sorted(r.holders.begin(), r.holders.end()) ||
        std::adjacent_find(r.holders.begin(), r.holders.end()) != r.holders.end() ||
        r.holders.back() >= world) {
      return InvalidArgument("run {}: holders must be distinct ranks below {}, ascending", i,
                             world);
    }
    if (!std::binary_search(r.holders.begin(), r.holders.end(), rank)) {
      return InvalidArgument("run {} is not held by this member (rank {})", i, rank);
    }
    if (!std::binary_search(r.holders.begin(), r.holders.end(), r.owner)) {
      return InvalidArgument("run {}: owner {} is not among its holders", i, r.owner);
    }
    spans.emplace_back(r.offset, r.offset + r.count);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return InvalidArgument("runs overlap");
  }
  return Status::Ok();
}

RunPlan PlanRuns(std::span<const ReduceRun> runs, uint32_t rank, uint32_t world) {
  RunPlan plan;
  plan.to_owner.resize(world);
  plan.owned_with.resize(world);
  for (size_t i = 0; i < runs.size(); ++i) {
    const ReduceRun& r = runs[i];
    if (r.owner != rank) {
      plan.to_owner[r.owner].push_back(i);
      continue;
    }
    for (uint32_t h : r.holders) {
      if (h != rank) plan.owned_with[h].push_back(i);
    }
  }
  return plan;
}

size_t RunElements(std::span<const ReduceRun> runs, const std::vector<size_t>& which) {
  size_t n = 0;
  for (size_t i : which) n += runs[i].count;
  return n;
}

void WriteRunHeader(uint32_t codec_id, uint64_t elements, uint8_t* out) {
  const uint32_t words[2] = {kRunMagic, codec_id};
  std::memcpy(out, words, sizeof(words));
  std::memcpy(out + sizeof(words), &elements, sizeof(elements));
}

Status CheckRunHeader(uint32_t codec_id, std::string_view codec_name, uint64_t elements,
                      const uint8_t* in, size_t from_rank) {
  uint32_t words[2];
  uint64_t theirs;
  std::memcpy(words, in, sizeof(words));
  std::memcpy(&theirs, in + sizeof(words), sizeof(theirs));
  if (words[0] != kRunMagic) {
    return Error(Code::kConflict, "rank {} sent no message of runs (magic {:#x})", from_rank,
                 words[0]);
  }
  if (words[1] != codec_id) {
    return Error(Code::kConflict, "rank {} encodes its runs with codec id {}, this member with {} ({})",
                 from_rank, words[1], codec_id, codec_name);
  }
  if (theirs != elements) {
    return Error(Code::kConflict,
                 "rank {} exchanges {} elements with this member, which expects {}: the members "
                 "planned different runs",
                 from_rank, theirs, elements);
  }
  return Status::Ok();
}

}  // namespace lk::comm
