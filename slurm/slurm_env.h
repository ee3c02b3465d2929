// The Slurm side of a process's world: its job, array task, restart count, node and node list,
// and the job's times, parsed from the environment and from `scontrol show job`.
// Parsing is pure (tests feed fixed env maps and fixed scontrol lines); the few functions that
// read the process environment or run scontrol say so and take a CommandRunner.
// Thread-safety: the pure functions are safe from any thread; ProcessEnv() reads `environ`, so do
// not call it while another thread calls setenv().
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/status.h>
#include "slurm/command.h"

namespace lk::slurm {

using EnvMap = std::map<std::string, std::string>;
using TimePoint = std::chrono::system_clock::time_point;

struct SlurmEnv {
  int64_t job_id = 0;                  // SLURM_JOB_ID (older spelling SLURM_JOBID); required
  std::optional<int64_t> array_job_id;   // SLURM_ARRAY_JOB_ID, only in array tasks
  std::optional<int64_t> array_task_id;  // SLURM_ARRAY_TASK_ID, only in array tasks
  // SLURM_RESTART_COUNT: Slurm 22.05 sets it only after the first requeue, so absent means 0.
  int64_t restart_count = 0;
  int64_t node_id = 0;                   // SLURM_NODEID: this node's index in the allocation
  int64_t num_nodes = 0;                 // SLURM_JOB_NUM_NODES (SLURM_NNODES)
  std::optional<int64_t> num_tasks;      // SLURM_NTASKS: set only when the job asked for tasks
  std::optional<int64_t> proc_id;        // SLURM_PROCID: the task's rank, in steps
  std::optional<int64_t> local_id;       // SLURM_LOCALID: the task's rank on its node
  int64_t cpus_on_node = 0;              // SLURM_CPUS_ON_NODE
  std::string partition;                 // SLURM_JOB_PARTITION
  std::string job_name;                  // SLURM_JOB_NAME
  std::string cluster_name;              // SLURM_CLUSTER_NAME
  std::string node_name;                 // SLURMD_NODENAME: this node's Slurm name
  std::string node_list;                 // SLURM_JOB_NODELIST as Slurm wrote it
  std::vector<std::string> nodes;        // node_list expanded (empty while nodes_error says why)
  // Why node_list is not expanded (the parser refused it, or its count disagrees with
  // SLURM_JOB_NUM_NODES); empty when it is. Not an error of the whole environment: nothing that
  // decides a leave or a requeue needs the names, and ResolveNodes() asks Slurm itself.
  std::string nodes_error;
  // The job's end time: SLURM_JOB_END_TIME (Slurm 23.02+), else filled by FillEndTime().
  std::optional<TimePoint> end_time;

  bool IsArrayTask() const { return array_job_id.has_value() && array_task_id.has_value(); }
  // How Slurm's commands name this job: "ARRAYJOBID_TASKID" for array tasks (scontrol requeue
  // of the task's own id would requeue the wrong thing on some versions), else the job id.
  std::string JobRef() const;
};

// Parses the Slurm variables of `env`. Errors: not in a Slurm job (no SLURM_JOB_ID), a number
// that does not parse. A node list that the parser cannot expand, or whose count disagrees with
// the node count, leaves `nodes` empty and says why in `nodes_error` (ResolveNodes asks Slurm).
Result<SlurmEnv> ParseSlurmEnv(const EnvMap& env);

// Whether `env` belongs to a process inside a Slurm job (SLURM_JOB_ID is set).
bool InSlurm(const EnvMap& env);

// A Slurm duration ("30", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS"), as --time and
// scontrol's TimeLimit write it; nullopt for "UNLIMITED", "INFINITE" and "Partition_Limit".
Result<std::optional<std::chrono::seconds>> ParseSlurmDuration(std::string_view text);

// What `scontrol show job -o ID` says about a job, read with SLURM_TIME_FORMAT=%s so that times
// are epoch seconds and no time zone is involved.
struct JobInfo {
  std::string state;                               // JobState: RUNNING, COMPLETING, PENDING, ...
  int64_t restarts = 0;                            // Restarts: requeues so far
  std::optional<TimePoint> start_time;             // StartTime
  std::optional<TimePoint> end_time;               // EndTime
  std::optional<std::chrono::seconds> time_limit;  // TimeLimit; nullopt when unlimited

  // When the job's wall-time limit runs out: StartTime + TimeLimit when both are known, else
  // EndTime. Not EndTime first, because Slurm moves EndTime to now + GraceTime when it preempts
  // a job (seen on 22.05), which would make every preemption look like a time limit.
  std::optional<TimePoint> LimitEnd() const;
};

// Parses one line of `scontrol show job -o` output (space-separated Key=Value fields).
Result<JobInfo> ParseJobInfo(std::string_view scontrol_line);

// The id of one life of a replica group (see ARCHITECTURE.md, "incarnation"). In order:
//   1. LK_INCARNATION from `env`, which the generated batch script sets once per job start, so
//      that the agents on every node of a multi-node job agree on it;
//   2. in Slurm: "JOBREF.rRESTARTS.RANDOM" (e.g. "1234_7.r1.9f3a0c11");
//   3. elsewhere: "HOSTNAME.pPID.RANDOM".
// The random suffix keeps ids unique when job ids repeat (another cluster, a reset slurmctld).
// Pure: the caller supplies hostname, pid and the random value.
std::string MakeIncarnationId(const EnvMap& env, std::string_view hostname, int64_t pid,
                              uint32_t random);

// --- Shell: these read the process or run commands. ---

// This process's environment as a map.
EnvMap ProcessEnv();
// InSlurm(ProcessEnv()).
bool InSlurm();
// MakeIncarnationId with this process's environment, hostname, pid and a random value.
std::string NewIncarnationId();

// Runs `scontrol show job -o REF` (10 s bound). Errors: kNotFound when scontrol is not in PATH,
// kUnavailable when scontrol fails (message carries its stderr).
Result<JobInfo> QueryJob(CommandRunner& runner, std::string_view job_ref);

// Sets env->end_time from QueryJob() unless SLURM_JOB_END_TIME already did (Slurm 22.05 has no
// such variable). On error env is unchanged.
Status FillEndTime(CommandRunner& runner, SlurmEnv* env);

// Expands env->node_list the way Slurm does, by `scontrol show hostnames LIST` (10 s bound),
// which knows every syntax its version accepts; the parser's expansion (hostlist.h) stays when
// scontrol is missing or fails. Clears nodes_error when scontrol answered. Errors: neither could
// expand the list (env unchanged).
Status ResolveNodes(CommandRunner& runner, SlurmEnv* env);

}  // namespace lk::slurm
