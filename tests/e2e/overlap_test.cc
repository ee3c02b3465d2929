// Overlapped outer steps (--outer-overlap, issue 15) end to end, on real processes:
//  - a group alone in its job follows the blocking outer step's trajectory bit for bit (the
//    stand-in for the average still on the wire is the group's own pseudo-gradient, which is
//    the average when it is alone): the same param_hash and eval_loss at every step;
//  - a kill of the slow group while the fast group's exchange is in flight: the fast group's
//    exchange is aborted by the lost quorum (its log says overlapped=true), retried once the
//    killed group is back and healed from the fast group's live state, no committed step is
//    lost and the weights agree at every commit;
//  - a job of a C++ and a Python group, both overlapped, agree at every commit.
// The chaos run with overlap (kills, a lighthouse restart, a leave, a join) is in chaos_test.cc.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <csignal>
#include <fstream>
#include <map>
#include <sstream>

#include "tests/e2e/chaos_run.h"

namespace lk::e2e {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// (step, group_rank) -> (param_hash, eval_loss) of one group's logs.
std::map<std::pair<uint32_t, uint32_t>, std::pair<std::string, double>> Trajectory(
    const Run& run) {
  std::map<std::pair<uint32_t, uint32_t>, std::pair<std::string, double>> out;
  for (const TrainerLog& t : run.AllLogs()) {
    for (const LogLine& l : ReadLog(t.path)) {
      out[{l.step, l.group_rank}] = {l.hash, l.eval_loss.value_or(-1)};
    }
  }
  return out;
}

TEST_CASE("overlap: a group alone follows the blocking trajectory bit for bit") {
  auto run_one = [](const std::string& name, std::vector<std::string> flags) {
    RunOptions o;
    o.job = "solo";
    o.steps = 8;
    o.group_size = 2;  // the stand-in's all-gather inside the group runs too
    o.trainer_flags = std::move(flags);
    o.trainer_flags.insert(o.trainer_flags.end(), {"--eval-batches", "2"});
    o.lighthouse_flags = {"--min-replicas", "1", "--join-timeout-ms", "2000"};
    auto run = std::make_unique<Run>(name, o);
    run->StartGroup("g0");
    run->WaitSurvivors(120s);
    CheckLogs(run->AllLogs(), o.steps, o.group_size);
    return run;
  };
  auto blocking = run_one("overlap-solo-blocking", {});
  auto overlapped = run_one("overlap-solo-overlapped", {"--outer-overlap"});
  auto a = Trajectory(*blocking), b = Trajectory(*overlapped);
  REQUIRE(a.size() == 16);
  CHECK(b.size() == a.size());
  for (const auto& [key, value] : a) {
    INFO("step " << key.first << " rank " << key.second);
    REQUIRE(b.count(key) == 1);
    CHECK(b[key].first == value.first);
    CHECK(b[key].second == value.second);
  }
}

TEST_CASE("overlap: a kill while the other group's exchange is in flight heals and loses nothing") {
  RunOptions o;
  o.job = "inflight";
  o.steps = 14;
  o.group_size = 1;
  o.trainer_flags = {"--outer-overlap"};
  // g1's inner steps are slow, so g0 waits for g1's part of every exchange with its own part
  // already sent: a kill of g1 during its inner steps lands while g0's exchange is in flight.
  o.group_flags["g1"] = {"--inner-step-min-ms", "40"};
  Run run("overlap-inflight", o);
  StatusWatch watch(run.lh.address, o.job);
  Life* g0 = run.StartGroup("g0");
  Life* g1 = run.StartGroup("g1");
  REQUIRE(WaitCommitted(watch, 4, 90s));
  MESSAGE("kill -9 the trainer of g1 at committed step " << watch.committed());
  g1->trainers[0]->Signal(SIGKILL);
  std::optional<int> code = run.Reap(g1, 30s);
  CHECK(code == std::optional<int>(3));  // a trainer of its group died
  Life* back = run.StartGroup("g1");
  REQUIRE_MESSAGE(run.WaitFirstCommit(back, 90s), "g1 did not come back");
  run.WaitSurvivors(180s);
  watch.Stop();
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CHECK(watch.committed() == o.steps);
  CheckLogs(run.AllLogs(), o.steps, o.group_size);
  // Whether the kill found g0's exchange still waiting for g1's part (usually: g0 waits for it
  // most of the time) or just after both parts had met; either way nothing committed is lost.
  const std::string fast = Slurp(g0->trainers[0]->log_path());
  MESSAGE("g0's exchange in flight was aborted by the kill: "
          << std::string(fast.find("overlapped=true") != std::string::npos ? "yes" : "no") << " ("
          << g0->trainers[0]->log_path() << ")");
  const std::string healed = Slurp(back->trainers[0]->log_path());
  INFO("g1's new life: " << back->trainers[0]->log_path());
  CHECK(healed.find("heal_fetched from=peers") != std::string::npos);
}

TEST_CASE("overlap: a C++ group and a Python group agree at every commit") {
  RunOptions o;
  o.job = "overlap-py";
  o.steps = 6;
  o.group_size = 1;
  o.trainer_flags = {"--outer-overlap"};
  Run run("overlap-python", o);
  run.StartGroup("g0", TrainerKind::kCpp);
  run.StartGroup("g1", TrainerKind::kPython);
  run.WaitSurvivors(180s);
  CheckLogs(run.AllLogs(), o.steps, o.group_size);
  for (const TrainerLog& t : run.AllLogs()) {
    INFO("log " << t.path);
    CHECK(Slurp(t.path).find("\"overlap\":true") != std::string::npos);
  }
}

}  // namespace
}  // namespace lk::e2e
