#include "common/float_env.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace lk {
namespace {

#if defined(__x86_64__)
constexpr uint64_t kFlush = 0x8000 | 0x0040;  // MXCSR FTZ | DAZ
constexpr uint64_t kRound = 0x6000;           // MXCSR RC, 00 = to nearest
constexpr uint64_t kTowardZero = 0x6000;
constexpr uint64_t kStatus = 0x003f;          // MXCSR exception flags, sticky: not the mode
#elif defined(__aarch64__)
constexpr uint64_t kFlush = uint64_t{1} << 24;  // FPCR FZ (inputs and results)
constexpr uint64_t kRound = uint64_t{3} << 22;  // FPCR RMode, 00 = to nearest
constexpr uint64_t kTowardZero = uint64_t{3} << 22;
constexpr uint64_t kStatus = 0;  // FPSR holds them
#else
constexpr uint64_t kFlush = 0, kRound = 0, kTowardZero = 0, kStatus = 0;
#endif

}  // namespace

uint64_t FloatControlWord() {
#if defined(__x86_64__)
  return _mm_getcsr();
#elif defined(__aarch64__)
  uint64_t w;
  asm volatile("mrs %0, fpcr" : "=r"(w));
  return w;
#else
  return 0;
#endif
}

void SetFloatControlWord(uint64_t word) {
#if defined(__x86_64__)
  _mm_setcsr(static_cast<unsigned>(word));
#elif defined(__aarch64__)
  asm volatile("msr fpcr, %0" : : "r"(word));
#else
  (void)word;
#endif
}

uint64_t WithFlushDenormals(uint64_t word, bool on) { return on ? word | kFlush : word & ~kFlush; }

uint64_t WithRoundTowardZero(uint64_t word) { return (word & ~kRound) | kTowardZero; }

uint64_t FloatMode(uint64_t word) { return word & ~kStatus; }

bool FixedFloatEnv::Active() { return kFlush != 0; }

// Out of line on purpose: the compiler cannot see into these calls, so it keeps loads and stores
// of memory the arithmetic works on between the constructor and the destructor.
FixedFloatEnv::FixedFloatEnv() : saved_(FloatControlWord()) {
  if (Active()) SetFloatControlWord((saved_ & ~kRound) | kFlush);
}

// The caller's mode comes back; exception flags raised meanwhile stay raised, as IEEE flags do.
FixedFloatEnv::~FixedFloatEnv() {
  if (Active()) SetFloatControlWord(FloatMode(saved_) | (FloatControlWord() & kStatus));
}

}  // namespace lk
