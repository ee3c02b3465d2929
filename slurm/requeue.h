// What a replica_agent does with Slurm when its job is told to go: decide why it is leaving
// (the reason it reports to the lighthouse and whether to requeue), requeue the job with
// `scontrol requeue`, and parse signal settings such as "B:USR2@120".
// ClassifyLeave and ParseSignalSetting are pure; Requeue runs scontrol through a CommandRunner.
// Thread-safety: free functions; Requeue is safe from any thread (it only runs a child).
//
// What Slurm 22.05 does (seen on the local Slurm, see slurm/README.md):
//   - warning (`--signal=B:USR2@S`): the batch shell gets USR2 S..S+60 s before the time limit;
//     with SlurmctldParameters=preempt_send_user_signal also when the job is preempted.
//   - preemption (PreemptMode=REQUEUE): USR2 at once, while EndTime jumps to now + GraceTime;
//     SIGTERM at the end of GraceTime, when scontrol already shows Restarts + 1.
//   - scancel: SIGTERM while the job is already COMPLETING.
//   - `scontrol requeue`: SIGTERM to every step moments later; the agent must ignore it.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/status.h>
#include "slurm/command.h"
#include "slurm/slurm_env.h"

namespace lk::slurm {

enum class LeaveReason { kPreempted, kTimeLimit, kCancelled };
// "preempted", "time_limit", "cancelled": the names the lighthouse's /v1/leave reports.
std::string_view LeaveReasonName(LeaveReason reason);

enum class LeaveSignal {
  kWarning,  // the --signal warning (USR2), forwarded by the batch script to the agent step
  kTerm,     // SIGTERM (or SIGINT) with no warning before it
};

struct LeaveInput {
  LeaveSignal signal = LeaveSignal::kWarning;
  bool in_slurm = false;
  // When the wall-time limit runs out: SlurmEnv::end_time from start-up, used when `job_now`
  // is absent.
  std::optional<TimePoint> limit_end;
  // QueryJob() at the signal, when scontrol answered: its LimitEnd(), state and restarts win.
  std::optional<JobInfo> job_now;
  int64_t restart_count = 0;  // SlurmEnv::restart_count: this life's SLURM_RESTART_COUNT
  TimePoint now;
  // A limit end at most this far ahead means the time limit is what is ending the job. Slurm
  // sends the warning S..S+60 s early, so use at least S + 60 s; see TimeLimitMargin().
  std::chrono::seconds margin{0};
};

struct LeaveDecision {
  LeaveReason reason = LeaveReason::kCancelled;
  bool requeue = false;  // whether the agent should run Requeue() after leaving
  std::string why;       // one sentence for the log line
};

// The margin for a job whose warning comes `signal_before` ahead of its limit.
std::chrono::seconds TimeLimitMargin(std::chrono::seconds signal_before);

// Rules, in order:
//   1. Outside Slurm: SIGTERM is `cancelled`; a warning is `preempted`; nothing to requeue.
//   2. Limit end within `margin` of now: `time_limit`, requeue.
//   3. Warning: `preempted`, requeue (Slurm sends the warning early only at preemption).
//   4. SIGTERM and scontrol shows more restarts than this life began with: Slurm is already
//      requeueing it (preemption without a warning): `preempted`, no requeue of our own.
//   5. SIGTERM while the job is still RUNNING: Slurm is taking the node away (preemption):
//      `preempted`, requeue.
//   6. Any other SIGTERM (COMPLETING after scancel, or scontrol did not answer): `cancelled`,
//      no requeue, because requeueing a job a person cancelled would undo their decision.
LeaveDecision ClassifyLeave(const LeaveInput& in);

// The command that requeues this job: {"scontrol", "requeue", "ARRAYJOBID_TASKID" or "JOBID"}.
std::vector<std::string> RequeueArgv(const SlurmEnv& env);

// Runs RequeueArgv (30 s bound). Errors: kNotFound when scontrol is not in PATH,
// kPermissionDenied when Slurm refuses for good (requeue disabled, no permission), kNotFound
// also when the job is gone, and kConflict for another refusal (the message has scontrol's reason and a hint),
// kDeadlineExceeded on timeout.
// Slurm sends SIGTERM to the job right after an accepted requeue: ignore it.
Status Requeue(const SlurmEnv& env, CommandRunner& runner);
// Whether a failed Requeue may pass on a retry: not when scontrol is missing or the job is gone
// (kNotFound) or Slurm's refusal stays (kPermissionDenied: requeue disabled for the job, not
// its owner); yes on a timeout or another refusal (kConflict: slurmctld busy, ...).
bool RequeueRetryable(const Status& st);

struct RetryPolicy {
  int attempts = 4;                          // Requeue calls at most, the first included
  std::chrono::seconds first_wait{5};        // before the second call; doubled after each
};

// Requeue, retried while RequeueRetryable, at most policy.attempts calls, with `sleep` between
// them (a parameter so that tests do not wait). The last call's status; *attempts (when given)
// the calls made.
Status RequeueWithRetry(const SlurmEnv& env, CommandRunner& runner, const RetryPolicy& policy,
                        const std::function<void(std::chrono::seconds)>& sleep,
                        int* attempts = nullptr);

// Requeue with a SubprocessRunner.
Status Requeue(const SlurmEnv& env);

// A signal setting as sbatch's --signal spells it: "[B:]SIG[@SECONDS]", SIG one of USR1, USR2,
// TERM (with or without "SIG", any case). Other signals are refused: KILL cannot be caught, and
// the agent handles only these.
struct SignalSetting {
  int signo = 0;
  std::string name;         // "USR1", "USR2" or "TERM"
  bool batch_only = false;  // "B:": only the batch shell gets it, not the job steps
  std::optional<std::chrono::seconds> before;  // "@S": seconds before the time limit

  // "B:USR2@120", as written after sbatch's --signal=.
  std::string ToString() const;
};
Result<SignalSetting> ParseSignalSetting(std::string_view text);

}  // namespace lk::slurm
