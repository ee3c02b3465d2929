#include "slurm/requeue.h"

#include <doctest/doctest.h>

#include <csignal>

#include "slurm/fake_runner.h"

namespace lk::slurm {
namespace {

using std::chrono::seconds;

const TimePoint kNow = TimePoint(seconds(1'800'000'000));

JobInfo Job(std::string state, int64_t restarts, int64_t limit_in_s) {
  JobInfo j;
  j.state = std::move(state);
  j.restarts = restarts;
  j.start_time = kNow - seconds(1000);
  j.time_limit = seconds(1000 + limit_in_s);
  return j;
}

TEST_CASE("leave: reason and requeue for each way a job is told to go") {
  struct Row {
    std::string name;
    LeaveInput in;
    LeaveReason reason;
    bool requeue;
    std::string why;
  };
  auto input = [](LeaveSignal sig, bool in_slurm, std::optional<TimePoint> limit_end,
                  std::optional<JobInfo> job, int64_t restart_count = 0) {
    LeaveInput in;
    in.signal = sig;
    in.in_slurm = in_slurm;
    in.limit_end = limit_end;
    in.job_now = std::move(job);
    in.restart_count = restart_count;
    in.now = kNow;
    in.margin = TimeLimitMargin(seconds(120));  // 210 s
    return in;
  };
  const auto warn = LeaveSignal::kWarning;
  const auto term = LeaveSignal::kTerm;
  const std::vector<Row> rows = {
      {"plain SIGTERM outside Slurm", input(term, false, {}, {}), LeaveReason::kCancelled, false,
       "outside Slurm"},
      {"warning outside Slurm", input(warn, false, {}, {}), LeaveReason::kPreempted, false,
       "outside Slurm"},
      {"warning 150 s before the limit", input(warn, true, {}, Job("RUNNING", 0, 150)),
       LeaveReason::kTimeLimit, true, "time limit in 150 s"},
      {"warning exactly at the margin", input(warn, true, {}, Job("RUNNING", 0, 210)),
       LeaveReason::kTimeLimit, true, "within the margin of 210 s"},
      {"warning just past the margin", input(warn, true, {}, Job("RUNNING", 0, 211)),
       LeaveReason::kPreempted, true, "time limit in 211 s"},
      {"warning, limit from start-up only", input(warn, true, kNow + seconds(100), {}),
       LeaveReason::kTimeLimit, true, "time limit in 100 s"},
      {"warning, scontrol's limit wins over start-up's",
       input(warn, true, kNow + seconds(100), Job("RUNNING", 0, 5000)), LeaveReason::kPreempted,
       true, "time limit in 5000 s"},
      {"warning without any limit", input(warn, true, {}, {}), LeaveReason::kPreempted, true,
       "no time limit"},
      {"SIGTERM at the time limit", input(term, true, {}, Job("COMPLETING", 0, 0)),
       LeaveReason::kTimeLimit, true, "time limit in 0 s"},
      {"SIGTERM after Slurm requeued it", input(term, true, {}, Job("COMPLETING", 1, 5000)),
       LeaveReason::kPreempted, false, "Restarts 0 -> 1"},
      {"SIGTERM in a second life, not requeued", input(term, true, {}, Job("COMPLETING", 1, 5000),
                                                      1),
       LeaveReason::kCancelled, false, "COMPLETING"},
      {"SIGTERM while RUNNING", input(term, true, {}, Job("RUNNING", 0, 5000)),
       LeaveReason::kPreempted, true, "RUNNING"},
      {"scancel: SIGTERM while COMPLETING", input(term, true, {}, Job("COMPLETING", 0, 5000)),
       LeaveReason::kCancelled, false, "COMPLETING"},
      {"SIGTERM, scontrol silent", input(term, true, kNow + seconds(5000), {}),
       LeaveReason::kCancelled, false, "did not answer"},
  };
  for (const auto& row : rows) {
    CAPTURE(row.name);
    LeaveDecision d = ClassifyLeave(row.in);
    CHECK(LeaveReasonName(d.reason) == LeaveReasonName(row.reason));
    CHECK(d.requeue == row.requeue);
    CHECK_MESSAGE(d.why.find(row.why) != std::string::npos, d.why);
  }
}

TEST_CASE("leave: reason names are the ones the lighthouse reports") {
  CHECK(LeaveReasonName(LeaveReason::kPreempted) == "preempted");
  CHECK(LeaveReasonName(LeaveReason::kTimeLimit) == "time_limit");
  CHECK(LeaveReasonName(LeaveReason::kCancelled) == "cancelled");
  CHECK(TimeLimitMargin(seconds(300)) == seconds(390));
}

SlurmEnv Env(int64_t job, std::optional<int64_t> array_job = {},
             std::optional<int64_t> task = {}) {
  SlurmEnv env;
  env.job_id = job;
  env.array_job_id = array_job;
  env.array_task_id = task;
  return env;
}

TEST_CASE("requeue: plain jobs by id and array tasks as ARRAYJOBID_TASKID") {
  CHECK(RequeueArgv(Env(42)) == std::vector<std::string>{"scontrol", "requeue", "42"});
  CHECK(RequeueArgv(Env(57, 50, 7)) == std::vector<std::string>{"scontrol", "requeue", "50_7"});
  FakeRunner runner;
  runner.Answer(0, "");
  CHECK(Requeue(Env(57, 50, 7), runner).ok());
  REQUIRE(runner.ran().size() == 1);
  CHECK(runner.ran()[0].argv.back() == "50_7");
  // Only the requeue asks for the job signals blocked (a requeue killed half way by the SIGTERM
  // Slurm sends the step would report an accepted requeue as a failure).
  CHECK(runner.ran()[0].block_job_signals);
}

TEST_CASE("requeue: a missing scontrol and a refusal are clear errors") {
  FakeRunner runner;
  runner.Answer(Error(Code::kNotFound, "scontrol: not found in PATH"));
  Status missing = Requeue(Env(42), runner);
  CHECK(missing.code() == Code::kNotFound);
  CHECK(missing.message().find("requeue job 42") != std::string::npos);
  CHECK(missing.message().find("not found in PATH") != std::string::npos);

  // What 22.05 answers for a job submitted with --no-requeue.
  runner.Answer(1, "", "Requested operation is presently disabled for job 6\n");
  Status refused = Requeue(Env(6), runner);
  CHECK(refused.code() == Code::kPermissionDenied);
  CHECK(refused.message() ==
        "requeue job 6: Slurm refused (scontrol exit 1): Requested operation is presently "
        "disabled for job 6 (was the job submitted with --no-requeue, or is JobRequeue=0?)");

  runner.Answer(1, "", "Invalid job id specified for job 99999\n");
  CHECK(Requeue(Env(99999), runner).message().find("(the job is gone)") != std::string::npos);

  runner.Answer(Error(Code::kDeadlineExceeded, "scontrol (after 30000 ms): timed out"));
  CHECK(Requeue(Env(1), runner).code() == Code::kDeadlineExceeded);
}

TEST_CASE("requeue: retried with a bound while the refusal may pass, never when it stays") {
  std::vector<int64_t> waits;
  auto sleep = [&](std::chrono::seconds s) { waits.push_back(s.count()); };
  RetryPolicy p;
  p.attempts = 4;
  p.first_wait = std::chrono::seconds(5);
  {  // slurmctld busy twice, then the requeue passes
    FakeRunner runner;
    runner.Answer(1, "", "Slurm temporarily unable to accept job, sleeping and retrying\n");
    runner.Answer(Error(Code::kDeadlineExceeded, "scontrol (after 30000 ms): timed out"));
    runner.Answer(0, "");
    int attempts = 0;
    CHECK(RequeueWithRetry(Env(42), runner, p, sleep, &attempts).ok());
    CHECK(attempts == 3);
    CHECK(waits == std::vector<int64_t>{5, 10});
  }
  waits.clear();
  {  // busy every time: four calls, then the last refusal
    FakeRunner runner;
    for (int i = 0; i < 4; ++i) runner.Answer(1, "", "Socket timed out on send/recv operation\n");
    int attempts = 0;
    Status st = RequeueWithRetry(Env(42), runner, p, sleep, &attempts);
    CHECK(st.code() == Code::kConflict);
    CHECK(st.message().find("Socket timed out") != std::string::npos);
    CHECK(attempts == 4);
    CHECK(runner.ran().size() == 4);
    CHECK(waits == std::vector<int64_t>{5, 10, 20});
  }
  waits.clear();
  for (auto answer : {std::string("Requested operation is presently disabled for job 42"),
                      std::string("Invalid job id specified"),
                      std::string("Access/permission denied for job 42")}) {
    FakeRunner runner;
    runner.Answer(1, "", answer + "\n");
    int attempts = 0;
    Status st = RequeueWithRetry(Env(42), runner, p, sleep, &attempts);
    CHECK(!RequeueRetryable(st));
    CHECK(attempts == 1);
  }
  FakeRunner missing;
  missing.Answer(Error(Code::kNotFound, "scontrol: not found in PATH"));
  CHECK(RequeueWithRetry(Env(42), missing, p, sleep).code() == Code::kNotFound);
  CHECK(waits.empty());
}

TEST_CASE("requeue: with the real runner and no scontrol on PATH") {
  // The real SubprocessRunner: a PATH without Slurm must give kNotFound, not a crash or hang.
  const char* old_path = std::getenv("PATH");
  std::string saved = old_path ? old_path : "";
  setenv("PATH", "/nonexistent", 1);
  Status s = Requeue(Env(42));
  setenv("PATH", saved.c_str(), 1);
  CHECK(s.code() == Code::kNotFound);
  CHECK(s.message().find("scontrol") != std::string::npos);
}

TEST_CASE("runner: output and exit code and stdin and timeout and signals during a command") {
  SubprocessRunner runner;
  Command cmd;
  cmd.argv = {"sh", "-c", "cat; echo err >&2; exit 3"};
  cmd.stdin_text = "in";
  auto r = runner.Run(cmd);
  REQUIRE(r.ok());
  CHECK(r->exit_code == 3);
  CHECK(r->out == "in");
  CHECK(r->err == "err\n");
  // A SIGTERM to the child while it runs (as Slurm sends one to the whole step after a
  // requeue) must not kill a command that asked for the job signals blocked...
  cmd.argv = {"sh", "-c", "kill -TERM $$; kill -USR2 $$; echo survived"};
  cmd.stdin_text.clear();
  cmd.block_job_signals = true;
  r = runner.Run(cmd);
  REQUIRE(r.ok());
  CHECK(r->exit_code == 0);
  CHECK(r->out == "survived\n");
  // ...and ends any other, so that `timeout` inside it bounds what it runs.
  cmd.block_job_signals = false;
  r = runner.Run(cmd);
  REQUIRE(r.ok());
  CHECK(r->exit_code == 128 + SIGTERM);
  CHECK(r->out.empty());
  cmd.argv = {"sleep", "10"};
  cmd.timeout = std::chrono::milliseconds(200);
  auto t0 = std::chrono::steady_clock::now();
  r = runner.Run(cmd);
  CHECK(r.status().code() == Code::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  cmd.argv = {"lk-no-such-program"};
  CHECK(runner.Run(cmd).status().code() == Code::kNotFound);
}

TEST_CASE("runner: a child's own `timeout` works even when the calling thread blocks TERM") {
  // The agent's threads block the Slurm signals (a signal thread takes them); the children it
  // starts must not inherit that mask, or `timeout 5 sinfo` could never end sinfo.
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  REQUIRE(pthread_sigmask(SIG_BLOCK, &term, &old) == 0);
  SubprocessRunner runner;
  Command cmd;
  cmd.argv = {"timeout", "0.2", "sleep", "20"};
  cmd.timeout = std::chrono::seconds(15);
  auto r = runner.Run(cmd);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  REQUIRE(r.ok());
  CHECK(r->exit_code == 124);  // timeout's own answer: it ended sleep with SIGTERM
}

TEST_CASE("signal settings: USR1 USR2 and TERM with B: and @seconds") {
  struct Row {
    std::string text;
    int signo;
    bool batch_only;
    int64_t before;  // -1: none
    std::string canonical;
  };
  const std::vector<Row> rows = {
      {"USR2", SIGUSR2, false, -1, "USR2"},
      {"B:USR2@120", SIGUSR2, true, 120, "B:USR2@120"},
      {"SIGUSR1@60", SIGUSR1, false, 60, "USR1@60"},
      {"b:usr1", SIGUSR1, true, -1, "B:USR1"},
      {"TERM", SIGTERM, false, -1, "TERM"},
      {"sigterm@0", SIGTERM, false, 0, "TERM@0"},
      {"12@30", SIGUSR2, false, 30, "USR2@30"},
  };
  for (const auto& row : rows) {
    CAPTURE(row.text);
    auto s = ParseSignalSetting(row.text);
    REQUIRE_MESSAGE(s.ok(), s.status().ToString());
    CHECK(s->signo == row.signo);
    CHECK(s->batch_only == row.batch_only);
    CHECK(s->before == (row.before < 0 ? std::optional<seconds>() : seconds(row.before)));
    CHECK(s->ToString() == row.canonical);
  }
}

TEST_CASE("signal settings: unknown signals and bad times are refused with the reason") {
  struct Row {
    std::string text;
    std::string reason;
  };
  const std::vector<Row> rows = {
      {"KILL", "unknown signal 'KILL'"},     {"USR3", "unknown signal"},
      {"HUP@10", "unknown signal 'HUP'"},    {"", "unknown signal ''"},
      {"B:", "unknown signal"},              {"R:USR2", "only the 'B:' prefix"},
      {"USR2@", "not 0..65535"},             {"USR2@-1", "not 0..65535"},
      {"USR2@70000", "not 0..65535"},        {"USR2@1m", "not 0..65535"},
  };
  for (const auto& row : rows) {
    CAPTURE(row.text);
    auto s = ParseSignalSetting(row.text);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == Code::kInvalidArgument);
    CHECK_MESSAGE(s.status().message().find(row.reason) != std::string::npos,
                  s.status().message());
  }
}

}  // namespace
}  // namespace lk::slurm
