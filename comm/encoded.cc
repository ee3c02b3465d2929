#include "comm/encoded.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace lk::comm {

namespace {

constexpr uint32_t kMagic = 0x31434b4c;  // "LKC1"
static_assert(std::endian::native == std::endian::little, "headers are little-endian");

}  // namespace

Chunk EncodedChunk(size_t count, size_t block, size_t world, size_t index) {
  const size_t blocks = (count + block - 1) / block;
  Chunk c = RingChunk(blocks, world, index);
  const size_t begin = std::min(count, c.begin * block);
  const size_t end = std::min(count, (c.begin + c.size) * block);
  return {begin, end - begin};
}

void WriteEncodedHeader(const ChunkCodec& codec, uint64_t count, uint8_t* out) {
  const uint32_t words[2] = {kMagic, codec.id()};
  std::memcpy(out, words, sizeof(words));
  std::memcpy(out + sizeof(words), &count, sizeof(count));
}

Status CheckEncodedHeader(const ChunkCodec& codec, uint64_t count, const uint8_t* in,
                          size_t from_rank) {
  uint32_t words[2];
  uint64_t their_count;
  std::memcpy(words, in, sizeof(words));
  std::memcpy(&their_count, in + sizeof(words), sizeof(their_count));
  if (words[0] != kMagic) {
    return Error(Code::kConflict, "replica_rank {} sent no encoded chunk (magic {:#x})", from_rank,
                 words[0]);
  }
  if (words[1] != codec.id()) {
    return Error(Code::kConflict,
                 "replica_rank {} encodes with codec id {}, this member with {} ({})", from_rank,
                 words[1], codec.id(), codec.name());
  }
  if (their_count != count) {
    return Error(Code::kConflict, "replica_rank {} reduces {} elements, this member {}", from_rank,
                 their_count, count);
  }
  return Status::Ok();
}

void ReduceEncoded(const ChunkCodec& codec, const std::vector<const uint8_t*>& contributions,
                   size_t n, ReduceOp op, float* out, float* scratch) {
  if (n == 0 || contributions.empty()) return;
  codec.Decode(contributions[0], n, out);
  for (size_t r = 1; r < contributions.size(); ++r) {
    codec.Decode(contributions[r], n, scratch);
    AddInto(out, scratch, n);
  }
  if (op == ReduceOp::kAvg) Divide(out, n, static_cast<float>(contributions.size()));
}

}  // namespace lk::comm
