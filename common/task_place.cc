#include "common/task_place.h"

#include <charconv>

extern char** environ;

namespace lk {

namespace {

// The variable's value as a number, nullopt when it is not set.
Result<std::optional<uint32_t>> Number(const std::map<std::string, std::string>& env,
                                       const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::optional<uint32_t>();
  const std::string& v = it->second;
  uint32_t out = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
    return InvalidArgument("{}={} is not a rank or size (a number)", name, v);
  }
  return std::optional<uint32_t>(out);
}

Result<std::optional<TaskPlace>> From(const std::map<std::string, std::string>& env,
                                      const char* rank_var, const char* size_var,
                                      const char* local_var, const char* source) {
  LK_ASSIGN_OR_RETURN(auto rank, Number(env, rank_var));
  LK_ASSIGN_OR_RETURN(auto size, Number(env, size_var));
  LK_ASSIGN_OR_RETURN(auto local, Number(env, local_var));
  if (!rank && !size) return std::optional<TaskPlace>();
  if (!rank || !size) {
    return InvalidArgument("{} is set without {}: cannot place this trainer in its group",
                           rank ? rank_var : size_var, rank ? size_var : rank_var);
  }
  if (*size == 0 || *rank >= *size) {
    return InvalidArgument("{}={} is not below {}={}", rank_var, *rank, size_var, *size);
  }
  TaskPlace p;
  p.rank = *rank;
  p.size = *size;
  p.local_rank = local;
  p.source = source;
  return std::optional<TaskPlace>(p);
}

}  // namespace

Result<std::optional<TaskPlace>> TaskPlaceFromEnv(const std::map<std::string, std::string>& env) {
  LK_ASSIGN_OR_RETURN(auto torchrun, From(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun"));
  if (torchrun) return torchrun;
  return From(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm");
}

std::map<std::string, std::string> EnvironMap() {
  std::map<std::string, std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) out.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return out;
}

}  // namespace lk
