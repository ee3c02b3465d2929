// The agent's outbox: every report the node owes the lighthouse (commits and failure reports,
// durable-checkpoint registrations, the leave), in the order the node made them, kept until the
// lighthouse took or refused each one. A lighthouse that is away when a run ends (or restarts
// in the middle of one) then still learns how the run went: the agent delivers what it kept, in
// order, when the lighthouse answers again.
//
// The rule it keeps: reports leave in the order they came, one at a time (the lighthouse judges
// a commit against the one before it, and a leave must come after the group's last commit).
// The outbox is bounded; past the bound the oldest report that is not a leave is dropped (and
// returned, so that the agent logs it): a newer report says more than an older one (a later
// commit moves the record further), and the leave is the group's last word.
//
// Pure: no I/O, no clock, no threads. Thread-safety: none; the agent holds it under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>

namespace lk::agent {

enum class ReportKind : uint8_t { kCommit, kCheckpoint, kLeave };

// "commit", "checkpoint", "leave" (for log lines).
std::string_view ReportKindName(ReportKind kind);

struct Report {
  ReportKind kind = ReportKind::kCommit;
  uint32_t step = 0;       // the committed step, or the checkpoint's; a leave: the node's step
  uint32_t quorum_id = 0;  // the quorum a commit names
  bool failed = false;     // a failure report (a commit with failed=true)
  std::string body;        // the request as the agent sends it (serialized protobuf)
  uint64_t seq = 0;        // set by Push: the report's place in the node's order
};

class Outbox {
 public:
  // `max` reports at most (at least 1).
  explicit Outbox(size_t max);

  // Appends `report` and returns the report dropped to keep the bound, if any: the oldest one
  // that is not a leave, or `report` itself when every kept report is a leave.
  std::optional<Report> Push(Report report);

  bool empty() const { return reports_.empty(); }
  size_t size() const { return reports_.size(); }
  size_t max() const { return max_; }
  // The next report to deliver. Only when !empty().
  const Report& front() const { return reports_.front(); }
  // The report `seq` was delivered or refused: it leaves the outbox. False when it is no longer
  // there (dropped past the bound while it was on its way).
  bool Done(uint64_t seq);
  // Whether report `seq` still waits.
  bool Contains(uint64_t seq) const;
  // Whether a report of `kind` waits.
  bool Holds(ReportKind kind) const { return held_[static_cast<size_t>(kind)] > 0; }
  // What waits, for a log line: "commit=3 steps=38..40 checkpoint=0 leave=1" (empty: nothing).
  std::string Summary() const;

  uint64_t pushed() const { return next_seq_ - 1; }
  uint64_t dropped() const { return dropped_; }

 private:
  void Erase(std::deque<Report>::iterator it);

  size_t max_;
  std::deque<Report> reports_;
  size_t held_[3] = {0, 0, 0};
  uint64_t next_seq_ = 1;
  uint64_t dropped_ = 0;
};

}  // namespace lk::agent
