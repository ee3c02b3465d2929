#include "examples/diloco/corpus.h"

#include <algorithm>
#include <array>
#include <string_view>

namespace lk::diloco {

namespace {

constexpr std::array<std::string_view, 16> kNouns = {
    "keeper", "lamp",  "ship",   "harbour", "sailor", "gull",   "storm",  "island",
    "rock",   "wave",  "signal", "tower",   "fisher", "anchor", "lantern", "compass"};
constexpr std::array<std::string_view, 12> kAdjectives = {
    "old", "bright", "quiet", "distant", "small", "grey", "brave", "cold", "tall", "silver",
    "tired", "patient"};
constexpr std::array<std::string_view, 12> kVerbs = {
    "watches", "guides", "passes", "finds", "calls", "follows", "warns", "reaches", "leaves",
    "lights", "carries", "answers"};
constexpr std::array<std::string_view, 8> kPlaces = {
    "at night", "before dawn", "in the fog", "near the rocks", "across the bay",
    "after the storm", "by the pier", "over the water"};
constexpr std::array<std::string_view, 4> kJoiners = {"and", "while", "because", "so"};

}  // namespace

uint64_t SplitMix::Next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t MixSeed(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x243f6a8885a308d3ULL;
  for (uint64_t p : parts) h = SplitMix(h ^ p).Next();
  return h;
}

std::string MakeCorpus(size_t bytes) {
  // A fixed seed: the corpus is part of the program, not of the run.
  SplitMix rng(20240611);
  auto pick = [&rng](const auto& words) { return words[rng.Below(words.size())]; };
  std::string text;
  text.reserve(bytes + 128);
  while (text.size() < bytes) {
    std::string clause;
    bool plural = rng.Below(3) == 0;
    clause += "the ";
    if (rng.Below(2) == 0) clause += std::string(pick(kAdjectives)) + " ";
    clause += pick(kNouns);
    if (plural) clause += "s";
    std::string verb(pick(kVerbs));
    // Agreement: a plural subject drops the verb's final "s" ("watches" -> "watch").
    if (plural) verb.erase(verb.size() - (verb.ends_with("es") && !verb.ends_with("ves") ? 2 : 1));
    clause += " " + verb + " the " + std::string(pick(kNouns));
    if (rng.Below(2) == 0) clause += " " + std::string(pick(kPlaces));
    if (rng.Below(4) == 0) {
      clause += ", " + std::string(pick(kJoiners)) + " the " + std::string(pick(kNouns)) + " " +
                std::string(pick(kVerbs));
    }
    clause[0] = static_cast<char>(clause[0] - 'a' + 'A');
    text += clause + (rng.Below(8) == 0 ? "!\n" : ".\n");
  }
  return text;
}

Encoded Encode(const std::string& text) {
  Encoded e;
  e.vocab = text;
  std::sort(e.vocab.begin(), e.vocab.end());
  e.vocab.erase(std::unique(e.vocab.begin(), e.vocab.end()), e.vocab.end());
  std::array<int64_t, 256> index{};
  for (size_t i = 0; i < e.vocab.size(); ++i) index[static_cast<unsigned char>(e.vocab[i])] = int64_t(i);
  e.tokens.reserve(text.size());
  for (char c : text) e.tokens.push_back(index[static_cast<unsigned char>(c)]);
  return e;
}

}  // namespace lk::diloco
