// Where a trainer process sits in its replica group, from the launcher's environment, for when
// its flags do not say: torchrun's RANK / WORLD_SIZE / LOCAL_RANK first (torchrun inside a Slurm
// step sets them per process, while Slurm's name the step's task), then Slurm's SLURM_PROCID /
// SLURM_NTASKS / SLURM_LOCALID. One Slurm job (or one torchrun) per replica group is the layout
// the project's batch scripts use, so the launcher's rank is the rank inside the group.
// Pure: the caller hands the environment in (EnvironMap reads the process's).
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <lightkeeper/status.h>

namespace lk {

struct TaskPlace {
  uint32_t rank = 0;                     // rank inside the group
  uint32_t size = 1;                     // trainers in the group
  std::optional<uint32_t> local_rank;    // rank on this node (picks the device), if known
  std::string source;                    // "torchrun" or "slurm", for the start-up log line
};

// The place the environment gives, nullopt when it names none (neither launcher's variables are
// set). A variable that is set but not a number, or a rank not below the size, is an error
// naming the variable: a trainer must not guess its rank.
Result<std::optional<TaskPlace>> TaskPlaceFromEnv(const std::map<std::string, std::string>& env);

// This process's environment as a map.
std::map<std::string, std::string> EnvironMap();

}  // namespace lk
