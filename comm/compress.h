// Block codecs for the encoded allreduce (DiLoCo's compressed pseudo-gradients, --outer-compress): the codecs that turn
// float32 values into bytes and back, and the error feedback that keeps what a codec dropped for
// the next step. Pure: no I/O, no threads, no clock.
//
// Encodings (little-endian, as every supported target is):
//   none  4 bytes per element, the float32 bits (the collective's exact reference)
//   bf16  2 bytes per element, rounded to nearest even (NaN stays NaN, inf stays inf)
//   int8  per block of kCompressBlockElems elements: the block's absmax as float32, then one
//         signed byte per element in [-127, 127]
//   int4  per block: the absmax as float32, then one nibble per element in [-7, 7] (two's
//         complement), element 2k in the low nibble of byte k, 2k+1 in the high one
// The last block of a span may be short; it is encoded the same way with its own length.
// int8 and int4 decode code q of a block with absmax a as (q / L) * a (L = 127 or 7, float32,
// one division and one multiplication, each rounded once), so the largest element of every block,
// zero, and a block of one repeated value come back exactly, and every member that decodes the
// same bytes gets the same bits.
//
// Non-finite input: a block that holds a NaN or an infinity encodes its absmax as NaN, so the
// whole block decodes to NaN: a diverged trainer's pseudo-gradient reaches the average as NaN,
// as it would in float32, instead of being hidden by a clamp. The residual of such an element is
// 0 (see KeepResidual), so error feedback does not carry the NaN into every later step.
//
// Thread-safety: plain functions on caller-owned memory; a BlockCodec is immutable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "comm/comm.h"

namespace lk::comm {

// The encodings (DiLoCo's --outer-compress names them; its Codec has the same values).
enum class Codec { kNone, kBf16, kInt8, kInt4 };
std::string_view CodecName(Codec codec);  // "none", "bf16", "int8", "int4"
bool ParseCodec(std::string_view name, Codec* out);

// Elements per block of int8 and int4: each block carries a 4-byte scale, so 128 costs 1/32 of a
// byte per element (int8 1.031 bytes, 0.258x of float32; int4 0.531 bytes, 0.133x), under the
// issue's 0.27x and 0.14x with room for framing, while a block stays small enough that one large
// element (an outlier) coarsens only its 127 neighbours. 64 would put int4 at 0.141x, above its
// goal; 256 would gain 0.004x and double the reach of an outlier. Even, so int4's nibble pairs
// never straddle a block, and chunk boundaries at multiples of it cut no block.
inline constexpr size_t kCompressBlockElems = 128;

// Bytes of the encoding of `count` elements.
size_t EncodedBytes(Codec codec, size_t count);
// The largest EncodedBytes of any codec for `count` elements.
size_t MaxEncodedBytes(size_t count);
// Elements per block: kCompressBlockElems for int8/int4, 1 for none and bf16 (no scales).
size_t BlockElems(Codec codec);

// `out` holds exactly EncodedBytes(codec, in.size()) bytes.
void Encode(Codec codec, std::span<const float> in, std::span<uint8_t> out);
// `in` holds exactly EncodedBytes(codec, out.size()) bytes.
void Decode(Codec codec, std::span<const uint8_t> in, std::span<float> out);

// Error feedback, step by step: the trainer sends x = delta + residual (AddResidual, float32
// additions), the collective encodes x and reports what its encoding decodes to, and
// KeepResidual stores residual = x - decoded. For every finite element that subtraction is exact
// (decoded is the nearest code to x, so it lies within a factor of two of x, or is zero), hence
// decoded + residual == x bit for bit, and over steps t = 1..T
//   sum_t decoded_t + residual_T == sum_t delta_t + sum_t e_t,  |e_t| <= ulp(x_t) / 2,
// where e_t is the rounding of the addition delta_t + residual_{t-1}: nothing is lost but that.
// The average the members decode is itself encoded once, by the owner of each chunk, and that
// rounding is kept the same way (two-way error feedback): the owner encodes y = sum + r, every
// member decodes the same bytes, and the owner keeps r = y - decoded for its next result of
// those elements, so the global weights receive over the steps what the sums held instead of
// taking a fresh rounding every step. With int4 that second rounding, left alone, was the
// larger part of the loss against float32 (BENCHMARKS.md, "Compressed outer steps").
void AddResidual(std::span<const float> residual, std::span<float> values);
// residual = sent - decoded where decoded is finite; 0 where it is not (a NaN block).
void KeepResidual(std::span<const float> sent, std::span<const float> decoded,
                  std::span<float> residual);

// One trainer's error feedback across the attempts of its outer steps: the residual of what it
// sends, and the result residual of the chunks it owns (the communicator's result_feedback).
// What an exchange leaves is staged, not used at once: the attempt may still be thrown away
// (another trainer of the group failed, the commit did not happen) and retried with the same
// pseudo-gradient, which must then meet the same residuals again. Staged residuals take effect
// at the next exchange if the step they were computed for has been committed by then, and are
// dropped otherwise.
class ErrorFeedback {
 public:
  // Before the exchange that would commit step committed_step + 1: values += residual, and
  // result() is set to the result residual as of the last committed step.
  void Apply(uint32_t committed_step, std::span<float> values);
  // The result residual the exchange updates in place (as many elements as values, after Apply).
  std::span<float> result() { return result_work_; }
  // After that exchange succeeded: stages KeepResidual(sent, decoded) and result() for
  // committed_step + 1.
  void Stage(uint32_t committed_step, std::span<const float> sent, std::span<const float> decoded);
  // Zeros of `count` elements, nothing staged: the state came from elsewhere.
  void Reset(size_t count);
  std::span<const float> residual() const { return residual_; }
  std::span<const float> result_residual() const { return result_; }
  // Bytes its buffers hold (the library's outer-state accounting).
  size_t bytes() const {
    return (residual_.capacity() + staged_.capacity() + result_.capacity() +
            result_staged_.capacity() + result_work_.capacity()) * sizeof(float);
  }

 private:
  std::vector<float> residual_, staged_, result_, result_staged_, result_work_;
  bool has_staged_ = false;
  uint32_t staged_step_ = 0;
};

// A codec as the communicator's AllReduceEncoded takes it.
class BlockCodec final : public ChunkCodec {
 public:
  explicit BlockCodec(Codec codec) : codec_(codec) {}
  uint32_t id() const override { return static_cast<uint32_t>(codec_) + 1; }
  std::string_view name() const override { return CodecName(codec_); }
  size_t block_elems() const override { return BlockElems(codec_); }
  size_t EncodedBytes(size_t count) const override { return comm::EncodedBytes(codec_, count); }
  size_t MaxEncodedBytes(size_t count) const override { return comm::MaxEncodedBytes(count); }
  void Encode(const float* in, size_t count, uint8_t* out) const override {
    comm::Encode(codec_, {in, count}, {out, comm::EncodedBytes(codec_, count)});
  }
  void Decode(const uint8_t* in, size_t count, float* out) const override {
    comm::Decode(codec_, {in, comm::EncodedBytes(codec_, count)}, {out, count});
  }

 private:
  Codec codec_;
};

}  // namespace lk::comm
