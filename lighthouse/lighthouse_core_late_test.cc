// Late reports: what agents kept while the lighthouse was away (commits of the steps they went
// on to on their quorum, leaves, checkpoint registrations) and deliver when it is back, also
// after a restart that kept the persisted records and lost every heartbeat. The lighthouse
// takes those consistent with its record and refuses the rest with a reason, changing nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <memory>

#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_test_util.h"

namespace lk::lighthouse::testing {
namespace {

using namespace std::chrono_literals;

// What the shell would have in RocksDB: the last record written of each job and group, and the
// checkpoints.
struct Store {
  std::vector<JobRecordData> jobs;
  std::vector<GroupRecordData> groups;
  std::vector<CheckpointData> checkpoints;

  void Keep(const Effects& fx) {
    for (const auto& j : fx.persist_jobs) {
      std::erase_if(jobs, [&](const JobRecordData& x) { return x.job == j.job; });
      jobs.push_back(j);
    }
    for (const auto& g : fx.persist_groups) {
      std::erase_if(groups, [&](const GroupRecordData& x) { return x.group_id == g.group_id; });
      groups.push_back(g);
    }
    for (const auto& c : fx.persist_checkpoints) checkpoints.push_back(c);
  }
};

// A job of groups a and b that trained on quorum 1 to step 2 with the lighthouse, while c
// (c0 replaced by c1) heartbeats outside the quorum; then the lighthouse restarted from what it
// had persisted. The quorum was handed out for step 1 (max_step 1), so step 2 is its regular
// commit and steps 3, 4, ... are the ones the groups went on to without the lighthouse.
struct Restarted {
  Store store;
  Harness before;
  std::unique_ptr<Harness> h;
  uint32_t q = 0;

  Restarted() {
    auto keep = [&] { store.Keep(before.fx); };
    for (const char* g : {"a", "b"}) {
      REQUIRE(before.Beat(g).ok());
      keep();
    }
    for (const char* g : {"a", "b"}) {
      REQUIRE(before.Join(g, 0).ok());
      keep();
    }
    q = before.Answer("a")->quorum_id;
    for (uint32_t step : {1u, 2u}) {
      for (const char* g : {"a", "b"}) {
        REQUIRE(before.Commit(g, q, step).ok());
        keep();
      }
      if (step == 2) break;
      for (const char* g : {"a", "b"}) {
        REQUIRE(before.Join(g, step).ok());
        keep();
      }
      REQUIRE(before.Answer("a") != nullptr);
      REQUIRE(before.Answer("a")->quorum_id == q);  // the same members: the same id
      REQUIRE(before.Answer("a")->max_step == 1);
    }
    REQUIRE(before.Beat("c", 0, "c0").ok());
    keep();
    REQUIRE(before.Beat("c", 0, "c1").ok());
    keep();
    h = std::make_unique<Harness>(before.options);
    h->clock.Set(before.clock.Now());
    REQUIRE(h->core.Load(store.jobs, store.checkpoints, h->clock.Now(), store.groups).ok());
    // No agent heartbeats after the restart (their trainers finished): the loaded members expire.
    h->clock.Advance(before.options.heartbeat_timeout + 1s);
    h->Tick();
  }

  Status Leave(const std::string& g, const std::string& inc, const std::string& reason) {
    h->fx = {};
    return h->core.OnLeave("j", g, inc, reason, h->clock.Now(), &h->fx);
  }
  uint32_t Committed() { return h->core.CommittedStep("j"); }
};

TEST_CASE(
    "late: after a restart, the commits members kept are taken in order - the record "
    "catches up - their leaves end each group") {
  Restarted r;
  Harness& h = *r.h;
  CHECK(r.Committed() == 2);
  for (uint32_t step : {3u, 4u, 5u}) {
    for (const char* g : {"a", "b"}) {
      auto c = h.Commit(g, r.q, step);
      REQUIRE_MESSAGE(c.ok(), g << " step " << step << ": " << c.status().ToString());
      CHECK(h.HasEvent(fmt::format("commit job=j quorum_id={} group={}", r.q, g)));
      CHECK(h.fx.events.back().find("continued=true") != std::string::npos);
      // The record is written with each one, as with any commit.
      REQUIRE(h.fx.persist_jobs.size() == 1);
      CHECK(h.fx.persist_jobs[0].committed_step == step);
      r.store.Keep(h.fx);
    }
  }
  CHECK(r.Committed() == 5);
  // A repeat (the answer to a delivery was lost) changes nothing and is no error.
  REQUIRE(h.Commit("a", r.q, 5).ok());
  CHECK(r.Committed() == 5);
  // A durable checkpoint registered late, after the commit of its step.
  h.fx = {};
  REQUIRE(h.core.OnRegisterCheckpoint({"j", 5, "/ckpt/j/step-5", "", "a", 0}, &h.fx).ok());
  r.store.Keep(h.fx);
  // The leaves of the group's recorded incarnations, after their last commits.
  REQUIRE(r.Leave("a", "i1", "finished").ok());
  r.store.Keep(h.fx);
  CHECK(h.HasEvent("job_finished job=j step=5 group=a"));
  REQUIRE(r.Leave("b", "i1", "finished").ok());
  r.store.Keep(h.fx);
  for (const char* g : {"a", "b"}) {
    const GroupView* v = h.Group(g);
    REQUIRE(v != nullptr);
    CHECK(v->state == "left");
    CHECK(v->reason == "finished");
    CHECK(v->step == 5);
  }
  // All of it survives the next restart.
  LighthouseCore again(h.options);
  REQUIRE(again.Load(r.store.jobs, r.store.checkpoints, h.clock.Now(), r.store.groups).ok());
  auto views = again.View(h.clock.Now());
  REQUIRE(views.size() == 1);
  CHECK(views[0].committed_step == 5);
  CHECK(views[0].finished_step == 5);
  REQUIRE(views[0].checkpoints.size() == 1);
  CHECK(views[0].checkpoints[0].step == 5);
  for (const GroupView& v : views[0].groups) {
    if (v.group_id == "c") continue;
    CHECK(v.state == "left");
    CHECK(v.reason == "finished");
  }
}

TEST_CASE(
    "late: a kept commit delivered after the quorum was handed out again for a later step is "
    "taken - it moves no step back and counts its tokens once") {
  Harness h;
  h.Form({"a", "b"});
  const uint32_t q = h.Answer("a")->quorum_id;
  auto commit = [&](const std::string& g, uint32_t step) {
    h.fx = {};
    return h.core.OnCommit(CommitInput{"j", g, "i1", 0, q, step, true, "h", 100}, h.clock.Now(),
                           &h.fx);
  };
  // Both went on to step 3 while the lighthouse was away. a delivered what it kept; b's outbox
  // is slower, and its next ask overtook it.
  for (uint32_t step : {1u, 2u, 3u}) REQUIRE(commit("a", step).ok());
  for (const char* g : {"a", "b"}) REQUIRE(h.Join(g, 3).ok());
  REQUIRE(h.Answer("b") != nullptr);
  REQUIRE(h.Answer("b")->quorum_id == q);
  REQUIRE(h.Answer("b")->max_step == 3);
  for (uint32_t step : {1u, 2u, 3u}) {
    auto c = commit("b", step);
    REQUIRE_MESSAGE(c.ok(), "step " << step << ": " << c.status().ToString());
    CHECK(h.fx.events.back().find("late=true") != std::string::npos);
    CHECK(h.core.CommittedStep("j") == 3);
  }
  REQUIRE(h.Group("b") != nullptr);
  CHECK(h.Group("b")->tokens_step == 3);
  CHECK(h.Group("b")->tokens_total == 300);
  // The same commit again (its answer was lost) counts nothing twice.
  REQUIRE(commit("b", 3).ok());
  CHECK(h.Group("b")->tokens_total == 300);
  // The quorum's regular step is still the only one past it, and nothing below its first step
  // (step 0 here) or past the committed step is late.
  REQUIRE(commit("b", 4).ok());
  CHECK(h.core.CommittedStep("j") == 4);
  CHECK(commit("b", 7).status().reason() == Reason::kWrongStep);
  CHECK(commit("b", 0).status().reason() == Reason::kWrongStep);
}

TEST_CASE(
    "late: reports inconsistent with the record are refused with a reason and change "
    "nothing") {
  Restarted r;
  Harness& h = *r.h;
  REQUIRE(h.Commit("a", r.q, 3).ok());  // a is at step 3 now, b at 2
  REQUIRE(r.Leave("b", "i1", "cancelled").ok());
  LighthouseCore& core = h.core;
  auto now = [&] { return h.clock.Now(); };
  auto commit = [&](const std::string& g, const std::string& inc, uint32_t qid, uint32_t step,
                    bool ok = true) {
    return [&, g, inc, qid, step, ok](Effects* fx) {
      return core.OnCommit(CommitInput{"j", g, inc, 0, qid, step, ok, ""}, now(), fx).status();
    };
  };
  struct Case {
    const char* what;
    std::function<Status(Effects*)> input;
    Code code;
    Reason reason;
  };
  const std::vector<Case> cases = {
      {"a commit of an incarnation not in the record", commit("a", "ghost", r.q, 4),
       Code::kConflict, Reason::kUnknownIncarnation},
      {"a commit of a replaced incarnation", commit("c", "c0", r.q, 1), Code::kConflict,
       Reason::kStaleIncarnation},
      {"a commit of a group the record never had", commit("zz", "z1", r.q, 4), Code::kNotFound,
       Reason::kUnknownGroup},
      {"a commit for a quorum never issued", commit("a", "i1", r.q + 3, 4), Code::kConflict,
       Reason::kWrongQuorum},
      {"a commit for an older quorum", commit("a", "i1", r.q - 1, 4), Code::kConflict,
       Reason::kWrongQuorum},
      {"a commit of a group outside the quorum", commit("c", "c1", r.q, 1), Code::kConflict,
       Reason::kNotAMember},
      {"a commit two steps past the group's", commit("a", "i1", r.q, 5), Code::kConflict,
       Reason::kWrongStep},
      {"a commit at step 4294967295", commit("a", "i1", r.q, 4294967295u), Code::kConflict,
       Reason::kWrongStep},
      {"a commit below the quorum's start", commit("a", "i1", r.q, 1), Code::kConflict,
       Reason::kWrongStep},
      {"a commit after the group's leave", commit("b", "i1", r.q, 3), Code::kConflict,
       Reason::kGroupLeft},
      {"a leave of an incarnation not in the record",
       [&](Effects* fx) { return core.OnLeave("j", "a", "ghost", "finished", now(), fx); },
       Code::kConflict, Reason::kUnknownIncarnation},
      {"a leave of a replaced incarnation",
       [&](Effects* fx) { return core.OnLeave("j", "c", "c0", "finished", now(), fx); },
       Code::kConflict, Reason::kStaleIncarnation},
      {"a checkpoint past the committed step",
       [&](Effects* fx) {
         return core.OnRegisterCheckpoint({"j", 4, "/ckpt/j/step-4", "", "a", 0}, fx);
       },
       Code::kConflict, Reason::kCheckpointNotCommitted},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const std::string before = Snapshot(core, now());
    Effects fx;
    Status st = c.input(&fx);
    CHECK(st.code() == c.code);
    CHECK(ReasonName(st.reason()) == ReasonName(c.reason));
    CHECK(fx.events.empty());
    CHECK(fx.persist_jobs.empty());
    CHECK(fx.persist_groups.empty());
    CHECK(fx.persist_checkpoints.empty());
    CHECK(Snapshot(core, now()) == before);
  }
  CHECK(r.Committed() == 3);
  // After all the refusals the next step of a is still taken.
  REQUIRE(h.Commit("a", r.q, 4).ok());
  CHECK(r.Committed() == 4);
}

TEST_CASE(
    "late: once a newer quorum was issued after the restart, the old quorum's kept commits are "
    "refused - its leaves are still taken") {
  Restarted r;
  Harness& h = *r.h;
  // c, outside the old quorum, asks while a and b (finished, silent) are unhealthy: a quorum of
  // c alone is issued with a new id.
  REQUIRE(h.Beat("c", 0, "c1").ok());
  REQUIRE(h.Join("c", 0, "c1").ok());
  REQUIRE(h.Answer("c") != nullptr);
  const uint32_t newer = h.Answer("c")->quorum_id;
  CHECK(newer > r.q);
  auto late = h.Commit("a", r.q, 3);
  CHECK(late.status().code() == Code::kConflict);
  CHECK(ReasonName(late.status().reason()) == ReasonName(Reason::kWrongQuorum));
  CHECK(r.Committed() == 2);
  REQUIRE(r.Leave("a", "i1", "finished").ok());
  CHECK(h.Group("a")->state == "left");
}

TEST_CASE(
    "late: a failure report of the current quorum is taken after a restart - the next "
    "quorum gets a new id") {
  Restarted r;
  Harness& h = *r.h;
  REQUIRE(h.Commit("a", r.q, 0, /*ok=*/false).ok());
  CHECK(r.Committed() == 2);
  REQUIRE(h.Beat("a", 2).ok());
  REQUIRE(h.Beat("b", 2).ok());
  REQUIRE(h.Join("a", 2).ok());
  REQUIRE(h.Join("b", 2).ok());
  REQUIRE(h.Answer("a") != nullptr);
  CHECK(h.Answer("a")->quorum_id > r.q);
}

TEST_CASE(
    "late: with the lighthouse up, a group that went on without it (a partition) has its "
    "kept commits taken in order; a heartbeat's step counts as reached") {
  Harness h;
  h.Form({"a", "b"});
  const uint32_t q = h.Answer("a")->quorum_id;
  REQUIRE(h.Commit("a", q, 1).ok());
  REQUIRE(h.Commit("a", q, 2).ok());  // continued: one past the step reached
  CHECK(h.Commit("a", q, 4).status().reason() == Reason::kWrongStep);
  // b's heartbeat says it is at step 4: its commits up to step 5 are one past what it reached.
  REQUIRE(h.Beat("b", 4).ok());
  REQUIRE(h.Commit("b", q, 3).ok());
  REQUIRE(h.Commit("b", q, 5).ok());
  CHECK(h.core.CommittedStep("j") == 5);
  CHECK(h.Commit("a", q, 7).status().reason() == Reason::kWrongStep);
}

// Found by the agents' simulation (tests/sim/agent_sim.cc): a restarted lighthouse forgot that
// its current quorum had lost a member, handed the same id out again to the members that came
// back, and agents that had heard of the loss counted it lost (their trainers failed every step
// on it at once) while the others waited in it.
TEST_CASE("late: a quorum that lost a member is not handed out again after a restart") {
  Store store;
  Harness before;
  auto keep = [&] { store.Keep(before.fx); };
  for (const char* g : {"a", "b"}) {
    REQUIRE(before.Beat(g).ok());
    keep();
  }
  for (const char* g : {"a", "b"}) {
    REQUIRE(before.Join(g, 0).ok());
    keep();
  }
  const uint32_t q = before.Answer("a")->quorum_id;
  before.clock.Advance(before.options.heartbeat_timeout / 2);
  REQUIRE(before.Beat("a").ok());  // b goes silent
  before.clock.Advance(before.options.heartbeat_timeout / 2 + 1ms);
  before.Tick();
  keep();
  REQUIRE(before.HasEvent("member_lost job=j quorum_id=1 group=b"));
  REQUIRE(before.core.Watch("j", q)->lost);
  Harness h(before.options);
  h.clock.Set(before.clock.Now());
  REQUIRE(h.core.Load(store.jobs, store.checkpoints, h.clock.Now(), store.groups).ok());
  CHECK(h.core.Watch("j", q)->lost);
  // Both come back and ask for step 0 again: a new id, not the lost one.
  for (const char* g : {"a", "b"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(h.Join("a", 0).ok());
  REQUIRE(h.Join("b", 0).ok());
  REQUIRE(h.Answer("b") != nullptr);
  CHECK(h.Answer("b")->quorum_id > q);
}

// Found by the agents' simulation: a failed outer step left the quorum standing for the other
// members, whose step on it then waited for the failing group until their communicators timed
// out.
TEST_CASE("late: a failed outer step tells the quorum's other members at once") {
  Harness h;
  h.Form({"a", "b"});
  const uint32_t q = h.Answer("a")->quorum_id;
  CHECK(!h.core.Watch("j", q)->lost);
  REQUIRE(h.Commit("a", q, 1, /*ok=*/false).ok());
  CHECK(h.fx.watch_wakeups.count("j") == 1);
  CHECK(h.core.Watch("j", q)->lost);
  REQUIRE(h.fx.persist_jobs.size() == 1);
  CHECK(h.fx.persist_jobs[0].lost);
  // The next round takes a new id.
  REQUIRE(h.Join("a", 0).ok());
  REQUIRE(h.Join("b", 0).ok());
  REQUIRE(h.Answer("a") != nullptr);
  CHECK(h.Answer("a")->quorum_id > q);
}

// The agents' simulation, seed 23931: a node's kept commit of the earlier round arrived after
// the round was handed out again; counted as a use of the new round, the retry of the group's
// other node (whose answer was lost) was taken as a new ask, and the node that had its answer
// waited in the round for good.
TEST_CASE("late: a late commit does not use the round handed out now - a retry still gets it") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(h.Commit("a", 1, 1).ok());
  REQUIRE(h.Commit("b", 1, 1).ok());
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.Join("b", 1).ok());
  REQUIRE(h.fx.answers.size() == 2);
  REQUIRE(h.Answer("a")->quorum_id == 1);
  REQUIRE(h.Commit("a", 1, 1).ok());  // the kept commit of the round before
  CHECK(h.HasEvent("commit job=j quorum_id=1 group=a incarnation=i1 node=0 step=1 ok=true "
                   "committed_step=1 tokens=0 continued=false late=true"));
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.Answer("a") != nullptr);
  CHECK(h.Answer("a")->reason == "retry: current quorum 1");
}

}  // namespace
}  // namespace lk::lighthouse::testing
