// The model's 16-bit parameter formats (DilocoOptions::param_dtype) and their exact conversions
// to and from the float32 outer state: what a bf16 or fp16 model hands the library and gets
// back. Pure: no I/O, no threads. Thread-safety: plain functions on caller-owned memory.
//
// Every member must hold bitwise-identical model weights after a commit, so the rounding is
// a pure function of the float32 bits (integer arithmetic only, whatever the floating-point
// environment): round to nearest, ties to even, as PyTorch's `.to(torch.bfloat16)` and
// `.half()` round. Overflow goes to infinity (fp16: from 65520 up), values below the smallest
// subnormal round to a signed zero, infinities stay, and a NaN stays a quiet NaN of the same
// sign (bf16 keeps its top payload bits, as the cross-group bf16 codec does).
#pragma once

#include <lightkeeper/diloco.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace lk::diloco {

// Bytes of one parameter element in `dtype` (4 or 2).
size_t ParamDTypeBytes(ParamDType dtype);

uint16_t FloatToFp16(float f);
float Fp16ToFloat(uint16_t h);
uint16_t FloatToBf16Param(float f);
float Bf16ParamToFloat(uint16_t b);

// in (16-bit `dtype`) -> out (float32), element by element; the sizes must match.
void WidenParams(ParamDType dtype, std::span<const uint16_t> in, std::span<float> out);
// in (float32) -> out (16-bit `dtype`), rounded as above; the sizes must match.
void NarrowParams(ParamDType dtype, std::span<const float> in, std::span<uint16_t> out);

}  // namespace lk::diloco
