// LighthouseCore: a group's lives across its incarnations (POST /v1/event and the crash count of
// a leave). What a Slurm batch script needs to bound crash requeues lives here, in the job's
// record, because nothing on the compute nodes survives a requeue and the group's own record is
// collected while the requeued job waits in the queue.
#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_state.h"

namespace lk::lighthouse {

std::string_view GroupEventName(GroupEventKind kind) {
  switch (kind) {
    case GroupEventKind::kTrainerCrashed: return "trainer_crashed";
    case GroupEventKind::kRequeueRefused: return "requeue_refused";
  }
  return "";
}

std::optional<GroupEventKind> ParseGroupEvent(std::string_view name) {
  for (GroupEventKind k : {GroupEventKind::kTrainerCrashed, GroupEventKind::kRequeueRefused}) {
    if (name == GroupEventName(k)) return k;
  }
  return std::nullopt;
}

bool LighthouseCore::Impl::CountCrash(Job& job, const std::string& group_id,
                                      const std::string& incarnation) {
  GroupLivesData& l = job.lives[group_id];
  l.group_id = group_id;
  auto& seen = l.crashed_incarnations;
  if (std::find(seen.begin(), seen.end(), incarnation) != seen.end()) return false;
  seen.push_back(incarnation);
  if (seen.size() > kCrashedLivesKept) seen.erase(seen.begin());
  if (l.crashes < UINT32_MAX) ++l.crashes;
  return true;
}

Result<GroupLivesData> LighthouseCore::OnGroupEvent(const GroupEventInput& in, TimePoint now,
                                                    Effects* fx) {
  Impl& s = *impl_;
  LK_RETURN_IF_ERROR(s.CheckIds(in.job, in.group_id, in.incarnation));
  if (in.detail.size() > s.options.text_bytes_max) {
    return InvalidArgument("detail longer than {} bytes", s.options.text_bytes_max);
  }
  auto j = s.jobs.find(in.job);
  if (j == s.jobs.end()) {
    return Refuse(Code::kNotFound, Reason::kUnknownJob, "unknown job {}", in.job);
  }
  Impl::Job& job = j->second;
  // Any life of the group may report, also one the lighthouse never heard of: a life whose
  // trainers crash before its agent's first heartbeat (a bad import, a missing file) is the
  // crash loop the cap is for. The report is taken on the launcher's word, which holds the
  // job's token.
  if (!job.lives.contains(in.group_id) && job.lives.size() >= s.options.groups_per_job_max) {
    return Refuse(Code::kResourceExhausted, Reason::kGroupsMax,
                  "job {} already records the lives of {} groups", in.job, job.lives.size());
  }
  s.ApplyTimeouts(now, fx);
  bool changed = true;
  GroupLivesData& l = job.lives[in.group_id];
  l.group_id = in.group_id;
  switch (in.kind) {
    case GroupEventKind::kTrainerCrashed:
      changed = s.CountCrash(job, in.group_id, in.incarnation);
      break;
    case GroupEventKind::kRequeueRefused:
      if (l.requeue_refusals < UINT32_MAX) ++l.requeue_refusals;
      l.last_event = fmt::format("requeue_refused: {}", in.detail);
      break;
  }
  fx->events.push_back(fmt::format(
      "group_event job={} group={} incarnation={} event={} detail={} crashes={} "
      "requeue_refusals={} counted={}",
      Q(in.job), Q(in.group_id), Q(in.incarnation), GroupEventName(in.kind), Q(in.detail),
      l.crashes, l.requeue_refusals, changed));
  // Synced with the job's record: a count the launcher acted on is never forgotten.
  if (changed) fx->persist_jobs.push_back(s.Record(job));
  return l;
}

}  // namespace lk::lighthouse
