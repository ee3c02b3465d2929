#include "replica_agent/outbox.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace lk::agent {

std::string_view ReportKindName(ReportKind kind) {
  switch (kind) {
    case ReportKind::kCommit:
      return "commit";
    case ReportKind::kCheckpoint:
      return "checkpoint";
    case ReportKind::kLeave:
      return "leave";
  }
  return "unknown";
}

Outbox::Outbox(size_t max) : max_(std::max<size_t>(1, max)) {}

std::optional<Report> Outbox::Push(Report report) {
  report.seq = next_seq_++;
  std::optional<Report> dropped;
  if (reports_.size() >= max_) {
    auto oldest = std::find_if(reports_.begin(), reports_.end(),
                               [](const Report& r) { return r.kind != ReportKind::kLeave; });
    if (oldest == reports_.end()) {
      ++dropped_;
      return report;  // nothing but leaves: the newcomer is the one that cannot be kept
    }
    dropped = std::move(*oldest);
    Erase(oldest);
    ++dropped_;
  }
  ++held_[static_cast<size_t>(report.kind)];
  reports_.push_back(std::move(report));
  return dropped;
}

bool Outbox::Done(uint64_t seq) {
  // Usually the front; a report dropped meanwhile is not there at all.
  auto it = std::find_if(reports_.begin(), reports_.end(),
                         [seq](const Report& r) { return r.seq == seq; });
  if (it == reports_.end()) return false;
  Erase(it);
  return true;
}

bool Outbox::Contains(uint64_t seq) const {
  return std::any_of(reports_.begin(), reports_.end(),
                     [seq](const Report& r) { return r.seq == seq; });
}

void Outbox::Erase(std::deque<Report>::iterator it) {
  --held_[static_cast<size_t>(it->kind)];
  reports_.erase(it);
}

std::string Outbox::Summary() const {
  if (reports_.empty()) return "";
  uint32_t first = std::numeric_limits<uint32_t>::max(), last = 0;
  for (const Report& r : reports_) {
    if (r.kind != ReportKind::kCommit) continue;
    first = std::min(first, r.step);
    last = std::max(last, r.step);
  }
  std::string steps = held_[0] > 0 ? fmt::format("{}..{}", first, last) : "none";
  return fmt::format("commit={} steps={} checkpoint={} leave={}", held_[0], steps, held_[1],
                     held_[2]);
}

}  // namespace lk::agent
