// Exact tests of the outer-step codecs and their error feedback (comm/compress.h): known inputs
// give known bytes and known decoded values; zeros, one repeated value, NaN and infinities, and
// lengths that are not a multiple of the block; the residual's bookkeeping step by step.
#include "comm/compress.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "comm/reduce.h"

namespace lk::comm {
namespace {

constexpr Codec kAll[] = {Codec::kNone, Codec::kBf16, Codec::kInt8,
                                  Codec::kInt4};
constexpr Codec kLossy[] = {Codec::kBf16, Codec::kInt8,
                                    Codec::kInt4};

std::vector<uint8_t> EncodeAll(Codec c, const std::vector<float>& in) {
  std::vector<uint8_t> out(EncodedBytes(c, in.size()));
  Encode(c, in, out);
  return out;
}

std::vector<float> RoundTrip(Codec c, const std::vector<float>& in) {
  std::vector<float> out(in.size());
  Decode(c, EncodeAll(c, in), out);
  return out;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Values over many magnitudes and both signs, with exact zeros among them.
std::vector<float> Mixed(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-20, 4);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i % 17 == 3 ? 0.0f : std::ldexp(u(rng), e(rng));
  return v;
}

TEST_CASE("codec names parse back and unknown names are refused") {
  for (Codec c : kAll) {
    Codec got = Codec::kNone;
    REQUIRE(ParseCodec(CodecName(c), &got));
    CHECK(got == c);
  }
  Codec got;
  CHECK_FALSE(ParseCodec("int2", &got));
  CHECK_FALSE(ParseCodec("", &got));
  CHECK(CodecName(Codec::kInt4) == "int4");
}

TEST_CASE("encoded sizes: 4-byte scale per 128-element block, a short last block, none empty") {
  CHECK(EncodedBytes(Codec::kNone, 3) == 12);
  CHECK(EncodedBytes(Codec::kBf16, 3) == 6);
  CHECK(EncodedBytes(Codec::kInt8, 0) == 0);
  CHECK(EncodedBytes(Codec::kInt8, 128) == 132);
  CHECK(EncodedBytes(Codec::kInt8, 129) == 132 + 5);
  CHECK(EncodedBytes(Codec::kInt4, 128) == 68);
  CHECK(EncodedBytes(Codec::kInt4, 131) == 68 + 4 + 2);
  CHECK(EncodedBytes(Codec::kInt4, 1) == 5);
  CHECK(MaxEncodedBytes(1) == 5);  // int8 and int4 (4 + 1) beat float32 (4) for one element
  CHECK(MaxEncodedBytes(1000) == 4000);
  CHECK(BlockElems(Codec::kInt8) == kCompressBlockElems);
  CHECK(BlockElems(Codec::kBf16) == 1);
  // The ratios the benchmark's goals rest on (issue: int8 <= 0.27x, int4 <= 0.14x).
  const double n = 1 << 20;
  CHECK(EncodedBytes(Codec::kInt8, 1 << 20) / (4 * n) == doctest::Approx(0.2578125));
  CHECK(EncodedBytes(Codec::kInt4, 1 << 20) / (4 * n) == doctest::Approx(0.1328125));
}

TEST_CASE("int8 known bytes and values: absmax scale, round half to even, decode (q/127)*absmax") {
  const std::vector<float> in = {1.0f, -0.5f, 0.25f, 0.0f};
  // absmax 1.0f = 0x3f800000; -0.5 * 127 = -63.5 rounds to -64 (even); 0.25 * 127 = 31.75 -> 32.
  const std::vector<uint8_t> want = {0x00, 0x00, 0x80, 0x3f, 0x7f, 0xc0, 0x20, 0x00};
  CHECK(EncodeAll(Codec::kInt8, in) == want);
  auto out = RoundTrip(Codec::kInt8, in);
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -64.0f / 127.0f);
  CHECK(out[2] == 32.0f / 127.0f);
  CHECK(SameBits(out[3], 0.0f));
}

TEST_CASE("int4 known bytes and values: two codes per byte, low nibble first") {
  const std::vector<float> in = {1.0f, -0.5f, 0.25f, 0.0f, -1.0f};
  // Codes 7, -4 (-3.5 to even), 2 (1.75), 0, -7: nibbles 0x7 0xc | 0x2 0x0 | 0x9.
  const std::vector<uint8_t> want = {0x00, 0x00, 0x80, 0x3f, 0xc7, 0x02, 0x09};
  CHECK(EncodeAll(Codec::kInt4, in) == want);
  auto out = RoundTrip(Codec::kInt4, in);
  CHECK(out == std::vector<float>{1.0f, -4.0f / 7.0f, 2.0f / 7.0f, 0.0f, -1.0f});
}

TEST_CASE("bf16 known bytes: round to nearest even of the float32 bits") {
  const std::vector<float> in = {1.0f, -2.5f, 1.0f + std::ldexp(1.0f, -8)};
  const std::vector<uint8_t> want = {0x80, 0x3f, 0x20, 0xc0, 0x80, 0x3f};  // the tie goes to 1
  CHECK(EncodeAll(Codec::kBf16, in) == want);
  CHECK(RoundTrip(Codec::kBf16, in) == std::vector<float>{1.0f, -2.5f, 1.0f});
}

TEST_CASE("none is the float32 bits themselves") {
  const std::vector<float> in = {0.1f, -3e-38f, 7.0f};
  auto bytes = EncodeAll(Codec::kNone, in);
  CHECK(std::memcmp(bytes.data(), in.data(), bytes.size()) == 0);
  CHECK(RoundTrip(Codec::kNone, in) == in);
}

TEST_CASE("zeros, negative zeros and a block of one repeated value come back exactly") {
  for (Codec c : kAll) {
    CAPTURE(CodecName(c));
    std::vector<float> zeros(200, 0.0f);
    zeros[5] = -0.0f;
    auto z = RoundTrip(c, zeros);
    for (size_t i = 0; i < z.size(); ++i) CHECK(z[i] == 0.0f);
    if (c == Codec::kInt8 || c == Codec::kInt4) {
      auto bytes = EncodeAll(c, zeros);
      CHECK(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; }));
      CHECK(SameBits(z[5], 0.0f));  // code 0 decodes to +0
    }
    for (float v : {0.3f, -0.3f, 1e-30f, 3e38f}) {
      std::vector<float> same(kCompressBlockElems, v);
      auto back = RoundTrip(c, same);
      if (c == Codec::kBf16) {
        for (float x : back) CHECK(x == comm::Bf16ToFloat(comm::FloatToBf16(v)));
      } else {
        for (float x : back) CHECK(SameBits(x, v));
      }
    }
  }
}

TEST_CASE("int8 and int4: every block's largest element is exact, the others within half a step") {
  for (Codec c : {Codec::kInt8, Codec::kInt4}) {
    const float levels = c == Codec::kInt8 ? 127.0f : 7.0f;
    for (size_t n : {1, 2, 127, 128, 129, 255, 1000}) {
      CAPTURE(n);
      auto in = Mixed(n, static_cast<uint32_t>(n));
      auto out = RoundTrip(c, in);
      for (size_t b = 0; b < n; b += kCompressBlockElems) {
        const size_t end = std::min(n, b + kCompressBlockElems);
        float absmax = 0;
        size_t at = b;
        for (size_t i = b; i < end; ++i) {
          if (std::fabs(in[i]) > absmax) absmax = std::fabs(in[i]), at = i;
        }
        CHECK(out[at] == in[at]);
        for (size_t i = b; i < end; ++i) {
          // Half a step, plus the two roundings of the decode ((q / L) * absmax).
          CHECK(std::fabs(out[i] - in[i]) <= absmax / levels * 0.5f + absmax * 4e-7f);
        }
      }
    }
  }
}

TEST_CASE("a span cut at a block boundary encodes as the concatenation of its parts") {
  // The compressed collective encodes each owner's chunk alone; chunks start at multiples of the
  // block, so the bytes must be those of the whole span.
  for (Codec c : kAll) {
    auto in = Mixed(3 * kCompressBlockElems + 41, 9);
    auto whole = EncodeAll(c, in);
    const size_t cut = 2 * kCompressBlockElems;
    auto head = EncodeAll(c, std::vector<float>(in.begin(), in.begin() + cut));
    auto tail = EncodeAll(c, std::vector<float>(in.begin() + cut, in.end()));
    head.insert(head.end(), tail.begin(), tail.end());
    CHECK(head == whole);
  }
}

TEST_CASE("NaN or infinity makes its whole block NaN, other blocks untouched, residual zero") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf, -inf}) {
    for (Codec c : {Codec::kInt8, Codec::kInt4}) {
      auto in = Mixed(2 * kCompressBlockElems + 10, 3);
      in[kCompressBlockElems + 7] = bad;  // in the second block
      auto out = RoundTrip(c, in);
      for (size_t i = 0; i < out.size(); ++i) {
        const bool second = i >= kCompressBlockElems && i < 2 * kCompressBlockElems;
        CHECK(std::isnan(out[i]) == second);
      }
      std::vector<float> residual(in.size());
      KeepResidual(in, out, residual);
      for (size_t i = kCompressBlockElems; i < 2 * kCompressBlockElems; ++i) {
        CHECK(residual[i] == 0.0f);
      }
      CHECK(residual[0] == in[0] - out[0]);
    }
    // bf16 keeps them element by element.
    std::vector<float> in = {1.0f, bad, 2.0f};
    auto out = RoundTrip(Codec::kBf16, in);
    CHECK(out[0] == 1.0f);
    CHECK(out[2] == 2.0f);
    if (std::isnan(bad)) {
      CHECK(std::isnan(out[1]));
    } else {
      CHECK(out[1] == bad);
    }
    std::vector<float> residual(3, 5.0f);
    KeepResidual(in, out, residual);
    CHECK(residual == std::vector<float>{0.0f, 0.0f, 0.0f});
  }
}

TEST_CASE("error feedback: residual is input minus decoded, and decoded plus residual is input") {
  for (Codec c : kLossy) {
    CAPTURE(CodecName(c));
    auto x = Mixed(1000, 21);
    auto d = RoundTrip(c, x);
    std::vector<float> r(x.size());
    KeepResidual(x, d, r);
    for (size_t i = 0; i < x.size(); ++i) {
      CHECK(SameBits(r[i], x[i] - d[i]));
      CHECK(d[i] + r[i] == x[i]);  // the subtraction was exact
    }
  }
}

TEST_CASE("error feedback over steps: sum of decoded plus final residual is the sum of inputs") {
  // x_t = fl(g_t + r_{t-1}); decoded_t + r_t == x_t exactly, so
  // sum decoded_t + r_T - sum g_t = sum (x_t - g_t - r_{t-1}), each term one rounding of the
  // addition: at most half an ulp of x_t. Checked per element in double precision.
  const size_t n = 700, steps = 12;
  for (Codec c : kLossy) {
    CAPTURE(CodecName(c));
    std::vector<float> residual(n, 0.0f);
    std::vector<double> sum_in(n, 0), sum_dec(n, 0), bound(n, 0);
    for (size_t t = 0; t < steps; ++t) {
      auto g = Mixed(n, static_cast<uint32_t>(100 + t));
      std::vector<float> x = g;
      AddResidual(residual, x);
      auto d = RoundTrip(c, x);
      KeepResidual(x, d, residual);
      for (size_t i = 0; i < n; ++i) {
        sum_in[i] += g[i];
        sum_dec[i] += d[i];
        const float ax = std::fabs(x[i]);
        bound[i] += 0.5 * (std::nextafter(ax, std::numeric_limits<float>::infinity()) - ax);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      CHECK(std::fabs(sum_dec[i] + residual[i] - sum_in[i]) <= bound[i] * (1 + 1e-9) + 1e-300);
    }
  }
}

TEST_CASE("error feedback delivers a small steady pseudo-gradient that int4 alone rounds away") {
  // One element far below its block's step (1/7 of the absmax) is coded 0 every time without
  // feedback; with it, the decoded values add up to the inputs within one step of the grid.
  const size_t steps = 40;
  std::vector<float> residual(2, 0.0f);
  double sent = 0, plain = 0;
  for (size_t t = 0; t < steps; ++t) {
    std::vector<float> g = {1.0f, 0.02f};
    plain += RoundTrip(Codec::kInt4, g)[1];
    AddResidual(residual, g);
    auto d = RoundTrip(Codec::kInt4, g);
    KeepResidual(g, d, residual);
    sent += d[1];
  }
  CHECK(plain == 0.0);
  CHECK(std::fabs(sent - 0.02 * steps) <= 1.0 / 7.0);
}

TEST_CASE("ErrorFeedback: a staged residual counts once its step commits, a retry meets the old") {
  ErrorFeedback fb;
  fb.Reset(2);
  const std::vector<float> first_sent = {1.0f, 2.0f}, first_decoded = {0.75f, 2.0f};
  std::vector<float> v = {1.0f, 2.0f};
  fb.Apply(/*committed_step=*/4, v);  // residual zero: unchanged
  CHECK(v == std::vector<float>{1.0f, 2.0f});
  fb.Stage(4, first_sent, first_decoded);  // for step 5
  // The attempt was thrown away: the retry at committed step 4 meets the zero residual again.
  v = {1.0f, 2.0f};
  fb.Apply(4, v);
  CHECK(v == std::vector<float>{1.0f, 2.0f});
  fb.Stage(4, first_sent, first_decoded);
  // Step 5 committed: the next exchange adds what step 5's encoding dropped.
  v = {10.0f, 20.0f};
  fb.Apply(5, v);
  CHECK(v == std::vector<float>{10.25f, 20.0f});
  CHECK(fb.residual()[0] == 0.25f);
  // A heal: zeros, and a staged residual of before it never comes back.
  fb.Stage(5, std::vector<float>{1.0f, 1.0f}, std::vector<float>{0.5f, 0.5f});
  fb.Reset(2);
  v = {1.0f, 1.0f};
  fb.Apply(6, v);
  CHECK(v == std::vector<float>{1.0f, 1.0f});
}

TEST_CASE("ErrorFeedback: the result residual is staged with the other, and dropped with it") {
  ErrorFeedback fb;
  fb.Reset(2);
  std::vector<float> v = {1.0f, 2.0f};
  fb.Apply(4, v);
  REQUIRE(fb.result().size() == 2);
  CHECK(fb.result()[0] == 0.0f);
  // The exchange updates the result residual in place; the attempt is then thrown away.
  fb.result()[0] = 0.5f;
  fb.Stage(4, v, v);
  v = {1.0f, 2.0f};
  fb.Apply(4, v);  // a retry of the same step: the result residual of before the attempt
  CHECK(fb.result()[0] == 0.0f);
  CHECK(fb.result_residual()[0] == 0.0f);
  fb.result()[1] = -0.25f;  // an attempt that fails half way does not reach the committed one
  v = {1.0f, 2.0f};
  fb.Apply(4, v);
  CHECK(fb.result()[1] == 0.0f);
  fb.result()[1] = 0.75f;
  fb.Stage(4, v, v);
  // Step 5 committed: its result residual is the one the next exchange starts from.
  fb.Apply(5, v);
  CHECK(fb.result()[1] == 0.75f);
  CHECK(fb.result_residual()[1] == 0.75f);
  // A heal drops it.
  fb.Reset(2);
  fb.Apply(5, v);
  CHECK(fb.result()[1] == 0.0f);
}

TEST_CASE("BlockCodec adapts a codec to the communicator's interface") {
  BlockCodec codec(Codec::kInt8);
  CHECK(codec.name() == "int8");
  CHECK(codec.block_elems() == kCompressBlockElems);
  CHECK(codec.id() != BlockCodec(Codec::kInt4).id());
  std::vector<float> in = {1.0f, -0.5f, 0.25f, 0.0f};
  std::vector<uint8_t> bytes(codec.EncodedBytes(in.size()));
  codec.Encode(in.data(), in.size(), bytes.data());
  CHECK(bytes == EncodeAll(Codec::kInt8, in));
  std::vector<float> out(in.size());
  codec.Decode(bytes.data(), out.size(), out.data());
  CHECK(out == RoundTrip(Codec::kInt8, in));
}

}  // namespace
}  // namespace lk::comm
