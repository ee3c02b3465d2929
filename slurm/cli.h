// `lkctl slurm ...`: the Slurm subcommands of the command-line tool.
//   slurm script  [flags] -- TRAINER...   print the batch script of one replica group
//   slurm submit  [flags] -- TRAINER...   sbatch that script; print the job id
//   slurm env                             print the Slurm environment as this process sees it
//   slurm leave   --signal USR2|TERM      classify a leave inside a job and requeue when due
// Thread-safety: call from the main thread; it reads the environment and writes stdout/stderr.
#pragma once

#include <ostream>

#include "slurm/command.h"

namespace lk::slurm {

// argv[0] is "slurm", argv[1] the subcommand. Returns the process exit status: 0 on success,
// 1 when the command failed, 2 for bad usage.
int RunSlurmCli(int argc, const char* const* argv);

// The same with the runner and streams given, for tests.
int RunSlurmCli(int argc, const char* const* argv, CommandRunner& runner, std::ostream& out,
                std::ostream& err);

}  // namespace lk::slurm
