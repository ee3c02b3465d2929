// Rule 7's divergence check as a table: which hash is the reference, by which rule, and who is
// off it, for two groups (the tie), three and more, and before every member reported.
#include "lighthouse/divergence.h"

#include <doctest/doctest.h>

namespace lk::lighthouse {
namespace {

TEST_CASE("divergence verdict: majority - most - the tie to the lowest replica_rank - or wait") {
  struct Row {
    const char* name;
    std::vector<std::string> hashes;  // index = replica_rank; "" = not reported yet
    ReferenceRule rule;
    std::string reference;
    uint32_t reference_rank;
    std::vector<bool> off;
  };
  const std::vector<Row> rows = {
      {"two agree", {"h", "h"}, ReferenceRule::kMajority, "h", 0, {false, false}},
      {"two: a tie goes to replica_rank 0", {"a", "b"}, ReferenceRule::kTieLowestRank, "a", 0,
       {false, true}},
      {"two: the tie rule follows the rank, not the hash's order", {"z", "b"},
       ReferenceRule::kTieLowestRank, "z", 0, {false, true}},
      {"two: one still to report waits", {"a", ""}, ReferenceRule::kNone, "", 0, {false, false}},
      {"three: the minority is off", {"h", "z", "h"}, ReferenceRule::kMajority, "h", 0,
       {false, true, false}},
      {"three: rank 0 in the minority is off", {"z", "h", "h"}, ReferenceRule::kMajority, "h", 1,
       {true, false, false}},
      {"three: a majority decides before the third reports", {"h", "h", ""},
       ReferenceRule::kMajority, "h", 0, {false, false, false}},
      {"three: one each waits for the third", {"a", "b", ""}, ReferenceRule::kNone, "", 0,
       {false, false, false}},
      {"three: all differ: a tie of three", {"c", "a", "b"}, ReferenceRule::kTieLowestRank, "c", 0,
       {false, true, true}},
      {"four: two against two", {"b", "a", "a", "b"}, ReferenceRule::kTieLowestRank, "b", 0,
       {false, true, true, false}},
      {"four: the most without a majority", {"b", "a", "a", "c"}, ReferenceRule::kMost, "a", 1,
       {true, false, false, true}},
      {"four: two of four is no majority yet", {"a", "a", "", ""}, ReferenceRule::kNone, "", 0,
       {false, false, false, false}},
      {"one member", {"h"}, ReferenceRule::kMajority, "h", 0, {false}},
      {"nobody reported", {"", ""}, ReferenceRule::kNone, "", 0, {false, false}},
  };
  for (const Row& row : rows) {
    CAPTURE(row.name);
    DivergenceVerdict v = JudgeStateHashes(row.hashes);
    CHECK(v.rule == row.rule);
    CHECK(v.reference == row.reference);
    CHECK(v.reference_rank == row.reference_rank);
    CHECK(v.off == row.off);
  }
  CHECK(std::string(RuleName(ReferenceRule::kTieLowestRank)) == "tie_lowest_replica_rank");
}

}  // namespace
}  // namespace lk::lighthouse
