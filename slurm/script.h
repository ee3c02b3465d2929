// The batch script of one replica group: what `lkctl slurm script` prints and `lkctl slurm
// submit` gives to sbatch. Pure: options and the submitting environment in, text out.
// Thread-safety: free functions on values, safe from any thread.
//
// The script, on each start (the first and every requeue):
//   1. sets the LK_* settings of the submitting environment and flags as exports, and one
//      LK_INCARNATION shared by the agents of all nodes;
//   2. starts one replica_agent per node (`srun --overlap --ntasks-per-node=1 ... &`), with its
//      node rank from SLURM_NODEID and a per-node socket DIR/lk-JOBID-NODEID.sock;
//   3. starts the trainers (`srun ... &`) with LK_AGENT_SOCKET set to that socket;
//   4. waits with `wait`, so the traps run at once: the warning signal (USR2, `--signal=B:USR2@S`)
//      is forwarded to the agent step, which drains the trainers, leaves and requeues the job;
//      SIGTERM is noted and otherwise ignored, because Slurm sends it after every requeue;
//   5. after the trainers exit, gives the agent a bounded time to exit on its own, and with
//      --requeue-on-crash requeues the job when the trainers failed with no signal (at most
//      --crash-requeues-max times).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/status.h>
#include "slurm/slurm_env.h"

namespace lk::slurm {

struct ScriptOptions {
  std::string job;         // the training run (lighthouse namespace); required
  std::string group_id;    // stable across requeues, e.g. "jupiter-0"; required
  std::string lighthouse;  // lighthouse URL, e.g. http://host:7070; required
  std::string token_file;  // the job token, a path readable on the compute nodes; optional
  int64_t nodes = 1;                   // nodes of the group
  int64_t tasks_per_node = 1;          // trainers per node (usually one per GPU)
  std::string gpus_per_node;           // "#SBATCH --gpus-per-node" when not empty
  std::string time;                    // wall-time limit in sbatch's --time syntax; required
  std::string partition;               // "#SBATCH --partition" when not empty
  std::string account;                 // "#SBATCH --account" when not empty
  // Warning seconds before the time limit: enough for a durable checkpoint and the leave.
  int64_t signal_before_s = 300;
  bool requeue_on_crash = false;       // requeue when the trainers fail with no signal
  // ...at most this many times over the group's lives (the lighthouse counts its crashes;
  // SLURM_RESTART_COUNT + 1 stands in when the lighthouse cannot answer)
  int64_t crash_requeues_max = 3;
  std::string job_name;                // default "lk-<group_id>"
  std::string output = "lk-%x-%j.out"; // sbatch --output; appended to across requeues
  std::string agent_bin = "replica_agent";
  std::string lkctl_bin = "lkctl";     // reports a crash to the lighthouse (--requeue-on-crash)
  std::string socket_dir = "/tmp";     // node-local directory for the agent's socket
  // A network interface (e.g. ib0): on each node the trainers' communicators bind to its IPv4
  // address (LK_BIND_HOST) and the agent serves peers there (--serve ADDRESS:0). Empty: the
  // trainers' and agent's own settings (127.0.0.1 by default: one host only).
  std::string bind_iface;
  int64_t agent_exit_wait_s = 60;      // after the trainers exit, before the agent is stopped
  std::vector<std::string> trainer;    // the trainer command; required

  // Errors name the flag: missing required values, values sbatch would misread in an #SBATCH
  // line (whitespace, quotes), a --time that does not parse or is not longer than the warning.
  Status Validate() const;
};

// Quotes `word` for bash: unchanged when it has only safe characters, else in single quotes.
std::string ShellQuote(std::string_view word);

// The batch script. `submit_env` is the submitting process's environment: its LK_* variables are
// exported in the script (flags in `options` win), except per-node ones the script sets itself,
// the submit-side LK_SLURM_* settings, and secrets (names ending in TOKEN), which are listed in a
// comment instead: give a token file. Call Validate() first.
std::string GenerateBatchScript(const ScriptOptions& options, const EnvMap& submit_env);

}  // namespace lk::slurm
