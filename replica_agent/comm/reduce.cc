#include "replica_agent/comm/reduce.h"

namespace lk::comm {

// Plain loops over restrict pointers: g++ -O2 vectorises them, which keeps the reduction well
// ahead of loopback TCP.
void WidenBf16(const uint16_t* __restrict in, float* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(in[i]);
}

void NarrowToBf16(const float* __restrict in, uint16_t* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = FloatToBf16(in[i]);
}

void AddInto(float* __restrict acc, const float* __restrict in, size_t count) {
  for (size_t i = 0; i < count; ++i) acc[i] += in[i];
}

void Divide(float* data, size_t count, float divisor) {
  for (size_t i = 0; i < count; ++i) data[i] /= divisor;
}

}  // namespace lk::comm
