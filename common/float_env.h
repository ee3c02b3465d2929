#pragma once

#include <cstdint>

namespace lk {

// For its lifetime, the calling thread computes float arithmetic with round-to-nearest and with
// denormals flushed to zero (results) and read as zero (inputs); the destructor restores what the
// thread had before.
//
// Every member of a DiLoCo job repeats the same outer arithmetic on the same inputs (the outer
// optimizer step, decoding an encoded sum, the overlapped stand-in) and must end with the same
// bits. Those bits depend on the thread's floating-point control word, which belongs to the
// caller: a trainer that calls torch.set_flush_denormal(True) or fesetround would otherwise
// compute a different global state than one that does not, as soon as a value is denormal (the
// outer momentum of a parameter without gradient decays into that range after some hundreds of
// steps). The library therefore fixes the mode around its own arithmetic. Flushing rather than
// gradual underflow, because denormal operands cost on the order of a hundred cycles each on
// x86 and the values flushed are below 1.2e-38, far under anything a model's weights resolve.
//
// x86-64 (MXCSR: FTZ, DAZ, rounding control) and AArch64 (FPCR: FZ, RMode); elsewhere the
// thread's mode is left as it is and Active() is false.
class FixedFloatEnv {
 public:
  FixedFloatEnv();
  ~FixedFloatEnv();
  FixedFloatEnv(const FixedFloatEnv&) = delete;
  FixedFloatEnv& operator=(const FixedFloatEnv&) = delete;

  // Whether this platform has a mode to fix.
  static bool Active();

 private:
  uint64_t saved_ = 0;
};

// Tests: the calling thread's control word (MXCSR or FPCR; 0 where neither exists), and setting
// it, to start from a caller's non-default mode.
uint64_t FloatControlWord();
void SetFloatControlWord(uint64_t word);

// Tests: the control word with flush-to-zero and denormals-are-zero on (the mode
// torch.set_flush_denormal(True) sets), or the same word with them off, rounding untouched.
uint64_t WithFlushDenormals(uint64_t word, bool on);
// Tests: the control word with the rounding mode set to round toward zero.
uint64_t WithRoundTowardZero(uint64_t word);
// Tests: the control word without its sticky exception flags (x86-64), i.e. the mode alone.
uint64_t FloatMode(uint64_t word);

}  // namespace lk
