#include "slurm/script.h"

#include <set>

namespace lk::slurm {
namespace {

// Variables the script sets per node or per start, so a value from the submitting shell would
// be wrong on the compute nodes.
const std::set<std::string, std::less<>> kNotExported = {
    "LK_NODE_RANK", "LK_SOCKET", "LK_AGENT_SOCKET", "LK_NODES", "LK_INCARNATION", "LK_AGENT_BIN",
};

// The agent's socket on each node, expanded there. The restart count makes it new in every life
// of the job, so a trainer never finds the socket of the previous life's agent.
constexpr std::string_view kSocketName =
    "lk-$SLURM_JOB_ID-r${SLURM_RESTART_COUNT:-0}-$SLURM_NODEID.sock";
// How long a trainer waits for its agent's socket before it starts anyway (and fails to connect).
constexpr int kSocketWaitS = 60;

bool IsShellName(std::string_view name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

bool IsSecretName(std::string_view name) { return name.ends_with("TOKEN"); }

// sbatch splits "#SBATCH" lines itself and stops at '#', so values with whitespace, quotes or
// '#' would be misread; they are refused rather than quoted.
Status CheckSbatchValue(std::string_view flag, std::string_view value) {
  for (char c : value) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == '"' || c == '\'' || c == '#' ||
        c == '\\' || std::iscntrl(static_cast<unsigned char>(c))) {
      return InvalidArgument("--{} '{}': whitespace, quotes, '#' and '\\' are not allowed", flag,
                             value);
    }
  }
  return Status::Ok();
}

std::string JobName(const ScriptOptions& o) {
  return o.job_name.empty() ? "lk-" + o.group_id : o.job_name;
}

std::string QuoteAll(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) {
    if (!out.empty()) out += ' ';
    out += ShellQuote(w);
  }
  return out;
}

// Bash functions and traps shared by every script. Kept free of generated values.
constexpr std::string_view kPrelude = R"lk(set -u
lk_log() { echo "$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ) I lk_batch $*" >&2; }
# Array tasks are requeued as ARRAYJOBID_TASKID.
lk_job_ref=$SLURM_JOB_ID
if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then lk_job_ref=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}; fi
# One incarnation per start of the job, the same on every node (the agents read it).
export LK_INCARNATION="${lk_job_ref}.r${SLURM_RESTART_COUNT:-0}.$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
lk_warned=0
lk_termed=0
lk_agent_pid=
# The warning goes to the agent step: srun forwards USR2 to its tasks unchanged.
lk_on_warning() {
  lk_warned=1
  lk_log "event=warning_signal job=$lk_job_ref forward_to_agent_pid=${lk_agent_pid:-none}"
  if [ -n "$lk_agent_pid" ]; then kill -USR2 "$lk_agent_pid" 2>/dev/null || lk_log "event=forward_failed"; fi
}
# Slurm sends SIGTERM after every requeue and at the end of a job; the steps get it from Slurm
# directly, so the batch shell only notes it and keeps waiting for them.
lk_on_term() {
  lk_termed=1
  lk_log "event=sigterm job=$lk_job_ref"
}
trap lk_on_warning USR2
trap lk_on_term TERM
# Waits for pid $1 across trap interruptions (wait returns >128 when a trap ran); its status.
lk_wait() {
  local rc
  while :; do
    wait "$1"; rc=$?
    if [ "$rc" -le 128 ]; then return "$rc"; fi
    if ! kill -0 "$1" 2>/dev/null; then
      wait "$1"; local again=$?
      if [ "$again" -ne 127 ]; then rc=$again; fi
      return "$rc"
    fi
  done
}
)lk";

}  // namespace

std::string ShellQuote(std::string_view word) {
  bool safe = !word.empty();
  for (char c : word) {
    if (!std::isalnum(static_cast<unsigned char>(c)) &&
        std::string_view("_-./:=@%+,").find(c) == std::string_view::npos) {
      safe = false;
    }
  }
  if (safe) return std::string(word);
  std::string out = "'";
  for (char c : word) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

Status ScriptOptions::Validate() const {
  if (job.empty()) return InvalidArgument("--job (LK_JOB) is required");
  if (group_id.empty()) return InvalidArgument("--group-id (LK_GROUP_ID) is required");
  if (lighthouse.empty()) return InvalidArgument("--lighthouse (LK_LIGHTHOUSE) is required");
  if (time.empty()) return InvalidArgument("--time is required (sbatch syntax, e.g. 04:00:00)");
  if (trainer.empty()) return InvalidArgument("the trainer command is required after '--'");
  if (nodes < 1) return InvalidArgument("--nodes {} must be at least 1", nodes);
  if (tasks_per_node < 1) {
    return InvalidArgument("--tasks-per-node {} must be >= 1", tasks_per_node);
  }
  if (signal_before_s < 0 || signal_before_s > 65535) {
    return InvalidArgument("--signal-before-s {} is not 0..65535", signal_before_s);
  }
  if (crash_requeues_max < 0) return InvalidArgument("--crash-requeues-max must be >= 0");
  if (agent_exit_wait_s < 0) return InvalidArgument("--agent-exit-wait-s must be >= 0");
  if (agent_bin.empty()) return InvalidArgument("--agent-bin must not be empty");
  if (lkctl_bin.empty()) return InvalidArgument("--lkctl-bin must not be empty");
  for (char c : bind_iface) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.' &&
        c != ':' && c != '@') {
      return InvalidArgument("--bind-iface '{}' is not an interface name", bind_iface);
    }
  }
  if (bind_iface.size() > 15) {
    return InvalidArgument("--bind-iface '{}' is longer than an interface name can be", bind_iface);
  }
  if (socket_dir.empty() || socket_dir[0] != '/') {
    return InvalidArgument("--socket-dir '{}' must be an absolute path", socket_dir);
  }
  LK_RETURN_IF_ERROR(CheckSbatchValue("time", time));
  LK_RETURN_IF_ERROR(CheckSbatchValue("partition", partition));
  LK_RETURN_IF_ERROR(CheckSbatchValue("account", account));
  LK_RETURN_IF_ERROR(CheckSbatchValue("gpus-per-node", gpus_per_node));
  LK_RETURN_IF_ERROR(CheckSbatchValue("job-name", JobName(*this)));
  LK_RETURN_IF_ERROR(CheckSbatchValue("output", output));
  auto limit = ParseSlurmDuration(time);
  if (!limit.ok()) return limit.status().WithContext("--time");
  if (*limit && limit->value().count() <= signal_before_s) {
    return InvalidArgument(
        "--time {} is not longer than --signal-before-s {}: the warning would "
        "come at the start",
        time, signal_before_s);
  }
  return Status::Ok();
}

std::string GenerateBatchScript(const ScriptOptions& o, const EnvMap& submit_env) {
  std::string s = "#!/bin/bash\n";
  s += fmt::format("# Lightkeeper replica group {} of job {}, written by `lkctl slurm script`.\n",
                   o.group_id, o.job);
  s += "# Each start (the first and every requeue) runs one replica_agent per node, then the\n"
       "# trainers; the warning signal makes the agent drain, leave and requeue the job.\n";
  s += "#SBATCH --job-name=" + JobName(o) + "\n";
  s += fmt::format("#SBATCH --nodes={}\n", o.nodes);
  s += fmt::format("#SBATCH --ntasks-per-node={}\n", o.tasks_per_node);
  s += "#SBATCH --time=" + o.time + "\n";
  if (!o.partition.empty()) s += "#SBATCH --partition=" + o.partition + "\n";
  if (!o.account.empty()) s += "#SBATCH --account=" + o.account + "\n";
  if (!o.gpus_per_node.empty()) s += "#SBATCH --gpus-per-node=" + o.gpus_per_node + "\n";
  s += "#SBATCH --requeue\n";
  s += fmt::format("#SBATCH --signal=B:USR2@{}\n", o.signal_before_s);
  s += "#SBATCH --open-mode=append\n";
  s += "#SBATCH --output=" + o.output + "\n\n";

  // Exports: the submitting environment's LK_* first, then the flags on top.
  EnvMap exports;
  std::vector<std::string> secrets;
  for (const auto& [name, value] : submit_env) {
    if (!name.starts_with("LK_") || !IsShellName(name)) continue;
    if (name.starts_with("LK_SLURM_") || kNotExported.contains(name)) continue;
    if (IsSecretName(name)) {
      secrets.push_back(name);
      continue;
    }
    exports[name] = value;
  }
  exports["LK_JOB"] = o.job;
  exports["LK_GROUP_ID"] = o.group_id;
  exports["LK_LIGHTHOUSE"] = o.lighthouse;
  if (!o.token_file.empty()) exports["LK_TOKEN_FILE"] = o.token_file;
  s += "# Lightkeeper settings: the submitting environment's LK_* variables and the flags.\n";
  for (const auto& [name, value] : exports) s += "export " + name + "=" + ShellQuote(value) + "\n";
  for (const auto& name : secrets) {
    s += "# not exported: " + name + " (a secret; use --token-file instead)\n";
  }
  s += "\n";
  s += kPrelude;

  // The node's address on --bind-iface, found on each node by its step. An interface without an
  // IPv4 address ends the step with the reason.
  std::string iface_addr;
  if (!o.bind_iface.empty()) {
    s += "\n# --bind-iface: each step finds its node's IPv4 address on the interface.\n";
    s += "export LK_BIND_IFACE=" + ShellQuote(o.bind_iface) + "\n";
    iface_addr =
        "a=$(ip -o -4 addr show dev \"$LK_BIND_IFACE\" 2>/dev/null | "
        "sed -n \"s|.* inet \\([0-9.]*\\)/.*|\\1|p\" | head -n 1); "
        "if [ -z \"$a\" ]; then echo \"lk: no IPv4 address on $LK_BIND_IFACE on $(hostname)\" "
        ">&2; exit 1; fi; ";
  }
  const std::string dir = ShellQuote(o.socket_dir);
  s += "\nlk_log \"event=start job=$lk_job_ref restart_count=${SLURM_RESTART_COUNT:-0} "
       "nodes=$SLURM_JOB_NUM_NODES incarnation=$LK_INCARNATION\"\n";
  s += "# One agent per node. --overlap: it shares the CPUs with the trainer step instead of\n"
       "# holding them. Its node rank and socket are per node, so they are expanded there.\n";
  s += "srun --overlap --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks=\"$SLURM_JOB_NUM_NODES\" "
       "--ntasks-per-node=1 --kill-on-bad-exit=0 \\\n";
  s += "  bash -c 'd=$1; shift; " + iface_addr + "exec \"$@\" " +
       (o.bind_iface.empty() ? "" : "--serve \"$a:0\" ") +
       "--node-rank \"$SLURM_NODEID\" --socket \"$d/" + std::string(kSocketName) +
       "\"' lk-agent " + dir + " \\\n";
  // The agent tells a time limit from a preemption by how far the limit is: it needs the same
  // warning lead as the #SBATCH --signal line.
  s += "  " + ShellQuote(o.agent_bin) + fmt::format(" --signal-before-s {}", o.signal_before_s) +
       " --lighthouse \"$LK_LIGHTHOUSE\" --job \"$LK_JOB\" --group-id \"$LK_GROUP_ID\" "
       "--nodes \"$SLURM_JOB_NUM_NODES\"";
  if (!o.token_file.empty()) s += " --token-file \"$LK_TOKEN_FILE\"";
  s += " &\nlk_agent_pid=$!\n\n";

  s += fmt::format(
      "# The trainers, {} per node; a failed task ends the step so no peer hangs. They ignore\n"
      "# USR2 (exec keeps an ignored signal ignored): `scancel --signal=USR2 JOB` sends it to\n"
      "# every step's tasks, and its default action would kill a trainer. The agent tells them\n"
      "# to drain instead. Both steps start together: a trainer waits (up to {} s) for its\n"
      "# agent's socket, which is new in every life of the job.\n",
      o.tasks_per_node, kSocketWaitS);
  s += fmt::format(
      "srun --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks-per-node={0} "
      "--ntasks=$((SLURM_JOB_NUM_NODES * {0})) --kill-on-bad-exit=1 \\\n",
      o.tasks_per_node);
  s += "  bash -c 'trap \"\" USR2; d=$1; shift; " + iface_addr +
       (o.bind_iface.empty() ? "" : "export LK_BIND_HOST=\"$a\"; ") +
       "export LK_AGENT_SOCKET=\"$d/" +
       std::string(kSocketName) + "\"; " +
       fmt::format(
           "for _ in $(seq 1 {}); do [ -S \"$LK_AGENT_SOCKET\" ] && break; sleep 0.1; done; ",
           kSocketWaitS * 10) +
       "exec \"$@\"' lk-trainer " + dir + " \\\n";
  s += "  " + QuoteAll(o.trainer) + " &\n";
  s += "lk_trainer_pid=$!\n";
  s += "lk_wait \"$lk_trainer_pid\"; lk_trainer_rc=$?\n";
  s += "lk_log \"event=trainers_exited rc=$lk_trainer_rc warned=$lk_warned termed=$lk_termed\"\n\n";

  s += "# The agent exits by itself once its trainers are gone (after leaving, and after the\n"
       "# requeue when warned); stop it when it does not within the bound.\n";
  s += fmt::format(
      "for _ in $(seq 1 {}); do kill -0 \"$lk_agent_pid\" 2>/dev/null || break; sleep 0.1; done\n",
      o.agent_exit_wait_s * 10);
  s += "if kill -0 \"$lk_agent_pid\" 2>/dev/null; then\n";
  s += fmt::format("  lk_log \"event=agent_stopped reason=still_running_after_{}s\"\n",
                   o.agent_exit_wait_s);
  s += "  kill -TERM \"$lk_agent_pid\" 2>/dev/null\n";
  s += "fi\n\n";

  if (o.requeue_on_crash) {
    const std::string lkctl =
        ShellQuote(o.lkctl_bin) + " --lighthouse \"$LK_LIGHTHOUSE\"" +
        (o.token_file.empty() ? "" : " --token-file \"$LK_TOKEN_FILE\"") +
        " event \"$LK_JOB\" \"$LK_GROUP_ID\" \"$LK_INCARNATION\"";
    s += fmt::format(
        "# --requeue-on-crash: trainers that failed with no signal requeue the job, at most {0}\n"
        "# times over the group's lives so that a trainer that always crashes does not loop\n"
        "# forever. The lighthouse counts the group's crashes (requeues for the time limit or a\n"
        "# preemption never count); only when it cannot answer does the restart count stand in.\n"
        "if [ \"$lk_trainer_rc\" -ne 0 ] && [ \"$lk_warned\" = 0 ] && "
        "[ \"$lk_termed\" = 0 ]; then\n"
        "  lk_crashes=$({1} trainer_crashed \"rc=$lk_trainer_rc\" 2>/dev/null "
        "| sed -n 's/^crashes=\\([0-9][0-9]*\\).*/\\1/p')\n"
        "  lk_counted_by=lighthouse\n"
        "  if [ -z \"$lk_crashes\" ]; then\n"
        "    lk_crashes=$(( ${{SLURM_RESTART_COUNT:-0}} + 1 )); lk_counted_by=restart_count\n"
        "  fi\n"
        "  if [ \"$lk_crashes\" -le {0} ]; then\n"
        "    lk_log \"event=trainer_crashed rc=$lk_trainer_rc crashes=$lk_crashes "
        "counted_by=$lk_counted_by action=requeue job=$lk_job_ref\"\n"
        "    # slurmctld may be busy or restarting: a bounded retry, none for a refusal that stays.\n"
        "    lk_try=0; lk_wait_s=5\n"
        "    while [ \"$lk_try\" -lt 4 ]; do\n"
        "      lk_try=$((lk_try + 1))\n"
        "      if lk_out=$(scontrol requeue \"$lk_job_ref\" 2>&1); then\n"
        "        lk_log \"event=requeued job=$lk_job_ref attempts=$lk_try\"; exit 0\n"
        "      fi\n"
        "      lk_out=$(printf '%s' \"$lk_out\" | tr '\\n\"' \"  \")\n"
        "      lk_log \"event=requeue_failed job=$lk_job_ref attempt=$lk_try error=\\\"$lk_out\\\"\"\n"
        "      case \"$lk_out\" in *\"presently disabled\"*|*\"Invalid job id\"*|*\"permission denied\"*) break ;; esac\n"
        "      [ \"$lk_try\" -lt 4 ] && sleep \"$lk_wait_s\"; lk_wait_s=$((lk_wait_s * 2))\n"
        "    done\n"
        "    lk_log \"event=requeue_refused job=$lk_job_ref attempts=$lk_try\"\n"
        "    {1} requeue_refused \"scontrol: $lk_out\" >/dev/null 2>&1 || "
        "lk_log \"event=event_report_failed event=requeue_refused\"\n"
        "  else\n"
        "    lk_log \"event=trainer_crashed rc=$lk_trainer_rc crashes=$lk_crashes "
        "counted_by=$lk_counted_by action=exit reason=crash_requeues_max_{0}\"\n"
        "  fi\n"
        "fi\n",
        o.crash_requeues_max, lkctl);
  }
  s += "exit \"$lk_trainer_rc\"\n";
  return s;
}

}  // namespace lk::slurm
