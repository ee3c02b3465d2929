// The example's generated corpus and data streams.
#include <doctest/doctest.h>

#include "examples/diloco/corpus.h"

namespace lk::diloco {

TEST_CASE("diloco corpus is deterministic and groups' data streams differ") {
  CHECK(MakeCorpus(8192) == MakeCorpus(8192));
  Encoded e = Encode(MakeCorpus(8192));
  CHECK(e.vocab.size() > 20);
  CHECK(e.vocab.size() < 64);
  CHECK(e.tokens.size() >= 8192);
  SplitMix a(MixSeed({1, 0, 0})), b(MixSeed({1, 1, 0})), a2(MixSeed({1, 0, 0}));
  uint64_t x = a.Next();
  CHECK(x == a2.Next());
  CHECK(x != b.Next());
}

}  // namespace lk::diloco
