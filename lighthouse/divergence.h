// The divergence check of rule 7: given the state hashes the members of a quorum committed for
// one step, which state is the quorum's reference and which members are off it. Every member
// of a DiLoCo quorum must hold bitwise the same global weights after a commit, so any two
// hashes that differ mean at least one member split from the others; the lighthouse flags the
// ones off the reference and their next quorum heals them from it (PlanRecovery: a diverged
// member is no donor). Pure: the core calls it at each commit that carries a hash.
// Thread-safety: pure functions over const data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lk::lighthouse {

// How the reference was chosen.
enum class ReferenceRule : uint8_t {
  kNone,      // not decided: no hash holds a majority and members have still to report
  kMajority,  // held by more than half of the quorum's members
  kMost,      // every member reported and this hash is held by more members than any other
  // Every member reported and several hashes are held by equally many (two groups that
  // disagree, one to one): the one held by the lowest replica_rank. The lighthouse decides for
  // everyone, so any fixed order would do; this one is the order the rest of the job already
  // trusts: the first start takes replica_rank 0's weights and the state sync's donor is the
  // lowest rank at the newest step.
  kTieLowestRank,
};
const char* RuleName(ReferenceRule rule);  // "majority", "most", "tie_lowest_replica_rank"

struct DivergenceVerdict {
  ReferenceRule rule = ReferenceRule::kNone;
  std::string reference;        // the reference hash (empty with kNone)
  uint32_t reference_rank = 0;  // the lowest replica_rank that holds it
  std::vector<bool> off;        // per member: reported a hash, and not the reference
};

// hashes[i]: the hash member i (replica_rank i) committed for the step; empty while it has not
// reported one. A majority decides as soon as it exists; anything short of one waits for every
// member, so that a member is never called off the reference by a count still to change.
DivergenceVerdict JudgeStateHashes(const std::vector<std::string>& hashes);

}  // namespace lk::lighthouse
