// A lighthouse outage that outlasts the run: the groups train on without it and finish; their
// agents keep what they could not report (the last commits, the leaves) and deliver it, in
// order, when the lighthouse is back on the same state directory and port, so that its record
// (the committed step, each group's end and reason) is the run's. Real binaries on port 0;
// every wait is bounded and waits for a condition.
#include <doctest/doctest.h>
#include <signal.h>

#include <fstream>
#include <thread>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include "tests/support/process.h"
#include "tests/support/status_snapshot.h"
#include "tests/support/wait.h"

namespace lk::test {
namespace {

using namespace std::chrono_literals;
namespace pb = lightkeeper::v1;

const std::vector<std::string> kLighthouseFlags = {"--heartbeat-timeout-ms", "3000",
                                                   "--join-timeout-ms", "300"};

struct Group {
  std::unique_ptr<Process> agent;
  std::unique_ptr<Process> trainer;
  std::string trainer_log;
};

struct Run {
  std::string dir;
  Lighthouse lh;
  std::map<std::string, Group> groups;

  explicit Run(const std::string& tag) : dir(TempDir(tag)) {
    lh = StartLighthouse(dir + "/data", kLighthouseFlags, dir + "/lighthouse.log");
  }

  void Start(const std::string& name, uint32_t steps, const std::string& final_timeout_ms) {
    Group& g = groups[name];
    const std::string socket = fmt::format("{}/{}.sock", dir, name);
    g.agent = std::make_unique<Process>(
        std::vector<std::string>{
            BinDir() + "/replica_agent", "--lighthouse", lh.url(), "--job", "t", "--group-id", name,
            "--socket", socket, "--heartbeat-interval-ms", "100", "--drain-timeout-ms", "5000",
            "--backoff-max-ms", "500", "--final-report-timeout-ms", final_timeout_ms},
        fmt::format("{}/agent-{}.log", dir, name));
    REQUIRE_FALSE(g.agent->WaitForLog("agent_listening", 10s).empty());
    g.trainer_log = fmt::format("{}/trainer-{}.jsonl", dir, name);
    g.trainer = std::make_unique<Process>(
        std::vector<std::string>{BinDir() + "/test_trainer", "--group-rank", "0", "--group-size",
                                 "1", "--steps", std::to_string(steps), "--step-sleep-ms", "50",
                                 "--log", g.trainer_log},
        g.trainer_log + ".stderr", std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}});
  }

  pb::JobStatus Status() { return test::JobStatusAt(lh.url(), "t"); }

  // Waits until both groups ran an outer step together (their quorum's communicator is built;
  // a quorum still forming when the lighthouse dies would wait for its rendezvous).
  void WaitForStepTogether() {
    for (auto& [name, g] : groups) {
      bool together = WaitUntil(
          [&] {
            std::ifstream in(g.trainer_log);
            std::string line;
            while (std::getline(in, line)) {
              if (JsonField(line, "event") == "allreduce" && JsonField(line, "ok") == "true" &&
                  JsonField(line, "world") == "2") {
                return true;
              }
            }
            return false;
          },
          30s, "a step with both groups");
      REQUIRE_MESSAGE(together, name << " never ran a step with the other group");
    }
  }

  void KillLighthouse() {
    lh.process->Signal(SIGKILL);
    REQUIRE(lh.process->Wait(10s).has_value());
  }
};

TEST_CASE(
    "a lighthouse outage that outlasts the run: once it is back, status shows the last "
    "committed step and both groups left finished") {
  constexpr uint32_t kSteps = 60;
  Run run("agent-outage");
  run.Start("a", kSteps, "120000");
  run.Start("b", kSteps, "120000");
  run.WaitForStepTogether();
  run.KillLighthouse();
  // The groups train on without the lighthouse and finish.
  for (auto& [name, g] : run.groups) {
    auto code = g.trainer->Wait(120s);
    REQUIRE_MESSAGE(code.has_value(), name << "'s trainer did not finish");
    CHECK(*code == 0);
    std::ifstream in(g.trainer_log);
    std::string line, done;
    while (std::getline(in, line)) {
      if (JsonField(line, "event") == "done") done = JsonField(line, "step");
    }
    CHECK(done == std::to_string(kSteps));
  }
  // Their agents stay for the final reports the lighthouse has not heard.
  for (auto& [name, g] : run.groups) {
    CAPTURE(name);
    CHECK_FALSE(g.agent->WaitForLog("final_reports_waiting reason=finished", 20s).empty());
    REQUIRE(g.agent->Running());
  }
  run.lh = StartLighthouse(run.dir + "/data", kLighthouseFlags, run.dir + "/lighthouse.log",
                           run.lh.address);
  for (auto& [name, g] : run.groups) {
    CAPTURE(name);
    auto code = g.agent->Wait(60s);
    REQUIRE(code.has_value());
    CHECK(*code == 0);
    CHECK_FALSE(g.agent->WaitForLog("final_reports_delivered reason=finished", 1s).empty());
    CHECK_FALSE(g.agent->WaitForLog("left reason=finished result=ok", 1s).empty());
  }
  pb::JobStatus job = run.Status();
  CHECK(job.committed_step() == kSteps);
  CHECK(job.finished_step() == kSteps);
  REQUIRE(job.groups_size() == 2);
  for (const auto& g : job.groups()) {
    CAPTURE(g.group_id());
    CHECK(g.state() == "left");
    CHECK(g.reason() == "finished");
    CHECK(g.step() == kSteps);
  }
  // The record is the persisted one: a second restart shows the same.
  run.KillLighthouse();
  run.lh = StartLighthouse(run.dir + "/data", kLighthouseFlags, run.dir + "/lighthouse.log",
                           run.lh.address);
  job = run.Status();
  CHECK(job.committed_step() == kSteps);
  for (const auto& g : job.groups()) {
    CHECK(g.state() == "left");
    CHECK(g.reason() == "finished");
  }
}

TEST_CASE(
    "a lighthouse that never comes back: the finished agent exits after "
    "--final-report-timeout-ms and logs what it could not deliver") {
  Run run("agent-outage-bound");
  run.Start("a", 40, "1500");
  run.Start("b", 40, "1500");
  run.WaitForStepTogether();
  run.KillLighthouse();
  for (auto& [name, g] : run.groups) {
    CAPTURE(name);
    auto trainer = g.trainer->Wait(120s);
    REQUIRE(trainer.has_value());
    CHECK(*trainer == 0);
    auto code = g.agent->Wait(60s);
    REQUIRE(code.has_value());
    CHECK(*code == 0);
    std::string undelivered = g.agent->WaitForLog("final_reports_undelivered reason=finished", 1s);
    REQUIRE_FALSE(undelivered.empty());
    CHECK(undelivered.find("leave=1") != std::string::npos);
    CHECK(undelivered.find("commit=0 ") == std::string::npos);
    CHECK(undelivered.find("steps=") != std::string::npos);
    CHECK(undelivered.find("..40") != std::string::npos);
  }
}

}  // namespace
}  // namespace lk::test
