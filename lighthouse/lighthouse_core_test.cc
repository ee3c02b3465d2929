// Tests of the lighthouse core state machine, driven by a manual clock: every rule through the
// public inputs, with the effects (answers, rejections, persists, events) and reasons checked.
#include "lighthouse/lighthouse_core.h"

#include <doctest/doctest.h>
#include <lightkeeper/clock.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "lighthouse/lighthouse_core_test_util.h"

namespace lk::lighthouse {
namespace {

using testing::Harness;
using testing::Snapshot;

TEST_CASE("rule 5: first quorum when every healthy group asked - answers name rank and plan") {
  Harness h;
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Join("a", 0, "i1", 0, 1, /*has_state=*/false).ok());
  CHECK(h.fx.answers.empty());
  CHECK(h.core.View(h.clock.Now())[0].last_decision ==
        "wait: 1 of 2 healthy groups asked, a majority needs 2");
  REQUIRE(h.Join("b", 0, "i1", 0, 1, /*has_state=*/false).ok());
  REQUIRE(h.fx.answers.size() == 2);
  const QuorumAnswer* a = h.Answer("a");
  const QuorumAnswer* b = h.Answer("b");
  REQUIRE((a && b));
  CHECK(a->quorum_id == 1);
  CHECK(a->replica_rank == 0);
  CHECK(b->replica_rank == 1);
  CHECK(a->reason == "all 2 healthy groups asked");
  CHECK(a->initial);  // no state anywhere, no checkpoint: rank 0's initial weights
  CHECK(!a->heal);
  CHECK(b->heal);
  CHECK(b->source_ranks == std::vector<uint32_t>{0});
  REQUIRE(h.fx.persist_jobs.size() == 1);
  CHECK(h.fx.persist_jobs[0].quorum_id == 1);
  CHECK(h.fx.persist_jobs[0].members.size() == 2);
  CHECK(h.fx.issued.size() == 1);
  CHECK(h.fx.issued[0].changed);
  CHECK(h.HasEvent("quorum_issued job=j quorum_id=1 changed=true members=2"));
}

TEST_CASE("rule 5: the join timeout fires through Tick exactly at NextDeadline") {
  Harness h;
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Beat(g).ok());
  h.clock.Advance(Millis(100));
  REQUIRE(h.Join("a", 0).ok());
  REQUIRE(h.Join("b", 0).ok());
  CHECK(h.fx.answers.empty());
  // c's heartbeat expires at +3000; the join timeout at +100+2000 comes first.
  const TimePoint deadline = h.clock.Now() + Millis(2000);
  REQUIRE(h.core.NextDeadline() == deadline);
  h.clock.Set(deadline - std::chrono::nanoseconds(1));
  h.Tick();
  CHECK(h.fx.answers.empty());
  CHECK(h.fx.events.empty());
  h.clock.Set(deadline);
  h.Tick();
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("a")->reason == "join_timeout: 2 of 3 healthy groups asked within 2000ms");
  // Next: c's heartbeat expiry (at +3000 from its beat), and no join deadline any more.
  CHECK(h.core.NextDeadline() == TimePoint{} + std::chrono::hours(1) + Millis(3000));
}

TEST_CASE("rule 4 and 6: an unchanged quorum re-issues the same id every step (hot path)") {
  Harness h;
  h.Form({"a", "b", "c"});
  for (uint32_t step = 1; step <= 3; ++step) {
    for (const char* g : {"a", "b", "c"}) REQUIRE(h.Commit(g, 1, step).ok());
    REQUIRE(h.Join("a", step).ok());
    REQUIRE(h.Join("b", step).ok());
    CHECK(h.fx.answers.empty());
    REQUIRE(h.Join("c", step).ok());
    REQUIRE(h.fx.answers.size() == 3);
    CHECK(h.Answer("c")->quorum_id == 1);
    CHECK(h.Answer("c")->reason == "fast_path: all 3 previous members rejoined");
    CHECK(h.Answer("c")->max_step == step);
    CHECK(!h.Answer("c")->heal);
    REQUIRE(h.fx.issued.size() == 1);
    CHECK(!h.fx.issued[0].changed);
    REQUIRE(h.fx.persist_jobs.size() == 1);  // every issue is persisted, also unchanged ones
    CHECK(h.fx.persist_jobs[0].members[0].step == step);
    CHECK(h.fx.watch_wakeups.empty());
  }
  CHECK(h.core.View(h.clock.Now())[0].committed_step == 3);
  CHECK(h.core.CommittedStep("j") == 3);
  CHECK(h.core.CommittedStep("unknown") == 0);
}

TEST_CASE("rule 6: a failed commit gives the next quorum a new id with the same members") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Commit("a", 1, 1).ok());
  REQUIRE(h.Commit("b", 1, 0, /*ok=*/false).ok());
  CHECK(h.HasEvent("commit job=j quorum_id=1 group=b incarnation=i1 node=0 step=0 ok=false"));
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.Join("b", 0).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("a")->quorum_id == 2);
  CHECK(h.Answer("b")->heal);  // behind: step 0 < max_step 1
  CHECK(h.Answer("b")->source_ranks == std::vector<uint32_t>{0});
  CHECK(h.fx.issued[0].changed);
}

TEST_CASE("rule 3: shrink_only keeps a joiner out until the next plain round") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Beat("c").ok());
  REQUIRE(h.Join("c", 0, "i1", 0, 1, /*has_state=*/false).ok());
  REQUIRE(h.Join("a", 1, "i1", 0, 1, true, /*shrink=*/true).ok());
  REQUIRE(h.Join("b", 1).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("c") == nullptr);
  CHECK(h.Answer("a")->reason ==
        "fast_path: all 2 previous members rejoined; shrink_only: 1 joiner held back");
  CHECK(h.Answer("a")->quorum_id == 1);
  CHECK(h.Group("c")->state == "waiting");
  REQUIRE(h.Join("a", 2).ok());
  REQUIRE(h.Join("b", 2).ok());
  REQUIRE(h.fx.answers.size() == 3);
  CHECK(h.Answer("c")->quorum_id == 2);
  CHECK(h.Answer("c")->heal);
  CHECK(h.Answer("a")->reason == "fast_path: all 2 previous members rejoined, 1 joiner came in");
}

TEST_CASE("rule 1: a new incarnation replaces the old at once") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Join("a", 1).ok());  // a waits for the next round
  REQUIRE(h.Beat("a", 0, "i2").ok());
  const Status* st = h.Rejection("a");
  REQUIRE(st != nullptr);
  CHECK(st->code() == Code::kConflict);
  CHECK(st->message() == "incarnation i1 of group a replaced by i2");
  CHECK(h.fx.watch_wakeups.count("j") == 1);
  CHECK(
      h.HasEvent("member_lost job=j quorum_id=1 group=a incarnation=i1 "
                 "reason=incarnation_replaced"));
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Beat("b").value().notices.size() == 1);
  CHECK(h.Beat("b").value().notices[0].reason == "incarnation_replaced");
  // The retired incarnation gets a clear conflict, and its error changes nothing.
  std::string before = Snapshot(h.core, h.clock.Now());
  auto r = h.Beat("a", 0, "i1");
  CHECK(r.status().code() == Code::kConflict);
  CHECK(r.status().message() == "stale incarnation i1 of group a (current i2)");
  CHECK(h.fx.events.empty());
  CHECK(Snapshot(h.core, h.clock.Now()) == before);
  // The new incarnation without state heals from b; the quorum id moves on.
  REQUIRE(h.Join("a", 0, "i2", 0, 1, /*has_state=*/false).ok());
  REQUIRE(h.Join("b", 1).ok());
  REQUIRE(h.Answer("a") != nullptr);
  CHECK(h.Answer("a")->quorum_id == 2);
  CHECK(h.Answer("a")->heal);
  CHECK(h.Answer("a")->max_step == 1);
  CHECK(h.Answer("a")->source_ranks == std::vector<uint32_t>{1});
}

TEST_CASE("rule 1: a member whose heartbeats stop is lost at its exact expiry") {
  Harness h;
  h.Form({"a", "b", "c"});
  h.clock.Advance(Millis(2000));
  REQUIRE(h.Beat("a").ok());
  REQUIRE(h.Beat("b").ok());
  // c was last heard at +0: it expires at +3000, before a and b (+5000).
  const TimePoint expiry = h.clock.Now() + Millis(1000);
  CHECK(h.core.NextDeadline() == expiry);
  h.clock.Set(expiry);
  h.Tick();
  CHECK(
      h.HasEvent("group_unhealthy job=j group=c incarnation=i1 "
                 "reason=\"heartbeat_timeout node=0 age=3000ms\""));
  CHECK(h.fx.watch_wakeups.count("j") == 1);
  auto w = h.core.Watch("j", 1);
  REQUIRE(w.ok());
  CHECK(w->lost);
  REQUIRE(w->notices.size() == 1);
  CHECK(w->notices[0].group_id == "c");
  CHECK(w->notices[0].reason == "heartbeat_timeout");
  CHECK(!h.Group("c")->healthy);
  // a and b: all healthy groups asked, a new id without c.
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.Join("b", 1).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("a")->quorum_id == 2);
  CHECK(h.Answer("a")->reason == "all 2 healthy groups asked");
  CHECK(h.core.Watch("j", 1)->lost);  // superseded
  CHECK(!h.core.Watch("j", 2)->lost);
  CHECK(h.core.Watch("nope", 1).status().code() == Code::kNotFound);
  CHECK(h.core.Watch("j", 3).status().code() == Code::kInvalidArgument);
  // c is heard again: healthy, and told once that it had been timed out, so that its agent
  // rejoins instead of ending the group. Its next heartbeat says nothing of it.
  auto back = h.Beat("c", 1);
  REQUIRE(back.ok());
  CHECK(back->revived_from == "heartbeat_timeout node=0 age=3000ms");
  CHECK(h.Group("c")->healthy);
  CHECK(h.Beat("c", 1)->revived_from.empty());
  CHECK(h.Beat("a", 1)->revived_from.empty());
}

// The e2e lapse test saw it: the agent's first message after a stall was a commit (its trainers
// had gone on), which revived the group, and the heartbeat after it said nothing of the lapse.
TEST_CASE("a group revived by an ask hears of its lapse on its next heartbeat") {
  Harness h;
  h.Form({"a", "c"});
  h.clock.Advance(Millis(2'000));
  REQUIRE(h.Beat("a").ok());
  h.clock.Advance(Millis(1'001));
  h.Tick();
  REQUIRE(h.HasEvent("group_unhealthy job=j group=c"));
  REQUIRE(h.Join("c", 0).ok());  // c is heard again, by an ask
  CHECK(h.HasEvent("group_healthy job=j group=c"));
  auto beat = h.Beat("c");
  REQUIRE(beat.ok());
  CHECK(beat->revived_from.rfind("heartbeat_timeout node=0", 0) == 0);
  CHECK(h.Beat("c")->revived_from.empty());
}

TEST_CASE("a new group's first heartbeat is no revival") {
  Harness h;
  auto r = h.Beat("n");
  REQUIRE(r.ok());
  CHECK(r->revived_from.empty());
}

TEST_CASE("rule 8: a member whose step stalls is evicted and comes back as a joiner") {
  CoreOptions o;
  o.progress_timeout = Millis(10'000);
  o.heartbeat_timeout = Millis(3'000);
  Harness h(o);
  h.Form({"a", "b"});
  // b keeps heartbeating at step 0; a advances.
  for (int i = 1; i <= 4; ++i) {
    h.clock.Advance(Millis(2'000));
    REQUIRE(h.Beat("a", static_cast<uint32_t>(i)).ok());
    REQUIRE(h.Beat("b", 0).ok());
  }
  const TimePoint stall = TimePoint{} + std::chrono::hours(1) + Millis(10'000);
  CHECK(h.core.NextDeadline() == stall);
  h.clock.Set(stall);
  h.Tick();
  CHECK(
      h.HasEvent("group_evicted job=j group=b incarnation=i1 step=0 stalled_ms=10000 "
                 "reason=progress_stalled"));
  CHECK(h.core.Watch("j", 1)->notices.at(0).reason == "progress_stalled");
  CHECK(h.Group("b")->state == "evicted");
  CHECK(!h.Group("b")->healthy);
  // a alone forms the next quorum at once (b is not healthy).
  REQUIRE(h.Join("a", 4).ok());
  CHECK(h.Answer("a")->quorum_id == 2);
  // b asks again: back as a joiner, healing from a.
  REQUIRE(h.Join("b", 0).ok());
  CHECK(h.HasEvent("group_rejoin job=j group=b"));
  CHECK(h.Group("b")->state == "waiting");
  REQUIRE(h.Join("a", 5).ok());
  REQUIRE(h.Answer("b") != nullptr);
  CHECK(h.Answer("b")->quorum_id == 3);
  CHECK(h.Answer("b")->heal);
}

TEST_CASE(
    "rule 8: a member blocked in the collective on a hung peer is not evicted - the peer is") {
  CoreOptions o;
  o.progress_timeout = Millis(1'000);
  Harness h(o);
  h.Form({"a", "b"});
  // a waits on b in the cross-group allreduce (peer_wait); b hangs in its inner steps.
  h.fx = {};
  REQUIRE(h.core
              .OnHeartbeat(HeartbeatInput{h.job, "a", "i1", 0, 1, 0, kPhasePeerWait, "addr-a"},
                           h.clock.Now(), &h.fx)
              .ok());
  h.clock.Advance(Millis(1'000));
  h.Tick();
  CHECK(h.HasEvent("group_evicted job=j group=b"));
  CHECK(!h.HasEvent("group_evicted job=j group=a"));
  // Leaving the wait restarts a's clock: it is evicted only a full timeout later.
  h.clock.Advance(Millis(500));
  REQUIRE(h.Beat("a", 0).ok());  // phase "train"
  h.clock.Advance(Millis(900));
  h.Tick();
  CHECK(!h.HasEvent("group_evicted job=j group=a"));
}

TEST_CASE(
    "rule 8: a member hung inside the collective its peers finished is evicted - they are not") {
  CoreOptions o;
  o.progress_timeout = Millis(1'000);
  Harness h(o);
  h.Form({"a", "b", "c"});
  // What each group's agent says in its heartbeats: its step, waiting on peers.
  std::map<std::string, uint32_t> waits{{"a", 0}, {"b", 0}, {"c", 0}};
  std::vector<std::string> events;
  // Time passes in heartbeat intervals; every group that still waits keeps saying so.
  auto pass = [&](Millis total) {
    for (Millis left = total; left.count() > 0;) {
      Millis d = std::min(left, Millis(100));
      h.clock.Advance(d);
      left -= d;
      for (const auto& [g, step] : waits) {
        h.fx = {};
        REQUIRE(h.core
                    .OnHeartbeat(
                        HeartbeatInput{h.job, g, "i1", 0, 1, step, kPhasePeerWait, "addr-" + g},
                        h.clock.Now(), &h.fx)
                    .ok());
        events.insert(events.end(), h.fx.events.begin(), h.fx.events.end());
      }
      h.Tick();
      events.insert(events.end(), h.fx.events.begin(), h.fx.events.end());
    }
  };
  auto evicted = [&](const std::string& g) {
    return std::any_of(events.begin(), events.end(), [&](const std::string& e) {
      return e.rfind("group_evicted job=j group=" + g + " ", 0) == 0;
    });
  };
  // All three in step 0's collective for longer than the timeout: each has peers to wait on.
  pass(Millis(3'000));
  CHECK(!evicted("a"));
  CHECK(!evicted("b"));
  CHECK(!evicted("c"));
  // a finishes step 0 and waits in step 1's: b and c still wait on each other at step 0.
  waits["a"] = 1;
  pass(Millis(3'000));
  CHECK(!evicted("b"));
  CHECK(!evicted("c"));
  // c finishes too (its next heartbeat says so). b, whose trainer stopped inside step 0's
  // collective, still says it waits, but every peer is past that step: its clock runs from
  // here, a full timeout.
  waits["c"] = 1;
  pass(Millis(100));
  pass(Millis(900));
  CHECK(!evicted("b"));
  pass(Millis(100));
  CHECK(std::count(events.begin(), events.end(),
                   "group_evicted job=j group=b incarnation=i1 step=0 stalled_ms=1000 "
                   "reason=progress_stalled") == 1);
  // a and c wait at step 1 on each other (b is lost now): neither is evicted.
  pass(Millis(5'000));
  CHECK(!evicted("a"));
  CHECK(!evicted("c"));
}

TEST_CASE("rule 8: a member left waiting when its last peer leaves gets a full timeout") {
  CoreOptions o;
  o.progress_timeout = Millis(1'000);
  Harness h(o);
  h.Form({"a", "b"});
  auto wait_on_peers = [&](const std::string& g) {
    h.fx = {};
    REQUIRE(h.core
                .OnHeartbeat(HeartbeatInput{h.job, g, "i1", 0, 1, 0, kPhasePeerWait, "addr-" + g},
                             h.clock.Now(), &h.fx)
                .ok());
  };
  for (int i = 0; i < 20; ++i) {
    h.clock.Advance(Millis(100));
    wait_on_peers("a");
    wait_on_peers("b");
  }
  h.Tick();
  CHECK(!h.HasEvent("group_evicted"));
  // b leaves: a has nobody left to wait on, but it waited on b until now, not stalled.
  h.fx = {};
  REQUIRE(h.core.OnLeave(h.job, "b", "i1", "finished", h.clock.Now(), &h.fx).ok());
  h.clock.Advance(Millis(900));
  wait_on_peers("a");
  CHECK(!h.HasEvent("group_evicted"));
  h.clock.Advance(Millis(100));
  h.Tick();
  CHECK(h.HasEvent("group_evicted job=j group=a incarnation=i1 step=0 stalled_ms=1000 "));
}

TEST_CASE("rule 8: a member waiting in a round is not evicted") {
  CoreOptions o;
  o.progress_timeout = Millis(1'000);
  Harness h(o);
  h.Form({"a", "b"});
  REQUIRE(h.Join("a", 1).ok());  // a waits; b keeps the round open
  h.clock.Advance(Millis(900));
  REQUIRE(h.Beat("a", 1).ok());
  // Only b's progress deadline remains (a is a waiting participant).
  CHECK(h.core.NextDeadline() == TimePoint{} + std::chrono::hours(1) + Millis(1'000));
  h.clock.Advance(Millis(100));
  h.Tick();
  CHECK(h.HasEvent("group_evicted job=j group=b"));
  CHECK(!h.HasEvent("group_evicted job=j group=a"));
  // b's eviction makes a's round ready at once: a is the only healthy group.
  REQUIRE(h.Answer("a") != nullptr);
  CHECK(h.Answer("a")->quorum_id == 2);
}

}  // namespace
}  // namespace lk::lighthouse

namespace lk::lighthouse {
namespace {

using testing::Harness;

CoreOptions TwoReplicas() {
  CoreOptions o;
  o.min_replicas = 2;
  return o;
}

// a and b train step 1 in quorum 1, but b's outer step fails: a alone commits step 1, saves it
// and finishes (leaves with reason "finished"), so b is one step behind a finished job.
void FinishWithOneBehind(Harness& h) {
  h.Form({"a", "b"});
  REQUIRE(h.Commit("b", 1, 1, /*ok=*/false).ok());
  REQUIRE(h.Commit("a", 1, 1).ok());
  Effects fx;
  REQUIRE(h.core.OnRegisterCheckpoint({"j", 1, "/ckpt/a", "", "a", 0}, &fx).ok());
  h.fx = {};
  REQUIRE(h.core.OnLeave("j", "a", "i1", "finished", h.clock.Now(), &h.fx).ok());
}

TEST_CASE(
    "a finished job: a group behind it catches up alone from the final checkpoint after "
    "join_timeout, and its commits are refused") {
  Harness h(TwoReplicas());
  FinishWithOneBehind(h);
  CHECK(h.HasEvent("job_finished job=j step=1 group=a"));
  REQUIRE(h.fx.persist_jobs.size() >= 1);
  CHECK(h.fx.persist_jobs[0].finished_step == 1);
  CHECK(h.core.View(h.clock.Now())[0].finished_step == 1);

  // b asks from step 0: min_replicas=2 can never be met again, but returning groups get the
  // join timeout to form a regular quorum first.
  REQUIRE(h.Join("b", 0).ok());
  CHECK(h.fx.answers.empty());
  const TimePoint ready = h.clock.Now() + Millis(2000);
  REQUIRE(h.core.NextDeadline() == ready);
  h.clock.Set(ready - std::chrono::nanoseconds(1));
  h.Tick();
  CHECK(h.fx.answers.empty());
  h.clock.Set(ready);
  h.Tick();
  const QuorumAnswer* b = h.Answer("b");
  REQUIRE(b != nullptr);
  CHECK(b->quorum_id == 2);
  CHECK(b->heal);
  CHECK(b->max_step == 1);
  REQUIRE(b->restore_checkpoint.has_value());
  CHECK(b->restore_checkpoint->step == 1);
  CHECK(b->restore_checkpoint->location == "/ckpt/a");
  CHECK(b->source_ranks.empty());
  CHECK(b->reason ==
        "catch_up: the job finished at step 1; 1 group behind it restore the newest checkpoint");
  CHECK(
      h.HasEvent("quorum_issued job=j quorum_id=2 changed=true members=1 healing=1 "
                 "max_step=1 restore_step=1 catch_up=true"));
  REQUIRE(!h.fx.persist_jobs.empty());
  CHECK(h.fx.persist_jobs.back().catch_up);

  // Nothing is trained past the finish below min_replicas.
  auto refused = h.Commit("b", 2, 2);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == Code::kConflict);
  CHECK(refused.status().reason() == Reason::kJobFinished);
  CHECK(h.core.CommittedStep("j") == 1);
  // A failed commit is still taken (it only asks for a new quorum id).
  CHECK(h.Commit("b", 2, 2, /*ok=*/false).ok());
  // And b's own finish keeps the job finished at step 1.
  REQUIRE(h.core.OnLeave("j", "b", "i1", "finished", h.clock.Now(), &h.fx).ok());
  CHECK(h.core.View(h.clock.Now())[0].finished_step == 1);
}

TEST_CASE(
    "a finished job survives a lighthouse restart: a new life of a group behind it catches "
    "up") {
  Harness h(TwoReplicas());
  FinishWithOneBehind(h);
  JobRecordData record = h.fx.persist_jobs.at(0);
  CHECK(record.finished_step == 1);
  LighthouseCore loaded(TwoReplicas());
  REQUIRE(loaded.Load({record}, h.core.Checkpoints("j"), h.clock.Now(), h.fx.persist_groups).ok());
  Effects fx;
  // b comes back as a new life without state (it was killed and restarted).
  REQUIRE(
      loaded.OnHeartbeat({"j", "b", "i2", 0, 1, 0, "train", "addr-b", 0}, h.clock.Now(), &fx).ok());
  fx = {};
  REQUIRE(
      loaded.OnJoin({"j", "b", "i2", 0, 1, 0, false, false, "addr-b", 0}, h.clock.Now(), &fx).ok());
  CHECK(fx.answers.empty());
  fx = {};
  loaded.Tick(h.clock.Now() + Millis(2000), &fx);
  REQUIRE(fx.answers.size() == 1);
  CHECK(fx.answers[0].second.heal);
  CHECK(fx.answers[0].second.max_step == 1);
  CHECK(fx.answers[0].second.restore_checkpoint.has_value());
}

TEST_CASE(
    "a finished job: groups that return together form a regular quorum, which restores "
    "the checkpoint ahead of their state and clears the finish") {
  Harness h(TwoReplicas());
  FinishWithOneBehind(h);
  REQUIRE(h.Beat("c").ok());
  REQUIRE(h.Join("b", 0).ok());
  CHECK(h.fx.answers.empty());
  REQUIRE(h.Join("c", 0).ok());
  REQUIRE(h.fx.answers.size() == 2);
  for (const char* g : {"b", "c"}) {
    const QuorumAnswer* a = h.Answer(g);
    REQUIRE(a != nullptr);
    CHECK(a->heal);
    CHECK(a->max_step == 1);
    REQUIRE(a->restore_checkpoint.has_value());
    CHECK(a->restore_checkpoint->step == 1);
    CHECK(a->reason.rfind("catch_up", 0) != 0);
  }
  CHECK(h.core.View(h.clock.Now())[0].finished_step == 0);
  // A regular quorum commits: the job trains on from the final step.
  REQUIRE(h.Commit("b", 2, 2).ok());
  CHECK(h.core.CommittedStep("j") == 2);
}

TEST_CASE("a finish that is not at the job's committed step marks nothing") {
  Harness h(TwoReplicas());
  h.Form({"a", "b", "c"});
  REQUIRE(h.Commit("a", 1, 1).ok());
  REQUIRE(h.Commit("b", 1, 1).ok());
  // c never committed step 1: its "finished" leave is no finish of the job.
  REQUIRE(h.core.OnLeave("j", "c", "i1", "finished", h.clock.Now(), &h.fx).ok());
  CHECK_FALSE(h.HasEvent("job_finished"));
  CHECK(h.core.View(h.clock.Now())[0].finished_step == 0);
  // Nor does a leave for another reason at the committed step.
  REQUIRE(h.core.OnLeave("j", "b", "i1", "preempted", h.clock.Now(), &h.fx).ok());
  CHECK(h.core.View(h.clock.Now())[0].finished_step == 0);
}

}  // namespace
}  // namespace lk::lighthouse
