// End-to-end tests of the Python trainer (examples/python/diloco_trainer.py) on real processes
// (issue 13, section 5), with chaos_test.cc's harness (chaos_run.h):
//  - the Python chaos test: three groups of two Python trainers, a seeded schedule of a kill -9
//    of a trainer and of an agent (each group comes back as a new incarnation and heals), a
//    kill -9 and restart of the lighthouse, and a fourth group that joins; then a failure-free
//    reference with the same membership changes at the same committed steps (one that would
//    come within 8 steps of T there is left out and printed: a Python group's return takes
//    many of the fast reference's steps, so it drifts behind the chaos run). Asserted: one
//    param_hash per (step, shard) across all members after every commit, quorum_id never
//    decreasing and one membership per quorum_id, the job's committed step never going back,
//    every surviving trainer reaching T and exiting 0, and the final eval loss within 5% of the
//    reference's;
//  - the mixed job: one group of C++ diloco_trainers and one of Python trainers train together,
//    and at every committed step the global weights (param_hash per shard) are bitwise equal
//    across the two.
// The seed is printed; LK_CHAOS_SEED=N replays a schedule. Every wait is bounded.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "tests/e2e/chaos_run.h"

namespace lk::e2e {
namespace {

using Clock = std::chrono::steady_clock;

// The package is built into build/python (target lightkeeper_python); without it the Python
// trainer cannot run, and the tests say so plainly instead of failing on a missing import.
bool HavePythonPackage() {
  return std::filesystem::exists(PythonPackageDir() + "/lightkeeper/__init__.py");
}

RunOptions ChaosOptions() {
  RunOptions o;
  o.job = "pychaos";
  // Longer outer steps than chaos_test's (24 inner steps, not 8) and more of them: a Python
  // group's return (the interpreter and torch start, then a heal) takes 15-25 s on a loaded
  // machine while the others go on at about a step a second, so the schedule's changes stay
  // far from T whatever the machine's load.
  o.steps = 70;
  o.inner_steps = 24;
  o.group_size = 2;
  o.seed = 5;
  return o;
}

TEST_CASE("python chaos three groups of two python trainers survive kills a lighthouse restart "
          "and a join") {
  REQUIRE_MESSAGE(HavePythonPackage(), "no lightkeeper package in " << PythonPackageDir()
                                                                 << " (ninja lightkeeper_python)");
  auto started = Clock::now();
  std::mt19937 rng(ChaosSeed("python chaos"));
  auto pick = [&](uint32_t lo, uint32_t hi) { return lo + rng() % (hi - lo + 1); };
  auto secs = [&] { return std::chrono::duration<double>(Clock::now() - started).count(); };
  const RunOptions o = ChaosOptions();

  Run run("pychaos", o);
  fmt::print("python chaos logs in {}\n", run.dir);
  StatusWatch watch(run.lh.address, o.job);
  std::vector<std::string> groups = {"g0", "g1", "g2"};
  for (const std::string& g : groups) run.StartGroup(g, TrainerKind::kPython);
  auto note = [&](const std::string& what) {
    fmt::print("[{:5.1f} s] step {:2}: {}\n", secs(), watch.committed(), what);
    std::fflush(stdout);
  };

  // What changed the membership, at which committed step, for the reference to repeat.
  enum class Change { kRestart, kJoin };
  std::vector<std::tuple<uint32_t, Change, std::string>> changes;
  auto kill_and_restart = [&](bool trainer) {
    std::string g = groups[rng() % groups.size()];
    Life* life = run.current[g];
    changes.emplace_back(watch.committed(), Change::kRestart, g);
    if (trainer) {
      uint32_t r = pick(0, o.group_size - 1);
      note(fmt::format("kill -9 python trainer {}/{}", g, r));
      life->trainers[r]->Signal(SIGKILL);
      std::optional<int> code = run.Reap(life, 30s);
      INFO("agent log " << life->agent->log_path());
      CHECK(code == std::optional<int>(3));  // a trainer of its group died
    } else {
      note(fmt::format("kill -9 agent of {}", g));
      life->agent->Signal(SIGKILL);
      run.Reap(life, 30s);
    }
    Life* next = run.StartGroup(g, TrainerKind::kPython);
    REQUIRE_MESSAGE(run.WaitFirstCommit(next, 150s), "group " << g << " did not come back");
    note(fmt::format("{} is back (life {}) and committed", g, next->index));
  };

  // A Python trainer's start (the interpreter, torch) takes many outer steps of the tiny model
  // on a loaded machine, so the join comes early and every event leaves T far enough away.
  REQUIRE(WaitCommitted(watch, pick(2, 4), 120s));
  kill_and_restart(true);
  note("g3 joins");
  changes.emplace_back(watch.committed(), Change::kJoin, "g3");
  Life* joiner = run.StartGroup("g3", TrainerKind::kPython);
  REQUIRE(run.WaitFirstCommit(joiner, 150s));
  groups.push_back("g3");
  note("g3 committed");
  REQUIRE(WaitCommitted(watch, watch.committed() + 1, 90s));
  kill_and_restart(false);
  REQUIRE(WaitCommitted(watch, watch.committed() + 1, 90s));
  note("kill -9 lighthouse and restart it on the same address and data");
  uint32_t before = watch.committed();
  run.RestartLighthouse(rng);
  REQUIRE_MESSAGE(WaitCommitted(watch, before + 2, 90s), "no progress after the restart");
  note("lighthouse back, training goes on");

  run.WaitSurvivors(300s);
  note("all survivors exited");
  watch.Stop();

  CHECK(watch.polls() > 10);
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CHECK(watch.committed() == o.steps);
  LogSummary logs = CheckLogs(run.AllLogs(), o.steps, o.group_size);
  CHECK(logs.healed_lines > 0);  // the groups that came back healed, and said so
  FinalLosses loss = FinalLoss(run.AllLogs(), o.steps);
  double chaos_secs = secs();

  // The failure-free reference: the same changes at the same committed steps, a killed group's
  // return as a clean leave (drain) and return (see chaos_test.cc for why it must repeat them).
  FinalLosses ref_loss;
  {
    Run ref("pychaos-reference", o);
    fmt::print("reference logs in {}\n", ref.dir);
    StatusWatch ref_watch(ref.lh.address, o.job);
    for (const char* g : {"g0", "g1", "g2"}) ref.StartGroup(g, TrainerKind::kPython);
    for (const auto& [step, change, g] : changes) {
      REQUIRE(WaitCommitted(ref_watch, step, 120s));
      // A Python group's return takes many of this fast run's steps (the interpreter and torch
      // start), so the reference drifts behind the chaos run's schedule; a change that would
      // come within a few steps of T, where the returning group could not join before the
      // others finish, is left out (and said so).
      if (ref_watch.committed() + 8 >= o.steps) {
        fmt::print("reference: {} of {} left out at step {} (too close to T)\n",
                   change == Change::kJoin ? "join" : "restart", g, ref_watch.committed());
        continue;
      }
      if (change == Change::kRestart) ref.Leave(g);
      Life* back = ref.StartGroup(g, TrainerKind::kPython);
      REQUIRE_MESSAGE(ref.WaitFirstCommit(back, 150s), "reference: " << g << " did not come back");
    }
    ref.WaitSurvivors(300s);
    ref_watch.Stop();
    CheckLogs(ref.AllLogs(), o.steps, o.group_size);
    ref_loss = FinalLoss(ref.AllLogs(), o.steps);
  }
  double total_secs = secs();
  fmt::print(
      "python chaos: {} lives, {} log lines ({} healed), {} quorums; final eval loss {:.4f} vs "
      "reference {:.4f} ({:+.2f}%); chaos run {:.0f} s, {:.0f} s in all\n",
      run.lives.size(), logs.lines, logs.healed_lines, watch.quorums().size(), loss.eval,
      ref_loss.eval, 100 * (loss.eval - ref_loss.eval) / ref_loss.eval, chaos_secs, total_secs);
  CHECK(std::abs(loss.eval - ref_loss.eval) <= 0.05 * ref_loss.eval);
}

TEST_CASE("mixed job a group of cpp trainers and a group of python trainers hold bitwise equal "
          "global weights at every commit") {
  REQUIRE_MESSAGE(HavePythonPackage(), "no lightkeeper package in " << PythonPackageDir()
                                                                 << " (ninja lightkeeper_python)");
  RunOptions o;
  o.job = "mixed";
  o.steps = 8;
  o.group_size = 2;
  o.seed = 3;
  Run run("mixed", o);
  fmt::print("mixed job logs in {}\n", run.dir);
  StatusWatch watch(run.lh.address, o.job);
  Life* cpp = run.StartGroup("g0", TrainerKind::kCpp);
  Life* py = run.StartGroup("g1", TrainerKind::kPython);
  run.WaitSurvivors(300s);
  watch.Stop();
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CHECK(watch.committed() == o.steps);
  // One param_hash per (step, shard) over both groups' logs, every step committed...
  CheckLogs(run.AllLogs(), o.steps, o.group_size);
  // ... and both groups logged every step, each shard of it: the C++ and the Python trainers
  // held the same global weights after every commit, in a quorum of both.
  auto steps_of = [](const Life* life) {
    std::set<std::tuple<uint32_t, uint32_t, std::string>> out;
    for (const std::string& path : life->logs) {
      for (const LogLine& l : ReadLog(path)) {
        CHECK(l.world == 2);
        out.emplace(l.step, l.group_rank, l.hash);
      }
    }
    return out;
  };
  auto from_cpp = steps_of(cpp), from_py = steps_of(py);
  CHECK(from_cpp.size() == o.steps * o.group_size);
  CHECK(from_cpp == from_py);
}

}  // namespace
}  // namespace lk::e2e
