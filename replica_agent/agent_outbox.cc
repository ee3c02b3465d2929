// The agent's reports to the lighthouse: the outbox thread that delivers commits, failure
// reports, checkpoint registrations and the leave in order, retrying while the lighthouse is
// away, and the leave that waits for them (outbox.h holds the pure container).
#include <algorithm>

#include "replica_agent/agent_impl.h"

namespace lk::agent {

namespace {

// Answers that are worth a retry: the lighthouse is away, overloaded or restarting. Any other
// answer is its judgement of the report (taken, or refused with a reason) and final.
bool Retryable(const Status& st) {
  switch (st.code()) {
    case Code::kUnavailable:
    case Code::kDeadlineExceeded:
    case Code::kResourceExhausted:
    case Code::kInternal:
      return true;
    default:
      return false;
  }
}

const char* PathOf(ReportKind kind) {
  switch (kind) {
    case ReportKind::kCommit: return "/v1/commit";
    case ReportKind::kCheckpoint: return "/v1/checkpoints";
    case ReportKind::kLeave: return "/v1/leave";
  }
  return "/";
}

// Other leaves than a finished group's wait at most this long for the lighthouse: a signal's
// leave has the scheduler's kill behind it, and a failed group's next life replaces this one
// anyway.
constexpr Millis kQuickLeaveWait{5'000};

}  // namespace

Status Agent::Impl::Deliver(http::Client& client, const Report& r) {
  auto resp = client.Do("POST", PathOf(r.kind), r.body, http::kProtoType, Millis(5000));
  Status st = resp.ok() ? http::StatusFromResponse(*resp) : resp.status();
  if (!st.ok() || r.kind != ReportKind::kCommit) return st;
  pb::CommitResponse c;
  if (http::Decode(resp->body, http::BodyFormat(resp->content_type), &c).ok() && c.diverged()) {
    LK_LOG_WARN("state_diverged step={}", r.step);
  }
  return st;
}

void Agent::Impl::QueueReport(Report r) {
  if (auto dropped = outbox.Push(std::move(r))) {
    LK_LOG_WARN("outbox_dropped kind={} step={} quorum_id={} outbox_max={} dropped={}",
                ReportKindName(dropped->kind), dropped->step, dropped->quorum_id, outbox.max(),
                outbox.dropped());
  }
  Wake();
}

void Agent::Impl::OutboxLoop() {
  auto client = LighthouseClient();
  int failures = 0;
  while (!stopping) {
    Report r;
    if (!AwaitOnIo([&] {
          if (outbox.empty()) return false;
          r = outbox.front();
          return true;
        })) {
      return;
    }
    Status st = Deliver(*client, r);
    // Cancelled by the agent's exit: the report stays undelivered (and is logged as such).
    if (stopping) return;
    std::optional<bool> delivered = OnIo([&] { return Delivered(r, st, &failures); });
    if (!delivered) return;
    // The lighthouse is away: the report stays first in line; trainers go on meanwhile.
    if (!*delivered) SleepUnlessStopping(Backoff(failures));
  }
}

bool Agent::Impl::Delivered(const Report& r, const Status& st, int* failures) {
  if (Retryable(st)) {
    if (!outbox_failing) {
      outbox_failing = true;
      Wake();  // a checkpoint registration waiting on the outbox queues instead
    }
    // Once per outage, under the event names the agent has always used for these calls.
    if ((*failures)++ == 0) {
      switch (r.kind) {
        case ReportKind::kCommit:
          LK_LOG_WARN("commit_failed step={} error={} pending={}", r.step, Q(st.ToString()),
                      outbox.size());
          break;
        case ReportKind::kCheckpoint:
          LK_LOG_WARN("checkpoint_registration_failed step={} error={} pending={}", r.step,
                      Q(st.ToString()), outbox.size());
          break;
        case ReportKind::kLeave:
          LK_LOG_WARN("leave_failed attempt=0 error={} pending={}", Q(st.ToString()),
                      outbox.size());
          break;
      }
    }
    return false;
  }
  if (*failures > 0) {
    LK_LOG_INFO("outbox_delivering after_failures={} pending={}", *failures, outbox.size());
    *failures = 0;
  }
  outbox_failing = false;
  outbox.Done(r.seq);
  ++outbox_delivered;
  switch (r.kind) {
    case ReportKind::kCommit:
      // A commit for a superseded quorum is moot: the next quorum carries the steps.
      if (!st.ok()) {
        LK_LOG_WARN("commit_refused step={} quorum_id={} error={}", r.step, r.quorum_id,
                    Q(st.ToString()));
      }
      break;
    case ReportKind::kCheckpoint:
      if (st.ok()) {
        LK_LOG_INFO("checkpoint_registered step={} late=true", r.step);
      } else {
        LK_LOG_WARN("checkpoint_refused step={} error={}", r.step, Q(st.ToString()));
      }
      break;
    case ReportKind::kLeave:
      LK_LOG_INFO("left reason={} result={}", core->state().drain_reason, Q(st.ToString()));
      break;
  }
  Wake();  // an ask ahead waits for the commits, a leave for itself
  if (r.kind == ReportKind::kCommit && st.reason() == Reason::kJobFinished) {
    // The job finished and this group is in a catch-up quorum that could not bring it to the
    // final step: no quorum will ever take its steps, so it leaves instead of waiting.
    Effects fx;
    core->OnJobFinished(&fx);
    Apply(std::move(fx));
  } else if (st.reason() == Reason::kGroupFinished) {
    // Another node of this group left it finished before this node's report got there.
    Effects fx;
    core->OnGroupFinished(st.message(), &fx);
    Apply(std::move(fx));
  }
  return true;
}

void Agent::Impl::SendLeave(const std::string& reason) {
  pb::LeaveRequest leave;
  leave.set_job(options.job);
  leave.set_group_id(options.group_id);
  leave.set_incarnation(options.incarnation);
  leave.set_reason(reason);
  leave.set_generation(generation.load());
  const Millis bound = reason == "finished"
                           ? options.final_report_timeout
                           : std::min(options.final_report_timeout, kQuickLeaveWait);
  const auto start = std::chrono::steady_clock::now();
  std::optional<uint64_t> queued = OnIo([&] {
    Report r;
    r.kind = ReportKind::kLeave;
    r.step = core->state().committed_step;
    r.body = leave.SerializeAsString();
    QueueReport(std::move(r));
    return outbox.pushed();
  });
  if (!queued) return;
  const uint64_t seq = *queued;
  auto left = [&] { return !outbox.Contains(seq); };  // on the io thread
  auto pending = [&] { return OnIo([&] { return outbox.size(); }).value_or(0); };
  auto summary = [&] { return OnIo([&] { return outbox.Summary(); }).value_or(""); };
  // With the lighthouse there, the leave is in within a round trip or a few; the wait is worth
  // a line only once the lighthouse is found away.
  AwaitOnIo([&] { return left() || outbox_failing; }, start + std::min(bound, Millis(1000)));
  if (OnIo(left).value_or(true)) return;
  // The lighthouse is away or has reports to take first: a finished group stays until its
  // final commit and its leave are in (or the bound passes); a signal shortens the wait.
  LK_LOG_INFO("final_reports_waiting reason={} pending={} bound_ms={} {}", reason, pending(),
              bound.count(), summary());
  bool done = false;
  while (!done && !stopping) {
    auto deadline = start + (signalled ? std::min(bound, kQuickLeaveWait) : bound);
    if (std::chrono::steady_clock::now() >= deadline) break;
    // A signal moves the deadline: look again at least every 200 ms.
    done = AwaitOnIo(left, std::min(deadline, std::chrono::steady_clock::now() + Millis(200)));
  }
  if (done || OnIo(left).value_or(false)) {
    LK_LOG_INFO("final_reports_delivered reason={} waited_ms={}", reason,
                ToMillis(std::chrono::steady_clock::now() - start));
    return;
  }
  LK_LOG_WARN("final_reports_undelivered reason={} waited_ms={} bound_ms={} signalled={} {}",
              reason, ToMillis(std::chrono::steady_clock::now() - start), bound.count(),
              signalled.load(), summary());
}

}  // namespace lk::agent
