#include "slurm/script.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "slurm/cli.h"
#include "slurm/fake_runner.h"

namespace lk::slurm {
namespace {

ScriptOptions Options() {
  ScriptOptions o;
  o.job = "llama-7b";
  o.group_id = "jupiter-0";
  o.lighthouse = "http://lh.example:7070";
  o.token_file = "/home/u/.lk/token";
  o.nodes = 4;
  o.tasks_per_node = 8;
  o.gpus_per_node = "8";
  o.time = "04:00:00";
  o.partition = "booster";
  o.account = "proj1";
  o.signal_before_s = 120;
  o.trainer = {"python", "train.py", "--data", "/p/data set", "--note", "it's"};
  return o;
}

bool Has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Runs `bash -n` on the script: a syntax error in generated shell would only show on a cluster.
int BashSyntaxCheck(const std::string& script) {
  char path[] = "/tmp/lk_script_test_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  std::ofstream(path) << script;
  int rc = std::system(fmt::format("bash -n {} 2>&1", path).c_str());
  std::remove(path);
  return rc;
}

TEST_CASE("shell quoting keeps words whole") {
  CHECK(ShellQuote("train.py") == "train.py");
  CHECK(ShellQuote("--lr=3e-4") == "--lr=3e-4");
  CHECK(ShellQuote("") == "''");
  CHECK(ShellQuote("a b") == "'a b'");
  CHECK(ShellQuote("it's") == "'it'\\''s'");
  CHECK(ShellQuote("$HOME") == "'$HOME'");
  CHECK(ShellQuote("a;rm -rf /") == "'a;rm -rf /'");
}

TEST_CASE("script: sbatch header and exports and agent and trainer steps") {
  EnvMap submit_env = {{"LK_HEARTBEAT_INTERVAL_MS", "500"},
                       {"LK_JOB", "from-env"},         // the flag wins
                       {"LK_NODE_RANK", "3"},          // per node: never exported
                       {"LK_SLURM_TIME", "01:00:00"},  // submit side: never exported
                       {"LK_TOKEN", "s3cret"},         // secret: never exported
                       {"LK_ODD", "a b'c"},
                       {"PATH", "/usr/bin"}};
  std::string s = GenerateBatchScript(Options(), submit_env);
  CAPTURE(s);
  CHECK(s.starts_with("#!/bin/bash\n"));
  for (const char* line :
       {"#SBATCH --job-name=lk-jupiter-0\n", "#SBATCH --nodes=4\n", "#SBATCH --ntasks-per-node=8\n",
        "#SBATCH --time=04:00:00\n", "#SBATCH --partition=booster\n", "#SBATCH --account=proj1\n",
        "#SBATCH --gpus-per-node=8\n", "#SBATCH --requeue\n", "#SBATCH --signal=B:USR2@120\n",
        "#SBATCH --open-mode=append\n", "#SBATCH --output=lk-%x-%j.out\n"}) {
    CHECK_MESSAGE(Has(s, line), line);
  }
  CHECK(Has(s, "export LK_JOB=llama-7b\n"));
  CHECK(Has(s, "export LK_GROUP_ID=jupiter-0\n"));
  CHECK(Has(s, "export LK_LIGHTHOUSE=http://lh.example:7070\n"));
  CHECK(Has(s, "export LK_TOKEN_FILE=/home/u/.lk/token\n"));
  CHECK(Has(s, "export LK_HEARTBEAT_INTERVAL_MS=500\n"));
  CHECK(Has(s, "export LK_ODD='a b'\\''c'\n"));
  CHECK_FALSE(Has(s, "from-env"));
  CHECK_FALSE(Has(s, "LK_NODE_RANK"));
  CHECK_FALSE(Has(s, "LK_SLURM_TIME"));
  CHECK_FALSE(Has(s, "s3cret"));
  CHECK(Has(s, "# not exported: LK_TOKEN (a secret; use --token-file instead)"));
  CHECK_FALSE(Has(s, "PATH="));
  // Agent: one per node, sharing CPUs, node rank and socket expanded on the node, in background.
  CHECK(Has(s,
            "srun --overlap --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks=\"$SLURM_JOB_NUM_NODES\" "
            "--ntasks-per-node=1"));
  CHECK(Has(s,
            "--node-rank \"$SLURM_NODEID\" "
            "--socket \"$d/lk-$SLURM_JOB_ID-r${SLURM_RESTART_COUNT:-0}-$SLURM_NODEID.sock\""));
  CHECK(Has(s,
            "replica_agent --signal-before-s 120 --lighthouse \"$LK_LIGHTHOUSE\" --job \"$LK_JOB\" "
            "--group-id \"$LK_GROUP_ID\" --nodes \"$SLURM_JOB_NUM_NODES\" "
            "--token-file \"$LK_TOKEN_FILE\" &\n"
            "lk_agent_pid=$!"));
  // Trainers: quoted command, socket in LK_AGENT_SOCKET, background + wait so traps run.
  CHECK(Has(s, "bash -c 'trap \"\" USR2; d=$1; shift; "));
  CHECK(Has(s,
            "export LK_AGENT_SOCKET=\"$d/lk-$SLURM_JOB_ID-r${SLURM_RESTART_COUNT:-0}-"
            "$SLURM_NODEID.sock\""));
  // The trainers start with the agent and wait for its socket, new in every life.
  CHECK(Has(s,
            "for _ in $(seq 1 600); do [ -S \"$LK_AGENT_SOCKET\" ] && break; sleep 0.1; done; "
            "exec \"$@\"' lk-trainer"));
  CHECK(Has(s, "python train.py --data '/p/data set' --note 'it'\\''s' &\n"));
  CHECK(Has(s, "lk_wait \"$lk_trainer_pid\""));
  CHECK(Has(s, "trap lk_on_warning USR2\n"));
  CHECK(Has(s, "kill -USR2 \"$lk_agent_pid\""));
  CHECK(Has(s, "trap lk_on_term TERM\n"));
  CHECK(Has(s, "export LK_INCARNATION="));
  CHECK_FALSE(Has(s, "scontrol requeue"));  // only with --requeue-on-crash
  CHECK(BashSyntaxCheck(s) == 0);
}

TEST_CASE("script: --bind-iface finds each node's address for the trainers and the agent") {
  ScriptOptions o = Options();
  o.bind_iface = "ib0";
  std::string s = GenerateBatchScript(o, {});
  CAPTURE(s);
  CHECK(Has(s, "export LK_BIND_IFACE=ib0\n"));
  CHECK(Has(s, "ip -o -4 addr show dev \"$LK_BIND_IFACE\""));
  CHECK(Has(s, "exec \"$@\" --serve \"$a:0\" --node-rank \"$SLURM_NODEID\""));
  CHECK(Has(s, "export LK_BIND_HOST=\"$a\"; export LK_AGENT_SOCKET="));
  CHECK(BashSyntaxCheck(s) == 0);
  // Without it, neither appears (the trainers' and agent's own settings hold).
  std::string plain = GenerateBatchScript(Options(), {});
  CHECK_FALSE(Has(plain, "LK_BIND_HOST"));
  CHECK_FALSE(Has(plain, "--serve"));
}

TEST_CASE("script: --requeue-on-crash requeues a bounded number of times") {
  ScriptOptions o = Options();
  o.requeue_on_crash = true;
  o.crash_requeues_max = 2;
  o.partition.clear();
  o.account.clear();
  o.gpus_per_node.clear();
  o.token_file.clear();
  std::string s = GenerateBatchScript(o, {});
  CAPTURE(s);
  // The lighthouse's count of the group's crashes decides; the restart count stands in.
  CHECK(Has(s, "lk_crashes=$(lkctl --lighthouse \"$LK_LIGHTHOUSE\" event \"$LK_JOB\" "
               "\"$LK_GROUP_ID\" \"$LK_INCARNATION\" trainer_crashed \"rc=$lk_trainer_rc\""));
  CHECK(Has(s, "lk_crashes=$(( ${SLURM_RESTART_COUNT:-0} + 1 )); lk_counted_by=restart_count"));
  CHECK(Has(s, "if [ \"$lk_crashes\" -le 2 ]; then"));
  CHECK(Has(s, "if lk_out=$(scontrol requeue \"$lk_job_ref\" 2>&1); then"));
  CHECK(Has(s, "event=requeue_refused job=$lk_job_ref"));
  CHECK(Has(s, "trainer_crashed \"rc=$lk_trainer_rc\""));
  CHECK_FALSE(Has(s, "--partition"));
  CHECK_FALSE(Has(s, "--account"));
  CHECK_FALSE(Has(s, "--gpus-per-node"));
  CHECK_FALSE(Has(s, "--token-file"));
  CHECK_FALSE(Has(s, "LK_TOKEN_FILE"));
  CHECK(BashSyntaxCheck(s) == 0);
}

// The crash branch of the generated script, run by bash with stand-ins for srun (the trainers
// exit with a given code), scontrol (answers queued in a file) and lkctl (the lighthouse's
// crash count, or no answer) on PATH, and a sleep that does not wait. What ran and what the
// script logged are checked.
struct CrashRun {
  std::string log;       // the script's stderr
  std::string scontrol;  // one line per scontrol call
  std::string lkctl;     // one line per lkctl call
  int rc = -1;
};

CrashRun RunCrashBranch(const std::string& crashes, int64_t restart_count,
                        const std::vector<std::string>& scontrol_answers) {
  char tmpl[] = "/tmp/lk_crash_branch_XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string d = tmpl;
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(d + "/" + name) << text;
    std::system(fmt::format("chmod +x {}/{}", d, name).c_str());
  };
  write("srun", "#!/bin/bash\ncase \"$*\" in *lk-trainer*) exit 7 ;; esac\nexit 0\n");
  write("sleep", "#!/bin/bash\nexit 0\n");
  // Each answer is "RC MESSAGE"; the calls take them in order.
  std::string answers;
  for (const auto& a : scontrol_answers) answers += a + "\n";
  std::ofstream(d + "/answers") << answers;
  write("scontrol",
        "#!/bin/bash\necho \"$*\" >> " + d + "/scontrol.calls\n"
        "line=$(head -n 1 " + d + "/answers); sed -i 1d " + d + "/answers\n"
        "echo \"${line#* }\" >&2; exit \"${line%% *}\"\n");
  write("lkctl", "#!/bin/bash\necho \"$*\" >> " + d + "/lkctl.calls\n" +
                     (crashes.empty() ? std::string("echo 'lkctl: connection refused' >&2; exit 1\n")
                                      : "echo 'crashes=" + crashes + " requeue_refusals=0'\n"));
  ScriptOptions o = Options();
  o.requeue_on_crash = true;
  o.crash_requeues_max = 2;
  o.agent_exit_wait_s = 0;
  std::ofstream(d + "/job.sh") << GenerateBatchScript(o, {});
  const std::string cmd = fmt::format(
      "cd {0} && env PATH={0}:$PATH SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=1 SLURM_NODEID=0 "
      "SLURM_RESTART_COUNT={1} bash job.sh 2> {0}/stderr",
      d, restart_count);
  CrashRun r;
  int status = std::system(cmd.c_str());
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  auto slurp = [&](const std::string& name) {
    std::ifstream in(d + "/" + name);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  r.log = slurp("stderr");
  r.scontrol = slurp("scontrol.calls");
  r.lkctl = slurp("lkctl.calls");
  std::system(fmt::format("rm -rf {}", d).c_str());
  return r;
}

TEST_CASE("script: a crash after five wall-time requeues is still requeued (the lighthouse counts)") {
  // SLURM_RESTART_COUNT=5 from five requeues for the time limit; the lighthouse counts 1 crash.
  CrashRun r = RunCrashBranch("1", 5, {"0 "});
  CAPTURE(r.log);
  CHECK(r.rc == 0);
  CHECK(Has(r.log, "event=trainer_crashed rc=7 crashes=1 counted_by=lighthouse action=requeue"));
  CHECK(Has(r.log, "event=requeued job=77 attempts=1"));
  CHECK(r.scontrol == "requeue 77\n");
  CHECK(Has(r.lkctl, "--lighthouse http://lh.example:7070 --token-file /home/u/.lk/token event "
                     "llama-7b jupiter-0 77.r5."));
  CHECK(Has(r.lkctl, " trainer_crashed rc=7\n"));
}

TEST_CASE("script: past the crash cap the job ends with the trainers' code, not requeued") {
  CrashRun r = RunCrashBranch("3", 0, {});
  CAPTURE(r.log);
  CHECK(r.rc == 7);
  CHECK(Has(r.log, "crashes=3 counted_by=lighthouse action=exit reason=crash_requeues_max_2"));
  CHECK(r.scontrol.empty());
}

TEST_CASE("script: without the lighthouse the restart count stands in for the crash count") {
  CrashRun r = RunCrashBranch("", 1, {"0 "});
  CAPTURE(r.log);
  CHECK(r.rc == 0);
  CHECK(Has(r.log, "crashes=2 counted_by=restart_count action=requeue"));
  r = RunCrashBranch("", 2, {});
  CAPTURE(r.log);
  CHECK(r.rc == 7);
  CHECK(Has(r.log, "crashes=3 counted_by=restart_count action=exit"));
}

TEST_CASE("script: a refused requeue is retried with a bound, then reported to the lighthouse") {
  // slurmctld busy on every call: four tries, then the refusal goes to the lighthouse.
  const std::string busy = "1 slurm_requeue error: Socket timed out on send/recv operation";
  CrashRun r = RunCrashBranch("1", 0, {busy, busy, busy, busy});
  CAPTURE(r.log);
  CHECK(r.rc == 7);
  CHECK(r.scontrol == "requeue 77\nrequeue 77\nrequeue 77\nrequeue 77\n");
  CHECK(Has(r.log, "event=requeue_failed job=77 attempt=4 error=\"slurm_requeue error: Socket"));
  CHECK(Has(r.log, "event=requeue_refused job=77 attempts=4"));
  CHECK(Has(r.lkctl, " requeue_refused scontrol: slurm_requeue error: Socket timed out"));
  // Busy once, then accepted.
  r = RunCrashBranch("1", 0, {busy, "0 "});
  CHECK(r.rc == 0);
  CHECK(Has(r.log, "event=requeued job=77 attempts=2"));
  // A refusal that stays is not retried.
  r = RunCrashBranch("1", 0, {"1 Requested operation is presently disabled for job 77"});
  CHECK(r.rc == 7);
  CHECK(r.scontrol == "requeue 77\n");
  CHECK(Has(r.log, "event=requeue_refused job=77 attempts=1"));
}

TEST_CASE("script: options are validated with the flag's name") {
  struct Row {
    std::string name;
    void (*change)(ScriptOptions&);
    std::string error;
  };
  const std::vector<Row> rows = {
      {"no job", [](ScriptOptions& o) { o.job.clear(); }, "--job (LK_JOB) is required"},
      {"no group", [](ScriptOptions& o) { o.group_id.clear(); }, "--group-id"},
      {"no lighthouse", [](ScriptOptions& o) { o.lighthouse.clear(); }, "--lighthouse"},
      {"no time", [](ScriptOptions& o) { o.time.clear(); }, "--time is required"},
      {"no trainer", [](ScriptOptions& o) { o.trainer.clear(); }, "after '--'"},
      {"bad interface", [](ScriptOptions& o) { o.bind_iface = "ib0;rm"; }, "--bind-iface 'ib0;rm'"},
      {"long interface", [](ScriptOptions& o) { o.bind_iface = std::string(16, 'i'); },
       "longer than an interface name"},
      {"zero nodes", [](ScriptOptions& o) { o.nodes = 0; }, "--nodes 0"},
      {"bad time", [](ScriptOptions& o) { o.time = "4h"; }, "--time: time '4h'"},
      {"short time", [](ScriptOptions& o) { o.time = "2:00"; }, "not longer than"},
      {"space in partition", [](ScriptOptions& o) { o.partition = "a b"; }, "--partition 'a b'"},
      {"quote in group", [](ScriptOptions& o) { o.group_id = "x\"y"; }, "--job-name"},
      {"hash in output", [](ScriptOptions& o) { o.output = "a#b"; }, "--output"},
      {"relative socket dir", [](ScriptOptions& o) { o.socket_dir = "tmp"; }, "absolute"},
      {"signal too far", [](ScriptOptions& o) { o.signal_before_s = 70000; }, "0..65535"},
  };
  CHECK(Options().Validate().ok());
  for (const auto& row : rows) {
    CAPTURE(row.name);
    ScriptOptions o = Options();
    row.change(o);
    Status s = o.Validate();
    REQUIRE_FALSE(s.ok());
    CHECK_MESSAGE(Has(s.message(), row.error), s.message());
  }
  ScriptOptions unlimited = Options();
  unlimited.time = "UNLIMITED";
  CHECK(unlimited.Validate().ok());
}

int Cli(std::vector<const char*> args, FakeRunner& runner, std::string* out, std::string* err) {
  std::ostringstream o, e;
  int rc = RunSlurmCli(static_cast<int>(args.size()), args.data(), runner, o, e);
  *out = o.str();
  *err = e.str();
  return rc;
}

TEST_CASE("cli: submit pipes the script to sbatch --parsable and prints the job id") {
  FakeRunner runner;
  runner.Answer(0, "4242;lk\n");
  std::string out, err;
  int rc = Cli({"slurm", "submit", "--job", "j", "--group-id", "g", "--lighthouse", "http://h:1",
                "--time", "10:00", "--signal-before-s", "60", "--", "sleep", "1"},
               runner, &out, &err);
  CHECK_MESSAGE(rc == 0, err);
  CHECK(out == "4242\n");
  REQUIRE(runner.ran().size() == 1);
  CHECK(runner.ran()[0].argv == std::vector<std::string>{"sbatch", "--parsable"});
  CHECK(Has(runner.ran()[0].stdin_text, "#SBATCH --signal=B:USR2@60\n"));
  CHECK(Has(runner.ran()[0].stdin_text, "sleep 1 &\n"));

  runner.Answer(1, "", "sbatch: error: invalid partition specified: nope\n");
  rc = Cli({"slurm", "submit", "--job", "j", "--group-id", "g", "--lighthouse", "http://h:1",
            "--time", "10:00", "--partition", "nope", "--", "true"},
           runner, &out, &err);
  CHECK(rc == 1);
  CHECK(Has(err, "sbatch exited 1: sbatch: error: invalid partition specified: nope"));

  runner.Answer(Error(Code::kNotFound, "sbatch: not found in PATH"));
  rc = Cli({"slurm", "submit", "--job", "j", "--group-id", "g", "--lighthouse", "http://h:1",
            "--time", "10:00", "--", "true"},
           runner, &out, &err);
  CHECK(rc == 1);
  CHECK(Has(err, "sbatch: not found in PATH"));
}

TEST_CASE("cli: usage errors exit 2 with the reason and --help lists every flag") {
  FakeRunner runner;
  std::string out, err;
  CHECK(Cli({"slurm", "script", "--job", "j", "--bogus"}, runner, &out, &err) == 2);
  CHECK(Has(err, "unknown flag --bogus"));
  CHECK(
      Cli({"slurm", "script", "--group-id", "g", "--lighthouse", "h", "--time", "10", "--job", "j"},
          runner, &out, &err) == 2);
  CHECK(Has(err, "the trainer command is required"));
  CHECK(Cli({"slurm", "frobnicate"}, runner, &out, &err) == 2);
  CHECK(Has(err, "unknown command 'frobnicate'"));
  CHECK(Cli({"slurm", "leave", "--signal", "KILL"}, runner, &out, &err) == 2);
  CHECK(Has(err, "unknown signal 'KILL'"));
  CHECK(Cli({"slurm", "script", "--help"}, runner, &out, &err) == 0);
  for (const char* flag :
       {"--job", "--group-id", "--lighthouse", "--token-file", "--nodes", "--time", "--partition",
        "--account", "--signal-before-s", "--requeue-on-crash", "--agent-bin", "$LK_SLURM_TIME"}) {
    CHECK_MESSAGE(Has(out, flag), flag);
  }
  CHECK(runner.ran().empty());
}

TEST_CASE("cli: the tool binary exports the submitting LK_* environment") {
  // Through the real binary and a controlled environment, as a user would run it.
  const char* bin_dir = std::getenv("LK_BIN_DIR");
  REQUIRE_MESSAGE(bin_dir != nullptr, "LK_BIN_DIR is not set (run through ctest)");
  std::string cmd = fmt::format(
      "env -i PATH=/usr/bin:/bin LK_LIGHTHOUSE=http://lh:7070 LK_JOB=envjob "
      "LK_TOKEN_FILE=/t/tok LK_EXTRA='x y' LK_SLURM_TIME=30:00 "
      "{}/lk_slurm_tool slurm script --group-id g1 -- ./train --steps 10",
      bin_dir);
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string s;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) s.append(buf, n);
  int status = pclose(p);
  CAPTURE(s);
  REQUIRE(status == 0);
  CHECK(Has(s, "export LK_LIGHTHOUSE=http://lh:7070\n"));
  CHECK(Has(s, "export LK_JOB=envjob\n"));
  CHECK(Has(s, "export LK_GROUP_ID=g1\n"));
  CHECK(Has(s, "export LK_TOKEN_FILE=/t/tok\n"));
  CHECK(Has(s, "export LK_EXTRA='x y'\n"));
  CHECK(Has(s, "#SBATCH --time=30:00\n"));  // LK_SLURM_TIME is the --time flag
  CHECK(Has(s, "./train --steps 10 &\n"));
  CHECK(BashSyntaxCheck(s) == 0);
}

}  // namespace
}  // namespace lk::slurm
