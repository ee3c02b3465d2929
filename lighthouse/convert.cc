#include "lighthouse/convert.h"

namespace lk::lighthouse {

namespace pb = lightkeeper::v1;

void ToProto(const MemberData& m, pb::Member* out) {
  out->set_group_id(m.group_id);
  out->set_incarnation(m.incarnation);
  out->set_step(m.step);
  for (const auto& a : m.addresses) out->add_addresses(a);
  out->set_heal(m.heal);
  out->set_group_size(m.group_size);
  out->set_mixed_group_sizes(m.mixed_group_sizes);
}

void AddGroupSizes(const QuorumAnswer& a, const std::vector<MemberData>& members,
                   pb::QuorumResponse* out) {
  // Only a quorum of different sizes sends them: at 1,024 groups every answer would otherwise
  // carry 1,024 equal numbers that the trainers already know.
  if (!a.group_sizes_differ) return;
  for (const auto& m : members) out->add_group_sizes(m.group_size);
}

void ToProto(const CheckpointData& c, pb::CheckpointInfo* out) {
  out->set_job(c.job);
  out->set_step(c.step);
  out->set_location(c.location);
  out->set_manifest_digest(c.manifest_digest);
  out->set_group_id(c.group_id);
  out->set_created_unix_s(c.created_unix_s);
}

CheckpointData FromProto(const pb::CheckpointInfo& c) {
  return CheckpointData{c.job(), c.step(), c.location(), c.manifest_digest(), c.group_id(),
                        c.created_unix_s()};
}

MemberData FromProto(const pb::Member& m) {
  MemberData out;
  out.group_id = m.group_id();
  out.incarnation = m.incarnation();
  out.step = m.step();
  out.addresses.assign(m.addresses().begin(), m.addresses().end());
  out.heal = m.heal();
  out.group_size = m.group_size();
  out.mixed_group_sizes = m.mixed_group_sizes();
  return out;
}

void ToProto(const QuorumAnswer& a, pb::QuorumResponse* out) {
  out->set_quorum_id(a.quorum_id);
  // Members come shared between all answers of one issue (the core does not copy the list n
  // times for n members), or inline.
  const auto& members = a.members_shared ? *a.members_shared : a.members;
  for (const auto& m : members) ToProto(m, out->add_members());
  AddGroupSizes(a, members, out);
  out->set_replica_rank(a.replica_rank);
  out->set_replica_world_size(static_cast<uint32_t>(members.size()));
  out->set_max_step(a.max_step);
  out->set_heal(a.heal);
  auto* plan = out->mutable_recovery();
  for (uint32_t r : a.source_ranks) plan->add_source_ranks(r);
  if (a.restore_checkpoint) ToProto(*a.restore_checkpoint, plan->mutable_restore_checkpoint());
  plan->set_initial(a.initial);
  out->set_reason(a.reason);
  out->set_generation(a.generation);
  out->set_diverged_step(a.diverged_step);
}

void ToProto(const FailureNoticeData& n, pb::FailureNotice* out) {
  out->set_quorum_id(n.quorum_id);
  out->set_group_id(n.group_id);
  out->set_incarnation(n.incarnation);
  out->set_reason(n.reason);
}

void ToProto(const JobView& v, pb::JobStatus* out) {
  out->set_job(v.job);
  out->set_quorum_id(v.quorum_id);
  for (const auto& m : v.members) ToProto(m, out->add_members());
  out->set_committed_step(v.committed_step);
  out->set_quorum_changes(v.quorum_changes);
  out->set_finished_step(v.finished_step);
  out->set_last_decision(v.last_decision);
  for (const auto& g : v.groups) {
    auto* gs = out->add_groups();
    gs->set_group_id(g.group_id);
    gs->set_incarnation(g.incarnation);
    gs->set_nodes(g.nodes);
    gs->set_step(g.step);
    gs->set_healthy(g.healthy);
    gs->set_participant(g.participant);
    gs->set_in_quorum(g.in_quorum);
    gs->set_heartbeat_age_ms(static_cast<double>(g.heartbeat_age.count()));
    gs->set_phase(g.phase);
    gs->set_draining(g.draining);
    gs->set_diverged(g.diverged);
    gs->set_divergences(g.divergences);
    gs->set_diverged_step(g.diverged_step);
    gs->set_state(g.state);
    gs->set_reason(g.reason);
    gs->set_generation(g.generation);
    gs->set_tokens(g.tokens);
    gs->set_tokens_step(g.tokens_step);
    gs->set_share(g.share);
    gs->set_tokens_total(g.tokens_total);
    gs->set_crashes(g.crashes);
    gs->set_requeue_refusals(g.requeue_refusals);
    gs->set_last_event(g.last_event);
    gs->set_gateway(g.gateway);
    gs->set_group_size(g.group_size);
    gs->set_mixed_group_sizes(g.mixed_group_sizes);
  }
  for (const auto& c : v.checkpoints) ToProto(c, out->add_checkpoints());
}

}  // namespace lk::lighthouse
