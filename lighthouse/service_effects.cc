// Applies the core's effects in the order the core promises: persist (synced when a quorum_id
// passes the reservation), then answers and rejections, metrics, watch wake-ups, log events; and
// keeps one timer armed at the core's next deadline.
#include "lighthouse/service_impl.h"

namespace lk::lighthouse {

void Service::Impl::ApplyEffects(Effects& fx) {
  Persist(fx);
  TimePoint now = Now();
  std::map<std::string, TimePoint> round_start;
  std::map<const void*, std::shared_ptr<const std::string>> members_wire;
  for (auto& [key, answer] : fx.answers) {
    auto it = quorum_waiters.find(key);
    if (it == quorum_waiters.end()) continue;
    auto [rs, inserted] = round_start.emplace(key.job, it->second.since);
    if (!inserted && it->second.since < rs->second) rs->second = it->second.since;
    AnswerQuorumWaiter(it, QuorumReply(answer, it->second.format, it->second.compact, &members_wire));
  }
  for (auto& [key, status] : fx.rejections) {
    auto it = quorum_waiters.find(key);
    if (it == quorum_waiters.end()) continue;
    AnswerQuorumWaiter(it, http::ErrorReply(status, it->second.format));
  }
  for (const auto& issued : fx.issued) {
    metrics.CountQuorum(issued.job, issued.changed);
    if (auto rs = round_start.find(issued.job); rs != round_start.end()) {
      metrics.ObserveFormation(now - rs->second);
    }
    if (issued.changed) {
      GcKv(issued.job, issued.quorum_id);
      fx.watch_wakeups.insert(issued.job);
    }
  }
  for (const auto& job : fx.divergences) metrics.CountDivergence(job);
  for (const auto& job : fx.watch_wakeups) WakeWatchers(job);
  // State changes at info; the per-step routine (every ask, every unchanged re-issue) at
  // debug, so that a healthy run logs a line per membership change, not per group and step.
  for (const auto& e : fx.events) {
    bool routine = e.rfind("quorum_ask ", 0) == 0 ||
                   (e.rfind("quorum_issued ", 0) == 0 && e.find(" changed=false") != std::string::npos) ||
                   e.rfind("quorum_wait ", 0) == 0 || e.rfind("commit ", 0) == 0;
    if (routine) LK_LOG_DEBUG("{}", e);
    else LK_LOG_INFO("{}", e);
  }
  ArmTick();
}
void Service::Impl::Persist(Effects& fx) {
  if (fx.persist_jobs.empty() && fx.persist_checkpoints.empty() && fx.forget_jobs.empty() &&
      fx.drop_checkpoints.empty() && fx.persist_groups.empty() && fx.drop_groups.empty()) {
    return;
  }
  // Only an id beyond the job's synced reservation (and checkpoint registrations, and
  // forgetting a job) must reach the disk before anyone hears of it: the record then reserves
  // the next quorum_id_block ids, synced. Everything else rides along unsynced, which survives
  // a process kill; a machine crash can lose it, but never lets an id be handed out twice,
  // because a restart continues above the synced reservation.
  // Group records carry generations and retired incarnations: synced, so that a restart
  // never hands a generation out twice nor revives a replaced life (they change only when a
  // group starts a new life or leaves, not per step).
  bool sync = !fx.persist_checkpoints.empty() || !fx.forget_jobs.empty() ||
              !fx.persist_groups.empty();
  for (auto& j : fx.persist_jobs) {
    uint32_t& reserved = reserved_quorum_id[j.job];
    if (j.quorum_id > reserved) {
      uint64_t top = uint64_t{j.quorum_id} + std::max<uint32_t>(options.quorum_id_block, 1) - 1;
      reserved = static_cast<uint32_t>(std::min<uint64_t>(top, UINT32_MAX));
      sync = true;
    }
    j.quorum_id_reserved = reserved;
  }
  Status st = store->Apply(fx.persist_jobs, fx.persist_checkpoints, fx.forget_jobs,
                           fx.persist_groups, fx.drop_groups, sync);
  // A lighthouse that cannot persist must not answer: it stops, and a restart resumes from
  // what was synced. Answering would hand out a quorum_id that a restart could reissue.
  LK_CHECK(st.ok()) << "persist failed: " << st.ToString();
  for (const auto& job : fx.forget_jobs) {
    reserved_quorum_id.erase(job);
    kv.erase(job);
    metrics.ForgetJob(job);
  }
  for (const auto& c : fx.drop_checkpoints) {
    // Registry entries pushed out by newer ones; a failure only leaves a stale record that
    // the next start's Load bounds again.
    if (Status ds = store->DeleteCheckpoint(c.job, c.step); !ds.ok()) {
      LK_LOG_WARN("checkpoint_drop_failed job={} step={} error={}", c.job, c.step, Q(ds.ToString()));
    }
  }
}
// One issue answers every member with the same member list: in binary protobuf the list is
// encoded once and appended to each answer's own fields (concatenated protobuf encodings
// merge, and repeated fields append), instead of n encodings of n members.
Response Service::Impl::QuorumReply(
    const QuorumAnswer& answer, Format f, bool compact,
    std::map<const void*, std::shared_ptr<const std::string>>* members_wire) {
  pb::QuorumResponse resp;
  bool shared_tail = f == Format::kProto && answer.members_shared;
  if (!answer.members_shared || (!compact && !shared_tail)) {
    ToProto(answer, &resp);
    return http::Reply(resp, f);
  }
  // The member's own fields; the members follow as donors only (compact) or as a shared tail.
  const auto& members = *answer.members_shared;
  QuorumAnswer own = answer;
  own.members_shared.reset();
  own.members.clear();
  ToProto(own, &resp);
  resp.set_replica_world_size(static_cast<uint32_t>(members.size()));
  AddGroupSizes(answer, members, &resp);
  if (compact) {
    for (uint32_t r : answer.source_ranks) {
      if (r < members.size()) ToProto(members[r], resp.add_sources());
    }
    return http::Reply(resp, f);
  }
  auto [it, fresh] = members_wire->emplace(&members, nullptr);
  if (fresh) {
    pb::QuorumResponse only_members;
    for (const auto& m : members) ToProto(m, only_members.add_members());
    it->second = std::make_shared<const std::string>(only_members.SerializeAsString());
  }
  Response r = http::Reply(resp, f);
  // The member list goes out as a shared tail: n answers, one copy in memory.
  r.body_tail = it->second;
  return r;
}
// One timer for every timeout in the core, armed at the core's next deadline; a timer that
// fires early just re-arms, so requests never need to cancel it.
void Service::Impl::ArmTick() {
  if (stopping) return;
  auto next = core.NextDeadline();
  if (!next) return;
  if (tick_armed && *tick_armed <= *next) return;
  tick_armed = *next;
  tick_timer.expires_at(*next);
  tick_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;
    self->tick_armed.reset();
    Effects fx;
    self->core.Tick(self->Now(), &fx);
    self->ApplyEffects(fx);
  });
}

}  // namespace lk::lighthouse
