#include "slurm/slurm_env.h"

#include <doctest/doctest.h>

#include "slurm/fake_runner.h"

namespace lk::slurm {
namespace {

using std::chrono::seconds;

// The batch environment Slurm 22.05 gave a one-node job on the local Slurm (trimmed).
EnvMap BatchEnv() {
  return {{"SLURMD_NODENAME", "localhost"}, {"SLURM_CLUSTER_NAME", "lk"},
          {"SLURM_CPUS_ON_NODE", "1"},      {"SLURM_JOBID", "1"},
          {"SLURM_JOB_ID", "1"},            {"SLURM_JOB_NAME", "j.sh"},
          {"SLURM_JOB_NODELIST", "localhost"}, {"SLURM_JOB_NUM_NODES", "1"},
          {"SLURM_JOB_PARTITION", "debug"}, {"SLURM_LOCALID", "0"},
          {"SLURM_NNODES", "1"},            {"SLURM_NODEID", "0"},
          {"SLURM_NODELIST", "localhost"},  {"SLURM_PROCID", "0"}};
}

TEST_CASE("slurm env: a 22.05 batch environment parses and an absent restart count means 0") {
  auto env = ParseSlurmEnv(BatchEnv());
  REQUIRE_MESSAGE(env.ok(), env.status().ToString());
  CHECK(env->job_id == 1);
  CHECK_FALSE(env->IsArrayTask());
  CHECK(env->JobRef() == "1");
  CHECK(env->restart_count == 0);
  CHECK(env->node_id == 0);
  CHECK(env->num_nodes == 1);
  CHECK_FALSE(env->num_tasks.has_value());
  CHECK(env->proc_id == 0);
  CHECK(env->cpus_on_node == 1);
  CHECK(env->partition == "debug");
  CHECK(env->job_name == "j.sh");
  CHECK(env->cluster_name == "lk");
  CHECK(env->node_name == "localhost");
  CHECK(env->nodes == std::vector<std::string>{"localhost"});
  CHECK_FALSE(env->end_time.has_value());
}

TEST_CASE("slurm env: table of environments") {
  struct Row {
    std::string name;
    EnvMap env;
    std::string error;  // empty: parses
    std::string job_ref;
    int64_t restart_count = 0;
    int64_t node_id = 0;
    size_t nodes = 0;
  };
  auto with = [](EnvMap extra) {
    EnvMap env = BatchEnv();
    for (auto& [k, v] : extra) env[k] = v;
    return env;
  };
  const std::vector<Row> rows = {
      {"requeued once", with({{"SLURM_RESTART_COUNT", "1"}}), "", "1", 1, 0, 1},
      {"array task", with({{"SLURM_JOB_ID", "17"}, {"SLURM_ARRAY_JOB_ID", "12"},
                           {"SLURM_ARRAY_TASK_ID", "5"}}), "", "12_5", 0, 0, 1},
      {"four nodes, third", with({{"SLURM_JOB_NODELIST", "gpu[001-004]"},
                                  {"SLURM_JOB_NUM_NODES", "4"}, {"SLURM_NNODES", "4"},
                                  {"SLURM_NODEID", "2"}}), "", "1", 0, 2, 4},
      {"old SLURM_JOBID only", {{"SLURM_JOBID", "9"}}, "", "9", 0, 0, 0},
      {"23.02 end time", with({{"SLURM_JOB_END_TIME", "1700000000"}}), "", "1", 0, 0, 1},
      {"no job id", {{"SLURM_NODEID", "0"}}, "SLURM_JOB_ID is not set", "", 0, 0, 0},
      {"empty job id", {{"SLURM_JOB_ID", ""}}, "SLURM_JOB_ID is not set", "", 0, 0, 0},
      {"bad job id", {{"SLURM_JOB_ID", "12x"}}, "SLURM_JOB_ID='12x'", "", 0, 0, 0},
      {"negative restarts", with({{"SLURM_RESTART_COUNT", "-1"}}), "SLURM_RESTART_COUNT", "",
       0, 0, 0},
      {"half an array", with({{"SLURM_ARRAY_JOB_ID", "12"}}), "set together", "", 0, 0, 0},
      {"node id too big", with({{"SLURM_NODEID", "1"}}), "not below the node count", "", 0, 0,
       0},
      {"bad end time", with({{"SLURM_JOB_END_TIME", "soon"}}), "SLURM_JOB_END_TIME", "", 0, 0,
       0},
  };
  for (const auto& row : rows) {
    CAPTURE(row.name);
    auto env = ParseSlurmEnv(row.env);
    if (!row.error.empty()) {
      REQUIRE_FALSE(env.ok());
      CHECK_MESSAGE(env.status().message().find(row.error) != std::string::npos,
                    env.status().message());
      continue;
    }
    REQUIRE_MESSAGE(env.ok(), env.status().ToString());
    CHECK(env->JobRef() == row.job_ref);
    CHECK(env->restart_count == row.restart_count);
    CHECK(env->node_id == row.node_id);
    CHECK(env->nodes.size() == row.nodes);
  }
  auto end = ParseSlurmEnv(with({{"SLURM_JOB_END_TIME", "1700000000"}}));
  REQUIRE(end.ok());
  CHECK(end->end_time == TimePoint(seconds(1700000000)));
}

TEST_CASE("slurm env: a node list the parser refuses or miscounts leaves the job usable, names for later") {
  EnvMap env = BatchEnv();
  env["SLURM_JOB_NODELIST"] = "gpu[1-";
  auto bad = ParseSlurmEnv(env);
  REQUIRE_MESSAGE(bad.ok(), bad.status().ToString());
  CHECK(bad->JobRef() == "1");
  CHECK(bad->nodes.empty());
  CHECK(bad->nodes_error.find("SLURM_JOB_NODELIST") != std::string::npos);
  env["SLURM_JOB_NODELIST"] = "n[1-3]";  // BatchEnv says one node
  auto miscount = ParseSlurmEnv(env);
  REQUIRE(miscount.ok());
  CHECK(miscount->nodes.empty());
  CHECK(miscount->nodes_error.find("names 3 nodes") != std::string::npos);
}

TEST_CASE("slurm env: ResolveNodes takes scontrol's names, keeps the parser's when scontrol fails") {
  EnvMap base = BatchEnv();
  base["SLURM_JOB_NODELIST"] = "gpu[1-";
  base["SLURM_JOB_NUM_NODES"] = "2";
  base["SLURM_NNODES"] = "2";
  {
    auto env = ParseSlurmEnv(base);
    REQUIRE(env.ok());
    FakeRunner runner;
    runner.Answer(0, "gpu1\ngpu2\n");
    REQUIRE(ResolveNodes(runner, &*env).ok());
    CHECK(env->nodes == std::vector<std::string>{"gpu1", "gpu2"});
    CHECK(env->nodes_error.empty());
    REQUIRE(runner.ran().size() == 1);
    CHECK(runner.ran()[0].argv == std::vector<std::string>{"scontrol", "show", "hostnames", "gpu[1-"});
  }
  {
    // Neither scontrol (missing) nor the parser: an error that says both, the env unchanged.
    auto env = ParseSlurmEnv(base);
    REQUIRE(env.ok());
    FakeRunner runner;
    runner.Answer(Error(Code::kNotFound, "scontrol is not in PATH"));
    Status st = ResolveNodes(runner, &*env);
    REQUIRE_FALSE(st.ok());
    CHECK(st.message().find("scontrol is not in PATH") != std::string::npos);
    CHECK(st.message().find("SLURM_JOB_NODELIST") != std::string::npos);
    CHECK(env->nodes.empty());
  }
  {
    // scontrol fails on a list the parser expanded: the parser's names stand.
    EnvMap ok = BatchEnv();
    ok["SLURM_JOB_NODELIST"] = "gpu[1-2]";
    ok["SLURM_JOB_NUM_NODES"] = "2";
    ok["SLURM_NNODES"] = "2";
    auto env = ParseSlurmEnv(ok);
    REQUIRE(env.ok());
    FakeRunner runner;
    runner.Answer(1, "", "slurm_load_partitions: Unable to contact slurm controller");
    REQUIRE(ResolveNodes(runner, &*env).ok());
    CHECK(env->nodes == std::vector<std::string>{"gpu1", "gpu2"});
  }
  {
    // scontrol's count disagrees with the job's: not taken.
    auto env = ParseSlurmEnv(base);
    REQUIRE(env.ok());
    FakeRunner runner;
    runner.Answer(0, "gpu1\n");
    Status st = ResolveNodes(runner, &*env);
    REQUIRE_FALSE(st.ok());
    CHECK(st.message().find("scontrol names 1 nodes") != std::string::npos);
  }
}

TEST_CASE("slurm env: InSlurm looks at SLURM_JOB_ID") {
  CHECK(InSlurm(BatchEnv()));
  CHECK_FALSE(InSlurm(EnvMap{{"HOME", "/root"}}));
  CHECK_FALSE(InSlurm(EnvMap{{"SLURM_JOB_ID", ""}}));
}

TEST_CASE("slurm env: durations in sbatch and scontrol syntax") {
  struct Row {
    std::string text;
    int64_t secs;  // -1: unlimited, -2: error
  };
  const std::vector<Row> rows = {
      {"30", 1800},         {"5:00", 300},       {"00:10:00", 600},  {"04:00:00", 14400},
      {"1-00:00:00", 86400}, {"2-3", 2 * 86400 + 3 * 3600},     {"1-2:30", 86400 + 9000},
      {"UNLIMITED", -1},    {"INFINITE", -1},    {"Partition_Limit", -1},
      {"", -2},             {"abc", -2},         {"1:2:3:4", -2},    {"-5", -2},
      {"1-", -2},           {"10:", -2},         {"1h", -2},
      // Fields that each parse but whose sum does not fit: refused, not wrapped around.
      {"1:9223372036854775807", -2},                {"0:0:9223372036854775807", -2},
      {"9223372036854775807", -2},                  {"1-0:0:9223372036854775807", -2},
  };
  for (const auto& row : rows) {
    CAPTURE(row.text);
    auto d = ParseSlurmDuration(row.text);
    if (row.secs == -2) {
      CHECK_FALSE(d.ok());
      continue;
    }
    REQUIRE_MESSAGE(d.ok(), d.status().ToString());
    if (row.secs == -1) CHECK_FALSE(d->has_value());
    else CHECK(d->value() == seconds(row.secs));
  }
}

TEST_CASE("slurm env: times beyond what a time point holds are refused, not wrapped") {
  // A time point counts nanoseconds in 64 bits: seconds since the epoch beyond about 2^33 do
  // not fit, and StartTime + TimeLimit must not overflow either.
  for (std::string secs : {"9223372036854775807", "99999999999", "18446744073"}) {
    CAPTURE(secs);
    CHECK_FALSE(ParseJobInfo(fmt::format("JobState=RUNNING StartTime={}", secs)).ok());
    CHECK_FALSE(ParseJobInfo(fmt::format("JobState=RUNNING EndTime={}", secs)).ok());
    EnvMap env = {{"SLURM_JOB_ID", "7"}, {"SLURM_JOB_END_TIME", secs}};
    CHECK_FALSE(ParseSlurmEnv(env).ok());
  }
  // The largest accepted start plus the largest accepted limit still fits.
  auto far = ParseJobInfo("JobState=RUNNING StartTime=4294967295 TimeLimit=36500-00:00:00");
  REQUIRE(far.ok());
  REQUIRE(far->LimitEnd().has_value());
  CHECK(far->LimitEnd()->time_since_epoch() > std::chrono::seconds(4294967295));
}

// `SLURM_TIME_FORMAT=%s scontrol show job -o` from Slurm 22.05 (trimmed), while running and
// while being preempted (EndTime moved to now + GraceTime, StartTime + TimeLimit unchanged).
constexpr char kRunning[] =
    "JobId=4 JobName=wrap UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 RunTime=00:00:01 TimeLimit=00:05:00 TimeMin=N/A "
    "SubmitTime=1795976226 StartTime=1795976227 EndTime=1795976527 Deadline=N/A "
    "Command=/tmp/my job.sh WorkDir=/work/main\n";
constexpr char kPreempted[] =
    "JobId=2 JobState=RUNNING Reason=None Restarts=0 TimeLimit=00:10:00 "
    "StartTime=1795976165 EndTime=1795976177\n";

TEST_CASE("slurm env: scontrol job lines and a limit end that ignores preemption") {
  auto running = ParseJobInfo(kRunning);
  REQUIRE_MESSAGE(running.ok(), running.status().ToString());
  CHECK(running->state == "RUNNING");
  CHECK(running->restarts == 0);
  CHECK(running->time_limit == seconds(300));
  CHECK(running->LimitEnd() == TimePoint(seconds(1795976527)));

  auto preempted = ParseJobInfo(kPreempted);
  REQUIRE(preempted.ok());
  CHECK(preempted->end_time == TimePoint(seconds(1795976177)));
  CHECK(preempted->LimitEnd() == TimePoint(seconds(1795976165 + 600)));

  auto unlimited = ParseJobInfo("JobState=PENDING Restarts=2 TimeLimit=UNLIMITED "
                                "StartTime=Unknown EndTime=Unknown");
  REQUIRE(unlimited.ok());
  CHECK(unlimited->restarts == 2);
  CHECK_FALSE(unlimited->LimitEnd().has_value());

  CHECK_FALSE(ParseJobInfo("slurm_load_jobs error: Invalid job id specified").ok());
  CHECK_FALSE(ParseJobInfo("JobState=RUNNING Restarts=x").ok());
}

TEST_CASE("slurm env: FillEndTime asks scontrol with epoch times and keeps a known one") {
  auto env = ParseSlurmEnv(BatchEnv());
  REQUIRE(env.ok());
  FakeRunner runner;
  runner.Answer(0, kRunning);
  REQUIRE(FillEndTime(runner, &*env).ok());
  CHECK(env->end_time == TimePoint(seconds(1795976527)));
  REQUIRE(runner.ran().size() == 1);
  CHECK(runner.ran()[0].argv == std::vector<std::string>{"scontrol", "show", "job", "-o", "1"});
  CHECK(runner.ran()[0].env.at("SLURM_TIME_FORMAT") == "%s");
  REQUIRE(FillEndTime(runner, &*env).ok());  // known: no second query
  CHECK(runner.ran().size() == 1);
}

TEST_CASE("slurm env: FillEndTime errors name the job and the cause") {
  auto env = ParseSlurmEnv(BatchEnv());
  REQUIRE(env.ok());
  FakeRunner runner;
  runner.Answer(Error(Code::kNotFound, "scontrol: not found in PATH"));
  Status missing = FillEndTime(runner, &*env);
  CHECK(missing.code() == Code::kNotFound);
  CHECK(missing.message() == "query job 1: scontrol: not found in PATH");
  runner.Answer(1, "", "slurm_load_jobs error: Invalid job id specified\n");
  Status refused = FillEndTime(runner, &*env);
  CHECK(refused.code() == Code::kUnavailable);
  CHECK(refused.message().find("Invalid job id specified") != std::string::npos);
  CHECK_FALSE(env->end_time.has_value());
}

TEST_CASE("slurm env: incarnation ids") {
  CHECK(MakeIncarnationId(BatchEnv(), "vm", 42, 0x9f3a0c11) == "1.r0.9f3a0c11");
  EnvMap array = BatchEnv();
  array["SLURM_ARRAY_JOB_ID"] = "12";
  array["SLURM_ARRAY_TASK_ID"] = "5";
  array["SLURM_RESTART_COUNT"] = "2";
  CHECK(MakeIncarnationId(array, "vm", 42, 1) == "12_5.r2.00000001");
  EnvMap set = BatchEnv();
  set["LK_INCARNATION"] = "1.r0.abcdef01";  // from the batch script: the same on every node
  CHECK(MakeIncarnationId(set, "vm", 42, 7) == "1.r0.abcdef01");
  CHECK(MakeIncarnationId({}, "vm", 42, 0xff) == "vm.p42.000000ff");
  CHECK(MakeIncarnationId({}, "", 42, 0xff) == "host.p42.000000ff");
  CHECK(NewIncarnationId() != NewIncarnationId());
}

}  // namespace
}  // namespace lk::slurm
