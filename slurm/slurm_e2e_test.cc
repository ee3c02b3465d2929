// End to end on a real Slurm 22.05 on localhost (scripts/slurm-local.sh, started here when sinfo
// does not answer): the batch script of `lkctl slurm script` runs the real replica_agent and
// tests/test_trainer.cc as trainers, one sbatch job per replica group, against a lighthouse that
// the test starts on 127.0.0.1. Slurm does to the jobs what it does in production: the USR2
// warning, a preemption by a higher partition, scancel, a trainer killed with -9; each group
// must leave with its reason, requeue (or not), come back as a new incarnation and heal.
// Every wait is bounded and a failed one prints the jobs' logs; no speed is asserted (the
// figures come from bench/slurm_bench.sh, which runs the warning case with LK_SLURM_BENCH_OUT).
#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "slurm/command.h"
#include "slurm/slurm_test_util.h"
#include "tests/support/process.h"

namespace lk::slurm {
namespace {

using namespace std::chrono_literals;
using namespace lk::slurm::testing;  // NOLINT
namespace pb = lightkeeper::v1;

using lk::test::JsonField;

// Epoch milliseconds of a log line that starts "2026-11-29T19:02:03.646Z " (agent and batch
// script lines); -1 for any other line.
int64_t LineMs(const std::string& line) {
  int y, mo, d, h, mi, s, ms;
  if (std::sscanf(line.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ", &y, &mo, &d, &h, &mi, &s, &ms) !=
      7) {
    return -1;
  }
  std::tm tm{};
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  return static_cast<int64_t>(timegm(&tm)) * 1000 + ms;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One training run: a lighthouse and one Slurm job per replica group. A thread samples the
// job's committed step all along, to catch it going backwards.
class SlurmRun {
 public:
  explicit SlurmRun(const std::string& tag) {
    EnsureSlurm();
    // Jobs of an earlier test may still be completing (scancel is asynchronous, KillWait is
    // 5 s) and hold CPUs of the one node; each case needs the node to itself.
    WaitFor([] { return Sh("squeue -h -o %i 2>/dev/null").out.empty(); }, 60s);
    dir_ = test::TempDir(tag);
    // The heartbeat timeout is far above every wait below: a group that is gone before it has
    // left the quorum itself.
    lh_ = test::StartLighthouse(dir_ + "/lh-data",
                                {"--heartbeat-timeout-ms", "60000", "--join-timeout-ms", "500"},
                                dir_ + "/lighthouse.log");
    watcher_ = std::thread([this] { WatchSteps(); });
  }
  ~SlurmRun() {
    stop_ = true;
    watcher_.join();
    for (const auto& [group, job] : jobs_) (void)Sh("scancel " + job + " 2>/dev/null; true");
  }

  // Writes the group's batch script with `lkctl slurm script` and submits it. Settings reach
  // the agent as LK_* variables of the submitting shell, as users give them. The trainer
  // records its pid (the shell execs it) and logs one file per life of the job.
  std::string Submit(const std::string& group, const std::string& flags = "") {
    std::string life = dir_ + "/" + group + "-r${SLURM_RESTART_COUNT:-0}";
    std::string trainer = fmt::format(
        "echo $$ > {0}.pid; exec {1}/test_trainer --steps 1000000 --step-sleep-ms 200 --log "
        "{0}.jsonl",
        life, Env("LK_BIN_DIR"));
    std::string gen = fmt::format(
        "cd {0} && LK_HEARTBEAT_INTERVAL_MS=200 LK_DRAIN_TIMEOUT_MS=20000 {1}/lkctl slurm script "
        "--job e2e --group-id {2} --lighthouse {3} --time 10:00 --signal-before-s 60 "
        "--output {0}/batch-{2}-%j.log --agent-bin {1}/replica_agent --lkctl-bin {1}/lkctl "
        "--agent-exit-wait-s 30 {4} "
        "-- bash -c '{5}' > {0}/{2}.sh",
        dir_, Env("LK_BIN_DIR"), group, lh_.url(), flags, trainer);
    auto made = Sh(gen);
    REQUIRE_MESSAGE(made.exit_code == 0, made.err);
    auto sub = Sh(fmt::format("cd {} && sbatch --parsable {}.sh", dir_, group));
    REQUIRE_MESSAGE(sub.exit_code == 0, sub.err);
    std::string id = sub.out.substr(0, sub.out.find_first_of(";\n"));
    REQUIRE(!id.empty());
    jobs_[group] = id;
    return id;
  }

  const std::string& Job(const std::string& group) { return jobs_.at(group); }
  std::string BatchLog(const std::string& group) {
    return ReadFile(fmt::format("{}/batch-{}-{}.log", dir_, group, Job(group)));
  }
  bool BatchHas(const std::string& group, const std::string& text) {
    return BatchLog(group).find(text) != std::string::npos;
  }
  // The first line of the batch log (agents and batch shell) at or after the start of life
  // `life` that contains `needle`; empty when none.
  std::string BatchLine(const std::string& group, int life, const std::string& needle) {
    bool in_life = false;
    std::string start = fmt::format("event=start job={} restart_count={}", Job(group), life);
    for (const auto& line : Lines(BatchLog(group))) {
      in_life |= line.find(start) != std::string::npos;
      if (in_life && line.find(needle) != std::string::npos) return line;
    }
    return "";
  }
  std::string TrainerLogPath(const std::string& group, int life) {
    return fmt::format("{}/{}-r{}.jsonl", dir_, group, life);
  }
  // The first trainer log line of that life satisfying `pred`, waiting up to `limit`.
  std::string WaitTrainerLine(const std::string& group, int life, std::chrono::seconds limit,
                              const std::function<bool(const std::string&)>& pred) {
    std::string found;
    WaitFor(
        [&] {
          for (const auto& line : Lines(ReadFile(TrainerLogPath(group, life)))) {
            if (pred(line)) {
              found = line;
              return true;
            }
          }
          return false;
        },
        limit);
    return found;
  }
  int TrainerPid(const std::string& group, int life) {
    return std::atoi(ReadFile(fmt::format("{}/{}-r{}.pid", dir_, group, life)).c_str());
  }

  pb::JobStatus Status() {
    auto c = http::Client::Create(lh_.url());
    if (!c.ok()) return pb::JobStatus();
    auto r = (*c)->Do("GET", "/status?job=e2e", "", "", Millis(3000));
    pb::StatusResponse st;
    if (r.ok() && r->status == 200) (void)http::Decode(r->body, http::Format::kJson, &st);
    return st.jobs().empty() ? pb::JobStatus() : st.jobs(0);
  }
  std::vector<std::string> Members() {
    std::vector<std::string> have;
    pb::JobStatus st = Status();  // kept: a loop over a temporary's field would dangle
    for (const auto& m : st.members()) have.push_back(m.group_id());
    std::sort(have.begin(), have.end());
    return have;
  }
  bool WaitMembers(const std::vector<std::string>& names, std::chrono::seconds limit) {
    return WaitFor([&] { return Members() == names; }, limit);
  }
  std::optional<pb::GroupStatus> GroupOf(const std::string& group) {
    pb::JobStatus st = Status();
    for (const auto& g : st.groups()) {
      if (g.group_id() == group) return g;
    }
    return std::nullopt;
  }
  // Waits until the lighthouse shows the group in `state` with an incarnation of life `life`.
  bool WaitGroup(const std::string& group, int life, const std::string& state,
                 std::chrono::seconds limit) {
    std::string prefix = fmt::format("{}.r{}.", Job(group), life);
    return WaitFor(
        [&] {
          auto g = GroupOf(group);
          return g && g->state() == state && g->incarnation().starts_with(prefix);
        },
        limit);
  }
  std::string JobState(const std::string& group) {
    std::string s = Sh("squeue -h -t all -j " + Job(group) + " -o %T 2>/dev/null").out;
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }

  // After a requeue the job waits cred_expire before it may start; StartTime=now shortens
  // that. Never in the second of the requeue (slurmd then refuses the launch, "Job credential
  // revoked", see README.md): 2 s after the job is first seen PENDING, repeated until life
  // `life` of the trainer has started.
  bool RestartNow(const std::string& group, int life, std::chrono::seconds limit) {
    std::optional<std::chrono::steady_clock::time_point> pending_since;
    std::string pid_file = fmt::format("{}/{}-r{}.pid", dir_, group, life);
    return WaitFor(
        [&] {
          if (std::ifstream(pid_file).good()) return true;
          if (JobState(group) != "PENDING") return false;
          auto now = std::chrono::steady_clock::now();
          if (!pending_since) pending_since = now;
          if (now - *pending_since >= 2s) {
            (void)Sh("scontrol update jobid=" + Job(group) + " StartTime=now 2>/dev/null; true");
          }
          return false;
        },
        limit);
  }

  bool StepsWentBackwards() {
    std::lock_guard<std::mutex> lock(mu_);
    return backwards_;
  }
  size_t StepSamples() {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_;
  }

  // Everything a failed wait needs to explain itself.
  std::string Logs() {
    std::string out;
    for (const auto& [group, job] : jobs_) {
      out += fmt::format("== batch log of {} (job {})\n{}", group, job, BatchLog(group));
      for (int life = 0; life < 3; ++life) {
        auto lines = Lines(ReadFile(TrainerLogPath(group, life)));
        if (lines.empty()) continue;
        out += fmt::format("== trainer {} life {}: {} lines, last: {}\n", group, life, lines.size(),
                           lines.back());
      }
    }
    out += "== squeue\n" + Sh("squeue -t all -o '%i %P %T %r'").out;
    out += "== lighthouse status\n" + http::ToJson(Status()) + "\n";
    return out;
  }

 private:
  void WatchSteps() {
    uint32_t last = 0;
    while (!stop_) {
      auto st = Status();
      if (!st.job().empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (st.committed_step() < last) {
          backwards_ = true;
          MESSAGE("committed step went back from " << last << " to " << st.committed_step());
        }
        last = std::max(last, st.committed_step());
        ++samples_;
      }
      // Kept: the sampler's pace (it watches for a step going back), not an order.
      std::this_thread::sleep_for(100ms);
    }
  }

  std::string dir_;
  test::Lighthouse lh_;
  std::map<std::string, std::string> jobs_;  // group -> Slurm job id
  std::thread watcher_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  bool backwards_ = false;
  size_t samples_ = 0;
};

bool IsCorrectAllreduce(const std::string& line, const std::string& world) {
  return JsonField(line, "event") == "allreduce" && JsonField(line, "world") == world &&
         JsonField(line, "correct") == "true";
}

// The two groups run together, every trainer's allreduce correct with world 2.
void StartTwoGroups(SlurmRun& run, const std::string& g1_flags = "") {
  run.Submit("g0");
  run.Submit("g1", g1_flags);
  REQUIRE_MESSAGE(run.WaitMembers({"g0", "g1"}, 90s), run.Logs());
  for (const char* g : {"g0", "g1"}) {
    REQUIRE_MESSAGE(
        !run.WaitTrainerLine(g, 0, 30s, [](auto& l) { return IsCorrectAllreduce(l, "2"); }).empty(),
        run.Logs());
  }
}

// A requeued group: life 1 starts with SLURM_RESTART_COUNT=1 as a new incarnation, heals from
// the live group (to at least `step_before`) and allreduces with it again.
void CheckComesBackHealed(SlurmRun& run, const std::string& group,
                          const std::vector<std::string>& members, uint32_t step_before) {
  REQUIRE_MESSAGE(run.RestartNow(group, 1, 90s), run.Logs());
  auto heal =
      run.WaitTrainerLine(group, 1, 60s, [](auto& l) { return JsonField(l, "event") == "heal"; });
  REQUIRE_MESSAGE(!heal.empty(), run.Logs());
  CHECK_MESSAGE(std::stoul(JsonField(heal, "step")) >= step_before, heal);
  CHECK(std::stoul(JsonField(heal, "sources")) >= 1);
  REQUIRE_MESSAGE(run.WaitMembers(members, 60s), run.Logs());
  CHECK_MESSAGE(run.WaitGroup(group, 1, "member", 10s), run.Logs());
  auto joined = run.WaitTrainerLine(group, 1, 30s, [&](auto& l) {
    return IsCorrectAllreduce(l, std::to_string(members.size()));
  });
  REQUIRE_MESSAGE(!joined.empty(), run.Logs());
  CHECK(JsonField(joined, "healed") == "true");
  const std::string& job = run.Job(group);
  CHECK(run.BatchHas(group, "event=start job=" + job + " restart_count=1 "));
  CHECK(!run.BatchLine(group, 1, "slurm job=" + job + " restart_count=1").empty());
  CHECK(!run.BatchLine(group, 1, "incarnation=" + job + ".r1.").empty());
}

// The durable save comes before the leave: the trainer drained (and exited) first.
void CheckDrainedThenLeft(SlurmRun& run, const std::string& group, const std::string& reason) {
  auto drain =
      run.WaitTrainerLine(group, 0, 10s, [](auto& l) { return JsonField(l, "event") == "drain"; });
  REQUIRE_MESSAGE(!drain.empty(), run.Logs());
  CHECK(JsonField(drain, "reason") == reason);
  // The agent leaves once its trainer has exited, after the trainer's drain line: wait for it.
  std::string left;
  WaitFor(
      [&] {
        left = run.BatchLine(group, 0, "left reason=" + reason);
        return !left.empty();
      },
      30s);
  REQUIRE_MESSAGE(!left.empty(), run.Logs());
  std::string exited = run.BatchLine(group, 0, "trainer_exited group_rank=0");
  CHECK_MESSAGE(exited.find("during_drain=true") != std::string::npos, run.Logs());
  CHECK(LineMs(exited) <= LineMs(left));
}

// The suite name becomes the CTest label "slurm" (ADD_LABELS in CMakeLists.txt).
TEST_SUITE_BEGIN("slurm");

TEST_CASE(
    "slurm e2e: the warning makes a group save then leave preempted then requeue and heal back") {
  SlurmRun run("se2e-warning");
  StartTwoGroups(run);
  const std::string job = run.Job("g1");
  uint32_t step_before = run.Status().committed_step();

  int64_t warned_ms = NowMs();
  REQUIRE(Sh("scancel --batch --signal=USR2 " + job).exit_code == 0);
  REQUIRE_MESSAGE(run.WaitGroup("g1", 0, "left", 30s), run.Logs());
  CHECK(run.GroupOf("g1")->reason() == "preempted");
  CHECK_MESSAGE(run.WaitMembers({"g0"}, 20s), run.Logs());
  CheckDrainedThenLeft(run, "g1", "preempted");
  CHECK(run.BatchHas("g1", "leave_reason=preempted requeue=true"));
  REQUIRE_MESSAGE(WaitFor([&] { return run.BatchHas("g1", "requeued job=" + job + "\n"); }, 20s),
                  run.Logs());
  // The other group goes on alone meanwhile.
  CHECK(!run.WaitTrainerLine("g0", 0, 30s, [](auto& l) { return IsCorrectAllreduce(l, "1"); })
             .empty());

  CheckComesBackHealed(run, "g1", {"g0", "g1"}, step_before);
  CHECK_FALSE(run.StepsWentBackwards());
  CHECK(run.StepSamples() > 10);

  // bench/slurm_bench.sh: the figures of this life, from the agent's and batch shell's clocks.
  if (std::string out = Env("LK_SLURM_BENCH_OUT"); !out.empty()) {
    int64_t left = LineMs(run.BatchLine("g1", 0, "left reason=preempted"));
    int64_t saved = LineMs(run.BatchLine("g1", 0, "trainer_exited group_rank=0"));
    int64_t trap = LineMs(run.BatchLine("g1", 0, "event=warning_signal"));
    int64_t classified = LineMs(run.BatchLine("g1", 0, "signal_received signal="));
    int64_t requeued = LineMs(run.BatchLine("g1", 0, "requeued job="));
    int64_t started = LineMs(run.BatchLine("g1", 1, "event=start"));
    int64_t quorum = LineMs(run.BatchLine("g1", 1, "quorum quorum_id="));
    auto first =
        run.WaitTrainerLine("g1", 1, 5s, [](auto& l) { return IsCorrectAllreduce(l, "2"); });
    REQUIRE(!first.empty());
    int64_t allreduce = std::stoll(JsonField(first, "t_ms"));
    std::ofstream(out, std::ios::app) << fmt::format(
        R"({{"warning_to_trap_ms":{},"warning_to_classified_ms":{},"warning_to_saved_ms":{},)"
        R"("warning_to_left_ms":{},)"
        R"("warning_to_requeued_ms":{},"restart_to_quorum_ms":{},)"
        R"("restart_to_healed_allreduce_ms":{}}})"
        "\n",
        trap - warned_ms, classified - warned_ms, saved - warned_ms, left - warned_ms,
        requeued - warned_ms, quorum - started, allreduce - started);
  }
}

TEST_CASE("slurm e2e: a preemption by the high partition makes the low group leave and come back") {
  SlurmRun run("se2e-preempt");
  // g0 in debug (never preempted), g1 in low: both hold one CPU each, so the node is full and
  // a one-CPU job in high can start only by preempting g1.
  StartTwoGroups(run, "--partition low");
  uint32_t step_before = run.Status().committed_step();
  auto high = Sh("sbatch --parsable -p high -n 1 -t 1 -o /dev/null --wrap 'sleep 3'");
  REQUIRE_MESSAGE(high.exit_code == 0, high.err);
  std::string high_id = high.out.substr(0, high.out.find_first_of(";\n"));
  REQUIRE_MESSAGE(run.WaitGroup("g1", 0, "left", 60s), run.Logs());
  CHECK(run.GroupOf("g1")->reason() == "preempted");
  CheckDrainedThenLeft(run, "g1", "preempted");
  CHECK(run.BatchHas("g1", "event=warning_signal"));
  CHECK_MESSAGE(
      WaitFor([&] { return run.BatchHas("g1", "requeued job=" + run.Job("g1") + "\n"); }, 20s),
      run.Logs());
  CheckComesBackHealed(run, "g1", {"g0", "g1"}, step_before);
  CHECK_FALSE(run.StepsWentBackwards());
  (void)Sh("scancel " + high_id + " 2>/dev/null; true");
}

TEST_CASE("slurm e2e: scancel shrinks the quorum at once and a later job joins and heals") {
  SlurmRun run("se2e-scancel");
  StartTwoGroups(run);
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(Sh("scancel " + run.Job("g1")).exit_code == 0);
  // At once: the lighthouse's heartbeat timeout is 60 s, 20 s is the bound here.
  REQUIRE_MESSAGE(run.WaitMembers({"g0"}, 20s), run.Logs());
  MESSAGE("scancel -> quorum without the group in "
          << std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::steady_clock::now() - t0)
                 .count()
          << " ms");
  auto g1 = run.GroupOf("g1");
  REQUIRE(g1);
  CHECK(g1->state() == "left");  // it left; not evicted by the heartbeat timeout
  // Slurm sends SIGTERM to the agent and the trainers at the same moment; the agent sees a
  // trainer die before it has asked scontrol why, so the reason may read trainer_crashed.
  WARN_MESSAGE(g1->reason() == "cancelled", "leave reason " << g1->reason());
  CHECK_MESSAGE(WaitFor([&] { return run.JobState("g1") == "CANCELLED"; }, 30s), run.Logs());
  CHECK_FALSE(run.BatchHas("g1", "requeued job="));

  uint32_t step_before = run.Status().committed_step();
  run.Submit("g2");
  REQUIRE_MESSAGE(run.WaitMembers({"g0", "g2"}, 90s), run.Logs());
  auto heal =
      run.WaitTrainerLine("g2", 0, 30s, [](auto& l) { return JsonField(l, "event") == "heal"; });
  REQUIRE_MESSAGE(!heal.empty(), run.Logs());
  CHECK(std::stoul(JsonField(heal, "step")) >= step_before);
  CHECK(!run.WaitTrainerLine("g2", 0, 30s, [](auto& l) { return IsCorrectAllreduce(l, "2"); })
             .empty());
  CHECK_FALSE(run.StepsWentBackwards());
}

TEST_CASE(
    "slurm e2e: a trainer killed with -9 fails its job or requeues it with --requeue-on-crash") {
  SlurmRun run("se2e-crash");
  StartTwoGroups(run);
  // Without --requeue-on-crash the job fails and stays gone.
  int pid = run.TrainerPid("g1", 0);
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, SIGKILL) == 0);
  REQUIRE_MESSAGE(run.WaitGroup("g1", 0, "left", 20s), run.Logs());
  CHECK(run.GroupOf("g1")->reason() == "trainer_crashed");
  CHECK_MESSAGE(WaitFor([&] { return run.JobState("g1") == "FAILED"; }, 40s), run.Logs());
  CHECK(run.BatchHas("g1", "agent_exit code=3"));
  CHECK_FALSE(run.BatchHas("g1", "requeued job="));
  CHECK_FALSE(run.BatchHas("g1", "action=requeue"));
  // The run goes on with g0 alone.
  REQUIRE_MESSAGE(run.WaitMembers({"g0"}, 20s), run.Logs());
  CHECK(!run.WaitTrainerLine("g0", 0, 30s, [](auto& l) { return IsCorrectAllreduce(l, "1"); })
             .empty());

  // With --requeue-on-crash the batch script requeues the job and it comes back healed.
  run.Submit("g2", "--requeue-on-crash");
  REQUIRE_MESSAGE(run.WaitMembers({"g0", "g2"}, 90s), run.Logs());
  REQUIRE(!run.WaitTrainerLine("g2", 0, 30s, [](auto& l) { return IsCorrectAllreduce(l, "2"); })
               .empty());
  uint32_t step_before = run.Status().committed_step();
  pid = run.TrainerPid("g2", 0);
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, SIGKILL) == 0);
  REQUIRE_MESSAGE(run.WaitGroup("g2", 0, "left", 20s), run.Logs());
  CHECK(run.GroupOf("g2")->reason() == "trainer_crashed");
  CHECK_MESSAGE(
      WaitFor(
          [&] {
            return run.BatchHas(
                "g2",
                "event=trainer_crashed rc=137 crashes=1 counted_by=lighthouse action=requeue");
          },
          40s),
      run.Logs());
  CheckComesBackHealed(run, "g2", {"g0", "g2"}, step_before);
  CHECK_FALSE(run.StepsWentBackwards());
}

TEST_SUITE_END();

}  // namespace
}  // namespace lk::slurm
