// The training text: a corpus generated deterministically from a small English grammar, so the
// repository ships no data file and every process (and every machine) sees the same bytes. The
// grammar has enough structure (spelling, agreement, punctuation) that a small character model's
// loss falls steadily for a few hundred steps, which is what the demo and the tests need.
// Thread-safety: plain values and functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lk::diloco {

// About `bytes` characters of text (whole sentences); the same for the same `bytes` everywhere.
std::string MakeCorpus(size_t bytes);

// The sorted set of characters of `text`, and the text as indices into it.
struct Encoded {
  std::string vocab;
  std::vector<int64_t> tokens;
};
Encoded Encode(const std::string& text);

// A splitmix64 stream: portable (std distributions differ between standard libraries) and cheap
// to seed per group and trainer.
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  // Uniform in [0, n), n > 0 (modulo bias is irrelevant at these sizes).
  uint64_t Below(uint64_t n) { return Next() % n; }
  // The whole state: SplitMix(state()) goes on with the same numbers (a checkpoint's extra
  // state carries it).
  uint64_t state() const { return state_; }

 private:
  uint64_t state_;
};

// Mixes several values into one seed.
uint64_t MixSeed(std::initializer_list<uint64_t> parts);

}  // namespace lk::diloco
