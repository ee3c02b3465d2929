// Chaos test of the DiLoCo trainer under Lightkeeper, on plain processes (issue 6): four groups
// of two diloco_trainer processes (one replica_agent each), a tiny model and 36 outer steps, with
// a seeded random schedule of kill -9 of trainers and of agents, a kill -9 and restart of the
// lighthouse, one group leaving (SIGTERM to its agent) and one joining. A killed group comes
// back as a new incarnation (a fresh agent and both trainers: the group is one failure domain).
// A failure-free reference with the same seeds runs after it with the same membership changes
// at the same committed steps (a killed group's return as a clean leave and return; the leave;
// the join), so that it differs from the chaos run by the failures alone.
// Asserted from the trainers' --log JSON lines and the lighthouse's /status, polled throughout:
//  - after every commit all members report the same param_hash per (step, shard);
//  - quorum_id never decreases in any trainer's log, and one quorum_id never names two
//    memberships (replica_world_size in the logs, members in /status);
//  - no committed step is lost: the job's committed step never goes backwards, across the
//    lighthouse restart too, and every surviving trainer reaches T;
//  - every process that was not killed exits 0;
//  - the final loss is within 5% of the reference's, either way: the loss of the final global
//    weights on fixed evaluation batches (eval_loss), which every member reports alike.
// The seed is printed; LK_CHAOS_SEED=N replays a schedule. Every wait is bounded.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <tuple>

#include "tests/e2e/chaos_run.h"

namespace lk::e2e {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kSteps = 36;      // T
constexpr uint32_t kGroupSize = 2;   // trainers per group

// The schedule's events are placed by committed step, and each return of a killed group (a new
// agent and trainers, whose start alone takes seconds on a loaded machine) must finish before
// the job's last step. Unpaced, the tiny model's outer steps took 0.3-0.6 s, so a return could
// outlast a dozen steps and the job end before the schedule did. Paced inner steps make an outer
// step take at least 1 s whatever the machine, and leave the cores to the processes that start;
// the sleep changes no number the trainers compute.
constexpr const char* kInnerStepMinMs = "125";

RunOptions Options(std::vector<std::string> trainer_flags) {
  RunOptions o;
  o.steps = kSteps;
  o.group_size = kGroupSize;
  o.seed = 11;  // the trainers' --seed (model init and data)
  o.trainer_flags = std::move(trainer_flags);
  o.trainer_flags.insert(o.trainer_flags.end(), {"--inner-step-min-ms", kInnerStepMinMs});
  return o;
}

// The whole chaos run and its reference, with `trainer_flags` added to every trainer of both.
void ChaosRun(const std::string& name, const std::vector<std::string>& trainer_flags,
              double loss_tolerance = 0.05) {
  auto started = Clock::now();
  std::mt19937 rng(ChaosSeed(name));
  auto pick = [&](uint32_t lo, uint32_t hi) { return lo + rng() % (hi - lo + 1); };
  auto secs = [&] { return std::chrono::duration<double>(Clock::now() - started).count(); };

  Run run(name, Options(trainer_flags));
  fmt::print("chaos logs in {}\n", run.dir);
  StatusWatch watch(run.lh.address, "chaos");
  for (const char* g : {"g0", "g1", "g2", "g3"}) run.StartGroup(g);
  std::vector<std::string> groups = {"g0", "g1", "g2", "g3"};
  auto random_group = [&] { return groups[rng() % groups.size()]; };
  auto note = [&](const std::string& what) {
    fmt::print("[{:5.1f} s] step {:2}: {}\n", secs(), watch.committed(), what);
    std::fflush(stdout);
  };

  // What changed the membership, at which committed step, for the reference to repeat without
  // the failures: a group that was killed and came back (a new process, so a fresh inner
  // optimizer and data stream), the leave, the join.
  enum class Change { kRestart, kLeave, kJoin };
  std::vector<std::tuple<uint32_t, Change, std::string>> changes;

  // A kill -9 of a trainer or of an agent of a random group, which then comes back.
  auto kill_and_restart = [&](bool trainer) {
    std::string g = random_group();
    Life* life = run.current[g];
    changes.emplace_back(watch.committed(), Change::kRestart, g);
    if (trainer) {
      uint32_t r = pick(0, kGroupSize - 1);
      note(fmt::format("kill -9 trainer {}/{}", g, r));
      life->trainers[r]->Signal(SIGKILL);
      std::optional<int> code = run.Reap(life, 30s);
      INFO("agent log " << life->agent->log_path());
      CHECK(code == std::optional<int>(3));  // a trainer of its group died
    } else {
      note(fmt::format("kill -9 agent of {}", g));
      life->agent->Signal(SIGKILL);
      run.Reap(life, 30s);
    }
    Life* next = run.StartGroup(g);
    REQUIRE_MESSAGE(run.WaitFirstCommit(next, 90s), "group " << g << " did not come back");
    note(fmt::format("{} is back (life {}) and committed", g, next->index));
  };

  REQUIRE(WaitCommitted(watch, pick(3, 5), 90s));
  kill_and_restart(true);
  REQUIRE(WaitCommitted(watch, watch.committed() + pick(1, 3), 60s));
  kill_and_restart(false);
  REQUIRE(WaitCommitted(watch, watch.committed() + pick(1, 2), 60s));
  note("kill -9 lighthouse and restart it on the same address and data");
  uint32_t before = watch.committed();
  run.RestartLighthouse(rng);
  REQUIRE_MESSAGE(WaitCommitted(watch, before + 2, 60s), "no progress after the restart");
  note("lighthouse back, training goes on");
  // The reference repeats this leave and join at the same committed step.
  const std::string leaver = random_group();
  changes.emplace_back(watch.committed(), Change::kLeave, leaver);
  note(fmt::format("SIGTERM agent of {}: the group drains and leaves", leaver));
  run.Leave(leaver);
  groups.erase(std::find(groups.begin(), groups.end(), leaver));
  note("g4 joins");
  changes.emplace_back(watch.committed(), Change::kJoin, "g4");
  Life* joiner = run.StartGroup("g4");
  groups.push_back("g4");
  REQUIRE(run.WaitFirstCommit(joiner, 90s));
  note("g4 committed");
  if (watch.committed() + 14 < kSteps) kill_and_restart(rng() % 2 == 0);

  run.WaitSurvivors(150s);
  note("all survivors exited");
  watch.Stop();

  // No committed step lost and one membership per quorum_id, as /status showed them.
  CHECK(watch.polls() > 10);
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CHECK(watch.committed() == kSteps);
  LogSummary logs = CheckLogs(run.AllLogs(), kSteps, kGroupSize);
  FinalLosses loss = FinalLoss(run.AllLogs(), kSteps);
  double chaos_secs = secs();

  // The failure-free reference: the same groups, seeds and steps, and the same membership
  // changes at the same committed steps, without the failures: a group that was killed and came
  // back here leaves cleanly (drain) and comes back; the leave and the join as they were. A
  // group that comes back is a new process whose inner AdamW starts afresh, and a fresh AdamW
  // takes larger steps than one whose second moments still remember the first, large gradients:
  // with this short run's learning rate that alone lowers the final loss by several percent
  // (see examples/diloco/README.md), so a reference without the restarts is not the same run.
  FinalLosses ref_loss;
  {
    auto ref_started = Clock::now();
    Run ref(name + "-reference", Options(trainer_flags));
    fmt::print("reference logs in {}\n", ref.dir);
    StatusWatch ref_watch(ref.lh.address, "chaos");
    for (const char* g : {"g0", "g1", "g2", "g3"}) ref.StartGroup(g);
    for (const auto& [step, change, g] : changes) {
      REQUIRE(WaitCommitted(ref_watch, step, 120s));
      if (change != Change::kJoin) ref.Leave(g);
      if (change != Change::kLeave) {
        Life* back = ref.StartGroup(g);
        REQUIRE_MESSAGE(ref.WaitFirstCommit(back, 90s), "reference: " << g << " did not come back");
      }
    }
    ref.WaitSurvivors(150s);
    ref_watch.Stop();
    CheckLogs(ref.AllLogs(), kSteps, kGroupSize);
    ref_loss = FinalLoss(ref.AllLogs(), kSteps);
    std::string done;
    for (const auto& [step, change, g] : changes) {
      done += fmt::format(" {}@{}", change == Change::kRestart ? "restart " + g
                                    : change == Change::kLeave ? "leave " + g
                                                               : "join " + g,
                          step);
    }
    fmt::print("reference: {} steps, changes{}, final eval loss {:.4f}, {:.0f} s\n", kSteps, done,
               ref_loss.eval, std::chrono::duration<double>(Clock::now() - ref_started).count());
  }

  double total_secs = secs();
  fmt::print(
      "chaos: {} lives of groups, {} log lines ({} healed), {} quorums; final eval loss {:.4f} vs "
      "reference {:.4f} ({:+.2f}%); last step's inner loss {:.4f} vs {:.4f} ({:+.2f}%); chaos "
      "run {:.0f} s, {:.0f} s in all\n",
      run.lives.size(), logs.lines, logs.healed_lines, watch.quorums().size(), loss.eval,
      ref_loss.eval, 100 * (loss.eval - ref_loss.eval) / ref_loss.eval, loss.inner,
      ref_loss.inner, 100 * (loss.inner - ref_loss.inner) / ref_loss.inner, chaos_secs,
      total_secs);
  // Issue 6: within 5% of the failure-free run, either way. The loss of the final global
  // weights on fixed batches, not the groups' training loss of the last step, which depends on
  // which groups ran it and how fresh their inner optimizer was (see README.md).
  CHECK(std::abs(loss.eval - ref_loss.eval) <= loss_tolerance * ref_loss.eval);
  CHECK(total_secs < 300);
}

TEST_CASE("chaos four groups of two trainers survive kills a lighthouse restart a leave and a join") {
  ChaosRun("chaos", {});
}

// The same schedule and assertions with the cross-group exchange in int8 with error feedback
// and overlapped outer steps (--outer-overlap) at once. The encoded allreduce must keep every
// member's weights bitwise equal through kills, heals (which drop the residual), the
// lighthouse restart, the leave and the join; each trainer's exchange is in flight during the
// next inner steps, so the failures land while one is on the wire, and the aborted exchange is
// retried or dropped with no committed step lost. The final loss must stay within 8% of its own
// failure-free reference (also int8 and overlapped): wider than 5% because the overlapped
// trajectory depends more on where the failures fall (a kill drops the step in flight and the
// one being computed, and a step cut short is retried blocking; in 7 seeded runs of overlap
// alone the chaos run's loss was -6.2% to +0.5% from its reference). One run for both settings
// keeps the e2e tier's time: each alone ran the same schedule before.
TEST_CASE("chaos with int8 outer compression and overlapped outer steps passes the same assertions") {
  ChaosRun("chaos-int8-overlap", {"--outer-compress", "int8", "--outer-overlap"}, 0.08);
}

}  // namespace
}  // namespace lk::e2e
