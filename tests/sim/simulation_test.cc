// The seeded simulations (sim.h): every seed runs the lighthouse's model and the agents' model.
// Fresh seeds at every run, so that CI keeps covering new ground:
//   LK_SIM_FIRST_SEED=S         the first seed (default: drawn at random and printed)
//   LK_SIM_SEEDS=N              how many seeds from there (default 1,000; a million on demand)
//   LK_SIM_AGENTS_FIRST_SEED=S  the agents' model's first seed (default: drawn like
//                               LK_SIM_FIRST_SEED, printed as agents_first_seed)
//   LK_SIM_MODELS=M             lighthouse or agents: runs that model alone (default both)
//   LK_SIM_SEED=S               replays one seed in both models (the command a failure prints)
//   LK_SIM_TRACE=1              prints both cores' event lines, and the trainers', as they happen
//   LK_SIM_FAILURES_SHOWN=K     how many failing seeds to print (default 5)
// Every run ends with one line:
//   sim_summary seeds=N first_seed=S quorums=Q polls=P restarts=R violations=V agents_first_seed=A
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tests/sim/sim.h"

namespace lk::sim {
namespace {

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

struct Outcome {
  uint64_t violations = 0;
};

// Runs each seed in both models, failing the test case with the replay command of each of the
// first five that break an invariant.
Outcome RunSeeds(const std::vector<uint64_t>& seeds, SimStats* lighthouse,
                 const std::vector<uint64_t>& agent_seeds, SimStats* agents) {
  Outcome out;
  auto failed = [&](uint64_t seed, const char* model, const std::string& error) {
    if (++out.violations <= EnvOr("LK_SIM_FAILURES_SHOWN", 5)) {
      FAIL_CHECK("seed " << seed << " (" << std::string(model) << " model): " << error
                         << "\n  replay: LK_SIM_SEED=" << seed << " build/bin/simulation_test");
    }
  };
  for (uint64_t seed : seeds) {
    if (std::string error = RunLighthouseSim(seed, lighthouse); !error.empty()) {
      failed(seed, "lighthouse", error);
    }
  }
  for (uint64_t seed : agent_seeds) {
    if (std::string error = RunAgentSim(seed, agents); !error.empty())
      failed(seed, "agents", error);
  }
  return out;
}

uint64_t DrawSeed() {
  // Below 2^40, so that first + N never wraps and the number is short to type.
  return std::random_device{}() % (uint64_t{1} << 32) * 256 + 1;
}

// Seeds found past the default 1,000 where a group was refused for its size in a job whose
// groups all mix: a member back from collection (or only some of its nodes asking again) had not
// said whether it mixes, and counted as one that cannot.
TEST_CASE("simulation: a member that has not said its shape again turns nobody away") {
  SimStats lighthouse, agents;
  RunSeeds({3655, 5111, 5943, 8295, 8519}, &lighthouse, {}, &agents);
}

TEST_CASE("simulation: invariants hold under crashes - partitions - stalls and restarts") {
  std::vector<uint64_t> seeds, agent_seeds;
  uint64_t first = 0, agents_first = 0;
  if (std::getenv("LK_SIM_SEED")) {
    first = agents_first = EnvOr("LK_SIM_SEED", 0);
    seeds.push_back(first);
    agent_seeds.push_back(first);
  } else {
    first = std::getenv("LK_SIM_FIRST_SEED") ? EnvOr("LK_SIM_FIRST_SEED", 0) : DrawSeed();
    const char* a = std::getenv("LK_SIM_AGENTS_FIRST_SEED");
    agents_first = !a || std::string(a) == "fresh" ? DrawSeed()
                                                   : EnvOr("LK_SIM_AGENTS_FIRST_SEED", 1);
    const uint64_t n = EnvOr("LK_SIM_SEEDS", 1000);
    const std::string models = std::getenv("LK_SIM_MODELS") ? std::getenv("LK_SIM_MODELS") : "";
    if (models != "agents") {
      for (uint64_t s = first; s < first + n; ++s) seeds.push_back(s);
    }
    if (models != "lighthouse") {
      for (uint64_t s = agents_first; s < agents_first + n; ++s) agent_seeds.push_back(s);
    }
  }
  fmt::print("sim_start first_seed={} agents_first_seed={} seeds={}\n", first, agents_first,
             seeds.size());
  std::fflush(stdout);
  SimStats lighthouse, agents;
  Outcome out = RunSeeds(seeds, &lighthouse, agent_seeds, &agents);
  std::string names;
  for (const auto& [name, n] : lighthouse.events) names += fmt::format(" {}={}", name, n);
  MESSAGE(
      fmt::format("lighthouse model: {} quorums issued ({} new ids), {} answers, {} "
                  "rejections, {} restarts; events:{}",
                  lighthouse.issued, lighthouse.changed, lighthouse.answers, lighthouse.rejections,
                  lighthouse.restarts, names));
  names.clear();
  for (const auto& [name, n] : agents.events) names += fmt::format(" {}={}", name, n);
  MESSAGE(
      fmt::format("agents model: {} quorums issued, {} polls, {} answered, {} commits taken, "
                  "{} lives, {} leaves, {} restarts; events:{}",
                  agents.issued, agents.polls, agents.trainer_answers, agents.commits, agents.lives,
                  agents.leaves, agents.restarts, names));
  fmt::print(
      "sim_summary seeds={} first_seed={} quorums={} polls={} restarts={} violations={} "
      "agents_first_seed={}\n",
      std::max(seeds.size(), agent_seeds.size()), first, lighthouse.issued + agents.issued,
      agents.polls, lighthouse.restarts + agents.restarts, out.violations, agents_first);
  std::fflush(stdout);
  // Every kind of fault and decision must have happened somewhere in a default run.
  if (seeds.size() >= 100) {
    if (!seeds.empty()) {
      CHECK(lighthouse.changed > 0);
      CHECK(lighthouse.issued > lighthouse.changed);  // unchanged re-issues (the hot path)
      CHECK(lighthouse.restarts > 0);
      CHECK(lighthouse.mixed_answers > 0);  // quorums of several sizes formed where all groups mix
      for (const char* name :
           {"incarnation_replaced", "group_unhealthy", "member_lost", "group_evicted", "group_left",
            "diverged", "quorum_retry", "group_rejoin", "checkpoint_registered", "group_collected",
            "group_refused", "quorum_abandoned", "state_lost"}) {
        CAPTURE(name);
        CHECK(lighthouse.events[name] > 0);
      }
    }
    if (!agent_seeds.empty()) {
      CHECK(agents.polls > 0);
      CHECK(agents.commits > 0);
      CHECK(agents.restarts > 0);
      CHECK(agents.lives > agents.leaves / 4);
      // The agents' own decisions, by their log lines.
      for (const char* name :
           {"agent_quorum", "agent_quorum_lost", "agent_group_failed", "agent_drain",
            "agent_lighthouse_unreachable", "agent_heartbeat_lapsed", "agent_no_trainers",
            "agent_outer_step_failed", "agent_trainer_exited", "agent_poll_answer_resent",
            "agent_ask_behind", "agent_ask_behind_withdrawn", "incarnation_replaced",
            "group_evicted", "group_left", "state_lost"}) {
        CAPTURE(name);
        CHECK(agents.events[name] > 0);
      }
    }
  }
}

}  // namespace
}  // namespace lk::sim
