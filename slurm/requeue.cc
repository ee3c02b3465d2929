#include "slurm/requeue.h"

#include <algorithm>
#include <csignal>
#include <cstdlib>

namespace lk::slurm {
namespace {

std::string Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  return std::string(s);
}

// Seconds as an integer for log text.
int64_t Secs(std::chrono::system_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::seconds>(d).count();
}

}  // namespace

std::string_view LeaveReasonName(LeaveReason reason) {
  switch (reason) {
    case LeaveReason::kPreempted: return "preempted";
    case LeaveReason::kTimeLimit: return "time_limit";
    case LeaveReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

std::chrono::seconds TimeLimitMargin(std::chrono::seconds signal_before) {
  // Slurm checks the --signal times every 30 s and may send the warning up to 60 s early; the
  // extra 30 s covers a slow scontrol answer.
  return signal_before + std::chrono::seconds(90);
}

LeaveDecision ClassifyLeave(const LeaveInput& in) {
  const bool warning = in.signal == LeaveSignal::kWarning;
  if (!in.in_slurm) {
    if (warning) return {LeaveReason::kPreempted, false, "warning signal outside Slurm"};
    return {LeaveReason::kCancelled, false, "SIGTERM outside Slurm"};
  }
  std::optional<TimePoint> limit_end = in.limit_end;
  if (in.job_now && in.job_now->LimitEnd()) limit_end = in.job_now->LimitEnd();
  if (limit_end && *limit_end - in.now <= in.margin) {
    return {LeaveReason::kTimeLimit, true,
            fmt::format("time limit in {} s, within the margin of {} s", Secs(*limit_end - in.now),
                        in.margin.count())};
  }
  std::string limit_text =
      limit_end ? fmt::format("time limit in {} s", Secs(*limit_end - in.now)) : "no time limit";
  if (warning) {
    return {LeaveReason::kPreempted, true, "warning signal with " + limit_text};
  }
  if (in.job_now && in.job_now->restarts > in.restart_count) {
    return {LeaveReason::kPreempted, false,
            fmt::format("SIGTERM after Slurm requeued the job (Restarts {} -> {})",
                        in.restart_count, in.job_now->restarts)};
  }
  if (in.job_now && in.job_now->state == "RUNNING") {
    return {LeaveReason::kPreempted, true, "SIGTERM while the job is RUNNING, " + limit_text};
  }
  if (in.job_now) {
    return {LeaveReason::kCancelled, false,
            fmt::format("SIGTERM with the job {}, {}", in.job_now->state, limit_text)};
  }
  return {LeaveReason::kCancelled, false, "SIGTERM and scontrol did not answer, " + limit_text};
}

std::vector<std::string> RequeueArgv(const SlurmEnv& env) {
  return {"scontrol", "requeue", env.JobRef()};
}

Status Requeue(const SlurmEnv& env, CommandRunner& runner) {
  Command cmd;
  cmd.argv = RequeueArgv(env);
  cmd.block_job_signals = true;
  cmd.timeout = std::chrono::seconds(30);
  const std::string context = fmt::format("requeue job {}", env.JobRef());
  auto ran = runner.Run(cmd);
  if (!ran.ok()) {
    if (ran.status().code() == Code::kNotFound) {
      return ran.status().WithContext(
          context + " (Slurm's client commands must be on PATH on the compute nodes)");
    }
    return ran.status().WithContext(context);
  }
  if (ran->exit_code == 0) return Status::Ok();
  std::string reason = Trim(ran->err.empty() ? ran->out : ran->err);
  std::string hint;
  // These refusals will be the same on a retry: kPermissionDenied (requeue disabled, not the
  // owner) and kNotFound (the job is gone). Any other (slurmctld busy or restarting, a socket
  // timeout) may pass later: kConflict.
  Code code = Code::kPermissionDenied;
  if (reason.find("presently disabled") != std::string::npos) {
    hint = " (was the job submitted with --no-requeue, or is JobRequeue=0?)";
  } else if (reason.find("Invalid job id") != std::string::npos) {
    hint = " (the job is gone)";
    code = Code::kNotFound;
  } else if (reason.find("Access/permission denied") != std::string::npos) {
    hint = " (only the job's owner or an operator may requeue it)";
  } else {
    code = Code::kConflict;
  }
  return Error(code, "{}: Slurm refused (scontrol exit {}): {}{}", context, ran->exit_code,
               reason, hint);
}

bool RequeueRetryable(const Status& st) {
  return !st.ok() && st.code() != Code::kNotFound && st.code() != Code::kPermissionDenied;
}

Status RequeueWithRetry(const SlurmEnv& env, CommandRunner& runner, const RetryPolicy& policy,
                        const std::function<void(std::chrono::seconds)>& sleep, int* attempts) {
  Status st;
  std::chrono::seconds wait = policy.first_wait;
  int made = 0;
  while (true) {
    ++made;
    st = Requeue(env, runner);
    if (st.ok() || !RequeueRetryable(st) || made >= std::max(1, policy.attempts)) break;
    sleep(wait);
    wait *= 2;
  }
  if (attempts) *attempts = made;
  return st;
}

Status Requeue(const SlurmEnv& env) {
  SubprocessRunner runner;
  return Requeue(env, runner);
}

std::string SignalSetting::ToString() const {
  std::string out = batch_only ? "B:" + name : name;
  if (before) out += fmt::format("@{}", before->count());
  return out;
}

Result<SignalSetting> ParseSignalSetting(std::string_view text) {
  SignalSetting s;
  std::string_view rest = text;
  if (rest.starts_with("B:") || rest.starts_with("b:")) {
    s.batch_only = true;
    rest.remove_prefix(2);
  } else if (rest.find(':') != std::string_view::npos) {
    return InvalidArgument("signal setting '{}': only the 'B:' prefix is supported", text);
  }
  std::string_view name = rest.substr(0, rest.find('@'));
  if (rest.find('@') != std::string_view::npos) {
    std::string secs(rest.substr(rest.find('@') + 1));
    char* end = nullptr;
    long v = std::strtol(secs.c_str(), &end, 10);
    // sbatch keeps the time in 16 bits.
    if (secs.empty() || *end != '\0' || v < 0 || v > 65535) {
      return InvalidArgument("signal setting '{}': '@{}' is not 0..65535 seconds", text, secs);
    }
    s.before = std::chrono::seconds(v);
  }
  std::string upper;
  for (char c : name) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper.starts_with("SIG")) upper = upper.substr(3);
  if (upper == "USR1" || upper == std::to_string(SIGUSR1)) {
    s.signo = SIGUSR1;
    s.name = "USR1";
  } else if (upper == "USR2" || upper == std::to_string(SIGUSR2)) {
    s.signo = SIGUSR2;
    s.name = "USR2";
  } else if (upper == "TERM" || upper == std::to_string(SIGTERM)) {
    s.signo = SIGTERM;
    s.name = "TERM";
  } else {
    return InvalidArgument("signal setting '{}': unknown signal '{}' (use USR1, USR2 or TERM)",
                           text, name);
  }
  return s;
}

}  // namespace lk::slurm
