// The seeded simulations of tests/sim/: one model of the lighthouse core alone (lighthouse_sim.cc)
// and one of the agents' cores beside it (agent_sim.cc). Each runs one seed deterministically
// and returns an empty string or the first invariant it found broken.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace lk::sim {

// What the seeds exercised, summed, so that a simulation that stopped doing anything fails.
struct SimStats {
  uint64_t issued = 0, changed = 0, answers = 0, rejections = 0, restarts = 0;
  uint64_t mixed_answers = 0;  // answers of quorums that hold groups of several sizes
  // The agents' model only.
  uint64_t polls = 0, trainer_answers = 0, commits = 0, lives = 0, leaves = 0;
  std::map<std::string, uint64_t> events;  // the lighthouse's by name; agent_* for the agents'
};

// Groups of one or several nodes train against the lighthouse core alone, which the
// simulation drives as a scripted agent would.
std::string RunLighthouseSim(uint64_t seed, SimStats* stats);

// Every node runs the real agent core, its trainers are scripted (hello, poll, outer step on the
// quorum answered, commit, inner steps, goodbye), and the simulation is the shell between them
// and the lighthouse core: heartbeats, asks, the watch, the outbox, leaves, with answers
// delayed, reordered and lost.
std::string RunAgentSim(uint64_t seed, SimStats* stats);

}  // namespace lk::sim
