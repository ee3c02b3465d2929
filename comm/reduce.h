// Pure helpers of the CPU allreduce: bfloat16 <-> float32 conversion, the ring's chunk plan and
// the element-wise reductions. No I/O, no threads.
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace lk::comm {

inline float Bf16ToFloat(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

// Rounds to nearest, ties to even, as PyTorch does; NaN stays a (quiet) NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void WidenBf16(const uint16_t* in, float* out, size_t count);
void NarrowToBf16(const float* in, uint16_t* out, size_t count);
void AddInto(float* acc, const float* in, size_t count);
// out[i] = widened mine[i] + widened in[i] (resp. + in[i]): the same float32 additions, in the
// same operand order, as widening `mine` into `out` first and then adding into it.
void SumBf16(const uint16_t* mine, const uint16_t* in, float* out, size_t count);
void SumBf16Float(const uint16_t* mine, const float* in, float* out, size_t count);
// Divides rather than multiplying by the reciprocal, so that an average is exactly sum / n.
void Divide(float* data, size_t count, float divisor);

// The ring splits `count` elements into `parts` contiguous chunks whose sizes differ by at most
// one; chunk `index` is [begin, begin + size).
struct Chunk {
  size_t begin = 0;
  size_t size = 0;
};
inline Chunk RingChunk(size_t count, size_t parts, size_t index) {
  size_t base = count / parts;
  size_t rem = count % parts;
  size_t begin = index * base + (index < rem ? index : rem);
  return {begin, base + (index < rem ? 1 : 0)};
}

// Which chunk a member sends and receives at `step` of the reduce-scatter phase (steps
// 0..world-2); the allgather phase is the same ring shifted by one.
inline size_t Mod(int64_t v, size_t n) {
  int64_t m = v % static_cast<int64_t>(n);
  return static_cast<size_t>(m < 0 ? m + static_cast<int64_t>(n) : m);
}
inline size_t ReduceScatterSendChunk(size_t rank, size_t world, size_t step) {
  return Mod(static_cast<int64_t>(rank) - static_cast<int64_t>(step), world);
}
inline size_t ReduceScatterRecvChunk(size_t rank, size_t world, size_t step) {
  return Mod(static_cast<int64_t>(rank) - static_cast<int64_t>(step) - 1, world);
}
inline size_t AllGatherSendChunk(size_t rank, size_t world, size_t step) {
  return Mod(static_cast<int64_t>(rank) + 1 - static_cast<int64_t>(step), world);
}
inline size_t AllGatherRecvChunk(size_t rank, size_t world, size_t step) {
  return Mod(static_cast<int64_t>(rank) - static_cast<int64_t>(step), world);
}

// The two phases as one sequence of 2(world-1) steps: reduce-scatter steps 0..world-2, then the
// allgather. The chunk a member receives at step s is the chunk it sends at step s+1, which is
// what lets the ring forward each segment as soon as it has arrived (and been reduced) instead
// of waiting for the whole step.
inline size_t RingSteps(size_t world) { return world < 2 ? 0 : 2 * (world - 1); }
inline bool RingStepReduces(size_t world, size_t step) { return step + 1 < world; }
inline size_t RingSendChunk(size_t rank, size_t world, size_t step) {
  return RingStepReduces(world, step) ? ReduceScatterSendChunk(rank, world, step)
                                      : AllGatherSendChunk(rank, world, step - (world - 1));
}
inline size_t RingRecvChunk(size_t rank, size_t world, size_t step) {
  return RingStepReduces(world, step) ? ReduceScatterRecvChunk(rank, world, step)
                                      : AllGatherRecvChunk(rank, world, step - (world - 1));
}

// Error feedback on n values, as the trainer keeps it for what it sends (comm/compress.h) and
// the owner of a chunk for the result it encodes (result_feedback): AddFeedback makes
// values += residual (float32 additions) before the encoding; KeepFeedback stores
// residual = encoded - decoded where decoded is finite, 0 where it is not (a NaN block), so a
// diverged step's NaN reaches that step's average but is not carried into every later one.
inline void AddFeedback(float* values, const float* residual, size_t n) {
  for (size_t i = 0; i < n; ++i) values[i] += residual[i];
}
inline void KeepFeedback(const float* encoded, const float* decoded, float* residual, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    residual[i] = std::isfinite(decoded[i]) ? encoded[i] - decoded[i] : 0.0f;
  }
}

}  // namespace lk::comm
