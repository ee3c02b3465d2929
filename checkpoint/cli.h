// `checkpoint` commands as a library, so lkctl (and lk_checkpoint_tool) can run them:
//   checkpoint inspect DIR [--json]          the manifest, for people or as JSON
//   checkpoint verify DIR                    every checksum and every shard's layout
//   checkpoint reshard DIR --ranks N --out ROOT2   writes ROOT2/step-S for N ranks
//   checkpoint serve DIR [--listen ADDR] [--prefix P]   a ShardServer, until SIGINT/SIGTERM
// DIR is a checkpoint directory (holding MANIFEST) or a root (its newest complete checkpoint).
// Exit codes: 0 ok, 1 damage or failure (the message names the file), 2 usage.
// Thread-safety: call from one thread; `serve` installs SIGINT/SIGTERM handlers while it runs.
#pragma once

namespace lk::ckpt {

// argv[0] is "checkpoint"; argv[1] the command.
int RunCheckpointCli(int argc, const char* const* argv);

}  // namespace lk::ckpt
