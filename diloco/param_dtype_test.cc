// Table tests of the 16-bit parameter conversions (diloco/param_dtype.h): ties to even,
// overflow, subnormals, signed zeros, infinities and NaN, and the round trip of every 16-bit
// pattern. python/tests/test_bf16.py checks the same functions against torch bit for bit.
#include "diloco/param_dtype.h"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

namespace lk::diloco {
namespace {

float F(uint32_t bits) { return std::bit_cast<float>(bits); }

struct Row {
  uint32_t in;    // float32 bits
  uint16_t want;  // 16-bit bits
  const char* what;
};

}  // namespace

TEST_CASE("bf16 params round to nearest even, as torch's .to(torch.bfloat16)") {
  const Row rows[] = {
      {0x3f800000, 0x3f80, "1.0 exact"},
      {0x3f808000, 0x3f80, "tie between 0x3f80 and 0x3f81 goes to the even 0x3f80"},
      {0x3f818000, 0x3f82, "tie between 0x3f81 and 0x3f82 goes to the even 0x3f82"},
      {0x3f808001, 0x3f81, "just above the tie rounds up"},
      {0x3f807fff, 0x3f80, "just below the tie rounds down"},
      {0xbf808000, 0xbf80, "negative tie to even"},
      {0x7f7fffff, 0x7f80, "FLT_MAX overflows to +inf"},
      {0xff7fffff, 0xff80, "-FLT_MAX overflows to -inf"},
      {0x7f7f7fff, 0x7f7f, "the largest finite bf16 stays"},
      {0x7f800000, 0x7f80, "+inf"},
      {0xff800000, 0xff80, "-inf"},
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0 keeps its sign"},
      {0x00008000, 0x0000, "float subnormal tie goes to the even zero"},
      {0x00018000, 0x0002, "float subnormal tie goes to the even 2"},
      {0x00010000, 0x0001, "the smallest bf16 subnormal"},
      {0x007fffff, 0x0080, "the largest float subnormal rounds up to the smallest normal"},
  };
  for (const Row& r : rows) {
    CAPTURE(r.what);
    CHECK(FloatToBf16Param(F(r.in)) == r.want);
  }
  CHECK(std::isnan(Bf16ParamToFloat(FloatToBf16Param(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(Bf16ParamToFloat(FloatToBf16Param(F(0x7f800001)))));  // a signalling NaN
  CHECK(FloatToBf16Param(F(0xffc00000)) == 0xffc0);  // NaN keeps its sign and stays quiet
  CHECK(FloatToBf16Param(F(0x7f800001)) == 0x7fc0);  // a NaN never turns into infinity
}

TEST_CASE("fp16 params round to nearest even, as torch's .half()") {
  const Row rows[] = {
      {0x3f800000, 0x3c00, "1.0 exact"},
      {0x3f801000, 0x3c00, "tie between 0x3c00 and 0x3c01 goes to the even 0x3c00"},
      {0x3f803000, 0x3c02, "tie between 0x3c01 and 0x3c02 goes to the even 0x3c02"},
      {0x3f801001, 0x3c01, "just above the tie rounds up"},
      {0x477fe000, 0x7bff, "65504, the largest half"},
      {0x477fefff, 0x7bff, "just below 65520 stays finite"},
      {0x477ff000, 0x7c00, "65520 (the tie above 65504) goes to +inf"},
      {0xc77ff000, 0xfc00, "-65520 goes to -inf"},
      {0x7f7fffff, 0x7c00, "FLT_MAX overflows to +inf"},
      {0x7f800000, 0x7c00, "+inf"},
      {0xff800000, 0xfc00, "-inf"},
      {0x80000000, 0x8000, "-0 keeps its sign"},
      {0x38800000, 0x0400, "2^-14, the smallest normal half"},
      {0x387fc000, 0x03ff, "1023 * 2^-24, the largest subnormal half"},
      {0x387fe000, 0x0400, "the tie above it rounds up to the smallest normal (even)"},
      {0x387fa000, 0x03fe, "a subnormal tie goes to the even 0x3fe"},
      {0x33800000, 0x0001, "2^-24, the smallest subnormal half"},
      {0x33000000, 0x0000, "2^-25, the tie between 0 and 2^-24, goes to the even zero"},
      {0x33000001, 0x0001, "just above 2^-25 rounds up to 2^-24"},
      {0xb3000001, 0x8001, "and with a minus sign"},
      {0x33c00000, 0x0002, "1.5 * 2^-24 ties to the even 2"},
      {0x34200000, 0x0002, "2.5 * 2^-24 ties to the even 2"},
      {0x00000001, 0x0000, "a float subnormal goes to zero"},
      {0x80000001, 0x8000, "to a signed zero"},
  };
  for (const Row& r : rows) {
    CAPTURE(r.what);
    CHECK(FloatToFp16(F(r.in)) == r.want);
  }
  CHECK(FloatToFp16(F(0x7fc00000)) == 0x7e00);
  CHECK(FloatToFp16(F(0xffc00000)) == 0xfe00);
  CHECK(FloatToFp16(F(0x7f800001)) == 0x7e00);  // a NaN never turns into infinity
}

TEST_CASE("every 16-bit pattern widens exactly and narrows back to itself (NaN to a NaN)") {
  for (ParamDType dtype : {ParamDType::kBfloat16, ParamDType::kFloat16}) {
    CAPTURE(ParamDTypeName(dtype));
    std::vector<uint16_t> all(65536), back(65536);
    for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
    std::vector<float> wide(65536);
    WidenParams(dtype, all, wide);
    NarrowParams(dtype, wide, back);
    int mismatches = 0;
    for (uint32_t i = 0; i < 65536; ++i) {
      if (std::isnan(wide[i])) {
        const float again =
            dtype == ParamDType::kBfloat16 ? Bf16ParamToFloat(back[i]) : Fp16ToFloat(back[i]);
        if (!std::isnan(again)) ++mismatches;
      } else if (back[i] != all[i]) {
        ++mismatches;
      }
    }
    CHECK(mismatches == 0);
  }
  CHECK(Fp16ToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(Fp16ToFloat(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(Fp16ToFloat(0x0400) == std::ldexp(1.0f, -14));
  CHECK(Fp16ToFloat(0x7bff) == 65504.0f);
  CHECK(std::isinf(Fp16ToFloat(0xfc00)));
  CHECK(std::signbit(Fp16ToFloat(0x8000)));
  CHECK(Bf16ParamToFloat(0x3f80) == 1.0f);
}

TEST_CASE("param dtype names parse back, and unknown ones are refused") {
  for (ParamDType d : {ParamDType::kFloat32, ParamDType::kBfloat16, ParamDType::kFloat16}) {
    ParamDType back = ParamDType::kFloat32;
    CHECK(ParseParamDType(ParamDTypeName(d), &back));
    CHECK(back == d);
  }
  ParamDType out;
  CHECK_FALSE(ParseParamDType("int8", &out));
  CHECK_FALSE(ParseParamDType("", &out));
  CHECK(ParamDTypeBytes(ParamDType::kBfloat16) == 2);
  CHECK(ParamDTypeBytes(ParamDType::kFloat32) == 4);
}

}  // namespace lk::diloco
