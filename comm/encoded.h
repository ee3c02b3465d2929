// Pure parts of the encoded allreduce (CommManager::AllReduceEncoded): which elements each
// member owns, the header every message carries, and the owner's reduction of the encoded
// contributions. No I/O, no threads.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <lightkeeper/status.h>
#include "comm/comm.h"
#include "comm/reduce.h"

namespace lk::comm {

// Chunk `index` of `count` elements over `world` owners, in whole blocks of `block` elements
// (the last chunk holding a non-empty one may end in a short block): RingChunk over the blocks.
Chunk EncodedChunk(size_t count, size_t block, size_t world, size_t index);

// Every message opens with {u32 magic, u32 codec id, u64 total count}, little-endian, so that
// a member of another codec or another size is refused by name rather than decoded as garbage.
inline constexpr size_t kEncodedHeaderBytes = 16;
void WriteEncodedHeader(const ChunkCodec& codec, uint64_t count, uint8_t* out);
// kConflict naming both sides when the header is not this member's.
Status CheckEncodedHeader(const ChunkCodec& codec, uint64_t count, const uint8_t* in,
                          size_t from_rank);

// The owner's part: `contributions[r]` is member r's encoding of the chunk (n elements), in
// replica_rank order. Decodes each, sums them in float32 in that order (the first is copied, so
// a lone member's result is its decoded contribution), and divides by world for kAvg.
// `scratch` holds n floats.
void ReduceEncoded(const ChunkCodec& codec, const std::vector<const uint8_t*>& contributions,
                   size_t n, ReduceOp op, float* out, float* scratch);

}  // namespace lk::comm
