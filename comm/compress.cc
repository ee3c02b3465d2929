#include "comm/compress.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include <lightkeeper/check.h>
#include "comm/reduce.h"

namespace lk::comm {

static_assert(std::endian::native == std::endian::little, "encodings are little-endian");
static_assert(kCompressBlockElems % 2 == 0, "int4 packs element pairs inside a block");

namespace {

constexpr size_t kScaleBytes = sizeof(float);

// The largest code of a block codec (codes are symmetric: -L..L).
float Levels(Codec codec) { return codec == Codec::kInt8 ? 127.0f : 7.0f; }

size_t PayloadBytes(Codec codec, size_t n) {
  return codec == Codec::kInt8 ? n : (n + 1) / 2;
}

// Round half to even of |r| < 2^22 by the float32 adder itself: adding 1.5 * 2^23 leaves no
// fraction bits, so the sum is rounded to an integer in the current (nearest-even) mode, and
// subtracting it back is exact. Unlike std::nearbyint it is two plain additions.
float RoundHalfEven(float r) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (r + kMagic) - kMagic;
}

void EncodeBlock(Codec codec, const float* in, size_t n, uint8_t* out) {
  float absmax = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(in[i]);
    absmax = std::max(absmax, std::fabs(in[i]));
  }
  if (!finite) absmax = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(out, &absmax, kScaleBytes);
  uint8_t* codes = out + kScaleBytes;
  std::memset(codes, 0, PayloadBytes(codec, n));
  if (!finite || absmax == 0.0f) return;
  const float levels = Levels(codec);
  for (size_t i = 0; i < n; ++i) {
    // |in[i] / absmax| <= 1 exactly (a correctly rounded quotient of values <= 1 is <= 1), so
    // the code lies in [-L, L] without a clamp.
    const auto q = static_cast<int32_t>(RoundHalfEven(in[i] / absmax * levels));
    if (codec == Codec::kInt8) {
      codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    } else {
      codes[i / 2] |= static_cast<uint8_t>((static_cast<uint32_t>(q) & 0xfu) << (4 * (i % 2)));
    }
  }
}

void DecodeBlock(Codec codec, const uint8_t* in, size_t n, float* out) {
  float absmax;
  std::memcpy(&absmax, in, kScaleBytes);
  const uint8_t* codes = in + kScaleBytes;
  const float levels = Levels(codec);
  for (size_t i = 0; i < n; ++i) {
    int32_t q;
    if (codec == Codec::kInt8) {
      q = static_cast<int8_t>(codes[i]);
    } else {
      const int32_t nibble = (codes[i / 2] >> (4 * (i % 2))) & 0xf;
      q = nibble >= 8 ? nibble - 16 : nibble;
    }
    out[i] = (static_cast<float>(q) / levels) * absmax;
  }
}

bool Blockwise(Codec codec) {
  return codec == Codec::kInt8 || codec == Codec::kInt4;
}

}  // namespace

std::string_view CodecName(Codec codec) {
  switch (codec) {
    case Codec::kNone:
      return "none";
    case Codec::kBf16:
      return "bf16";
    case Codec::kInt8:
      return "int8";
    case Codec::kInt4:
      return "int4";
  }
  return "unknown";
}

bool ParseCodec(std::string_view name, Codec* out) {
  for (Codec c :
       {Codec::kNone, Codec::kBf16, Codec::kInt8, Codec::kInt4}) {
    if (name == CodecName(c)) {
      *out = c;
      return true;
    }
  }
  return false;
}

size_t BlockElems(Codec codec) { return Blockwise(codec) ? kCompressBlockElems : 1; }

size_t EncodedBytes(Codec codec, size_t count) {
  switch (codec) {
    case Codec::kNone:
      return count * sizeof(float);
    case Codec::kBf16:
      return count * sizeof(uint16_t);
    case Codec::kInt8:
    case Codec::kInt4: {
      const size_t full = count / kCompressBlockElems, tail = count % kCompressBlockElems;
      return full * (kScaleBytes + PayloadBytes(codec, kCompressBlockElems)) +
             (tail > 0 ? kScaleBytes + PayloadBytes(codec, tail) : 0);
    }
  }
  return 0;
}

size_t MaxEncodedBytes(size_t count) {
  size_t most = 0;
  for (Codec c :
       {Codec::kNone, Codec::kBf16, Codec::kInt8, Codec::kInt4}) {
    most = std::max(most, EncodedBytes(c, count));
  }
  return most;
}

void Encode(Codec codec, std::span<const float> in, std::span<uint8_t> out) {
  LK_CHECK(out.size() == EncodedBytes(codec, in.size()))
      << "encode " << in.size() << " elements into " << out.size() << " bytes";
  if (codec == Codec::kNone) {
    std::memcpy(out.data(), in.data(), out.size());
  } else if (codec == Codec::kBf16) {
    for (size_t i = 0; i < in.size(); ++i) {
      const uint16_t b = comm::FloatToBf16(in[i]);
      std::memcpy(out.data() + 2 * i, &b, sizeof(b));
    }
  } else {
    uint8_t* at = out.data();
    for (size_t begin = 0; begin < in.size(); begin += kCompressBlockElems) {
      const size_t n = std::min(kCompressBlockElems, in.size() - begin);
      EncodeBlock(codec, in.data() + begin, n, at);
      at += kScaleBytes + PayloadBytes(codec, n);
    }
  }
}

void Decode(Codec codec, std::span<const uint8_t> in, std::span<float> out) {
  LK_CHECK(in.size() == EncodedBytes(codec, out.size()))
      << "decode " << in.size() << " bytes into " << out.size() << " elements";
  if (codec == Codec::kNone) {
    std::memcpy(out.data(), in.data(), in.size());
  } else if (codec == Codec::kBf16) {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, in.data() + 2 * i, sizeof(b));
      out[i] = comm::Bf16ToFloat(b);
    }
  } else {
    const uint8_t* at = in.data();
    for (size_t begin = 0; begin < out.size(); begin += kCompressBlockElems) {
      const size_t n = std::min(kCompressBlockElems, out.size() - begin);
      DecodeBlock(codec, at, n, out.data() + begin);
      at += kScaleBytes + PayloadBytes(codec, n);
    }
  }
}

void AddResidual(std::span<const float> residual, std::span<float> values) {
  LK_CHECK(residual.size() == values.size())
      << "residual " << residual.size() << " values " << values.size();
  comm::AddFeedback(values.data(), residual.data(), values.size());
}

void KeepResidual(std::span<const float> sent, std::span<const float> decoded,
                  std::span<float> residual) {
  LK_CHECK(sent.size() == decoded.size() && sent.size() == residual.size())
      << "residual sizes " << sent.size() << " " << decoded.size() << " " << residual.size();
  comm::KeepFeedback(sent.data(), decoded.data(), residual.data(), sent.size());
}

void ErrorFeedback::Apply(uint32_t committed_step, std::span<float> values) {
  if (has_staged_ && staged_step_ == committed_step) {
    residual_ = std::move(staged_);
    result_ = std::move(result_staged_);
  }
  has_staged_ = false;
  staged_.clear();
  result_staged_.clear();
  if (residual_.size() != values.size()) residual_.assign(values.size(), 0.0f);
  if (result_.size() != values.size()) result_.assign(values.size(), 0.0f);
  result_work_ = result_;
  AddResidual(residual_, values);
}

void ErrorFeedback::Stage(uint32_t committed_step, std::span<const float> sent,
                          std::span<const float> decoded) {
  staged_.resize(sent.size());
  KeepResidual(sent, decoded, staged_);
  result_staged_ = result_work_;
  has_staged_ = true;
  staged_step_ = committed_step + 1;
}

void ErrorFeedback::Reset(size_t count) {
  residual_.assign(count, 0.0f);
  result_.assign(count, 0.0f);
  result_work_.clear();
  staged_.clear();
  result_staged_.clear();
  has_staged_ = false;
}

}  // namespace lk::comm
