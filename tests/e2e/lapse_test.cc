// A group whose heartbeats lapse (its agent stalled: a frozen host, a long page-in, a network
// hiccup) past heartbeat_timeout is no dead group: the quorum goes on without it, and when the
// agent is heard again the group asks as a joiner, heals from its peers and trains to the end
// in the same life, with every replica equal. The agent is paused with SIGSTOP, which is what a
// stall looks like from the lighthouse; nothing is killed and every process must exit 0.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <csignal>
#include <thread>

#include "tests/e2e/chaos_run.h"

namespace lk::e2e {
namespace {

TEST_CASE("a group whose agent stalls past heartbeat_timeout rejoins in the same life, healed") {
  RunOptions o;
  o.job = "lapse";
  o.steps = 12;
  o.group_size = 2;
  o.trainer_flags = {"--inner-step-min-ms", "20"};
  o.lighthouse_flags = {"--min-replicas", "1", "--join-timeout-ms", "2000",
                        "--heartbeat-timeout-ms", "1000"};
  Run run("lapse", o);
  StatusWatch watch(run.lh.address, o.job);
  run.StartGroup("g0");
  Life* g1 = run.StartGroup("g1");
  REQUIRE(WaitCommitted(watch, 3, 90s));

  g1->agent->Signal(SIGSTOP);
  const std::string lapsed = run.lh.process->WaitForLog("group_unhealthy job=lapse group=g1", 30s);
  REQUIRE_MESSAGE(!lapsed.empty(), "the lighthouse never timed g1 out");
  // g0 goes on alone: a commit after the lapse is one without g1.
  const uint32_t at_lapse = watch.committed();
  const bool went_on = WaitCommitted(watch, at_lapse + 1, 60s);
  g1->agent->Signal(SIGCONT);
  REQUIRE_MESSAGE(went_on, "g0 did not commit without g1");
  MESSAGE("g1's agent paused at committed step " << at_lapse << ", resumed after step "
                                                 << watch.committed());

  INFO("g1's agent log " << g1->agent->log_path());
  CHECK_FALSE(g1->agent->WaitForLog("heartbeat_lapsed lighthouse_reason=\"heartbeat_timeout ", 30s).empty());
  run.WaitSurvivors(180s);  // every trainer and agent of both groups exits 0
  watch.Stop();
  for (const std::string& v : watch.violations()) FAIL_CHECK(v);
  CHECK(watch.committed() == o.steps);
  CheckLogs(run.AllLogs(), o.steps, o.group_size);
  CHECK(g1->agent->Log().find("group_failed") == std::string::npos);
  // Behind by the steps g0 committed alone, g1 came back by a heal from g0's live state.
  for (const auto& t : g1->trainers) {
    INFO("trainer stderr " << t->log_path());
    CHECK(t->Log().find("heal_fetched from=peers ") != std::string::npos);
  }
}

}  // namespace
}  // namespace lk::e2e
