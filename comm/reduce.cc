#include "comm/reduce.h"

namespace lk::comm {

// Plain loops over restrict pointers. g++ 12 at -O2 leaves loops with a run-time trip count
// scalar (its "very cheap" vectoriser cost model), which made AddInto a fifth of the ring's CPU
// time; CMakeLists.txt builds this file at -O3 so that they become SSE loops. Vector lanes add
// and divide element by element, exactly like the scalar code, so results stay bitwise equal.
void WidenBf16(const uint16_t* __restrict in, float* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(in[i]);
}

void NarrowToBf16(const float* __restrict in, uint16_t* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = FloatToBf16(in[i]);
}

void AddInto(float* __restrict acc, const float* __restrict in, size_t count) {
  for (size_t i = 0; i < count; ++i) acc[i] += in[i];
}

void SumBf16(const uint16_t* __restrict mine, const uint16_t* __restrict in, float* __restrict out,
             size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(mine[i]) + Bf16ToFloat(in[i]);
}

void SumBf16Float(const uint16_t* __restrict mine, const float* __restrict in,
                  float* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(mine[i]) + in[i];
}

void Divide(float* data, size_t count, float divisor) {
  for (size_t i = 0; i < count; ++i) data[i] /= divisor;
}

}  // namespace lk::comm
