// Tests against a real Slurm 22.05 on localhost (scripts/slurm-local.sh, started here when sinfo
// does not answer). The generated batch script runs with a fake agent and a fake trainer (small
// shell scripts) so that what Slurm does to a job is seen end to end: the warning signal through
// the batch shell's trap to the agent step, `scontrol requeue` through Requeue(), preemption by a
// higher partition, scancel. Every wait is bounded; a failing wait prints the job's logs.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include "slurm/command.h"
#include "slurm/slurm_test_util.h"

namespace lk::slurm {
namespace {

using namespace std::chrono_literals;
using namespace lk::slurm::testing;  // NOLINT

// The fake agent: records its arguments; on USR2 (and TERM) does what the agent does with
// Slurm through `lk_slurm_tool slurm leave`. LK_TEST_AGENT_MODE=requeue requeues on the warning;
// =observe only records the decision (--dry-run). It exits when the trainer of its life is done.
constexpr char kAgent[] = R"sh(#!/bin/bash
d=$(dirname "$0"); r=${SLURM_RESTART_COUNT:-0}; log="$d/agent-$r.log"
leave() {
  local dry=; [ "$LK_TEST_AGENT_MODE" = requeue ] && [ "$1" = USR2 ] || dry=--dry-run
  echo "signal $1 at $(date +%s.%N)" >> "$log"
  # Slurm signals every process of the step (a second TERM, the forwarded USR2): the tool runs
  # with them ignored, as an agent's own handlers would shield it.
  ( trap '' TERM USR2; exec "$LK_BIN_DIR/lk_slurm_tool" slurm leave --signal "$1" \
      --signal-before-s 60 $dry ) >> "$log" 2>&1
  echo "leave-rc $? $1" >> "$log"
}
on_usr2() { "$LK_BIN_DIR/lk_slurm_tool" slurm env > "$d/env-$r.txt" 2>&1; leave USR2; }
on_term() { leave TERM; gone=1; }
# The handlers are in place before the agent says it runs (the "args" line the tests wait for),
# as the real agent blocks its signals before anything else.
gone=0
trap on_usr2 USR2
trap on_term TERM
echo "args $* incarnation=$LK_INCARNATION" >> "$log"
# The trainer step waits for the agent's socket (the last argument): bind one, as the agent does.
python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "${@: -1}"
sock="${@: -1}"; trap 'rm -f "$sock"' EXIT  # the real agent removes its socket when it stops
for _ in $(seq 1 1800); do
  [ "$gone" = 1 ] || [ -e "$d/trainer-done-$r" ] && break
  sleep 0.1
done
echo "exit" >> "$log"
)sh";

// The fake trainer: records its start; the first life runs until Slurm ends it (bounded), a
// requeued life finishes at once so the job completes.
constexpr char kTrainer[] = R"sh(#!/bin/bash
d=$(dirname "$0"); r=${SLURM_RESTART_COUNT:-0}
echo "start restart=$r socket=$LK_AGENT_SOCKET bind=${LK_BIND_HOST:-} at $(date +%s.%N)" >> "$d/trainer-$r.log"
if [ "$r" -ge 1 ]; then touch "$d/trainer-done-$r"; exit 0; fi
for i in $(seq 1 1200); do echo "$i" > "$d/trainer-tick-$r"; sleep 0.1; done
)sh";

// The trainer of the crash-cap test: lives 0-4 run until a warning requeues them, life 5
// crashes (exit 7), life 6 finishes.
constexpr char kCrashingTrainer[] = R"sh(#!/bin/bash
d=$(dirname "$0"); r=${SLURM_RESTART_COUNT:-0}
echo "start restart=$r socket=$LK_AGENT_SOCKET at $(date +%s.%N)" >> "$d/trainer-$r.log"
if [ "$r" -eq 5 ]; then exit 7; fi
if [ "$r" -ge 6 ]; then touch "$d/trainer-done-$r"; exit 0; fi
for i in $(seq 1 1200); do echo "$i" > "$d/trainer-tick-$r"; sleep 0.1; done
)sh";

class TestJob {
 public:
  explicit TestJob(std::string mode, const char* trainer = kTrainer) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lk-slurm-test-XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    dir_ = tmpl;
    std::ofstream(dir_ + "/agent.sh") << kAgent;
    std::ofstream(dir_ + "/trainer.sh") << trainer;
    REQUIRE(Sh("chmod 755 " + dir_ + "/agent.sh " + dir_ + "/trainer.sh").exit_code == 0);
    mode_ = std::move(mode);
  }
  ~TestJob() {
    if (!id_.empty()) (void)Sh("scancel " + id_ + " 2>/dev/null; true");
  }

  // The generated script, with extra sbatch options on the command line (e.g. --array=3).
  void Submit(const std::string& flags, const std::string& sbatch_options = "",
              const std::string& lighthouse = "http://127.0.0.1:9") {
    std::string gen = fmt::format(
        "cd {0} && LK_TEST_AGENT_MODE={1} {2}/lk_slurm_tool slurm script --job t --group-id g "
        "--lighthouse {4} --time 10:00 --signal-before-s 60 "
        "--output {0}/batch-%j.log --agent-bin {0}/agent.sh --agent-exit-wait-s 5 {3} "
        "-- {0}/trainer.sh > {0}/job.sh",
        dir_, mode_, Env("LK_BIN_DIR"), flags, lighthouse);
    auto made = Sh(gen);
    REQUIRE_MESSAGE(made.exit_code == 0, made.err);
    auto sub = Sh(fmt::format("cd {} && sbatch --parsable {} job.sh", dir_, sbatch_options));
    REQUIRE_MESSAGE(sub.exit_code == 0, sub.err);
    id_ = sub.out.substr(0, sub.out.find_first_of(";\n"));
    REQUIRE(!id_.empty());
  }

  std::string File(const std::string& name) const { return ReadFile(dir_ + "/" + name); }
  bool Has(const std::string& name, const std::string& text) const {
    return File(name).find(text) != std::string::npos;
  }
  std::string State() const {
    auto r = Sh("squeue -h -j " + id_ + " -o %T 2>/dev/null");
    std::string s = r.out;
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  // Everything a failed wait needs to explain itself.
  std::string Logs() const {
    return Sh(fmt::format("cd {}; for f in *.log *.txt; do echo \"== $f\"; cat \"$f\"; done; "
                          "echo '== squeue'; squeue -o '%i %P %T %r'; echo '== slurmctld'; "
                          "tail -n 20 {}/log/slurmctld.log",
                          dir_, SlurmBase()))
        .out;
  }
  // After a requeue the job waits cred_expire (~11 s here) before it may start; starting it now
  // keeps the test short. Not in the second of the requeue: slurmd then refuses the launch
  // ("Job credential revoked") and the job FAILS for good (seen with an array task on 22.05), so
  // the update comes 2 s after the job is first seen PENDING. Repeats until the next life runs.
  bool RestartNow(const std::string& life_file, std::chrono::seconds limit,
                  const std::string& ref = "") {
    std::optional<std::chrono::steady_clock::time_point> pending_since;
    return WaitFor(
        [&] {
          if (std::ifstream(dir_ + "/" + life_file).good()) return true;
          if (State() != "PENDING") return false;
          auto now = std::chrono::steady_clock::now();
          if (!pending_since) pending_since = now;
          if (now - *pending_since >= 2s) {
            (void)Sh("scontrol update jobid=" + (ref.empty() ? id_ : ref) +
                     " StartTime=now 2>/dev/null; true");
          }
          return false;
        },
        limit);
  }

  const std::string& id() const { return id_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string mode_;
  std::string id_;
};

// The suite name becomes the CTest label "slurm" (ADD_LABELS in CMakeLists.txt).
TEST_SUITE_BEGIN("slurm");

TEST_CASE("real slurm: the USR2 warning reaches the agent step and Requeue() restarts the job") {
  EnsureSlurm();
  TestJob job("requeue");
  job.Submit("");
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("trainer-0.log", "start"); }, 60s), job.Logs());
  REQUIRE(WaitFor([&] { return job.Has("agent-0.log", "args"); }, 10s));
  // The agent got its node rank and per-node socket; the trainer got the same socket.
  std::string socket = fmt::format("/tmp/lk-{}-r0-0.sock", job.id());
  CHECK(job.Has("agent-0.log",
                "--lighthouse http://127.0.0.1:9 --job t --group-id g --nodes 1 "
                "--node-rank 0 --socket " +
                    socket));
  CHECK(job.Has("trainer-0.log", "socket=" + socket));

  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(Sh("scancel --batch --signal=USR2 " + job.id()).exit_code == 0);
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc"); }, 30s), job.Logs());
  auto to_requeue = std::chrono::steady_clock::now() - t0;
  MESSAGE("warning -> agent left and requeued in "
          << std::chrono::duration_cast<std::chrono::milliseconds>(to_requeue).count() << " ms");
  CHECK_MESSAGE(job.Has("agent-0.log", "reason=preempted requeue=true"), job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log", "requeued=" + job.id()), job.Logs());
  CHECK(job.Has("agent-0.log", "leave-rc 0 USR2"));
  CHECK(job.Has("batch-" + job.id() + ".log", "event=warning_signal"));
  // `slurm env` inside the job: parsed environment and the end time from scontrol.
  CHECK(job.Has("env-0.txt", "job_id=" + job.id() + "\n"));
  CHECK(job.Has("env-0.txt", "restart_count=0\nnode_id=0\nnum_nodes=1\nnodes=localhost\n"));
  CHECK_FALSE(job.Has("env-0.txt", "end_time=none"));
  // The task's place in its group, from Slurm's task variables (the agent step's one task).
  CHECK(job.Has("env-0.txt", "group_rank=0\ngroup_size=1\nlocal_rank=0\nplace_from=slurm\n"));

  REQUIRE_MESSAGE(job.RestartNow("trainer-1.log", 60s), job.Logs());
  CHECK(job.Has("trainer-1.log", "start restart=1"));
  REQUIRE_MESSAGE(WaitFor([&] { return job.State().empty() || job.State() == "COMPLETED"; }, 60s),
                  job.Logs());
  CHECK(job.Has("batch-" + job.id() + ".log", "event=start job=" + job.id() + " restart_count=1"));
  CHECK(job.Has("batch-" + job.id() + ".log", "event=trainers_exited rc=0"));
  // Each life is a new incarnation.
  auto incarnation = [&](const std::string& file) {
    std::string log = job.File(file);
    size_t at = log.find("incarnation=");
    return at == std::string::npos ? "" : log.substr(at, log.find('\n', at) - at);
  };
  CHECK(incarnation("agent-0.log").find("incarnation=" + job.id() + ".r0.") == 0);
  CHECK(incarnation("agent-1.log").find("incarnation=" + job.id() + ".r1.") == 0);
}

TEST_CASE("real slurm: an array task is requeued as ARRAYJOBID_TASKID") {
  EnsureSlurm();
  TestJob job("requeue");
  job.Submit("", "--array=3");
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("trainer-0.log", "start"); }, 60s), job.Logs());
  REQUIRE(Sh("scancel --batch --signal=USR2 " + job.id() + "_3").exit_code == 0);
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc"); }, 30s), job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log", "requeued=" + job.id() + "_3\n"), job.Logs());
  CHECK(job.Has("env-0.txt", "job_ref=" + job.id() + "_3\n"));
  REQUIRE_MESSAGE(job.RestartNow("trainer-1.log", 60s, job.id() + "_3"), job.Logs());
  CHECK(job.Has("trainer-1.log", "start restart=1"));
}

TEST_CASE("real slurm: a stray USR2 spares trainers and scancel reads cancelled") {
  EnsureSlurm();
  TestJob job("observe");
  job.Submit("");
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("trainer-0.log", "start"); }, 60s), job.Logs());
  REQUIRE(WaitFor([&] { return job.Has("agent-0.log", "args"); }, 10s));
  // Without --batch, scancel signals every step's tasks: the agent (which leaves) and the
  // trainers, which USR2's default action would kill (seen: "task 0: User defined signal 2").
  // The script makes the trainers ignore it.
  REQUIRE(Sh("scancel --signal=USR2 " + job.id()).exit_code == 0);
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc 0 USR2"); }, 30s),
                  job.Logs());
  std::string tick = job.File("trainer-tick-0");
  CHECK_MESSAGE(WaitFor([&] { return job.File("trainer-tick-0") != tick; }, 5s), job.Logs());
  CHECK(job.State() == "RUNNING");

  REQUIRE(Sh("scancel " + job.id()).exit_code == 0);
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc 0 TERM"); }, 30s),
                  job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log", "reason=cancelled requeue=false"), job.Logs());
  REQUIRE(WaitFor([&] { return job.State().empty() || job.State() == "CANCELLED"; }, 30s));
}

// Preemption on one node: a `low` job is taken over by an --exclusive `high` job.
void Preempt(TestJob& job, std::string* high_id) {
  job.Submit("--partition low");
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("trainer-0.log", "start"); }, 60s), job.Logs());
  auto high = Sh("sbatch --parsable -p high --exclusive -t 1 -o /dev/null --wrap 'sleep 2'");
  REQUIRE_MESSAGE(high.exit_code == 0, high.err);
  *high_id = high.out.substr(0, high.out.find_first_of(";\n"));
}

TEST_CASE("real slurm: preemption warns and the agent leaves preempted and requeues") {
  EnsureSlurm();
  TestJob job("requeue");
  std::string high;
  Preempt(job, &high);
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc"); }, 30s), job.Logs());
  // EndTime is now + GraceTime at this point; the limit end (start + 10 min) is not.
  CHECK_MESSAGE(job.Has("agent-0.log", "reason=preempted requeue=true"), job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log", "requeued=" + job.id()), job.Logs());
  REQUIRE_MESSAGE(job.RestartNow("trainer-1.log", 90s), job.Logs());
  CHECK(job.Has("trainer-1.log", "start restart=1"));
  MESSAGE("preemption with the agent requeueing:\n" << job.Logs());
  (void)Sh("scancel " + high + " 2>/dev/null; true");
}

TEST_CASE("real slurm: preemption requeues by itself and the late SIGTERM reads preempted") {
  EnsureSlurm();
  TestJob job("observe");
  std::string high;
  Preempt(job, &high);
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc 0 USR2"); }, 30s),
                  job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log", "reason=preempted requeue=true"), job.Logs());
  // No requeue of our own: Slurm kills the job at the end of GraceTime (10 s) and requeues it.
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("agent-0.log", "leave-rc 0 TERM"); }, 40s),
                  job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log",
                        "reason=preempted requeue=false why=\"SIGTERM after Slurm "
                        "requeued the job (Restarts 0 -> 1)\""),
                job.Logs());
  REQUIRE_MESSAGE(job.RestartNow("trainer-1.log", 90s), job.Logs());
  CHECK(job.Has("trainer-1.log", "start restart=1"));
  MESSAGE("preemption requeued by Slurm:\n" << job.Logs());
  (void)Sh("scancel " + high + " 2>/dev/null; true");
}

// Issue 31: --bind-iface makes every node's steps find their address on the interface: the
// trainers get it as LK_BIND_HOST, the agent serves peers there; a missing interface ends the
// step with the reason.
TEST_CASE("real slurm: --bind-iface gives the trainers and the agent the node's address") {
  EnsureSlurm();
  TestJob job("observe");
  job.Submit("--bind-iface lo");
  REQUIRE_MESSAGE(WaitFor([&] { return job.Has("trainer-0.log", "start"); }, 60s), job.Logs());
  REQUIRE(WaitFor([&] { return job.Has("agent-0.log", "args"); }, 10s));
  CHECK_MESSAGE(job.Has("trainer-0.log", " bind=127.0.0.1 "), job.Logs());
  CHECK_MESSAGE(job.Has("agent-0.log", "--serve 127.0.0.1:0 --node-rank 0 --socket"), job.Logs());
  REQUIRE(Sh("scancel " + job.id()).exit_code == 0);
  REQUIRE(WaitFor([&] { return job.State().empty() || job.State() == "CANCELLED"; }, 30s));

  TestJob missing("observe");
  missing.Submit("--bind-iface lk-none0");
  REQUIRE_MESSAGE(WaitFor([&] { return missing.State().empty(); }, 60s), missing.Logs());
  const std::string log = missing.File("batch-" + missing.id() + ".log");
  CAPTURE(log);
  CHECK(log.find("lk: no IPv4 address on lk-none0 on ") != std::string::npos);
  CHECK_FALSE(std::ifstream(missing.dir() + "/trainer-0.log").good());
}

// Issue 31: the crash cap counts crashes, not requeues. Five warnings requeue the job (its
// SLURM_RESTART_COUNT reaches 5, past --crash-requeues-max 3), then its trainer crashes: the
// batch script asks a real lighthouse (through the real lkctl) how many times this group has
// crashed over its lives, hears 1, and requeues the job, whose next life finishes.
TEST_CASE("real slurm: five warning requeues then a crash, and the crash is still requeued") {
  EnsureSlurm();
  TestJob job("requeue", kCrashingTrainer);
  const std::string bin = Env("LK_BIN_DIR");
  auto lh = Sh(fmt::format("{0}/lighthouse --bind 127.0.0.1:0 --data-dir {1}/lh-data "
                           "--heartbeat-timeout-ms 600000 > {1}/lighthouse.txt 2>&1 & echo $!",
                           bin, job.dir()));
  REQUIRE(lh.exit_code == 0);
  const std::string lh_pid = lh.out.substr(0, lh.out.find('\n'));
  struct Stop {
    std::string pid;
    ~Stop() { (void)Sh("kill " + pid + " 2>/dev/null; true"); }
  } stop{lh_pid};
  std::string address;
  REQUIRE(WaitFor(
      [&] {
        std::string log = job.File("lighthouse.txt");
        size_t at = log.find("listening address=");
        if (at == std::string::npos) return false;
        address = log.substr(at + 18, log.find_first_of(" \n", at + 18) - at - 18);
        return true;
      },
      20s));
  // The job is known to the lighthouse once a group of it was heard (the fake agent never is).
  auto hb = Sh(fmt::format(
      "curl -sf -X POST -H 'Content-Type: application/json' http://{}/v1/heartbeat -d "
      "'{{\"job\":\"t\",\"group_id\":\"g\",\"incarnation\":\"before\",\"nodes\":1}}'",
      address));
  REQUIRE_MESSAGE(hb.exit_code == 0, hb.err);

  job.Submit(fmt::format("--requeue-on-crash --crash-requeues-max 3 --lkctl-bin {}/lkctl", bin),
             "", "http://" + address);
  for (int r = 0; r < 5; ++r) {
    CAPTURE(r);
    const std::string life = fmt::format("trainer-{}.log", r);
    if (r > 0) REQUIRE_MESSAGE(job.RestartNow(life, 60s), job.Logs());
    REQUIRE_MESSAGE(WaitFor([&] { return job.Has(life, "start"); }, 60s), job.Logs());
    REQUIRE(WaitFor([&] { return job.Has(fmt::format("agent-{}.log", r), "args"); }, 10s));
    REQUIRE(Sh("scancel --batch --signal=USR2 " + job.id()).exit_code == 0);
    REQUIRE_MESSAGE(
        WaitFor([&] { return job.Has(fmt::format("agent-{}.log", r), "leave-rc 0 USR2"); }, 30s),
        job.Logs());
    CHECK_MESSAGE(job.Has(fmt::format("agent-{}.log", r), "requeued=" + job.id()), job.Logs());
  }
  // Life 5 crashes; the script requeues it on the lighthouse's count; life 6 finishes.
  REQUIRE_MESSAGE(job.RestartNow("trainer-5.log", 60s), job.Logs());
  REQUIRE_MESSAGE(job.RestartNow("trainer-6.log", 90s), job.Logs());
  REQUIRE_MESSAGE(
      WaitFor([&] { return job.State().empty() || job.State() == "COMPLETED"; }, 60s),
      job.Logs());
  const std::string batch = job.File("batch-" + job.id() + ".log");
  CAPTURE(batch);
  auto Has = [](const std::string& text, const std::string& needle) {
    return text.find(needle) != std::string::npos;
  };
  CHECK(Has(batch, "restart_count=5"));
  CHECK(Has(batch, "event=trainer_crashed rc=7 crashes=1 counted_by=lighthouse action=requeue"));
  CHECK(Has(batch, "event=requeued job=" + job.id() + " attempts=1"));
  CHECK(Has(batch, "event=trainers_exited rc=0"));
  CHECK(Has(job.File("lighthouse.txt"),
            "event=trainer_crashed detail=\"rc=7\" crashes=1 requeue_refusals=0 counted=true"));
}

TEST_SUITE_END();

}  // namespace
}  // namespace lk::slurm
