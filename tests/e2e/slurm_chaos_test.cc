// The chaos test of issue 6 with the replica groups as Slurm jobs on the real local Slurm
// (scripts/slurm-local.sh, started when sinfo does not answer): two groups, each one sbatch job
// written by `lkctl slurm script` that runs the real replica_agent and two diloco_trainer
// processes, against a lighthouse on 127.0.0.1. A seeded schedule sends Slurm's warning signal to
// one group's job (the group drains, saves a durable checkpoint, leaves with reason preempted and
// requeues; it comes back with SLURM_RESTART_COUNT=1 as a new incarnation, heals from the other
// group and rejoins), then kills a random trainer with -9 (its job requeues itself:
// --requeue-on-crash, and the group comes back and heals likewise). The same assertions as the
// plain chaos test, from the trainers' logs and /status: one param_hash per (step, shard),
// quorum_id never decreasing nor naming two memberships, no committed step lost, every trainer
// that was not killed exits 0, and the final loss within 5% of a failure-free run of the same
// two groups with the same seeds and the same returns at the same steps (plain processes: a
// clean leave and return where the Slurm run had a warning or a kill).
//
// The one-node local Slurm has 2 CPUs; a group asks for one (--ntasks-per-node=1 --overcommit on
// the sbatch line, which the batch script's two-trainer step inherits through
// SLURM_OVERCOMMIT), so both groups and a requeued one fit. Label "slurm", like the other tests
// on the real Slurm: `ctest -LE slurm` skips it where Slurm is not installed.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <signal.h>

#include <boost/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>

#include "slurm/slurm_test_util.h"
#include "tests/e2e/chaos_util.h"
#include "tests/support/process.h"
#include "tests/support/trainer_log.h"

namespace lk::e2e {
namespace {

using namespace std::chrono_literals;
using namespace lk::slurm::testing;  // NOLINT
using Clock = std::chrono::steady_clock;

constexpr uint32_t kSteps = 40;
constexpr uint32_t kGroupSize = 2;
constexpr uint32_t kSeed = 11;
const char* const kJob = "schaos";

// The trainer's flags shared by the Slurm run and the reference: the plain chaos test's tiny
// model, and the loss of the global weights on fixed batches at every commit.
// With `with_group_size` false the trainer takes its rank and group size from Slurm's task
// variables (SLURM_PROCID, SLURM_NTASKS), as a trainer started by the batch script does.
std::string ModelFlags(bool with_group_size = true, uint32_t steps = kSteps) {
  return fmt::format(
      "{}--inner-steps 8 --outer-steps {} --seed {} --model-width 32 --layers 1 "
      "--heads 2 --seq-len 32 --batch 8 --corpus-bytes 16384 --op-timeout-ms 20000 "
      "--eval-batches 8",
      with_group_size ? fmt::format("--group-size {} ", kGroupSize) : "", steps, kSeed);
}

// What group `g` draws when it trains `steps` outer steps alone and never stops: each rank's
// batches in order (the data stream depends on the group's name, seed and rank only).
std::vector<std::vector<std::string>> UnstoppedBatches(const std::string& g, uint32_t steps) {
  std::string dir = test::TempDir("slurm-chaos-stream");
  test::Lighthouse lh = test::StartLighthouse(dir + "/lh-data", {"--min-replicas", "1"},
                                              dir + "/lighthouse.log");
  std::string socket = dir + "/agent.sock";
  test::Process agent({test::BinDir() + "/replica_agent", "--lighthouse", lh.url(), "--job",
                       "stream", "--group-id", g, "--socket", socket},
                      dir + "/agent.log");
  REQUIRE_FALSE(agent.WaitForLog("agent_listening", 20s).empty());
  std::vector<std::unique_ptr<test::Process>> trainers;
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    std::vector<std::string> argv = {test::BinDir() + "/diloco_trainer", "--group-rank",
                                     std::to_string(r), "--log",
                                     fmt::format("{}/r{}.jsonl", dir, r)};
    std::istringstream flags(ModelFlags(true, steps));
    for (std::string f; flags >> f;) argv.push_back(f);
    trainers.push_back(std::make_unique<test::Process>(
        argv, fmt::format("{}/r{}.stderr", dir, r),
        std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}, {"LK_GROUP_ID", g}}));
  }
  std::vector<std::vector<std::string>> out;
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    INFO("stream reference trainer " << trainers[r]->log_path());
    REQUIRE(trainers[r]->Wait(120s) == std::optional<int>(0));
    out.push_back(test::BatchSequence(fmt::format("{}/r{}.jsonl", dir, r)));
  }
  return out;
}

// The group's entry in /status, or nothing.
struct GroupView {
  std::string state, reason, incarnation;
};
std::optional<GroupView> GroupOf(const std::string& address, const std::string& group) {
  std::string body = GetStatus(address);
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(body, ec);
  if (ec || !v.is_object()) return std::nullopt;
  for (const auto& j : v.at("jobs").as_array()) {
    if (j.at("job").as_string() != kJob) continue;
    for (const auto& g : j.at("groups").as_array()) {
      if (g.at("group_id").as_string() != group) continue;
      auto str = [&](const char* k) {
        const auto* f = g.as_object().if_contains(k);
        return f && f->is_string() ? std::string(f->as_string()) : std::string();
      };
      return GroupView{str("state"), str("reason"), str("incarnation")};
    }
  }
  return std::nullopt;
}

class SlurmChaos {
 public:
  explicit SlurmChaos(const std::string& dir) : dir_(dir) {
    // --min-replicas 2: while one group is away (requeued, about 7 s) the other waits for it
    // instead of training alone. Alone it would run an outer step in about 0.3 s on these two
    // cores and could reach T before the other is back, which would then find no live state
    // to heal from; and the final loss would compare a run that trained mostly on one group's
    // data with a failure-free run on two.
    lh_ = test::StartLighthouse(dir_ + "/lh-data",
                                {"--min-replicas", "2", "--join-timeout-ms", "2000",
                                 "--heartbeat-timeout-ms", "10000"},
                                dir_ + "/lighthouse.log");
  }
  ~SlurmChaos() {
    for (const auto& [group, job] : jobs_) (void)Sh("scancel " + job + " 2>/dev/null; true");
  }
  const test::Lighthouse& lh() const { return lh_; }

  // One life of a trainer writes DIR/GROUP-rLIFE-RANK.{pid,jsonl,stderr,rc}; the wrapper keeps
  // the exit code, which Slurm does not show per task.
  std::string Submit(const std::string& group) {
    std::string life = dir_ + "/" + group + "-r${SLURM_RESTART_COUNT:-0}-${SLURM_PROCID}";
    std::string trainer = fmt::format(
        "{1}/diloco_trainer {2} --ckpt-dir {3}/ckpt-{4} --live-dir "
        "{3}/live-{4} --log {0}.jsonl 2> {0}.stderr & p=$!; echo $p > {0}.pid; wait $p; rc=$?; "
        "echo $rc > {0}.rc; exit $rc",
        life, Env("LK_BIN_DIR"), ModelFlags(false), dir_, group);
    std::string gen = fmt::format(
        "cd {0} && LK_HEARTBEAT_INTERVAL_MS=100 LK_DRAIN_TIMEOUT_MS=20000 LK_SERVE=127.0.0.1:0 "
        "LK_SERVE_DIR={0}/live-{2} {1}/lkctl slurm script --job {5} --group-id {2} --lighthouse "
        "{3} --time 10:00 --signal-before-s 60 --tasks-per-node {6} --requeue-on-crash "
        "--output {0}/batch-{2}-%j.log --agent-bin {1}/replica_agent --lkctl-bin {1}/lkctl "
        "--agent-exit-wait-s 30 -- "
        "bash -c '{4}' > {0}/{2}.sh",
        dir_, Env("LK_BIN_DIR"), group, lh_.url(), trainer, kJob, kGroupSize);
    auto made = Sh(gen);
    REQUIRE_MESSAGE(made.exit_code == 0, made.err);
    auto sub = Sh(fmt::format(
        "cd {} && sbatch --parsable --ntasks-per-node=1 --overcommit {}.sh", dir_, group));
    REQUIRE_MESSAGE(sub.exit_code == 0, sub.err);
    std::string id = sub.out.substr(0, sub.out.find_first_of(";\n"));
    REQUIRE(!id.empty());
    jobs_[group] = id;
    return id;
  }

  const std::string& Job(const std::string& group) const { return jobs_.at(group); }
  std::string Path(const std::string& group, int life, uint32_t rank, const char* ext) const {
    return fmt::format("{}/{}-r{}-{}.{}", dir_, group, life, rank, ext);
  }
  std::string BatchLog(const std::string& group) const {
    return ReadFile(fmt::format("{}/batch-{}-{}.log", dir_, group, Job(group)));
  }
  bool BatchHas(const std::string& group, const std::string& text) const {
    return BatchLog(group).find(text) != std::string::npos;
  }
  std::string JobState(const std::string& group) const {
    std::string s = Sh("squeue -h -t all -j " + Job(group) + " -o %T 2>/dev/null").out;
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  // Both trainers of that life have logged a commit.
  bool Committed(const std::string& group, int life) const {
    for (uint32_t r = 0; r < kGroupSize; ++r) {
      if (ReadLog(Path(group, life, r, "jsonl")).empty()) return false;
    }
    return true;
  }
  // A requeued job waits cred_expire before it may start; StartTime=now 2 s after it is seen
  // PENDING shortens that (sooner, slurmd refuses the launch: see slurm/README.md). Returns
  // when life `life` has started its trainers.
  bool RestartNow(const std::string& group, int life, std::chrono::seconds limit) {
    std::optional<Clock::time_point> pending_since;
    return WaitFor(
        [&] {
          if (std::filesystem::exists(Path(group, life, 0, "pid"))) return true;
          if (JobState(group) != "PENDING") return false;
          auto now = Clock::now();
          if (!pending_since) pending_since = now;
          if (now - *pending_since >= 2s) {
            (void)Sh("scontrol update jobid=" + Job(group) + " StartTime=now 2>/dev/null; true");
          }
          return false;
        },
        limit);
  }

  std::string Logs() const {
    std::string out;
    for (const auto& [group, job] : jobs_) {
      out += fmt::format("== batch log of {} (job {})\n{}", group, job, BatchLog(group));
    }
    out += "== squeue\n" + Sh("squeue -t all -o '%i %P %T %r'").out;
    out += "== lighthouse status\n" + GetStatus(lh_.address) + "\n";
    return out;
  }

 private:
  std::string dir_;
  test::Lighthouse lh_;
  std::map<std::string, std::string> jobs_;  // group -> Slurm job id
};

// The failure-free reference: the same two groups and seeds as plain processes, and the same
// returns at the same committed steps, without Slurm and without failures: the group leaves
// cleanly (a drain: SIGUSR2 with a save for the warned return, SIGTERM for the others) and comes
// back as new processes that heal. A group that
// comes back has a fresh inner AdamW, which alone lowers the final loss by several percent in a
// run this short (see examples/diloco/README.md), so a reference without the returns is not the
// same run.
// A return after the warning leaves as the warning does (SIGUSR2: the group saves, then leaves),
// so that the new life finds the same checkpoint of its own and continues its data stream from
// it, as the requeued life did; the others leave without a save (SIGTERM).
struct Return {
  uint32_t step = 0;
  std::string group;
  bool saved = false;
};

FinalLosses RunReference(const std::vector<Return>& returns) {
  std::string dir = test::TempDir("slurm-chaos-reference");
  fmt::print("reference logs in {}\n", dir);
  test::Lighthouse lh = test::StartLighthouse(
      dir + "/lh-data", {"--min-replicas", "2", "--join-timeout-ms", "2000"},
      dir + "/lighthouse.log");
  StatusWatch watch(lh.address, kJob);
  struct Group {
    std::unique_ptr<test::Process> agent;
    std::vector<std::unique_ptr<test::Process>> trainers;
  };
  std::vector<Group> done;  // lives that left
  std::map<std::string, Group> live;
  std::map<std::string, int> lives;
  std::vector<TrainerLog> logs;
  auto start = [&](const std::string& g) {
    int l = lives[g]++;
    std::string socket = fmt::format("{}/{}.{}.sock", dir, g, l);
    Group grp;
    grp.agent = std::make_unique<test::Process>(
        std::vector<std::string>{test::BinDir() + "/replica_agent", "--lighthouse", lh.url(),
                                 "--job", kJob, "--group-id", g, "--socket", socket, "--serve",
                                 "127.0.0.1:0", "--serve-dir", dir + "/live-" + g,
                                 "--heartbeat-interval-ms", "100"},
        fmt::format("{}/agent-{}.{}.log", dir, g, l));
    REQUIRE_FALSE(grp.agent->WaitForLog("agent_listening", 20s).empty());
    for (uint32_t r = 0; r < kGroupSize; ++r) {
      std::string log = fmt::format("{}/{}-r{}-{}.jsonl", dir, g, l, r);
      logs.push_back({log, false});
      std::vector<std::string> argv = {test::BinDir() + "/diloco_trainer", "--group-rank",
                                       std::to_string(r), "--ckpt-dir", dir + "/ckpt-" + g,
                                       "--live-dir", dir + "/live-" + g, "--log", log};
      std::istringstream flags(ModelFlags());
      for (std::string f; flags >> f;) argv.push_back(f);
      grp.trainers.push_back(std::make_unique<test::Process>(
          argv, log + ".stderr",
          std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}, {"LK_GROUP_ID", g}}));
    }
    live[g] = std::move(grp);
    return l;
  };
  auto wait_exit = [](test::Process& p, std::chrono::seconds bound) {
    auto code = p.Wait(bound);
    INFO("reference process log " << p.log_path());
    REQUIRE(code == std::optional<int>(0));
  };
  for (const char* g : {"g0", "g1"}) start(g);
  for (const auto& [step, g, saved] : returns) {
    REQUIRE(WaitFor([&] { return watch.committed() >= step; }, 120s, 50ms));
    Group& old = live[g];
    old.agent->Signal(saved ? SIGUSR2 : SIGTERM);
    for (auto& t : old.trainers) wait_exit(*t, 30s);
    wait_exit(*old.agent, 10s);
    done.push_back(std::move(old));
    int l = start(g);
    REQUIRE_MESSAGE(WaitFor(
                        [&] {
                          return !ReadLog(fmt::format("{}/{}-r{}-0.jsonl", dir, g, l)).empty();
                        },
                        90s),
                    "reference: " << g << " did not come back");
  }
  for (auto& [g, grp] : live) {
    for (auto& t : grp.trainers) wait_exit(*t, 120s);
    wait_exit(*grp.agent, 20s);
    for (uint32_t r = 0; r < kGroupSize; ++r) {
      std::string last = fmt::format("{}/{}-r{}-{}.jsonl", dir, g, lives[g] - 1, r);
      for (auto& t : logs) t.must_finish |= t.path == last;
    }
  }
  watch.Stop();
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CheckLogs(logs, kSteps, kGroupSize);
  return FinalLoss(logs, kSteps);
}

// The suite name becomes the CTest label "slurm" (ADD_LABELS in CMakeLists.txt).
TEST_SUITE_BEGIN("slurm");

TEST_CASE("slurm chaos: two groups as Slurm jobs survive a warning with requeue and a kill -9") {
  EnsureSlurm();
  // Jobs of an earlier test may still be completing and hold the node's CPUs.
  WaitFor([] { return Sh("squeue -h -o %i 2>/dev/null").out.empty(); }, 60s);
  auto started = Clock::now();
  auto secs = [&] { return std::chrono::duration<double>(Clock::now() - started).count(); };
  std::mt19937 rng(ChaosSeed("slurm chaos"));
  auto pick = [&](uint32_t lo, uint32_t hi) { return lo + rng() % (hi - lo + 1); };

  std::string dir = test::TempDir("slurm-chaos");
  fmt::print("slurm chaos logs in {}\n", dir);
  SlurmChaos run(dir);
  StatusWatch watch(run.lh().address, kJob);
  auto note = [&](const std::string& what) {
    fmt::print("[{:5.1f} s] step {:2}: {}\n", secs(), watch.committed(), what);
    std::fflush(stdout);
  };
  auto wait_committed = [&](uint32_t step, std::chrono::seconds bound) {
    return WaitFor([&] { return watch.committed() >= step; }, bound, 50ms);
  };
  const std::vector<std::string> groups = {"g0", "g1"};
  std::map<std::string, int> life = {{"g0", 0}, {"g1", 0}};
  std::set<std::pair<std::string, int>> killed_lives;
  // The returns, for the reference to repeat: the group and the life that came back.
  std::vector<std::pair<std::string, int>> came_back;
  for (const auto& g : groups) run.Submit(g);
  REQUIRE_MESSAGE(WaitFor([&] { return run.Committed("g0", 0) && run.Committed("g1", 0); }, 120s),
                  run.Logs());
  note("both groups committed");
  // No --group-rank or --group-size on the trainers' command: each took its place from Slurm.
  for (const auto& g : groups) {
    for (uint32_t r = 0; r < kGroupSize; ++r) {
      std::string err = ReadFile(run.Path(g, 0, r, "stderr"));
      INFO("trainer " << g << "/" << r << " stderr:\n" << err);
      CHECK(err.find("place=slurm") != std::string::npos);
      CHECK(err.find(fmt::format("group_rank={} group_size={} ", r, kGroupSize)) !=
            std::string::npos);
    }
  }

  // The warning: drain, durable save, leave (preempted), requeue, back as life 1, healed.
  REQUIRE_MESSAGE(wait_committed(pick(3, 6), 60s), run.Logs());
  const std::string warned = groups[rng() % 2];
  const std::string& warned_job = run.Job(warned);
  note(fmt::format("scancel --batch --signal=USR2 {} (group {})", warned_job, warned));
  REQUIRE(Sh("scancel --batch --signal=USR2 " + warned_job).exit_code == 0);
  REQUIRE_MESSAGE(WaitFor(
                      [&] {
                        auto g = GroupOf(run.lh().address, warned);
                        return g && g->state == "left";
                      },
                      30s),
                  run.Logs());
  {
    auto left = GroupOf(run.lh().address, warned);
    REQUIRE(left);
    CHECK(left->reason == "preempted");
  }
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    std::string err = ReadFile(run.Path(warned, 0, r, "stderr"));
    INFO("trainer " << warned << "/" << r << " stderr:\n" << err);
    CHECK(err.find("drain step=") != std::string::npos);
    CHECK(err.find("checkpoint_now=true") != std::string::npos);
    CHECK(err.find("drain_save_failed") == std::string::npos);
  }
  CHECK(std::filesystem::exists(dir + "/ckpt-" + warned));
  REQUIRE_MESSAGE(
      WaitFor([&] { return run.BatchHas(warned, "requeued job=" + warned_job + "\n"); }, 30s),
      run.Logs());
  note(fmt::format("{} saved, left preempted and requeued", warned));
  const uint32_t step_at_warning = watch.committed();
  REQUIRE_MESSAGE(run.RestartNow(warned, 1, 90s), run.Logs());
  life[warned] = 1;
  came_back.emplace_back(warned, 1);
  REQUIRE_MESSAGE(WaitFor([&] { return run.Committed(warned, 1); }, 90s), run.Logs());
  CHECK(run.BatchHas(warned, "event=start job=" + warned_job + " restart_count=1 "));
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    std::vector<LogLine> l = ReadLog(run.Path(warned, 1, r, "jsonl"));
    REQUIRE(!l.empty());
    CHECK(l.front().healed);
    CHECK(l.front().step > step_at_warning);
    CHECK(l.front().world == 2);
  }
  auto g = GroupOf(run.lh().address, warned);
  REQUIRE(g);
  CHECK(g->incarnation.starts_with(warned_job + ".r1."));
  note(fmt::format("{} is back (SLURM_RESTART_COUNT=1), healed and committed", warned));

  // A kill -9 of a random trainer: its job fails the step and requeues itself.
  REQUIRE_MESSAGE(wait_committed(watch.committed() + pick(1, 3), 60s), run.Logs());
  if (watch.committed() + 8 < kSteps) {
    const std::string victim = groups[rng() % 2];
    const uint32_t rank = pick(0, kGroupSize - 1);
    const int vl = life[victim];
    int pid = std::atoi(ReadFile(run.Path(victim, vl, rank, "pid")).c_str());
    REQUIRE(pid > 0);
    note(fmt::format("kill -9 trainer {}/{} (life {}, pid {})", victim, rank, vl, pid));
    REQUIRE(::kill(pid, SIGKILL) == 0);
    killed_lives.insert({victim, vl});
    REQUIRE_MESSAGE(
        // The step's exit code is that of its first task to end: 137, or 143 for the other
        // trainer that srun stopped.
        WaitFor([&] { return run.BatchHas(victim, " action=requeue job=" + run.Job(victim)); },
                40s),
        run.Logs());
    REQUIRE_MESSAGE(run.RestartNow(victim, vl + 1, 90s), run.Logs());
    life[victim] = vl + 1;
    came_back.emplace_back(victim, vl + 1);
    REQUIRE_MESSAGE(WaitFor([&] { return run.Committed(victim, vl + 1); }, 90s), run.Logs());
    CHECK(ReadLog(run.Path(victim, vl + 1, 0, "jsonl")).front().healed);
    note(fmt::format("{} is back (life {}), healed and committed", victim, vl + 1));
  } else {
    note("too close to the end for the kill: skipped");
  }

  // Both jobs end with their last life done.
  for (const auto& grp : groups) {
    CHECK_MESSAGE(WaitFor([&] { return run.JobState(grp) == "COMPLETED"; }, 150s),
                  grp << ": " << run.JobState(grp) << "\n"
                      << run.Logs());
  }
  note("both jobs completed");
  watch.Stop();

  CHECK(watch.polls() > 10);
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CHECK(watch.committed() == kSteps);
  std::vector<TrainerLog> logs;
  for (const auto& grp : groups) {
    for (int l = 0; l <= life[grp]; ++l) {
      bool killed = killed_lives.count({grp, l}) > 0;
      for (uint32_t r = 0; r < kGroupSize; ++r) {
        logs.push_back({run.Path(grp, l, r, "jsonl"), l == life[grp]});
        if (killed) continue;
        // Every trainer that was not killed exits 0: the drained ones and the finishers.
        std::string rc = ReadFile(run.Path(grp, l, r, "rc"));
        INFO("trainer " << grp << "/" << r << " life " << l << " stderr "
                        << run.Path(grp, l, r, "stderr"));
        CHECK(rc == "0\n");
      }
    }
  }
  LogSummary summary = CheckLogs(logs, kSteps, kGroupSize);
  FinalLosses loss = FinalLoss(logs, kSteps);
  double slurm_secs = secs();

  // A return is repeated at the step where it happened, not where its cause did: the warned
  // group leaves at the boundary after the warning, whichever that was, and a life comes back
  // healed to the step the job had committed, its first line's step less one (the other group
  // waits for it: --min-replicas 2). A reference that left one step off ran a different
  // trajectory, several percent apart in final loss by that alone.
  std::vector<Return> returns;
  for (const auto& [g, l] : came_back) {
    std::vector<LogLine> first = ReadLog(run.Path(g, l, 0, "jsonl"));
    REQUIRE(!first.empty());
    returns.push_back({first.front().step - 1, g, g == warned && l == 1});
  }
  FinalLosses ref = RunReference(returns);
  fmt::print(
      "slurm chaos: {} log lines ({} healed), {} quorums; final eval loss {:.4f} vs failure-free "
      "reference with the same returns {:.4f} ({:+.2f}%); Slurm run {:.0f} s, {:.0f} s in all\n",
      summary.lines, summary.healed_lines, watch.quorums().size(), loss.eval, ref.eval,
      100 * (loss.eval - ref.eval) / ref.eval, slurm_secs, secs());
  CHECK(std::abs(loss.eval - ref.eval) <= 0.05 * ref.eval);

  // The warned group's data stream went on through the requeue: its first two lives together
  // drew the batches of the same group trained alone without a stop. Life 1 healed its weights
  // from the other group's live state and took its data position from its own drain save.
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    std::string err = ReadFile(run.Path(warned, 1, r, "stderr"));
    INFO("trainer " << warned << "/" << r << " life 1 stderr:\n" << err);
    CHECK(err.find("extra_state_from_own_checkpoint") != std::string::npos);
    CHECK(err.find("extra_state_loaded") != std::string::npos);
  }
  std::vector<std::vector<std::string>> drawn(kGroupSize);
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    for (int l : {0, 1}) {
      auto b = test::BatchSequence(run.Path(warned, l, r, "jsonl"));
      drawn[r].insert(drawn[r].end(), b.begin(), b.end());
    }
  }
  // A kill -9 in the warned group's second life may land between the ranks' log lines of one
  // step: the killed rank's stream then ends a step short of its peer's. Each rank's stream is
  // still a prefix of the unstopped run's, and only then may their lengths differ.
  const bool second_life_killed = killed_lives.count({warned, 1}) > 0;
  size_t longest = 0;
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    REQUIRE(drawn[r].size() % 8 == 0);
    longest = std::max(longest, drawn[r].size());
  }
  auto want = UnstoppedBatches(warned, static_cast<uint32_t>(longest / 8));
  for (uint32_t r = 0; r < kGroupSize; ++r) {
    INFO("rank " << r << (second_life_killed ? " (life 1 killed)" : ""));
    if (second_life_killed) {
      REQUIRE(drawn[r].size() + 8 >= longest);
    } else {
      REQUIRE(drawn[r].size() == longest);
    }
    REQUIRE(want[r].size() == longest);
    for (size_t i = 0; i < drawn[r].size(); ++i) {
      INFO("batch " << i);
      CHECK(drawn[r][i] == want[r][i]);
    }
  }
  fmt::print("slurm chaos: {} drew {} batches per rank over the requeue, those of a run that "
             "never stopped; {:.0f} s in all\n",
             warned, longest, secs());
}

TEST_SUITE_END();

}  // namespace
}  // namespace lk::e2e
