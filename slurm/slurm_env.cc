#include "slurm/slurm_env.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <random>
#include <sstream>

#include "slurm/hostlist.h"

extern char** environ;

namespace lk::slurm {
namespace {

const std::string* Find(const EnvMap& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

Result<int64_t> ParseCount(std::string_view name, std::string_view text) {
  std::string s(text);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || errno != 0 || *end != '\0' || v < 0) {
    return InvalidArgument("{}='{}' is not a non-negative integer", name, text);
  }
  return static_cast<int64_t>(v);
}

// Reads an optional integer variable; absent stays nullopt.
Status ReadOptional(const EnvMap& env, const char* name, std::optional<int64_t>* out) {
  if (const std::string* v = Find(env, name)) {
    LK_ASSIGN_OR_RETURN(int64_t n, ParseCount(name, *v));
    *out = n;
  }
  return Status::Ok();
}

Status ReadInto(const EnvMap& env, const char* name, int64_t* out) {
  std::optional<int64_t> v;
  LK_RETURN_IF_ERROR(ReadOptional(env, name, &v));
  if (v) *out = *v;
  return Status::Ok();
}

std::string ReadString(const EnvMap& env, const char* name) {
  const std::string* v = Find(env, name);
  return v == nullptr ? "" : *v;
}

// A TimePoint counts nanoseconds in 64 bits (about 292 years either side of 1970). Times are
// bounded where they are read so that a time, and a time plus the longest duration below, always
// fit: Slurm's own times are 32-bit (its INFINITE is 2^32 - 1).
constexpr int64_t kEpochSecondsMax = 4'294'967'295;
constexpr int64_t kDurationSecondsMax = int64_t{100} * 365 * 24 * 3600;

Result<std::optional<TimePoint>> ParseEpoch(std::string_view name, std::string_view text) {
  // scontrol writes "Unknown" or "None" when there is no such time (a pending job's end).
  if (text == "Unknown" || text == "None" || text == "N/A") return std::optional<TimePoint>();
  LK_ASSIGN_OR_RETURN(int64_t secs, ParseCount(name, text));
  if (secs > kEpochSecondsMax) {
    return InvalidArgument("{}='{}' is beyond {} seconds since 1970", name, text, kEpochSecondsMax);
  }
  return std::optional<TimePoint>(TimePoint(std::chrono::seconds(secs)));
}

}  // namespace

std::string SlurmEnv::JobRef() const {
  if (IsArrayTask()) return fmt::format("{}_{}", *array_job_id, *array_task_id);
  return fmt::format("{}", job_id);
}

bool InSlurm(const EnvMap& env) { return Find(env, "SLURM_JOB_ID") != nullptr; }

Result<SlurmEnv> ParseSlurmEnv(const EnvMap& env) {
  SlurmEnv s;
  const std::string* job = Find(env, "SLURM_JOB_ID");
  if (job == nullptr) job = Find(env, "SLURM_JOBID");
  if (job == nullptr) return InvalidArgument("not in a Slurm job: SLURM_JOB_ID is not set");
  LK_ASSIGN_OR_RETURN(s.job_id, ParseCount("SLURM_JOB_ID", *job));
  LK_RETURN_IF_ERROR(ReadOptional(env, "SLURM_ARRAY_JOB_ID", &s.array_job_id));
  LK_RETURN_IF_ERROR(ReadOptional(env, "SLURM_ARRAY_TASK_ID", &s.array_task_id));
  if (s.array_job_id.has_value() != s.array_task_id.has_value()) {
    return InvalidArgument("SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID must be set together");
  }
  LK_RETURN_IF_ERROR(ReadInto(env, "SLURM_RESTART_COUNT", &s.restart_count));
  LK_RETURN_IF_ERROR(ReadInto(env, "SLURM_NODEID", &s.node_id));
  LK_RETURN_IF_ERROR(ReadInto(env, "SLURM_NNODES", &s.num_nodes));
  LK_RETURN_IF_ERROR(ReadInto(env, "SLURM_JOB_NUM_NODES", &s.num_nodes));
  LK_RETURN_IF_ERROR(ReadOptional(env, "SLURM_NTASKS", &s.num_tasks));
  LK_RETURN_IF_ERROR(ReadOptional(env, "SLURM_PROCID", &s.proc_id));
  LK_RETURN_IF_ERROR(ReadOptional(env, "SLURM_LOCALID", &s.local_id));
  LK_RETURN_IF_ERROR(ReadInto(env, "SLURM_CPUS_ON_NODE", &s.cpus_on_node));
  s.partition = ReadString(env, "SLURM_JOB_PARTITION");
  s.job_name = ReadString(env, "SLURM_JOB_NAME");
  s.cluster_name = ReadString(env, "SLURM_CLUSTER_NAME");
  s.node_name = ReadString(env, "SLURMD_NODENAME");
  s.node_list = ReadString(env, "SLURM_JOB_NODELIST");
  if (s.node_list.empty()) s.node_list = ReadString(env, "SLURM_NODELIST");
  if (!s.node_list.empty()) {
    // A list the parser refuses must not make the whole environment unusable: that would turn
    // the agent's requeues off for a syntax only Slurm knows. The names wait for ResolveNodes.
    auto nodes = ExpandHostlist(s.node_list);
    if (!nodes.ok()) {
      s.nodes_error = nodes.status().WithContext("SLURM_JOB_NODELIST").message();
    } else if (s.num_nodes != 0 && s.num_nodes != static_cast<int64_t>(nodes->size())) {
      s.nodes_error = fmt::format("SLURM_JOB_NUM_NODES={} but SLURM_JOB_NODELIST='{}' names {} nodes",
                                  s.num_nodes, s.node_list, nodes->size());
    } else {
      s.nodes = std::move(nodes).value();
      if (s.num_nodes == 0) s.num_nodes = static_cast<int64_t>(s.nodes.size());
    }
  }
  if (s.num_nodes > 0 && s.node_id >= s.num_nodes) {
    return InvalidArgument("SLURM_NODEID={} is not below the node count {}", s.node_id,
                           s.num_nodes);
  }
  if (const std::string* end = Find(env, "SLURM_JOB_END_TIME")) {
    LK_ASSIGN_OR_RETURN(s.end_time, ParseEpoch("SLURM_JOB_END_TIME", *end));
  }
  return s;
}

Result<std::optional<std::chrono::seconds>> ParseSlurmDuration(std::string_view text) {
  using Out = std::optional<std::chrono::seconds>;
  if (text == "UNLIMITED" || text == "INFINITE" || text == "infinite" || text == "unlimited" ||
      text == "Partition_Limit") {
    return Out();
  }
  auto bad = [&] {
    return InvalidArgument(
        "time '{}' is not MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS", text);
  };
  int64_t days = 0;
  std::string_view rest = text;
  bool has_days = false;
  if (size_t dash = text.find('-'); dash != std::string_view::npos) {
    auto d = ParseCount("days", text.substr(0, dash));
    if (!d.ok()) return bad();
    days = *d;
    has_days = true;
    rest = text.substr(dash + 1);
  }
  std::vector<int64_t> parts;
  size_t start = 0;
  while (true) {
    size_t colon = rest.find(':', start);
    auto part = ParseCount("time", rest.substr(start, colon - start));
    if (!part.ok() || parts.size() == 3) return bad();
    parts.push_back(*part);
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  int64_t h = 0, m = 0, s = 0;
  if (has_days) {
    h = parts[0];  // D-HH, D-HH:MM, D-HH:MM:SS
    if (parts.size() > 1) m = parts[1];
    if (parts.size() > 2) s = parts[2];
  } else if (parts.size() == 1) {
    m = parts[0];  // MM
  } else if (parts.size() == 2) {
    m = parts[0];  // MM:SS
    s = parts[1];
  } else {
    h = parts[0];
    m = parts[1];
    s = parts[2];
  }
  // Each part bounded first, so that the sum cannot overflow; then the sum.
  if (days > 365 * 100 || h > 24 * 365 * 100 || m > 60 * 24 * 365 * 100 ||
      s > kDurationSecondsMax) {
    return bad();
  }
  int64_t total = ((days * 24 + h) * 60 + m) * 60 + s;
  if (total > kDurationSecondsMax) return bad();
  return Out(std::chrono::seconds(total));
}

std::optional<TimePoint> JobInfo::LimitEnd() const {
  if (start_time && time_limit) return *start_time + *time_limit;
  return end_time;
}

Result<JobInfo> ParseJobInfo(std::string_view line) {
  JobInfo info;
  bool has_state = false;
  size_t i = 0;
  while (i < line.size()) {
    size_t end = line.find_first_of(" \n", i);
    if (end == std::string_view::npos) end = line.size();
    std::string_view field = line.substr(i, end - i);
    i = end + 1;
    size_t eq = field.find('=');
    if (eq == std::string_view::npos) continue;  // a value with spaces spilled over
    std::string_view key = field.substr(0, eq);
    std::string_view value = field.substr(eq + 1);
    if (key == "JobState") {
      info.state = std::string(value);
      has_state = true;
    } else if (key == "Restarts") {
      LK_ASSIGN_OR_RETURN(info.restarts, ParseCount("Restarts", value));
    } else if (key == "StartTime") {
      LK_ASSIGN_OR_RETURN(info.start_time, ParseEpoch("StartTime", value));
    } else if (key == "EndTime") {
      LK_ASSIGN_OR_RETURN(info.end_time, ParseEpoch("EndTime", value));
    } else if (key == "TimeLimit") {
      auto limit = ParseSlurmDuration(value);
      if (!limit.ok()) return limit.status().WithContext("TimeLimit");
      info.time_limit = *limit;
    }
  }
  if (!has_state) {
    return InvalidArgument("scontrol output has no JobState field: '{}'", line.substr(0, 200));
  }
  return info;
}

std::string MakeIncarnationId(const EnvMap& env, std::string_view hostname, int64_t pid,
                              uint32_t random) {
  if (const std::string* set = Find(env, "LK_INCARNATION")) return *set;
  auto slurm = ParseSlurmEnv(env);
  if (slurm.ok()) {
    return fmt::format("{}.r{}.{:08x}", slurm->JobRef(), slurm->restart_count, random);
  }
  return fmt::format("{}.p{}.{:08x}", hostname.empty() ? "host" : hostname, pid, random);
}

EnvMap ProcessEnv() {
  EnvMap env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view entry(*e);
    size_t eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

bool InSlurm() { return InSlurm(ProcessEnv()); }

std::string NewIncarnationId() {
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::random_device rd;
  return MakeIncarnationId(ProcessEnv(), host, ::getpid(), rd());
}

Result<JobInfo> QueryJob(CommandRunner& runner, std::string_view job_ref) {
  Command cmd;
  cmd.argv = {"scontrol", "show", "job", "-o", std::string(job_ref)};
  cmd.env = {{"SLURM_TIME_FORMAT", "%s"}};
  cmd.timeout = std::chrono::seconds(10);
  auto ran = runner.Run(cmd);
  if (!ran.ok()) return ran.status().WithContext(fmt::format("query job {}", job_ref));
  if (ran->exit_code != 0) {
    return Error(Code::kUnavailable, "query job {}: scontrol exited {}: {}", job_ref,
                 ran->exit_code, ran->err.empty() ? ran->out : ran->err);
  }
  auto info = ParseJobInfo(ran->out);
  if (!info.ok()) return info.status().WithContext(fmt::format("query job {}", job_ref));
  return info;
}

Status ResolveNodes(CommandRunner& runner, SlurmEnv* env) {
  if (env->node_list.empty()) return Status::Ok();
  Command cmd;
  cmd.argv = {"scontrol", "show", "hostnames", env->node_list};
  cmd.timeout = std::chrono::seconds(10);
  auto ran = runner.Run(cmd);
  std::string why;
  if (!ran.ok()) {
    why = ran.status().message();
  } else if (ran->exit_code != 0) {
    why = fmt::format("scontrol exited {}: {}", ran->exit_code, ran->err.empty() ? ran->out : ran->err);
  } else {
    std::vector<std::string> nodes;
    std::istringstream lines(ran->out);
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty()) nodes.push_back(line);
    }
    if (env->num_nodes != 0 && env->num_nodes != static_cast<int64_t>(nodes.size())) {
      why = fmt::format("scontrol names {} nodes, SLURM_JOB_NUM_NODES={}", nodes.size(),
                        env->num_nodes);
    } else if (nodes.empty()) {
      why = "scontrol named no node";
    } else {
      env->nodes = std::move(nodes);
      env->nodes_error.clear();
      if (env->num_nodes == 0) env->num_nodes = static_cast<int64_t>(env->nodes.size());
      return Status::Ok();
    }
  }
  if (env->nodes_error.empty()) return Status::Ok();  // the parser's expansion stands
  return Error(Code::kUnavailable, "node list '{}': {}; scontrol show hostnames: {}",
               env->node_list, env->nodes_error, why);
}

Status FillEndTime(CommandRunner& runner, SlurmEnv* env) {
  if (env->end_time) return Status::Ok();
  LK_ASSIGN_OR_RETURN(JobInfo info, QueryJob(runner, env->JobRef()));
  env->end_time = info.LimitEnd();
  return Status::Ok();
}

}  // namespace lk::slurm
