#include "slurm/cli.h"

#include <iostream>

#include "common/flags.h"
#include "common/task_place.h"
#include "slurm/requeue.h"
#include "slurm/script.h"
#include "slurm/slurm_env.h"

namespace lk::slurm {
namespace {

constexpr std::string_view kUsage =
    "usage: lkctl slurm <command> [flags]\n\n"
    "commands:\n"
    "  script [flags] -- TRAINER...  print the batch script of one replica group\n"
    "  submit [flags] -- TRAINER...  submit that script with sbatch; print the job id\n"
    "  env                           print this process's Slurm environment, job times and\n"
    "                                the task's place in its group (group_rank, local_rank)\n"
    "  leave --signal USR2|TERM      inside a job: classify the leave, requeue when due\n\n"
    "`lkctl slurm <command> --help` describes each command's flags.\n";

void AddScriptFlags(Flags& flags, ScriptOptions& o) {
  flags.Add("job", &o.job, "training run (lighthouse namespace); required");
  flags.Add("group-id", &o.group_id, "replica group id, stable across requeues; required");
  flags.Add("lighthouse", &o.lighthouse, "lighthouse URL, e.g. http://host:7070; required");
  flags.Add("token-file", &o.token_file, "job token file, readable on the compute nodes");
  flags.Add("nodes", &o.nodes, "nodes of the group", "LK_SLURM_NODES");
  flags.Add("tasks-per-node", &o.tasks_per_node, "trainers per node (one per GPU)",
            "LK_SLURM_TASKS_PER_NODE");
  flags.Add("gpus-per-node", &o.gpus_per_node, "sbatch --gpus-per-node, when set",
            "LK_SLURM_GPUS_PER_NODE");
  flags.Add("time", &o.time, "wall-time limit, sbatch --time syntax (e.g. 04:00:00); required",
            "LK_SLURM_TIME");
  flags.Add("partition", &o.partition, "sbatch --partition, when set", "LK_SLURM_PARTITION");
  flags.Add("account", &o.account, "sbatch --account, when set", "LK_SLURM_ACCOUNT");
  flags.Add("signal-before-s", &o.signal_before_s,
            "seconds before the time limit that USR2 warns the group (--signal=B:USR2@S)",
            "LK_SLURM_SIGNAL_BEFORE_S");
  flags.Add("requeue-on-crash", &o.requeue_on_crash,
            "requeue the job when the trainers fail with no signal", "LK_SLURM_REQUEUE_ON_CRASH");
  flags.Add("crash-requeues-max", &o.crash_requeues_max,
            "requeue on a crash at most this many times over the group's lives (counted by the "
            "lighthouse; SLURM_RESTART_COUNT when it cannot answer)",
            "LK_SLURM_CRASH_REQUEUES_MAX");
  flags.Add("job-name", &o.job_name, "sbatch --job-name (default lk-<group-id>)",
            "LK_SLURM_JOB_NAME");
  flags.Add("output", &o.output, "sbatch --output, appended to across requeues",
            "LK_SLURM_OUTPUT");
  flags.Add("agent-bin", &o.agent_bin, "replica_agent program on the compute nodes",
            "LK_AGENT_BIN");
  flags.Add("bind-iface", &o.bind_iface,
            "network interface (e.g. ib0) whose IPv4 address on each node the trainers bind to "
            "(LK_BIND_HOST) and the agent serves peers on (--serve ADDRESS:0)",
            "LK_SLURM_BIND_IFACE");
  flags.Add("lkctl-bin", &o.lkctl_bin,
            "lkctl program on the compute nodes (reports crashes with --requeue-on-crash)",
            "LK_LKCTL_BIN");
  flags.Add("socket-dir", &o.socket_dir, "node-local directory for the agent's socket",
            "LK_SLURM_SOCKET_DIR");
  flags.Add("agent-exit-wait-s", &o.agent_exit_wait_s,
            "seconds the agent gets to exit after the trainers before it is stopped",
            "LK_SLURM_AGENT_EXIT_WAIT_S");
}

// Parses the script flags; returns -1 to go on, else the exit status to return.
int ParseScript(std::string_view command, int argc, const char* const* argv, ScriptOptions* o,
                std::ostream& out, std::ostream& err) {
  Flags flags(fmt::format("lkctl slurm {}", command),
              fmt::format("{} the Slurm batch script of one replica group. The trainer command "
                          "follows '--'. Every LK_* variable of this environment is exported "
                          "in the script (flags win); LK_*TOKEN secrets never are.",
                          command == "script" ? "Print" : "Submit with sbatch"));
  AddScriptFlags(flags, *o);
  Status parsed = flags.Parse(argc, argv, 2);
  if (flags.help_requested()) {
    out << flags.Help();
    return 0;
  }
  if (!parsed.ok()) {
    err << "lkctl slurm " << command << ": " << parsed.message() << "\n";
    return 2;
  }
  o->trainer = flags.positional();
  if (Status valid = o->Validate(); !valid.ok()) {
    err << "lkctl slurm " << command << ": " << valid.message() << "\n";
    return 2;
  }
  return -1;
}

int Submit(const std::string& script, CommandRunner& runner, std::ostream& out,
           std::ostream& err) {
  Command cmd;
  cmd.argv = {"sbatch", "--parsable"};
  cmd.stdin_text = script;
  cmd.timeout = std::chrono::seconds(60);
  auto ran = runner.Run(cmd);
  if (!ran.ok()) {
    err << "lkctl slurm submit: " << ran.status().message() << "\n";
    return 1;
  }
  if (ran->exit_code != 0) {
    err << "lkctl slurm submit: sbatch exited " << ran->exit_code << ": " << ran->err;
    return 1;
  }
  // --parsable prints "JOBID" or "JOBID;CLUSTER".
  std::string id = ran->out.substr(0, ran->out.find_first_of(";\n"));
  if (id.empty()) {
    err << "lkctl slurm submit: sbatch printed no job id: " << ran->out << "\n";
    return 1;
  }
  out << id << "\n";
  return 0;
}

std::string TimeText(const std::optional<TimePoint>& t) {
  if (!t) return "none";
  return fmt::format("{}", std::chrono::duration_cast<std::chrono::seconds>(
                               t->time_since_epoch()).count());
}

int Env(CommandRunner& runner, std::ostream& out, std::ostream& err) {
  auto env = ParseSlurmEnv(ProcessEnv());
  if (!env.ok()) {
    err << "lkctl slurm env: " << env.status().message() << "\n";
    return 1;
  }
  if (Status s = FillEndTime(runner, &*env); !s.ok()) {
    err << "lkctl slurm env: end time unknown: " << s.message() << "\n";
  }
  if (Status s = ResolveNodes(runner, &*env); !s.ok()) {
    err << "lkctl slurm env: nodes unknown: " << s.message() << "\n";
  }
  std::string nodes;
  for (const auto& n : env->nodes) nodes += (nodes.empty() ? "" : ",") + n;
  out << "job_id=" << env->job_id << "\njob_ref=" << env->JobRef()
      << "\nrestart_count=" << env->restart_count << "\nnode_id=" << env->node_id
      << "\nnum_nodes=" << env->num_nodes << "\nnodes=" << nodes
      << "\npartition=" << env->partition << "\ncpus_on_node=" << env->cpus_on_node
      << "\nend_time=" << TimeText(env->end_time) << "\n";
  // The trainer's place in its group as the trainers read it when no --group-rank is given
  // (torchrun's variables first, then Slurm's task ones; common/task_place.h).
  auto place = TaskPlaceFromEnv(ProcessEnv());
  if (!place.ok()) {
    err << "lkctl slurm env: " << place.status().message() << "\n";
    return 1;
  }
  if (*place) {
    out << "group_rank=" << (*place)->rank << "\ngroup_size=" << (*place)->size
        << "\nlocal_rank="
        << ((*place)->local_rank ? std::to_string(*(*place)->local_rank) : std::string("none"))
        << "\nplace_from=" << (*place)->source << "\n";
  } else {
    out << "group_rank=none\n";
  }
  return 0;
}

int Leave(int argc, const char* const* argv, CommandRunner& runner, std::ostream& out,
          std::ostream& err) {
  std::string signal = "USR2";
  int64_t margin_s = 0;
  int64_t signal_before_s = 300;
  bool dry_run = false;
  Flags flags("lkctl slurm leave",
              "Inside a Slurm job, after a signal: decide the leave reason (preempted, "
              "time_limit, cancelled) as the replica_agent does, print it, and run scontrol "
              "requeue when the decision says so.");
  flags.Add("signal", &signal, "the signal received: USR2 (the warning) or TERM",
            "LK_SLURM_LEAVE_SIGNAL");
  flags.Add("signal-before-s", &signal_before_s, "the job's --signal warning seconds",
            "LK_SLURM_SIGNAL_BEFORE_S");
  flags.Add("margin-s", &margin_s, "time-limit margin (default: signal-before-s + 90)",
            "LK_SLURM_MARGIN_S");
  flags.Add("dry-run", &dry_run, "decide and print, do not requeue", "LK_SLURM_DRY_RUN");
  Status parsed = flags.Parse(argc, argv, 2);
  if (flags.help_requested()) {
    out << flags.Help();
    return 0;
  }
  auto setting = parsed.ok() ? ParseSignalSetting(signal) : Result<SignalSetting>(parsed);
  if (!setting.ok()) {
    err << "lkctl slurm leave: " << setting.status().message() << "\n";
    return 2;
  }
  EnvMap process_env = ProcessEnv();
  LeaveInput in;
  in.signal = setting->name == "TERM" ? LeaveSignal::kTerm : LeaveSignal::kWarning;
  in.in_slurm = InSlurm(process_env);
  in.now = std::chrono::system_clock::now();
  in.margin = flags.IsSet("margin-s")
                  ? std::chrono::seconds(margin_s)
                  : TimeLimitMargin(std::chrono::seconds(signal_before_s));
  Result<SlurmEnv> env = InvalidArgument("not in Slurm");
  if (in.in_slurm) {
    env = ParseSlurmEnv(process_env);
    if (!env.ok()) {
      err << "lkctl slurm leave: " << env.status().message() << "\n";
      return 1;
    }
    in.restart_count = env->restart_count;
    in.limit_end = env->end_time;
    auto job = QueryJob(runner, env->JobRef());
    if (job.ok()) in.job_now = *job;
    else err << "lkctl slurm leave: " << job.status().message() << "\n";
  }
  LeaveDecision d = ClassifyLeave(in);
  out << "reason=" << LeaveReasonName(d.reason) << " requeue=" << (d.requeue ? "true" : "false")
      << " why=\"" << d.why << "\"\n";
  if (!d.requeue || dry_run) return 0;
  if (Status s = Requeue(*env, runner); !s.ok()) {
    err << "lkctl slurm leave: " << s.message() << "\n";
    return 1;
  }
  out << "requeued=" << env->JobRef() << "\n";
  return 0;
}

}  // namespace

int RunSlurmCli(int argc, const char* const* argv, CommandRunner& runner, std::ostream& out,
                std::ostream& err) {
  std::string_view command = argc > 1 ? argv[1] : "";
  if (command == "script" || command == "submit") {
    ScriptOptions o;
    if (int rc = ParseScript(command, argc, argv, &o, out, err); rc >= 0) return rc;
    std::string script = GenerateBatchScript(o, ProcessEnv());
    if (command == "script") {
      out << script;
      return 0;
    }
    return Submit(script, runner, out, err);
  }
  if (command == "env") return Env(runner, out, err);
  if (command == "leave") return Leave(argc, argv, runner, out, err);
  if (command == "--help" || command == "-h" || command == "help") {
    out << kUsage;
    return 0;
  }
  err << (command.empty() ? "lkctl slurm: a command is required\n"
                          : fmt::format("lkctl slurm: unknown command '{}'\n", command))
      << kUsage;
  return 2;
}

int RunSlurmCli(int argc, const char* const* argv) {
  SubprocessRunner runner;
  return RunSlurmCli(argc, argv, runner, std::cout, std::cerr);
}

}  // namespace lk::slurm
