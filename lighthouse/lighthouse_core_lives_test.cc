// A group's lives across incarnations: the crash count a Slurm batch script bounds its crash
// requeues with (POST /v1/event, and a leave with reason trainer_crashed), and refused requeues.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include "lighthouse/lighthouse_core_test_util.h"

namespace lk::lighthouse {
namespace {

using testing::Harness;
using testing::Snapshot;

Result<GroupLivesData> Event(Harness& h, const std::string& g, const std::string& inc,
                             GroupEventKind kind, const std::string& detail = "") {
  h.fx = {};
  return h.core.OnGroupEvent({h.job, g, inc, kind, detail}, h.clock.Now(), &h.fx);
}

TEST_CASE("lives: a crash counts once per incarnation, whether the agent's leave or the "
          "launcher says so; preemptions never count") {
  Harness h;
  h.Form({"a", "b"});
  h.fx = {};
  REQUIRE(h.core.OnLeave("j", "a", "i1", "trainer_crashed", h.clock.Now(), &h.fx).ok());
  CHECK(h.HasEvent("group_left"));
  REQUIRE(h.fx.persist_jobs.size() >= 1);
  CHECK(h.Group("a")->crashes == 1);
  // The batch script reports the same crash: nothing more is counted.
  auto r = Event(h, "a", "i1", GroupEventKind::kTrainerCrashed, "rc=1");
  REQUIRE(r.ok());
  CHECK(r->crashes == 1);
  CHECK(h.HasEvent("group_event job=j group=a incarnation=i1 event=trainer_crashed"));
  CHECK(h.fx.persist_jobs.empty());
  // A second life that is preempted (requeued for wall time) counts nothing.
  REQUIRE(h.Beat("a", 0, "i2").ok());
  h.fx = {};
  REQUIRE(h.core.OnLeave("j", "a", "i2", "time_limit", h.clock.Now(), &h.fx).ok());
  CHECK(h.Group("a")->crashes == 1);
  // A third life crashes and only the launcher says so (its agent died with it).
  REQUIRE(h.Beat("a", 0, "i3").ok());
  r = Event(h, "a", "i3", GroupEventKind::kTrainerCrashed);
  REQUIRE(r.ok());
  CHECK(r->crashes == 2);
  REQUIRE(h.fx.persist_jobs.size() == 1);
  CHECK(h.fx.persist_jobs[0].lives.size() == 1);
  CHECK(h.fx.persist_jobs[0].lives[0].crashes == 2);
  // A retired life may still report (late): i1's crash was counted already.
  r = Event(h, "a", "i1", GroupEventKind::kTrainerCrashed);
  REQUIRE(r.ok());
  CHECK(r->crashes == 2);
  CHECK(h.Group("b")->crashes == 0);
  // A life that crashed before its agent was ever heard of (its launcher reports it) counts.
  r = Event(h, "a", "i4", GroupEventKind::kTrainerCrashed, "rc=1 before the first heartbeat");
  REQUIRE(r.ok());
  CHECK(r->crashes == 3);
}

TEST_CASE("lives: a crash loop of many lives counts each, and the record stays bounded") {
  Harness h;
  h.Form({"a"});
  for (int i = 0; i < 40; ++i) {
    auto r = Event(h, "a", fmt::format("loop-{}", i), GroupEventKind::kTrainerCrashed);
    REQUIRE(r.ok());
    CHECK(r->crashes == static_cast<uint32_t>(i + 1));
    CHECK(r->crashed_incarnations.size() <= kCrashedLivesKept);
  }
  // The newest lives are the ones remembered: a repeated report of one of them counts nothing.
  CHECK(Event(h, "a", "loop-39", GroupEventKind::kTrainerCrashed)->crashes == 40);
}

TEST_CASE("lives: every refused requeue counts and is shown with its detail") {
  Harness h;
  h.Form({"a"});
  for (uint32_t i = 1; i <= 3; ++i) {
    auto r = Event(h, "a", "i1", GroupEventKind::kRequeueRefused, "Requeue of JobId=7 refused");
    REQUIRE(r.ok());
    CHECK(r->requeue_refusals == i);
    CHECK(r->crashes == 0);
  }
  CHECK(h.Group("a")->requeue_refusals == 3);
  CHECK(h.Group("a")->last_event == "requeue_refused: Requeue of JobId=7 refused");
}

TEST_CASE("lives: refusals change nothing - unknown job, no group id, oversized detail") {
  Harness h;
  h.Form({"a"});
  const std::string before = Snapshot(h.core, h.clock.Now());
  h.job = "other";
  auto r = Event(h, "a", "i1", GroupEventKind::kTrainerCrashed);
  h.job = "j";
  CHECK(r.status().reason() == Reason::kUnknownJob);
  r = Event(h, "", "i1", GroupEventKind::kTrainerCrashed);
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(h.fx.events.empty());
  r = Event(h, "a", "i1", GroupEventKind::kRequeueRefused, std::string(300, 'x'));
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(h.fx.events.empty());
  CHECK(h.fx.persist_jobs.empty());
  CHECK(h.Group("a")->requeue_refusals == 0);
  CHECK(h.Group("a")->crashes == 0);
  CHECK(Snapshot(h.core, h.clock.Now()) == before);
}

TEST_CASE("lives: the count outlives the group's record and a lighthouse restart") {
  CoreOptions o;
  o.group_grace = Millis(1'000);
  Harness h(o);
  h.Form({"a", "b"});
  h.fx = {};
  REQUIRE(h.core.OnLeave("j", "a", "i1", "trainer_crashed", h.clock.Now(), &h.fx).ok());
  // The requeued job waits in the queue past the grace: the group is collected.
  h.clock.Advance(Millis(5'000));
  REQUIRE(h.Beat("b").ok());
  h.Tick();
  CHECK(h.Group("a") == nullptr);
  // Its next life crashes at once, before its agent is heard of: the launcher's report counts.
  auto r = Event(h, "a", "i2", GroupEventKind::kTrainerCrashed);
  REQUIRE(r.ok());
  CHECK(r->crashes == 2);
  REQUIRE(h.fx.persist_jobs.size() == 1);
  // A restarted lighthouse loads the job's record and goes on counting from it.
  LighthouseCore restarted(o);
  REQUIRE(restarted.Load({h.fx.persist_jobs[0]}, {}, h.clock.Now()).ok());
  Effects fx;
  auto again = restarted.OnGroupEvent({"j", "a", "i3", GroupEventKind::kTrainerCrashed, ""},
                                      h.clock.Now(), &fx);
  REQUIRE_MESSAGE(again.ok(), again.status().ToString());
  CHECK(again->crashes == 3);
  // A record with the lives of one group twice is refused as corrupt.
  JobRecordData bad = h.fx.persist_jobs[0];
  bad.lives.push_back(bad.lives[0]);
  LighthouseCore third(o);
  CHECK(third.Load({bad}, {}, h.clock.Now()).code() == Code::kDataLoss);
}

}  // namespace
}  // namespace lk::lighthouse
