// Conversions between the core's plain structs and the wire messages, done once at the edge so
// that the core links no protobuf.
// Thread-safety: pure functions.
#pragma once

#include "common/proto/lightkeeper.pb.h"
#include "lighthouse/lighthouse_core.h"

namespace lk::lighthouse {

void ToProto(const MemberData& m, lightkeeper::v1::Member* out);
// Every member's group size into out->group_sizes, when the members' sizes differ
// (a.group_sizes_differ); `members` is a's list, shared or inline.
void AddGroupSizes(const QuorumAnswer& a, const std::vector<MemberData>& members,
                   lightkeeper::v1::QuorumResponse* out);
void ToProto(const CheckpointData& c, lightkeeper::v1::CheckpointInfo* out);
void ToProto(const QuorumAnswer& a, lightkeeper::v1::QuorumResponse* out);
void ToProto(const FailureNoticeData& n, lightkeeper::v1::FailureNotice* out);
void ToProto(const JobView& v, lightkeeper::v1::JobStatus* out);
CheckpointData FromProto(const lightkeeper::v1::CheckpointInfo& c);
MemberData FromProto(const lightkeeper::v1::Member& m);

}  // namespace lk::lighthouse
