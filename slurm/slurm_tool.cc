// lk_slurm_tool: `lk_slurm_tool slurm ...` runs the Slurm subcommands of lkctl on their own, so
// tests (and job scripts) can use them before lkctl links them in.
#include "slurm/cli.h"

int main(int argc, char** argv) {
  if (argc < 2) return lk::slurm::RunSlurmCli(1, argv);
  // Drop our own program name: RunSlurmCli expects argv[0] == "slurm".
  return lk::slurm::RunSlurmCli(argc - 1, argv + 1);
}
