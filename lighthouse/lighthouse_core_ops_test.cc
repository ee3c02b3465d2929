// Tests of the lighthouse core around the rules: multi-node groups, bad input, retries, Load,
// divergence, drain, forget, leave, the checkpoint registry, views, the hot path and scale
// (their costs are measured in bench/lighthouse_core_bench.cc).
#include <doctest/doctest.h>
#include <lightkeeper/clock.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_test_util.h"

namespace lk::lighthouse {
namespace {

using testing::Harness;
using testing::Snapshot;

JoinInput J(const std::string& job, const std::string& group, const std::string& inc,
            uint32_t node = 0, uint32_t nodes = 1) {
  JoinInput in;
  in.job = job;
  in.group_id = group;
  in.incarnation = inc;
  in.node_rank = node;
  in.nodes = nodes;
  return in;
}

HeartbeatInput B(const std::string& group, uint32_t nodes) {
  HeartbeatInput in;
  in.job = "j";
  in.group_id = group;
  in.incarnation = "i1";
  in.nodes = nodes;
  return in;
}

CommitInput C(const std::string& group, uint32_t quorum_id) {
  CommitInput in;
  in.job = "j";
  in.group_id = group;
  in.incarnation = "i1";
  in.quorum_id = quorum_id;
  in.step = 1;
  return in;
}

// One node's trainers healed on an answer the other node never received (lost on the way), and
// the quorum was lost before that node asked again: it asks with its step 0 and no state, the
// other node with the step it healed to. Refused (STEP_DISAGREEMENT, as between two nodes with
// state), the group was held out for good; the agents' simulation found it
// (tests/sim/agent_sim.cc).
TEST_CASE("multi-node group: a node without state asks at any step and the group heals") {
  Harness h;
  REQUIRE(h.Beat("a", 5, "i1", 0, 2).ok());
  REQUIRE(h.Beat("a", 5, "i1", 1, 2).ok());
  REQUIRE(h.Beat("b", 6).ok());
  REQUIRE(h.Join("b", 6).ok());
  REQUIRE(h.Join("a", 6, "i1", 0, 2).ok());
  REQUIRE(h.Join("a", 0, "i1", 1, 2, /*has_state=*/false).ok());
  CHECK(
      h.HasEvent("steps_disagree job=j group=a incarnation=i1 node=1 step=0 other_node=0 "
                 "other_step=6 action=heal"));
  REQUIRE(h.fx.answers.size() == 3);
  for (uint32_t node : {0u, 1u}) {
    CAPTURE(node);
    REQUIRE(h.Answer("a", node) != nullptr);
    CHECK(h.Answer("a", node)->heal);
    CHECK(h.Answer("a", node)->max_step == 6);
  }
  CHECK(!h.Answer("b")->heal);
}

TEST_CASE("multi-node group: a participant once all agents asked the same step") {
  Harness h;
  REQUIRE(h.Beat("a", 5, "i1", 0, 2).ok());
  REQUIRE(h.Beat("a", 5, "i1", 1, 2).ok());
  REQUIRE(h.Join("a", 5, "i1", 0, 2).ok());
  CHECK(h.fx.answers.empty());
  CHECK(!h.Group("a")->participant);
  SUBCASE("an earlier step beside a later one is refused, changing nothing") {
    REQUIRE(h.Join("a", 6, "i1", 0, 2).ok());
    const std::string before = Snapshot(h.core, h.clock.Now());
    Status st = h.Join("a", 5, "i1", 1, 2);
    CHECK(st.code() == Code::kConflict);
    CHECK(st.reason() == Reason::kStepDisagreement);
    CHECK(st.message() ==
          "agents of group a disagree on the step: node 0 asked with step 6, node 1 with step 5");
    CHECK(h.fx.events.empty());
    CHECK(Snapshot(h.core, h.clock.Now()) == before);
    REQUIRE(h.Join("a", 6, "i1", 1, 2).ok());
    REQUIRE(h.fx.answers.size() == 2);
    CHECK(h.Answer("a", 0)->max_step == 6);
    return;
  }
  SUBCASE("a later step supersedes the earlier one held: that agent is refused and asks again") {
    REQUIRE(h.Join("a", 6, "i1", 1, 2).ok());
    CHECK(
        h.HasEvent("ask_superseded job=j group=a incarnation=i1 node=0 step=5 by_node=1 "
                   "by_step=6"));
    const Status* refused = h.Rejection("a");
    REQUIRE(refused != nullptr);
    CHECK(refused->reason() == Reason::kStepDisagreement);
    CHECK(h.fx.answers.empty());
    CHECK(!h.Group("a")->participant);
    REQUIRE(h.Join("a", 6, "i1", 0, 2).ok());
    REQUIRE(h.fx.answers.size() == 2);
    CHECK(h.Answer("a", 0)->max_step == 6);
    return;
  }
  REQUIRE(h.Join("a", 5, "i1", 1, 2).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("a", 0)->quorum_id == 1);
  CHECK(h.Answer("a", 1)->quorum_id == 1);
  CHECK(h.Answer("a", 1)->members.at(0).addresses == std::vector<std::string>{"addr-a", "addr-a"});
}

TEST_CASE("multi-node group: unhealthy until every agent was heard") {
  Harness h;
  REQUIRE(h.Join("a", 0, "i1", 0, 2).ok());  // node 1 never heard: a is not healthy
  REQUIRE(h.Join("b", 0).ok());
  REQUIRE(h.fx.answers.size() == 1);
  CHECK(h.Answer("b")->reason == "all 1 healthy group asked");
  CHECK(!h.Group("a")->healthy);
}

TEST_CASE("bad input gets a reason and changes nothing") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Beat("c").ok());
  REQUIRE(h.Beat("a", 0, "i2").ok());  // i1 of a is now retired
  struct Row {
    const char* name;
    std::function<Status()> call;
    Code code;
    const char* message;
  };
  LighthouseCore& core = h.core;
  auto now = [&] { return h.clock.Now(); };
  Effects fx;
  const std::vector<Row> rows = {
      {"missing job", [&] { return core.OnJoin(J("", "x", "i1"), now(), &fx); },
       Code::kInvalidArgument, "missing job"},
      {"node_rank >= nodes", [&] { return core.OnJoin(J("j", "x", "i1", 2, 2), now(), &fx); },
       Code::kInvalidArgument, "node_rank=2 >= nodes=2"},
      {"nodes changed", [&] { return core.OnHeartbeat(B("b", 2), now(), &fx).status(); },
       Code::kInvalidArgument, "nodes changed within incarnation i1 of group b: 1 -> 2"},
      {"stale incarnation", [&] { return core.OnJoin(J("j", "a", "i1"), now(), &fx); },
       Code::kConflict, "stale incarnation i1 of group a (current i2)"},
      {"commit for an old quorum", [&] { return core.OnCommit(C("b", 7), now(), &fx).status(); },
       Code::kConflict, "commit for quorum 7 but the current quorum is 1"},
      {"commit by a non-member", [&] { return core.OnCommit(C("c", 1), now(), &fx).status(); },
       Code::kConflict, "group c is not a member of quorum 1"},
      {"leave of an unknown group", [&] { return core.OnLeave("j", "zz", "i1", "x", now(), &fx); },
       Code::kNotFound, "unknown group zz in job j"},
      {"leave of an unknown job", [&] { return core.OnLeave("k", "a", "i1", "x", now(), &fx); },
       Code::kNotFound, "unknown job k"},
      {"id too long", [&] { return core.OnJoin(J("j", std::string(300, 'g'), "i1"), now(), &fx); },
       Code::kInvalidArgument, "group_id longer than 256 bytes"},
      {"drain of an unknown group", [&] { return core.Drain("j", "zz", now(), &fx); },
       Code::kNotFound, "unknown group zz in job j"},
      {"forget of an unknown job", [&] { return core.Forget("k", &fx); }, Code::kNotFound,
       "unknown job k"},
      {"checkpoint without location",
       [&] {
         return core.OnRegisterCheckpoint(CheckpointData{"j", 1, "", "", "", 0}, &fx);
       },
       Code::kInvalidArgument, "a checkpoint needs a job and a location"},
  };
  for (const Row& row : rows) {
    const std::string name = row.name;
    CAPTURE(name);
    const std::string before = Snapshot(core, now());
    fx = {};
    Status st = row.call();
    CHECK(st.code() == row.code);
    CHECK(st.message() == std::string(row.message));
    CHECK(fx.events.empty());
    CHECK(fx.answers.empty());
    CHECK(fx.persist_jobs.empty());
    CHECK(Snapshot(core, now()) == before);
  }
}

TEST_CASE("retry: a member re-asking with its quorum step is answered at once") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Join("a", 0).ok());
  REQUIRE(h.fx.answers.size() == 1);
  CHECK(h.Answer("a")->quorum_id == 1);
  CHECK(h.Answer("a")->reason == "retry: current quorum 1");
  CHECK(h.fx.persist_jobs.empty());
  // A round where a's request times out before the quorum forms: its retry gets the answer.
  REQUIRE(h.Join("a", 1).ok());
  h.core.OnJoinTimeout({"j", "a", "i1", 0});
  REQUIRE(h.Join("b", 1).ok());
  REQUIRE(h.fx.answers.size() == 1);  // only b was still waiting
  CHECK(h.Answer("b")->quorum_id == 1);
  REQUIRE(h.Join("a", 1).ok());
  CHECK(h.Answer("a")->reason == "retry: current quorum 1");
  // After a commit the same step is a new ask, not a retry.
  REQUIRE(h.Commit("a", 1, 1, /*ok=*/false).ok());
  REQUIRE(h.Join("a", 1).ok());
  CHECK(h.fx.answers.empty());
}

// The agents' simulation, seeds 19376 and 24445: a member's answer was lost while the
// lighthouse was away; it went on with its old quorum and asked again from there, and the others
// waited in the new quorum's step for it for good.
TEST_CASE("asked again: a member of the standing quorum that never took its answer loses it") {
  auto ask = [](Harness& h, const std::string& g, uint32_t step, uint32_t on_quorum) {
    h.fx = {};
    JoinInput in{h.job, g, "i1", 0, 1, step, false, true, "addr-" + g};
    in.on_quorum_id = on_quorum;
    return h.core.OnJoin(in, h.clock.Now(), &h.fx);
  };
  SUBCASE("an ask at or below the quorum's step, not the one it was taken at") {
    Harness h;
    h.Form({"a", "b"}, 5);
    REQUIRE(ask(h, "a", 4, 0).ok());
    CHECK(h.HasEvent("quorum_abandoned job=j quorum_id=1 group=a incarnation=i1 node=0 step=4 "
                     "on_quorum_id=0"));
    CHECK(h.fx.watch_wakeups.count("j") == 1);
    CHECK(h.fx.persist_jobs.size() == 1);  // a restart must not hand quorum 1 out again
    REQUIRE(h.core.Watch("j", 1).ok());
    CHECK(h.core.Watch("j", 1)->lost);
    // No notice names a: its agent would take it for an eviction.
    REQUIRE(h.Beat("a", 4).ok());
    CHECK(h.Beat("a", 4).value().notices.empty());
    // b fails its step and asks again: the next quorum takes both, a healing.
    REQUIRE(h.Commit("b", 1, 6, /*ok=*/false).ok());
    REQUIRE(h.Join("b", 5).ok());
    REQUIRE(h.Answer("a") != nullptr);
    CHECK(h.Answer("a")->quorum_id == 2);
    CHECK(h.Answer("a")->heal);
    CHECK(h.Answer("b")->quorum_id == 2);
  }
  SUBCASE("a quorum lost already (a failed step) is not abandoned again") {
    Harness h;
    h.Form({"a", "b"}, 5);
    REQUIRE(h.Commit("b", 1, 6, /*ok=*/false).ok());
    REQUIRE(ask(h, "a", 5, 0).ok());
    CHECK_FALSE(h.HasEvent("quorum_abandoned"));
  }
  SUBCASE("an ask ahead from a member on another quorum") {
    Harness h;
    h.Form({"a", "b"}, 5);
    REQUIRE(ask(h, "a", 6, 3).ok());
    CHECK(h.HasEvent("quorum_abandoned job=j quorum_id=1 group=a incarnation=i1 node=0 step=6 "
                     "on_quorum_id=3"));
    CHECK(h.core.Watch("j", 1)->lost);
  }
  SUBCASE("an ask ahead from a member on this quorum, or one that does not say, keeps it") {
    for (uint32_t on : {0u, 1u}) {
      CAPTURE(on);
      Harness h;
      h.Form({"a", "b"}, 5);
      REQUIRE(ask(h, "a", 6, on).ok());
      CHECK_FALSE(h.HasEvent("quorum_abandoned"));
      CHECK_FALSE(h.core.Watch("j", 1)->lost);
    }
  }
  SUBCASE("the same step again is a retry, answered at once") {
    Harness h;
    h.Form({"a", "b"}, 5);
    REQUIRE(ask(h, "a", 5, 1).ok());
    CHECK_FALSE(h.HasEvent("quorum_abandoned"));
    REQUIRE(h.Answer("a") != nullptr);
    CHECK(h.Answer("a")->quorum_id == 1);
  }
}

TEST_CASE("state_lost: no live member and no checkpoint holds the committed step") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Commit("a", 1, 1).ok());
  REQUIRE(h.Commit("b", 1, 1).ok());
  REQUIRE(h.Leave("a").ok());
  REQUIRE(h.Leave("b").ok());
  for (const char* g : {"c", "d"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(h.Join("c", 0, "i1", 0, 1, /*has_state=*/false).ok());
  REQUIRE(h.Join("d", 0, "i1", 0, 1, /*has_state=*/false).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.HasEvent("state_lost job=j quorum_id=2 committed_step=1 max_step=0 lost_steps=1 "));
}

TEST_CASE("Load: ids continue - loaded members retry and rejoin on the fast path") {
  Harness first;
  first.Form({"a", "b"});
  REQUIRE(first.Join("a", 0, "i2").ok());  // a restarts: quorum 2 needs b's next ask
  REQUIRE(first.Join("b", 1).ok());
  REQUIRE(first.fx.persist_jobs.size() == 1);
  const JobRecordData record = first.fx.persist_jobs[0];
  CHECK(record.quorum_id == 2);

  Harness h;
  h.clock.Set(first.clock.Now() + Millis(500));
  REQUIRE(h.core.Load({record}, {}, h.clock.Now()).ok());
  CHECK(h.core.Load({record}, {}, h.clock.Now()).code() == Code::kInvalidArgument);
  CHECK(h.core.GroupCount() == 2);
  CHECK(h.core.NextDeadline() == h.clock.Now() + Millis(3000));  // loaded = heard now
  REQUIRE(h.Join("b", 1).ok());
  CHECK(h.Answer("b")->quorum_id == 2);
  CHECK(h.Answer("b")->reason == "retry: current quorum 2");
  REQUIRE(h.Join("a", 0, "i2").ok());
  CHECK(h.Answer("a")->heal);  // the plan survives the restart
  CHECK(h.Answer("a")->source_ranks == std::vector<uint32_t>{1});
  REQUIRE(h.Join("a", 2, "i2").ok());
  REQUIRE(h.Join("b", 2).ok());
  CHECK(h.Answer("a")->quorum_id == 2);
  CHECK(h.Answer("a")->reason == "fast_path: all 2 previous members rejoined");
  REQUIRE(h.Beat("b", 2, "i9").ok());
  REQUIRE(h.Join("a", 3, "i2").ok());
  REQUIRE(h.Join("b", 0, "i9", 0, 1, false).ok());
  CHECK(h.Answer("b")->quorum_id == 3);  // never reused: continues after the loaded id

  // A record whose later unsynced writes were lost (a machine crash) still carries the synced
  // reservation: new ids continue above it, so an id handed out before the crash never repeats.
  Harness crashed;
  crashed.clock.Set(first.clock.Now() + Millis(500));
  JobRecordData reserved = record;
  reserved.quorum_id_reserved = 9;
  REQUIRE(crashed.core.Load({reserved}, {}, crashed.clock.Now()).ok());
  REQUIRE(crashed.Join("b", 1).ok());
  CHECK(crashed.Answer("b")->quorum_id == 2);  // the loaded quorum itself keeps its id
  REQUIRE(crashed.Beat("b", 2, "i9").ok());
  REQUIRE(crashed.Join("a", 3, "i2").ok());
  REQUIRE(crashed.Join("b", 0, "i9", 0, 1, false).ok());
  CHECK(crashed.Answer("b")->quorum_id == 10);

  LighthouseCore bad({});
  JobRecordData unsorted = record;
  std::swap(unsorted.members[0], unsorted.members[1]);
  CHECK(bad.Load({unsorted}, {}, h.clock.Now()).code() == Code::kDataLoss);
  CHECK(!bad.HasJob("j"));
}

TEST_CASE("divergence: a minority state hash is flagged - heals next - and is no donor") {
  Harness h;
  h.Form({"a", "b", "c"});
  CHECK(!h.Commit("a", 1, 1, true, "h1").value());
  CHECK(!h.Commit("b", 1, 1, true, "h1").value());
  CHECK(h.Commit("c", 1, 1, true, "zz").value());
  CHECK(
      h.HasEvent("diverged job=j quorum_id=1 group=c incarnation=i1 step=1 hash=zz "
                 "majority=h1 rule=majority reference_replica_rank=0 replica_rank=2"));
  CHECK(h.fx.divergences == std::vector<std::string>{"j"});
  CHECK(h.Group("c")->diverged);
  CHECK(h.Group("c")->divergences == 1);
  CHECK(h.Group("c")->diverged_step == 1);
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Join(g, 1).ok());
  REQUIRE(h.fx.answers.size() == 3);
  // A new quorum id, so that the diverged member joins again (its trainers rebuild and heal).
  CHECK(h.Answer("c")->quorum_id == 2);
  CHECK(h.Answer("c")->heal);
  CHECK(h.Answer("c")->source_ranks == std::vector<uint32_t>{0, 1});
  CHECK(h.Answer("c")->reason.find("diverged from the quorum's at step 1") != std::string::npos);
  CHECK(!h.Answer("a")->heal);
  CHECK(h.Group("c")->diverged);  // until it commits the reference state
  CHECK(!h.Commit("a", 2, 2, true, "h2").value());
  CHECK(!h.Commit("b", 2, 2, true, "h2").value());
  CHECK(!h.Commit("c", 2, 2, true, "h2").value());
  CHECK(
      h.HasEvent("diverged_healed job=j group=c incarnation=i1 step=2 hash=h2 "
                 "diverged_step=1"));
  CHECK(h.fx.divergences.empty());
  CHECK(!h.Group("c")->diverged);
  CHECK(h.Group("c")->divergences == 1);
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Join(g, 2).ok());
  CHECK(h.Answer("c")->quorum_id == 2);  // healed: the quorum goes on as it is
  CHECK(!h.Answer("c")->heal);
}

TEST_CASE("divergence: two groups tie one to one - the lowest replica_rank is the reference") {
  Harness h;
  h.Form({"a", "b"});
  // The first commit alone decides nothing: one of two is no majority.
  CHECK(!h.Commit("b", 1, 1, true, "hb").value());
  CHECK(!h.HasEvent("diverged "));
  CHECK(h.Commit("a", 1, 1, true, "ha").value() == false);
  CHECK(
      h.HasEvent("diverged job=j quorum_id=1 group=b incarnation=i1 step=1 hash=hb "
                 "majority=ha rule=tie_lowest_replica_rank reference_replica_rank=0 "
                 "replica_rank=1"));
  CHECK(h.fx.divergences.size() == 1);
  CHECK(!h.Group("a")->diverged);
  CHECK(h.Group("b")->diverged);
  // Its later commits of the same split count once.
  for (const char* g : {"a", "b"}) REQUIRE(h.Join(g, 1).ok());
  CHECK(h.Answer("b")->heal);
  CHECK(h.Answer("b")->quorum_id == 2);
  CHECK(h.Answer("b")->source_ranks == std::vector<uint32_t>{0});
  CHECK(!h.Answer("a")->heal);
  CHECK(h.Commit("b", 2, 2, true, "hb2").value());
  CHECK(!h.Commit("a", 2, 2, true, "ha2").value());
  CHECK(h.fx.divergences.empty());
  CHECK(h.Group("b")->divergences == 1);
  CHECK(h.Group("b")->diverged);
  // Healed: the same hash as the reference at a later step clears the flag.
  for (const char* g : {"a", "b"}) REQUIRE(h.Join(g, 2).ok());
  CHECK(!h.Commit("a", 2, 3, true, "h3").value());
  CHECK(!h.Commit("b", 2, 3, true, "h3").value());
  CHECK(h.HasEvent("diverged_healed job=j group=b "));
  CHECK(!h.Group("b")->diverged);
}

TEST_CASE("divergence: three groups - a majority decides at once - a three-way split ties") {
  Harness h;
  h.Form({"a", "b", "c"});
  CHECK(!h.Commit("a", 1, 1, true, "z").value());
  CHECK(!h.Commit("b", 1, 1, true, "h").value());
  CHECK(!h.HasEvent("diverged "));  // one against one, the third still to come
  CHECK(!h.Commit("c", 1, 1, true, "h").value());
  CHECK(
      h.HasEvent("diverged job=j quorum_id=1 group=a incarnation=i1 step=1 hash=z majority=h "
                 "rule=majority reference_replica_rank=1 replica_rank=0"));
  CHECK(h.Group("a")->diverged);
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Join(g, 1).ok());
  CHECK(h.Answer("a")->heal);
  CHECK(h.Answer("a")->source_ranks == std::vector<uint32_t>{1, 2});

  // All three apart: the tie goes to replica_rank 0 (a, still diverged: it stays flagged, and
  // b and c are flagged off a's state).
  Harness t;
  t.Form({"a", "b", "c"});
  CHECK(!t.Commit("a", 1, 1, true, "x").value());
  CHECK(!t.Commit("b", 1, 1, true, "y").value());
  CHECK(t.Commit("c", 1, 1, true, "w").value());
  CHECK(t.fx.divergences.size() == 2);
  CHECK(!t.Group("a")->diverged);
  CHECK(t.Group("b")->diverged);
  CHECK(t.Group("c")->diverged);
  CHECK(
      t.HasEvent("diverged job=j quorum_id=1 group=c incarnation=i1 step=1 hash=w majority=x "
                 "rule=tie_lowest_replica_rank"));
}

TEST_CASE("drain: heartbeats answer drain - the group is no candidate - its waiters are told") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Join("b", 1).ok());
  h.fx = {};
  REQUIRE(h.core.Drain("j", "b", h.clock.Now(), &h.fx).ok());
  CHECK(h.HasEvent("group_drain job=j group=b incarnation=i1 in_quorum=true"));
  REQUIRE(h.Rejection("b") != nullptr);
  CHECK(h.Rejection("b")->message() == "group b is draining");
  CHECK(h.Beat("b").value().drain);
  CHECK(!h.Beat("a").value().drain);
  CHECK(h.Group("b")->state == "draining");
  CHECK(h.Join("b", 1).code() == Code::kConflict);
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.fx.answers.size() == 1);
  CHECK(h.Answer("a")->quorum_id == 2);
  CHECK(h.Answer("a")->members.size() == 1);
}

TEST_CASE("forget: waiters rejected - state gone - persisted state deleted") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Join("a", 1).ok());
  h.fx = {};
  REQUIRE(h.core.Forget("j", &h.fx).ok());
  CHECK(h.fx.forget_jobs == std::vector<std::string>{"j"});
  REQUIRE(h.Rejection("a") != nullptr);
  CHECK(h.Rejection("a")->code() == Code::kUnavailable);
  CHECK(!h.core.HasJob("j"));
  CHECK(h.core.GroupCount() == 0);
  CHECK(!h.core.NextDeadline().has_value());
  CHECK(h.core.Watch("j", 0).status().code() == Code::kNotFound);
}

TEST_CASE("leave: the remaining groups' quorum forms at once - the leaver is told 409 after") {
  Harness h;
  h.Form({"a", "b", "c"});
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.Join("b", 1).ok());
  CHECK(h.fx.answers.empty());
  REQUIRE(h.Leave("c").ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("a")->quorum_id == 2);
  CHECK(h.Answer("a")->reason == "all 2 healthy groups asked");
  CHECK(h.HasEvent("group_left job=j group=c incarnation=i1 reason=preempted"));
  CHECK(h.core.Watch("j", 1)->lost);
  CHECK(h.Group("c")->state == "left");
  auto r = h.Beat("c");
  CHECK(r.status().message() == "incarnation i1 of group c left (preempted)");
  CHECK(r.status().reason() == Reason::kGroupLeft);
  REQUIRE(h.Leave("c").ok());  // a repeated leave is fine and changes nothing
  CHECK(h.fx.events.empty());
}

TEST_CASE("leave finished: the group's other nodes hear GROUP_FINISHED, not GROUP_LEFT") {
  // Group a runs on two nodes. Node 1's trainers end at the final step first and its agent
  // leaves the group "finished"; node 0's agent (its trainers still writing the final save)
  // must learn that the group finished, not that it failed (the Slurm two-node test, where
  // node 0 exited 3 and srun failed the step).
  Harness h;
  for (uint32_t node : {0u, 1u}) REQUIRE(h.Beat("a", 0, "i1", node, 2).ok());
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Join("a", 0, "i1", 0, 2).ok());
  REQUIRE(h.Join("b", 0).ok());
  REQUIRE(h.Join("a", 0, "i1", 1, 2).ok());
  REQUIRE(h.Answer("b") != nullptr);
  const uint32_t q = h.Answer("b")->quorum_id;
  REQUIRE(h.Commit("a", q, 1).ok());
  REQUIRE(h.Commit("b", q, 1).ok());
  // Node 0 asks for the next round (its trainers polled once more) before node 1 leaves.
  REQUIRE(h.Join("a", 1, "i1", 0, 2).ok());
  h.fx = {};
  REQUIRE(h.core.OnLeave("j", "a", "i1", "finished", h.clock.Now(), &h.fx).ok());
  CHECK(h.HasEvent("group_left job=j group=a incarnation=i1 reason=finished"));
  CHECK(h.HasEvent("job_finished job=j step=1 group=a"));
  REQUIRE(h.Rejection("a") != nullptr);
  CHECK(h.Rejection("a")->reason() == Reason::kGroupFinished);
  auto beat = h.Beat("a", 1, "i1", 0, 2);
  REQUIRE(!beat.ok());
  CHECK(beat.status().code() == Code::kConflict);
  CHECK(beat.status().reason() == Reason::kGroupFinished);
  CHECK(beat.status().message() == "incarnation i1 of group a left (finished)");
  Status ask = h.Join("a", 1, "i1", 0, 2);
  CHECK(ask.reason() == Reason::kGroupFinished);
  auto commit = h.Commit("a", q, 1);
  CHECK(commit.status().reason() == Reason::kGroupFinished);
  CHECK(ReasonName(Reason::kGroupFinished) == "GROUP_FINISHED");
}

TEST_CASE("checkpoint registry: newest first - bounded - and restored when no state is live") {
  CoreOptions o;
  o.checkpoints_per_job_max = 3;
  Harness h(o);
  // Checkpoints are registered only at committed steps: group x commits step 5, then leaves.
  h.Form({"x"}, 4);
  REQUIRE(h.Commit("x", h.Answer("x")->quorum_id, 5).ok());
  REQUIRE(h.Leave("x").ok());
  for (uint32_t step : {3u, 1u, 5u, 2u, 4u}) {
    h.fx = {};
    REQUIRE(
        h.core.OnRegisterCheckpoint({"j", step, "/c/" + std::to_string(step), "d", "x", 0}, &h.fx)
            .ok());
  }
  std::vector<uint32_t> steps;
  for (const CheckpointData& c : h.core.Checkpoints("j")) steps.push_back(c.step);
  CHECK(steps == std::vector<uint32_t>{5, 4, 3});
  REQUIRE(h.fx.drop_checkpoints.size() == 1);
  CHECK(h.fx.drop_checkpoints[0].step == 2);
  REQUIRE(h.Beat("a").ok());
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Join("a", 0, "i1", 0, 1, false).ok());
  REQUIRE(h.Join("b", 0, "i1", 0, 1, false).ok());
  REQUIRE(h.fx.answers.size() == 2);
  for (const char* g : {"a", "b"}) {
    CHECK(h.Answer(g)->heal);
    REQUIRE(h.Answer(g)->restore_checkpoint.has_value());
    CHECK(h.Answer(g)->restore_checkpoint->step == 5);
    CHECK(h.Answer(g)->max_step == 5);
  }
}

TEST_CASE(
    "a restore from a checkpoint older than the committed step is reported with the steps lost") {
  Harness h;
  h.Form({"a", "b"}, 7);
  uint32_t q = h.Answer("a")->quorum_id;
  REQUIRE(h.Commit("a", q, 8).ok());
  REQUIRE(h.Commit("b", q, 8).ok());
  h.views = h.core.View(h.clock.Now());
  REQUIRE(h.views.size() == 1);
  REQUIRE(h.views[0].committed_step == 8);
  REQUIRE(h.core.OnRegisterCheckpoint({"j", 5, "/c/5", "d", "a", 0}, &h.fx).ok());
  REQUIRE(h.Leave("a").ok());
  REQUIRE(h.Leave("b").ok());
  // Two new groups without state: the newest durable checkpoint (step 5) is all there is.
  REQUIRE(h.Beat("c").ok());
  REQUIRE(h.Beat("d").ok());
  REQUIRE(h.Join("c", 0, "i1", 0, 1, false).ok());
  REQUIRE(h.Join("d", 0, "i1", 0, 1, false).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("c")->restore_checkpoint->step == 5);
  CHECK(
      h.HasEvent("recovery_behind_committed job=j quorum_id=2 committed_step=8 restore_step=5 "
                 "lost_steps=3 location=/c/5"));
  // A restore that is not behind says nothing.
  Harness fresh;
  fresh.Form({"x"}, 4);
  REQUIRE(fresh.Commit("x", fresh.Answer("x")->quorum_id, 5).ok());
  REQUIRE(fresh.Leave("x").ok());
  REQUIRE(fresh.core.OnRegisterCheckpoint({"j", 5, "/c/5", "d", "x", 0}, &fresh.fx).ok());
  REQUIRE(fresh.Beat("a").ok());
  REQUIRE(fresh.Join("a", 0, "i1", 0, 1, false).ok());
  REQUIRE(fresh.Answer("a")->restore_checkpoint.has_value());
  CHECK(!fresh.HasEvent("recovery_behind_committed"));
}

TEST_CASE("view: group states and events quote values with spaces") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Beat("c").ok());
  REQUIRE(h.Join("b", 1).ok());
  CHECK(h.fx.events.back() ==
        "quorum_wait job=j quorum_id=1 reason=\"wait: 1 of 3 healthy groups asked, a majority "
        "needs 2\"");
  CHECK(h.Group("a")->state == "member");
  CHECK(h.Group("b")->state == "waiting");
  CHECK(h.Group("c")->state == "joining");
  h.clock.Advance(Millis(1200));
  CHECK(h.Group("c")->heartbeat_age == Millis(1200));
  CHECK(h.Group("a")->in_quorum);
  CHECK(!h.Group("c")->in_quorum);
}

TEST_CASE("NextDeadline: none without state - only the collection after everyone left") {
  Harness h;
  CHECK(!h.core.NextDeadline().has_value());
  h.Form({"a"});
  CHECK(h.core.NextDeadline().has_value());
  REQUIRE(h.Leave("a").ok());
  // The group that left is forgotten after the grace period; then nothing is pending.
  REQUIRE(h.core.NextDeadline().has_value());
  CHECK(*h.core.NextDeadline() == h.clock.Now() + h.options.group_grace);
  h.clock.Advance(h.options.group_grace);
  h.Tick();
  CHECK(!h.core.NextDeadline().has_value());
  CHECK(h.Group("a") == nullptr);
}

// The hot path's cost is measured in bench/lighthouse_core_bench.cc, not asserted here: a test
// never asserts a speed. This pins down what the hot path does.
TEST_CASE("hot path: an unchanged quorum of 16 groups is re-issued with its id to all 16") {
  Harness h;
  std::vector<std::string> groups;
  for (int i = 0; i < 16; ++i) groups.push_back(fmt::format("g{:02}", i));
  h.Form(groups);
  for (uint32_t step = 1; step <= 200; ++step) {
    for (size_t i = 0; i + 1 < groups.size(); ++i) REQUIRE(h.Join(groups[i], step).ok());
    REQUIRE(h.fx.answers.empty());  // nobody is answered before the last member asked
    REQUIRE(h.Join(groups.back(), step).ok());
    REQUIRE(h.fx.answers.size() == 16);
    REQUIRE(h.fx.issued.size() == 1);
    CHECK(h.fx.issued.at(0).quorum_id == 1);
    CHECK(!h.fx.issued.at(0).changed);
  }
}

TEST_CASE("scale: 10 jobs x 1 000 groups - and one round of 1 024 groups") {
  CoreOptions o;
  o.answer_members_inline = false;  // what a shell serving 1,024 groups should use
  Harness h(o);
  for (int j = 0; j < 10; ++j) {
    h.job = fmt::format("job{}", j);
    for (int g = 0; g < 1000; ++g) REQUIRE(h.Beat(fmt::format("g{:04}", g)).ok());
  }
  CHECK(h.core.GroupCount() == 10'000);
  h.job = "big";
  std::vector<std::string> groups;
  for (int g = 0; g < 1024; ++g) groups.push_back(fmt::format("g{:04}", g));
  for (const std::string& g : groups) REQUIRE(h.Beat(g).ok());
  for (size_t i = 0; i + 1 < groups.size(); ++i) REQUIRE(h.Join(groups[i], 0).ok());
  REQUIRE(h.Join(groups.back(), 0).ok());
  REQUIRE(h.fx.answers.size() == 1024);
  CHECK(h.fx.answers[7].second.members.empty());
  CHECK(h.fx.answers[7].second.members_shared->size() == 1024);
  CHECK(h.fx.answers[7].second.members_shared == h.fx.answers[9].second.members_shared);
}

}  // namespace
}  // namespace lk::lighthouse

namespace lk::lighthouse {
namespace {

TEST_CASE("NoteGateway: the view shows the site a group's heartbeats come through, per life") {
  testing::Harness h;
  REQUIRE(h.Beat("a").ok());
  CHECK(h.Group("a")->gateway.empty());  // directly
  h.core.NoteGateway(h.job, "a", "i1", "alps");
  CHECK(h.Group("a")->gateway == "alps");
  // Another life's note, an unknown group or job: nothing changes.
  h.core.NoteGateway(h.job, "a", "i0", "lumi");
  h.core.NoteGateway(h.job, "b", "i1", "lumi");
  h.core.NoteGateway("other", "a", "i1", "lumi");
  CHECK(h.Group("a")->gateway == "alps");
  CHECK(h.Group("b") == nullptr);
  // A heartbeat straight to the lighthouse says so.
  h.core.NoteGateway(h.job, "a", "i1", "");
  CHECK(h.Group("a")->gateway.empty());
}

}  // namespace
}  // namespace lk::lighthouse
