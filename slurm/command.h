// Running Slurm's client commands (squeue, scontrol, sbatch) as child processes, behind an
// interface so that the code deciding what to run and how to read the answer is tested with a
// fake runner and fixed outputs.
// Thread-safety: SubprocessRunner keeps no state; Run() may be called from several threads. It
// waits for its own child with waitpid(pid), so it needs SIGCHLD not set to SIG_IGN.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <lightkeeper/status.h>

namespace lk::slurm {

struct CommandResult {
  int exit_code = 0;  // 128 + signal when the child was killed by a signal
  std::string out;
  std::string err;
};

struct Command {
  std::vector<std::string> argv;           // argv[0] is looked up in PATH
  std::map<std::string, std::string> env;  // set on top of this process's environment
  std::string stdin_text;                  // written to the child's stdin, then closed
  // When the timeout passes the child is killed with SIGKILL, whatever its signal mask.
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  // Start the child with TERM, INT, HUP, USR1 and USR2 blocked. Only for a command that must
  // finish even when Slurm signals the whole job step around it (scontrol requeue: a client
  // killed half way would report an accepted requeue as a failure). Off by default: a child
  // that inherits blocked signals cannot be ended by `timeout` or any SIGTERM-based bound it
  // starts itself, and the blocked set would pass on to every grandchild.
  bool block_job_signals = false;
};

class CommandRunner {
 public:
  virtual ~CommandRunner() = default;
  // Runs the command to completion. A child that exits non-zero is a CommandResult, not an error;
  // errors are: kNotFound when argv[0] is not in PATH, kDeadlineExceeded when the timeout passed
  // (the child is killed), kInternal when the process could not be started.
  virtual Result<CommandResult> Run(const Command& command) = 0;
};

// Runs commands with posix_spawnp. The child gets default dispositions and an empty signal mask,
// whatever the parent's (the agent blocks the Slurm signals in its own threads), or the job
// signals blocked when the command asks for it (Command::block_job_signals).
class SubprocessRunner : public CommandRunner {
 public:
  Result<CommandResult> Run(const Command& command) override;
};

}  // namespace lk::slurm
