// lk_checkpoint_tool: the `checkpoint` commands on their own (lkctl embeds the same library).
#include "checkpoint/cli.h"

int main(int argc, char** argv) {
  // Present the command as "checkpoint ..." whatever the binary is called.
  const char* name = "checkpoint";
  argv[0] = const_cast<char*>(name);
  return lk::ckpt::RunCheckpointCli(argc, argv);
}
