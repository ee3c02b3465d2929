// Tests of the core's trust boundary: every refusal of a hostile or stale input carries its
// reason code and leaves the state exactly as it was; incarnations are ordered by generations
// that survive a restart (Load); left and silent groups are collected after the grace period;
// --jobs-max holds.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include <lightkeeper/clock.h>
#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_test_util.h"

namespace lk::lighthouse {
namespace {

using testing::Harness;
using testing::Snapshot;

CommitInput C(const std::string& group, uint32_t quorum_id, uint32_t step,
              const std::string& inc = "i1") {
  CommitInput in;
  in.job = "j";
  in.group_id = group;
  in.incarnation = inc;
  in.quorum_id = quorum_id;
  in.step = step;
  return in;
}

// Calls `call` and checks that it is refused with `code` and `reason` and that neither the view,
// the deadlines nor the effects changed.
void ExpectRefused(Harness& h, const std::string& name, const std::function<Status(Effects*)>& call,
                   Code code, Reason reason) {
  CAPTURE(name);
  const std::string before = Snapshot(h.core, h.clock.Now());
  Effects fx;
  Status st = call(&fx);
  CHECK(st.code() == code);
  CHECK(ReasonName(st.reason()) == ReasonName(reason));
  CHECK(fx.events.empty());
  CHECK(fx.answers.empty());
  CHECK(fx.rejections.empty());
  CHECK(fx.persist_jobs.empty());
  CHECK(fx.persist_groups.empty());
  CHECK(fx.persist_checkpoints.empty());
  CHECK(Snapshot(h.core, h.clock.Now()) == before);
}

TEST_CASE("trust: each hostile input of issue 14 is refused with its code and changes nothing") {
  Harness h;
  h.Form({"a", "b"});  // quorum 1 at step 0
  const uint32_t q = h.Answer("a")->quorum_id;
  REQUIRE(h.Commit("a", q, 1).ok());
  REQUIRE(h.Commit("b", q, 1).ok());
  REQUIRE(h.Beat("c").ok());  // a group outside the quorum
  LighthouseCore& core = h.core;
  auto now = [&] { return h.clock.Now(); };
  ExpectRefused(
      h, "commit at step 4294967295",
      [&](Effects* fx) { return core.OnCommit(C("a", q, 4294967295u), now(), fx).status(); },
      Code::kConflict, Reason::kWrongStep);
  ExpectRefused(
      h, "commit two steps ahead",
      [&](Effects* fx) { return core.OnCommit(C("a", q, 3), now(), fx).status(); }, Code::kConflict,
      Reason::kWrongStep);
  ExpectRefused(
      h, "commit from outside the quorum",
      [&](Effects* fx) { return core.OnCommit(C("c", q, 1), now(), fx).status(); }, Code::kConflict,
      Reason::kNotAMember);
  ExpectRefused(
      h, "commit naming another quorum",
      [&](Effects* fx) { return core.OnCommit(C("a", q + 5, 1), now(), fx).status(); },
      Code::kConflict, Reason::kWrongQuorum);
  ExpectRefused(
      h, "commit of an incarnation that never lived",
      [&](Effects* fx) { return core.OnCommit(C("a", q, 1, "ghost"), now(), fx).status(); },
      Code::kConflict, Reason::kUnknownIncarnation);
  ExpectRefused(
      h, "checkpoint at a step nobody committed",
      [&](Effects* fx) {
        return core.OnRegisterCheckpoint({"j", 99, "/ckpt/j", "", "a", 0}, fx);
      },
      Code::kConflict, Reason::kCheckpointNotCommitted);
  for (const char* where : {"relative/dir", "/a/../etc", "/a/./b", "http://x/y", "/a\nb"}) {
    ExpectRefused(
        h, std::string("checkpoint location ") + where,
        [&](Effects* fx) {
          return core.OnRegisterCheckpoint({"j", 1, where, "", "a", 0}, fx);
        },
        Code::kInvalidArgument, Reason::kCheckpointLocationInvalid);
  }
  ExpectRefused(
      h, "checkpoint of an unknown job",
      [&](Effects* fx) {
        return core.OnRegisterCheckpoint({"k", 0, "/c", "", "", 0}, fx);
      },
      Code::kNotFound, Reason::kUnknownJob);
  ExpectRefused(
      h, "checkpoint naming an unknown group",
      [&](Effects* fx) {
        return core.OnRegisterCheckpoint({"j", 1, "/c", "", "zz", 0}, fx);
      },
      Code::kNotFound, Reason::kUnknownGroup);
  ExpectRefused(
      h, "leave of an incarnation that never lived",
      [&](Effects* fx) { return core.OnLeave("j", "a", "ghost", "x", now(), fx); }, Code::kConflict,
      Reason::kUnknownIncarnation);
  // A commit and a checkpoint that are right go through after all the refusals.
  REQUIRE(core.OnRegisterCheckpoint({"j", 1, "/ckpt/j", "", "a", 0}, &h.fx).ok());
  CHECK(h.Group("a")->state == "member");
}

TEST_CASE("trust: a commit completes max_step + 1, also for a healer that asked lower") {
  Harness h;
  REQUIRE(h.Beat("a", 7).ok());
  REQUIRE(h.Beat("b", 3).ok());
  REQUIRE(h.Join("a", 7).ok());
  REQUIRE(h.Join("b", 3).ok());
  REQUIRE(h.fx.answers.size() == 2);
  const uint32_t q = h.Answer("b")->quorum_id;
  CHECK(h.Answer("b")->heal);
  CHECK(h.Commit("b", q, 4).status().reason() == Reason::kWrongStep);
  REQUIRE(h.Commit("b", q, 8).ok());
  REQUIRE(h.Commit("a", q, 8).ok());
  // A failed commit moves no step, so its step is not checked: it only forces a new quorum id.
  REQUIRE(h.Commit("a", q, 0, /*ok=*/false).ok());
}

TEST_CASE("trust: generations order incarnations and a replaced life stays dead") {
  Harness h;
  auto first = h.Beat("a", 0, "i1");
  REQUIRE(first.ok());
  CHECK(first->generation == 1);
  auto second = h.Beat("a", 0, "i2");
  REQUIRE(second.ok());
  CHECK(second->generation == 2);
  REQUIRE(h.fx.persist_groups.size() == 1);
  CHECK(h.fx.persist_groups[0].incarnation == "i2");
  REQUIRE(h.fx.persist_groups[0].retired.size() == 1);
  CHECK(h.fx.persist_groups[0].retired[0].incarnation == "i1");
  ExpectRefused(
      h, "heartbeat of the retired life",
      [&](Effects* fx) {
        HeartbeatInput in{"j", "a", "i1", 0, 1, 0, "train", "", 1};
        return h.core.OnHeartbeat(in, h.clock.Now(), fx).status();
      },
      Code::kConflict, Reason::kStaleIncarnation);
  ExpectRefused(
      h, "leave of the retired life",
      [&](Effects* fx) { return h.core.OnLeave("j", "a", "i1", "x", h.clock.Now(), fx); },
      Code::kConflict, Reason::kStaleIncarnation);
  // An id never heard of that carries a generation this job handed out is an old life too, even
  // when it fell off the bounded list of retired names.
  ExpectRefused(
      h, "unknown name with an old generation",
      [&](Effects* fx) {
        HeartbeatInput in{"j", "a", "i0", 0, 1, 0, "train", "", 1};
        return h.core.OnHeartbeat(in, h.clock.Now(), fx).status();
      },
      Code::kConflict, Reason::kStaleIncarnation);
  // The current life may send its generation; a new life sends none and replaces it.
  CHECK(h.Beat("a", 0, "i2", 0, 1, 2).ok());
  auto third = h.Beat("a", 0, "i3");
  REQUIRE(third.ok());
  CHECK(third->generation == 3);
}

TEST_CASE("trust: after a restart (Load of the persisted records) a zombie is refused") {
  Harness h;
  std::vector<JobRecordData> jobs;
  std::vector<GroupRecordData> groups;
  auto keep = [&] {
    for (auto& j : h.fx.persist_jobs) {
      std::erase_if(jobs, [&](const JobRecordData& x) { return x.job == j.job; });
      jobs.push_back(j);
    }
    for (auto& g : h.fx.persist_groups) {
      std::erase_if(groups, [&](const GroupRecordData& x) { return x.group_id == g.group_id; });
      groups.push_back(g);
    }
  };
  REQUIRE(h.Beat("a", 0, "i1").ok());
  keep();
  REQUIRE(h.Join("a", 0, "i1").ok());
  keep();
  REQUIRE(h.Beat("a", 0, "i2").ok());  // i2 replaces i1 before any quorum holds it
  keep();
  REQUIRE(h.Beat("b", 0, "b1").ok());
  keep();
  REQUIRE(h.Leave("b", "b1").ok());
  keep();
  LighthouseCore restarted(h.options);
  REQUIRE(restarted.Load(jobs, {}, h.clock.Now(), groups).ok());
  Effects fx;
  auto zombie =
      restarted.OnHeartbeat({"j", "a", "i1", 0, 1, 0, "train", "", 1}, h.clock.Now(), &fx);
  CHECK(zombie.status().reason() == Reason::kStaleIncarnation);
  auto left = restarted.OnHeartbeat({"j", "b", "b1", 0, 1, 0, "train", "", 3}, h.clock.Now(), &fx);
  CHECK(left.status().reason() == Reason::kGroupLeft);
  auto live = restarted.OnHeartbeat({"j", "a", "i2", 0, 1, 0, "train", "", 2}, h.clock.Now(), &fx);
  REQUIRE(live.ok());
  CHECK(live->generation == 2);
  // Generations go on above the persisted counter.
  auto fresh = restarted.OnHeartbeat({"j", "c", "c1", 0, 1, 0, "train", ""}, h.clock.Now(), &fx);
  REQUIRE(fresh.ok());
  CHECK(fresh->generation == 4);
}

TEST_CASE("trust: on a lighthouse that lost its state, live agents' generations admit them") {
  Harness h;  // an empty core: a fresh data directory, or the job was forgotten
  auto back = h.Beat("a", 0, "i7", 0, 1, /*generation=*/9);
  REQUIRE(back.ok());
  CHECK(back->generation == 1);
  CHECK(h.Group("a")->incarnation == "i7");
}

TEST_CASE("trust: left and silent groups are collected after the grace period") {
  CoreOptions o;
  o.group_grace = Millis(10'000);
  o.groups_per_job_max = 2;
  Harness h(o);
  REQUIRE(h.Beat("a").ok());
  REQUIRE(h.Beat("b").ok());
  CHECK(h.Beat("c").status().reason() == Reason::kGroupsMax);
  REQUIRE(h.Leave("a").ok());
  h.clock.Advance(Millis(9'000));
  h.Tick();
  CHECK(h.Group("a") != nullptr);
  REQUIRE(h.Beat("b").ok());  // b keeps heartbeating: it is not collected
  h.clock.Advance(Millis(1'001));
  h.Tick();
  CHECK(h.Group("a") == nullptr);
  CHECK(h.HasEvent("group_collected job=j group=a incarnation=i1 generation=1 reason=preempted"));
  REQUIRE(h.fx.drop_groups.size() == 1);
  CHECK(h.fx.drop_groups[0].second == "a");
  CHECK(h.core.GroupCount() == 1);
  // Room again for a new group; the collected life stays refused by its generation.
  REQUIRE(h.Beat("c").ok());
  CHECK(h.Beat("a", 0, "i1", 0, 1, 1).status().reason() == Reason::kStaleIncarnation);
  // b goes silent: expired after the heartbeat timeout, collected a grace period later.
  h.clock.Advance(o.heartbeat_timeout + Millis(1));
  h.Tick();
  CHECK(h.Group("b")->state != "left");
  h.clock.Advance(Millis(10'000));
  h.Tick();
  CHECK(h.Group("b") == nullptr);
}

TEST_CASE("trust: a group that heartbeats again before the grace period ends is kept") {
  CoreOptions o;
  o.group_grace = Millis(10'000);
  Harness h(o);
  REQUIRE(h.Beat("a").ok());
  h.clock.Advance(o.heartbeat_timeout + Millis(1));
  h.Tick();
  CHECK(!h.Group("a")->healthy);
  h.clock.Advance(Millis(5'000));
  REQUIRE(h.Beat("a").ok());
  h.clock.Advance(Millis(6'000));
  REQUIRE(h.Beat("a").ok());
  h.Tick();
  REQUIRE(h.Group("a") != nullptr);
  CHECK(h.Group("a")->healthy);
}

TEST_CASE("trust: a node still waiting when its group is collected is answered") {
  CoreOptions o;
  o.group_grace = Millis(10'000);
  Harness h(o);
  REQUIRE(h.Join("a", 0, "i1", 1, 2).ok());  // node 0 never heard: a never comes alive
  CHECK(h.fx.answers.empty());
  h.clock.Advance(Millis(10'000));
  h.Tick();
  REQUIRE(h.Rejection("a") != nullptr);
  CHECK(h.Rejection("a")->reason() == Reason::kGroupUnhealthy);
  CHECK(h.Group("a") == nullptr);
}

TEST_CASE("trust: jobs_max refuses a new job and the existing ones keep working") {
  CoreOptions o;
  o.jobs_max = 2;
  Harness h(o);
  h.job = "j1";
  REQUIRE(h.Beat("a").ok());
  h.job = "j2";
  REQUIRE(h.Beat("a").ok());
  h.job = "j3";
  ExpectRefused(
      h, "a third job",
      [&](Effects* fx) {
        return h.core.OnHeartbeat({"j3", "a", "i1", 0, 1, 0, "", ""}, h.clock.Now(), fx).status();
      },
      Code::kResourceExhausted, Reason::kJobsMax);
  CHECK(h.core.JobCount() == 2);
  h.job = "j1";
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Join("a", 0).ok());
  // Forgetting a job makes room.
  REQUIRE(h.core.Forget("j2", &h.fx).ok());
  h.job = "j3";
  CHECK(h.Beat("a").ok());
}

TEST_CASE("trust: every reason has the proto's name") {
  CHECK(ReasonName(Reason::kUnspecified) == "UNSPECIFIED");
  CHECK(ReasonName(Reason::kStaleIncarnation) == "STALE_INCARNATION");
  CHECK(ReasonName(Reason::kInternal) == "INTERNAL");
  CHECK(ReasonName(static_cast<Reason>(kReasonCount)) == "UNSPECIFIED");
  CHECK(DefaultReason(Code::kInvalidArgument) == Reason::kBadRequest);
}

}  // namespace
}  // namespace lk::lighthouse
