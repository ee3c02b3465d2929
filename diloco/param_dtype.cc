#include "diloco/param_dtype.h"

#include <lightkeeper/check.h>

#include <bit>

#include "comm/reduce.h"

namespace lk::diloco {

std::string_view ParamDTypeName(ParamDType dtype) {
  switch (dtype) {
    case ParamDType::kFloat32:
      return "float32";
    case ParamDType::kBfloat16:
      return "bf16";
    case ParamDType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

bool ParseParamDType(std::string_view name, ParamDType* out) {
  if (name == "float32" || name == "float" || name == "fp32") {
    *out = ParamDType::kFloat32;
  } else if (name == "bf16" || name == "bfloat16") {
    *out = ParamDType::kBfloat16;
  } else if (name == "fp16" || name == "float16" || name == "half") {
    *out = ParamDType::kFloat16;
  } else {
    return false;
  }
  return true;
}

size_t ParamDTypeBytes(ParamDType dtype) { return dtype == ParamDType::kFloat32 ? 4 : 2; }

uint16_t FloatToBf16Param(float f) { return comm::FloatToBf16(f); }
float Bf16ParamToFloat(uint16_t b) { return comm::Bf16ToFloat(b); }

uint16_t FloatToFp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN: quiet, sign kept (PyTorch's rule)
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (half-way past 65504): infinity
  if (a >= 0x38800000u) {
    // A normal half (>= 2^-14): drop 13 mantissa bits, rounding to nearest even; a carry moves
    // into the exponent as it should. 0x38000000 rebiases the exponent from 127 to 15.
    const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (a <= 0x33000000u) return sign;  // at most 2^-25, half the smallest subnormal: to zero
  // A subnormal half: the value in units of 2^-24, rounded to nearest even (the largest ones
  // round up to 0x0400, the smallest normal, which is the right encoding).
  const uint32_t exp = a >> 23;  // in [102, 112]
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // in [14, 24]
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // A subnormal half is a normal float: shift the mantissa up to its leading one.
  const int lead = std::countl_zero(mant) - 21;  // mant << lead has bit 10 set
  mant <<= lead;
  return std::bit_cast<float>(sign | static_cast<uint32_t>(113 - lead) << 23 |
                              ((mant & 0x3ffu) << 13));
}

void WidenParams(ParamDType dtype, std::span<const uint16_t> in, std::span<float> out) {
  LK_CHECK(in.size() == out.size());
  LK_CHECK(dtype != ParamDType::kFloat32);
  if (dtype == ParamDType::kBfloat16) {
    comm::WidenBf16(in.data(), out.data(), in.size());
    return;
  }
  for (size_t i = 0; i < in.size(); ++i) out[i] = Fp16ToFloat(in[i]);
}

void NarrowParams(ParamDType dtype, std::span<const float> in, std::span<uint16_t> out) {
  LK_CHECK(in.size() == out.size());
  LK_CHECK(dtype != ParamDType::kFloat32);
  if (dtype == ParamDType::kBfloat16) {
    comm::NarrowToBf16(in.data(), out.data(), in.size());
    return;
  }
  for (size_t i = 0; i < in.size(); ++i) out[i] = FloatToFp16(in[i]);
}

}  // namespace lk::diloco
