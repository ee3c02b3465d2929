// Groups of different sizes in one job, end to end on real processes (issue 15): a lighthouse,
// one replica_agent per group, C++ and Python DiLoCo trainers with the tests' tiny model. Groups
// of 1, 2 and 3 trainers train one model together (the 2-trainer group runs the Python
// trainer): every commit's global_hash (a hash of the whole global weights, whatever the
// layout) agrees across all groups at every step; a trainer of the 3-trainer group is killed
// and the group comes back as a new life that heals from the live state of the 1- and
// 2-trainer groups; after the job ends a group of 4 joins and restores the final durable
// checkpoint, written by groups of other sizes, into its own layout; and the final checkpoints
// of all four groups, resharded to one rank with `lkctl checkpoint reshard --ranks 1`, hold
// bitwise identical global weights and outer momentum.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <boost/json.hpp>

#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/restore.h"
#include "tests/e2e/chaos_run.h"
#include "tests/support/wait.h"

namespace lk::e2e {
namespace {

using namespace std::chrono_literals;

struct HashLine {
  uint32_t step = 0;
  std::string global_hash;
  bool healed = false;
};

std::vector<HashLine> ReadHashLog(const std::string& path) {
  std::vector<HashLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::system::error_code ec;
    boost::json::value v = boost::json::parse(line, ec);
    if (ec || !v.is_object()) continue;  // a killed trainer's torn last line
    const boost::json::object& o = v.as_object();
    out.push_back({static_cast<uint32_t>(o.at("step").to_number<uint64_t>()),
                   std::string(o.at("global_hash").as_string()), o.at("healed").as_bool()});
  }
  return out;
}

uint32_t LastStep(const std::string& path) {
  auto log = ReadHashLog(path);
  return log.empty() ? 0 : log.back().step;
}

int Shell(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST_CASE("mixed groups of 1, 2 and 3 trainers train one model: one global hash per step, a "
          "heal across layouts, a restore into 4, final checkpoints equal on one rank") {
  constexpr uint32_t kSteps = 24;
  RunOptions o;
  o.job = "mixed";
  o.steps = kSteps;
  // Paced, so that g2's new life (a trainer's start takes seconds on a loaded machine) heals
  // from live peers while the others still train, rather than from the final checkpoint.
  o.trainer_flags = {"--inner-step-min-ms", "100"};
  o.group_size = 1;
  o.group_sizes = {{"g1", 2}, {"g2", 3}, {"g3", 4}};
  o.lighthouse_flags = {"--min-replicas", "2", "--join-timeout-ms", "2000",
                        "--heartbeat-timeout-ms", "2000"};
  Run run("mixed", o);
  fmt::print("mixed logs in {}\n", run.dir);
  run.StartGroup("g0", TrainerKind::kCpp);
  run.StartGroup("g1", TrainerKind::kPython);
  Life* g2 = run.StartGroup("g2", TrainerKind::kCpp);

  // Kill a trainer of the 3-trainer group once it has committed a few steps with the others.
  REQUIRE(test::WaitUntil([&] { return LastStep(g2->logs[0]) >= 5; }, 180s,
                          "step 5 committed in g2's trainer log", 100ms));
  g2->trainers[1]->Signal(SIGKILL);
  run.Reap(g2, 30s);
  // The group comes back with the same size: it heals from the groups of 1 and 2.
  Life* back = run.StartGroup("g2", TrainerKind::kCpp);
  run.WaitSurvivors(300s);

  // One global hash per step across every trainer of every group and life.
  std::map<uint32_t, std::set<std::string>> hashes;
  for (const auto& life : run.lives) {
    for (const std::string& path : life->logs) {
      for (const HashLine& l : ReadHashLog(path)) {
        CHECK(l.global_hash.size() == 16);
        hashes[l.step].insert(l.global_hash);
      }
    }
  }
  for (uint32_t step = 1; step <= kSteps; ++step) {
    INFO("step " << step);
    CHECK(hashes[step].size() == 1);
  }
  for (const auto& life : run.lives) {
    if (life->killed) continue;
    for (const std::string& path : life->logs) CHECK(LastStep(path) == kSteps);
  }
  // The new life of g2 healed from live peers of other layouts (not the communicator fallback).
  for (const auto& t : back->trainers) {
    INFO("trainer stderr " << t->log_path());
    CHECK(t->Log().find("heal_fetched from=peers ") != std::string::npos);
    CHECK(t->Log().find("group_sizes=") != std::string::npos);
  }

  // After the end, a group of 4 joins: the job is finished, so it restores the newest durable
  // checkpoint (written by a group of 1, 2 or 3) into 4 trainers and ends at the last step.
  Life* g3 = run.StartGroup("g3", TrainerKind::kCpp);
  run.WaitSurvivors(120s);
  for (size_t r = 0; r < g3->trainers.size(); ++r) {
    INFO("trainer stderr " << g3->trainers[r]->log_path());
    CHECK(g3->trainers[r]->Log().find("heal_fetched from=\"durable ") != std::string::npos);
    auto log = ReadHashLog(g3->logs[r]);
    REQUIRE_FALSE(log.empty());
    CHECK(log.back().step == kSteps);
    CHECK(log.back().healed);
    CHECK(hashes[kSteps].count(log.back().global_hash) == 1);
  }

  // Every group's final checkpoint, resharded to one rank, holds the same global weights and
  // outer momentum, bit for bit (the inner optimizer's state is each group's own).
  std::map<std::string, std::map<std::string, std::string>> tensors;  // group -> name -> bytes
  for (const std::string g : {"g0", "g1", "g2", "g3"}) {
    const std::string out = fmt::format("{}/reshard-{}", run.dir, g);
    const std::string cmd =
        fmt::format("{}/lkctl checkpoint reshard {}/ckpt-{} --ranks 1 --out {} > {}.log 2>&1",
                    test::BinDir(), run.dir, g, out, out);
    INFO(cmd);
    REQUIRE(Shell(cmd) == 0);
    ckpt::RestoreOptions ro;
    ro.layout = ckpt::TargetLayout{1, 0};
    auto state = ckpt::RestoreLatest(out, ro);
    REQUIRE(state.ok());
    CHECK(state->step == kSteps);
    // The inner optimizer's state and the trainers' extra state (their data positions) are each
    // group's own; the extra state is kept per trainer rank, one blob for each of the group's.
    size_t extras = 0;
    for (const auto& t : state->tensors) {
      if (t.name.rfind("extra_state/", 0) == 0) ++extras;
      if (t.name.rfind("inner/", 0) == 0 || t.name.rfind("extra_state/", 0) == 0) continue;
      tensors[g][t.name] = std::string(reinterpret_cast<const char*>(t.data.data()), t.data.size());
    }
    // A rank holds a data position once it ran an inner step after its last heal, or when its
    // heal restored one from the group's own durable checkpoint. g3 ran no inner step (the job
    // had finished), and g2's new life may have healed at the last step when the other groups
    // were quick: a rank the source group did not have restored nothing then.
    size_t want = g == "g0" ? 1 : g == "g1" ? 2 : 3;
    if (g == "g2" || g == "g3") {
      Life* last = g == "g2" ? back : g3;
      want = 0;
      for (size_t r = 0; r < last->trainers.size(); ++r) {
        auto log = ReadHashLog(last->logs[r]);
        const bool stepped = !log.empty() && !log.back().healed;
        want +=
            stepped || last->trainers[r]->Log().find("extra_state_restored ") != std::string::npos;
      }
      CHECK(want >= 1);
    }
    INFO("group " << g);
    CHECK(extras == want);
  }
  REQUIRE_FALSE(tensors["g0"].empty());
  for (const std::string g : {"g1", "g2", "g3"}) {
    INFO("group " << g);
    REQUIRE(tensors[g].size() == tensors["g0"].size());
    for (const auto& [name, bytes] : tensors["g0"]) {
      INFO("tensor " << name);
      CHECK(tensors[g][name] == bytes);
    }
  }
}

}  // namespace
}  // namespace lk::e2e
