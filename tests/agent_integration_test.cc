// The agent and the client library as users run them: a real lighthouse, one replica_agent per
// group and small trainers (tests/test_trainer.cc) that allreduce over Gloo; trainers, agents
// and the lighthouse are killed, stopped and restarted. Waits are bounded to catch hangs; no
// speed is asserted here (bench/ measures it).
#include <doctest/doctest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/http/client.h"
#include "common/http/codec.h"
#include "common/proto/lightkeeper.pb.h"
#include <lightkeeper/lightkeeper.h>
#include <lightkeeper/session.h>
#include "tests/support/process.h"
#include "tests/support/status_snapshot.h"
#include "tests/support/tcp_relay.h"
#include "tests/support/wait.h"

namespace lk::test {
namespace {

using namespace std::chrono_literals;
namespace pb = lightkeeper::v1;

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}


struct Group {
  std::string name;
  std::string socket;
  std::unique_ptr<Process> agent;
  std::vector<std::unique_ptr<Process>> trainers;
  std::vector<std::string> logs;
};

struct Cluster {
  std::string dir;
  Lighthouse lh;
  std::map<std::string, Group> groups;
  int starts = 0;
  std::vector<std::string> agent_flags;  // added to every agent's command line
  std::map<std::string, std::string> lighthouse_url;  // per group, instead of the lighthouse's
  std::map<std::string, std::vector<std::string>> trainer_flags;  // per group, added to each
  std::map<std::string, std::vector<std::string>> group_agent_flags;  // per group, added
  std::map<std::string, std::map<std::string, std::string>> agent_env;  // per group

  Cluster(const std::string& tag, std::vector<std::string> lh_flags) : dir(TempDir(tag)) {
    lh = StartLighthouse(dir + "/data", lh_flags, dir + "/lighthouse.log");
  }

  Group& Start(const std::string& name, uint32_t trainers, uint32_t steps, uint32_t sleep_ms = 30) {
    int n = starts++;
    Group& g = groups[name];
    g = Group{};
    g.name = name;
    g.socket = fmt::format("{}/{}-{}.sock", dir, name, n);
    std::string agent_log = fmt::format("{}/agent-{}-{}.log", dir, name, n);
    const std::string url = lighthouse_url.count(name) ? lighthouse_url[name] : lh.url();
    std::vector<std::string> argv{BinDir() + "/replica_agent", "--lighthouse", url, "--job",
                                  "t", "--group-id", name, "--socket", g.socket, "--serve",
                                  "127.0.0.1:0", "--heartbeat-interval-ms", "100",
                                  "--drain-timeout-ms", "5000"};
    argv.insert(argv.end(), agent_flags.begin(), agent_flags.end());
    const auto& own = group_agent_flags[name];
    argv.insert(argv.end(), own.begin(), own.end());
    g.agent = std::make_unique<Process>(argv, agent_log, agent_env[name]);
    REQUIRE_FALSE(g.agent->WaitForLog("agent_listening", 10s).empty());
    for (uint32_t r = 0; r < trainers; ++r) {
      std::string log = fmt::format("{}/trainer-{}-{}-{}.jsonl", dir, name, n, r);
      g.logs.push_back(log);
      std::vector<std::string> targv{BinDir() + "/test_trainer", "--group-rank",
                                     std::to_string(r), "--group-size",
                                     std::to_string(trainers), "--steps", std::to_string(steps),
                                     "--step-sleep-ms", std::to_string(sleep_ms), "--log", log};
      const auto& extra = trainer_flags[name];
      targv.insert(targv.end(), extra.begin(), extra.end());
      g.trainers.push_back(std::make_unique<Process>(
          targv, log + ".stderr",
          std::map<std::string, std::string>{{"LK_AGENT_SOCKET", g.socket}}));
    }
    return g;
  }

  pb::JobStatus Status() { return test::JobStatusAt(lh.url(), "t"); }

  // Waits until the quorum's members are exactly `names`; returns its quorum_id.
  uint32_t WaitForMembers(const std::vector<std::string>& names, std::chrono::seconds bound) {
    uint32_t quorum_id = 0;
    bool done = WaitUntil(
        [&] {
          auto j = Status();
          std::vector<std::string> have;
          for (const auto& m : j.members()) have.push_back(m.group_id());
          quorum_id = j.quorum_id();
          return have == names;
        },
        bound, "the quorum's members");
    if (done) return quorum_id;
    FAIL("quorum never had members " << fmt::format("{}", fmt::join(names, ",")) << "; status "
                                     << http::ToJson(Status()));
    return 0;
  }
};

// True when the line's step is at least `n`. A group that joins after the others have gone
// ahead heals to their step and never logs the steps in between, so waits ask for "at least".
bool StepAtLeast(const std::string& line, uint32_t n) {
  std::string s = JsonField(line, "step");
  return !s.empty() && std::stoul(s) >= n;
}

// Waits until `log` has an allreduce line satisfying `pred`.
std::string WaitForLine(const std::string& log, std::chrono::seconds bound,
                        const std::function<bool(const std::string&)>& pred) {
  std::string found;
  (void)WaitUntil(
      [&] {
        for (const auto& line : ReadLines(log)) {
          if (pred(line)) {
            found = line;
            return true;
          }
        }
        return false;
      },
      bound, "an allreduce line of " + log);
  return found;
}

TEST_CASE("3 groups x 2 trainers: kill -9 a trainer - survivors abort and regroup - the group heals back") {
  Cluster c("agent-kill", {"--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "300"});
  for (auto name : {"g0", "g1", "g2"}) c.Start(name, 2, 1000, 100);
  uint32_t q3 = c.WaitForMembers({"g0", "g1", "g2"}, 30s);
  // Every trainer of every group allreduces correctly with all three groups.
  for (auto& [name, g] : c.groups) {
    for (const auto& log : g.logs) {
      auto line = WaitForLine(log, 30s, [&](const std::string& l) {
        return JsonField(l, "event") == "allreduce" && JsonField(l, "world") == "3";
      });
      REQUIRE_FALSE(line.empty());
      CHECK(JsonField(line, "correct") == "true");
    }
  }
  auto killed_at = std::chrono::system_clock::now();
  c.groups["g2"].trainers[1]->Signal(SIGKILL);
  REQUIRE(c.groups["g2"].agent->Wait(10s).has_value());  // the whole group goes
  CHECK_FALSE(c.groups["g2"].agent->WaitForLog("reason=trainer_crashed", 1s).empty());
  uint32_t q2 = c.WaitForMembers({"g0", "g1"}, 10s);
  CHECK(q2 > q3);
  // The survivors go on at world size 2 with correct results, without any timeout wait. (The
  // first quorum may have had two groups too: only allreduces after the kill count.)
  auto killed_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                       killed_at.time_since_epoch()).count();
  for (auto name : {"g0", "g1"}) {
    for (const auto& log : c.groups[name].logs) {
      auto line = WaitForLine(log, 10s, [&](const std::string& l) {
        return JsonField(l, "event") == "allreduce" && JsonField(l, "world") == "2" &&
               JsonField(l, "ok") == "true" && std::stoll(JsonField(l, "t_ms")) >= killed_ms;
      });
      REQUIRE_FALSE(line.empty());
      CHECK(JsonField(line, "correct") == "true");
      auto t_ms = std::stoll(JsonField(line, "t_ms"));
      MESSAGE("first allreduce on the new quorum " << (t_ms - killed_ms) << " ms after the kill");
    }
  }
  // The group restarts as a new incarnation, is told to heal, and rejoins.
  c.Start("g2", 2, 1000, 100);
  c.WaitForMembers({"g0", "g1", "g2"}, 30s);
  for (const auto& log : c.groups["g2"].logs) {
    CHECK_FALSE(WaitForLine(log, 20s, [](const std::string& l) {
                  return JsonField(l, "event") == "heal";
                }).empty());
    CHECK_FALSE(WaitForLine(log, 20s, [](const std::string& l) {
                  return JsonField(l, "event") == "allreduce" && JsonField(l, "world") == "3" &&
                         JsonField(l, "correct") == "true";
                }).empty());
  }
}

TEST_CASE("a quorum asked ahead that loses a member before the poll is never handed out") {
  Cluster c("agent-ahead", {"--heartbeat-timeout-ms", "5000", "--join-timeout-ms", "300"});
  // Long inner steps (1.5 s before each poll) leave time to kill a group after the next
  // round was fetched ahead but before the trainers poll it.
  for (auto name : {"g0", "g1"}) c.Start(name, 1, 1000, 1500);
  c.WaitForMembers({"g0", "g1"}, 30s);
  std::string line = c.groups["g0"].agent->WaitForLog("agent_listening", 1s);
  auto at = line.find("serve=");
  REQUIRE(at != std::string::npos);
  std::string serve = line.substr(at + 6, line.find(' ', at) - at - 6);
  auto agent = http::Client::Create("http://" + serve);
  REQUIRE(agent.ok());
  // Wait for a commit after which g0's agent holds a quorum fetched ahead, unchanged, so that
  // it is also up on the poll board (the first one after g1 joined has a new id and is not).
  uint32_t ahead = 0;
  REQUIRE(WaitUntil(
      [&] {
        auto r = (*agent)->Do("GET", "/v1/agent/status", "", "", Millis(2000));
        REQUIRE(r.ok());
        std::string v = JsonField(r->body, "ahead_quorum_id");
        if (JsonField(r->body, "board_ready_step") != "-1") {
          ahead = v.empty() ? 0 : static_cast<uint32_t>(std::stoul(v));
        }
        return ahead > 0;
      },
      30s, "an ask-ahead quorum up on the board"));
  auto killed_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch()).count();
  c.groups["g1"].trainers[0]->Signal(SIGKILL);
  REQUIRE(c.groups["g1"].agent->Wait(10s).has_value());
  // g0's trainer never sees the stale two-group quorum: its first allreduce after the kill is
  // already on a quorum of one, and nothing was aborted or failed on the way.
  auto after = WaitForLine(c.groups["g0"].logs[0], 20s, [&](const std::string& l) {
    return JsonField(l, "event") == "allreduce" && std::stoll(JsonField(l, "t_ms")) >= killed_ms;
  });
  REQUIRE_FALSE(after.empty());
  CHECK(JsonField(after, "world") == "1");
  CHECK(JsonField(after, "ok") == "true");
  CHECK(JsonField(after, "correct") == "true");
  CHECK(std::stoul(JsonField(after, "quorum_id")) > ahead);
  CHECK_FALSE(c.groups["g0"].agent->WaitForLog("quorum_lost quorum_id=" + std::to_string(ahead), 1s).empty());
  // It had been put on the poll board and was taken off it before anyone took it.
  CHECK_FALSE(c.groups["g0"].agent->WaitForLog("poll_answer_withdrawn", 1s).empty());
}

TEST_CASE("SIGTERM an agent: graceful leave - the quorum shrinks at once - exit 0") {
  // A long heartbeat timeout shows the shrink does not wait for it.
  Cluster c("agent-term", {"--heartbeat-timeout-ms", "60000", "--join-timeout-ms", "300"});
  c.Start("a", 1, 1000);
  c.Start("b", 1, 1000);
  c.WaitForMembers({"a", "b"}, 30s);
  c.groups["b"].agent->Signal(SIGTERM);
  c.WaitForMembers({"a"}, 10s);
  auto code = c.groups["b"].agent->Wait(10s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  auto tcode = c.groups["b"].trainers[0]->Wait(10s);
  REQUIRE(tcode.has_value());
  CHECK(*tcode == 0);  // the trainer was told to drain and exited cleanly
  CHECK_FALSE(c.groups["b"].agent->WaitForLog("left reason=cancelled", 1s).empty());
}

// The allreduces a trainer's log reports done.
size_t OkAllreduces(const std::string& log) {
  size_t n = 0;
  for (const auto& l : ReadLines(log)) {
    n += JsonField(l, "event") == "allreduce" && JsonField(l, "ok") == "true";
  }
  return n;
}

// Waits until each of `groups` has run an allreduce with two members.
void WaitForStepTogether(Cluster& c, std::initializer_list<const char*> groups) {
  for (auto name : groups) {
    REQUIRE_FALSE(WaitForLine(c.groups[name].logs[0], 20s, [](const std::string& l) {
                    return JsonField(l, "event") == "allreduce" && JsonField(l, "ok") == "true" &&
                           JsonField(l, "world") == "2";
                  }).empty());
  }
}

TEST_CASE("kill -9 the lighthouse mid-run and restart it: no trainer exits - ids go on upward") {
  Cluster c("agent-lh", {"--heartbeat-timeout-ms", "3000", "--join-timeout-ms", "300"});
  c.Start("a", 1, 100000, 20);
  c.Start("b", 1, 100000, 20);
  uint32_t q1 = c.WaitForMembers({"a", "b"}, 30s);
  auto ok_steps = [&] { return OkAllreduces(c.groups["a"].logs[0]); };
  // Both groups have run a step together: the quorum's communicator is built (its rendezvous
  // needs the lighthouse's KV; a quorum still forming when the lighthouse dies waits for it).
  WaitForStepTogether(c, {"a", "b"});
  c.lh.process->Signal(SIGKILL);
  REQUIRE(c.lh.process->Wait(10s).has_value());
  size_t at_kill = ok_steps();
  // The trainers go on committing on the last quorum while the lighthouse is away (bounded
  // generously: on a loaded machine 20 ms steps take longer).
  CHECK(WaitUntil([&] { return ok_steps() > at_kill + 5; }, 20s,
                  "5 more steps without the lighthouse"));
  auto restarted = StartLighthouse(c.dir + "/data", {"--heartbeat-timeout-ms", "3000",
                                                     "--join-timeout-ms", "300"},
                                   c.dir + "/lighthouse.log", c.lh.address);
  c.lh = std::move(restarted);
  c.WaitForMembers({"a", "b"}, 20s);
  // A third group joining after the restart gets a higher quorum_id than any before.
  c.Start("c", 1, 100000, 20);
  uint32_t q2 = c.WaitForMembers({"a", "b", "c"}, 30s);
  CHECK(q2 > q1);
  for (auto& [name, g] : c.groups) {
    CHECK(g.agent->Running());
    for (auto& t : g.trainers) CHECK(t->Running());
  }
}

// The lighthouse comes back at an outer-step boundary that only one group's ask reaches: the
// other group's agent cannot reach it yet (here its link is cut by a relay), so its trainer goes
// on into the next step's allreduce, which waits for the first group, while that group waits in
// the lighthouse's round for the second. When the second agent's heartbeat reaches the
// lighthouse, it hears of the open round and asks for the step it went on from, which closes the
// round and lets the first group into the step, long before either side's timeout (the
// trainers' allreduce gives up after 30 s).
TEST_CASE("a lighthouse back at a boundary only one group's ask reaches: the other asks after all") {
  const std::vector<std::string> lh_flags = {"--heartbeat-timeout-ms", "20000",
                                             "--join-timeout-ms", "300"};
  Cluster c("agent-lh-split", lh_flags);
  TcpRelay relay(c.lh.address);
  c.lighthouse_url["b"] = "http://" + relay.address();
  c.Start("a", 1, 100000, 20);
  c.Start("b", 1, 100000, 20);
  c.WaitForMembers({"a", "b"}, 30s);
  auto ok_steps = [&](const std::string& g) { return OkAllreduces(c.groups[g].logs[0]); };
  WaitForStepTogether(c, {"a", "b"});
  c.lh.process->Signal(SIGKILL);
  REQUIRE(c.lh.process->Wait(10s).has_value());
  relay.Cut();
  // Both go on without the lighthouse.
  size_t at_kill = ok_steps("a");
  REQUIRE(WaitUntil([&] { return ok_steps("a") > at_kill + 3; }, 20s,
                    "3 more steps of a without the lighthouse"));
  c.lh = StartLighthouse(c.dir + "/data", lh_flags, c.dir + "/lighthouse.log", c.lh.address);
  // a's next ask reaches the lighthouse and waits there for b (a majority of two is both);
  // b's fail, and b's trainer goes on into the next step, where it waits for a. Nothing moves.
  auto stalled = [&] {
    size_t before = ok_steps("a") + ok_steps("b");
    // Kept: the sleep is what is under test (no step is made for a while), not an order.
    std::this_thread::sleep_for(1500ms);
    return ok_steps("a") + ok_steps("b") == before;
  };
  bool split = false;
  for (int i = 0; i < 10 && !split; ++i) split = stalled();
  REQUIRE(split);
  REQUIRE_FALSE(c.groups["b"].agent->WaitForLog("lighthouse_unreachable continuing", 1s).empty());
  relay.Mend();
  size_t at_mend_a = ok_steps("a"), at_mend_b = ok_steps("b");
  // Bounded well below the allreduce's 30 s timeout, which is what ended the wait before.
  (void)WaitUntil(
      [&] { return ok_steps("a") >= at_mend_a + 3 && ok_steps("b") >= at_mend_b + 3; }, 15s,
      "3 more steps of both groups after the mend");
  CHECK(ok_steps("a") >= at_mend_a + 3);
  CHECK(ok_steps("b") >= at_mend_b + 3);
  CHECK_FALSE(c.groups["b"].agent->WaitForLog("ask_behind", 1s).empty());
  // No allreduce gave up on its timeout.
  for (auto name : {"a", "b"}) {
    for (const auto& l : ReadLines(c.groups[name].logs[0])) {
      INFO(name << ": " << l);
      CHECK(l.find("deadline") == std::string::npos);
    }
  }
  for (auto& [name, g] : c.groups) {
    CHECK(g.agent->Running());
    for (auto& t : g.trainers) CHECK(t->Running());
  }
}

TEST_CASE("agents behind a CONNECT proxy: the lighthouse by a name only the proxy resolves - "
          "the run goes on through the proxy's restart") {
  Cluster c("agent-proxy", {"--heartbeat-timeout-ms", "3000", "--join-timeout-ms", "300"});
  const std::string port = c.lh.address.substr(c.lh.address.rfind(':'));
  // base64("user:pass"): the agents must send the proxy URL's credentials.
  TcpRelay proxy(TcpRelay::ConnectProxy{{{"lighthouse.invalid", "127.0.0.1"}}, "Basic dXNlcjpwYXNz"});
  const std::string proxy_url = "http://user:pass@" + proxy.address();
  // Nothing on this host resolves the name: every lighthouse call of theirs went through it.
  for (const char* g : {"a", "b"}) c.lighthouse_url[g] = "http://lighthouse.invalid" + port;
  c.group_agent_flags["a"] = {"--proxy", proxy_url};
  c.agent_env["b"] = {{"LK_PROXY", proxy_url}};
  c.Start("a", 1, 100000, 20);
  c.Start("b", 1, 100000, 20);
  c.WaitForMembers({"a", "b"}, 30s);
  WaitForStepTogether(c, {"a", "b"});
  for (const char* g : {"a", "b"}) {
    CAPTURE(g);
    const std::string listening = c.groups[g].agent->WaitForLog("agent_listening", 1s);
    CHECK(listening.find("proxy=http://***@" + proxy.address()) != std::string::npos);
    CHECK(c.groups[g].agent->Log().find("pass@") == std::string::npos);
  }
  for (const auto& t : proxy.Targets()) CHECK(t == "lighthouse.invalid" + port);
  // The proxy restarts: its tunnels close (the long polls and watches in them end) and new
  // connections are turned away until it is back.
  proxy.Cut();
  for (const char* g : {"a", "b"}) {
    CAPTURE(g);
    REQUIRE_FALSE(
        c.groups[g].agent->WaitForLog("lighthouse_unreachable continuing", 20s).empty());
  }
  const size_t tunnels_before = proxy.Targets().size();
  const uint32_t committed_before = c.Status().committed_step();
  proxy.Mend();
  // Through the proxy again: commits reach the lighthouse, in new tunnels.
  CHECK(WaitUntil([&] { return c.Status().committed_step() >= committed_before + 3; }, 30s,
                  "3 more commits recorded after the proxy came back"));
  CHECK(proxy.Targets().size() > tunnels_before);
  for (auto& [name, g] : c.groups) {
    CAPTURE(name);
    CHECK(g.agent->Running());
    for (auto& t : g.trainers) CHECK(t->Running());
    CHECK(g.agent->Log().find("group_failed") == std::string::npos);
  }
  // lkctl goes the same way.
  const std::string lkctl_log = c.dir + "/lkctl.log";
  Process lkctl({BinDir() + "/lkctl", "--lighthouse", "http://lighthouse.invalid" + port,
                 "--proxy", proxy_url, "status"},
                lkctl_log);
  auto code = lkctl.Wait(20s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  CHECK(lkctl.Log().find("job t ") != std::string::npos);
}

// Whether the lighthouse's /status shows `group` evicted. Its agent sees the notice naming
// itself and leaves with reason "evicted", so either state may be the one seen.
bool Evicted(Cluster& c, const std::string& group) {
  const pb::JobStatus j = c.Status();
  for (const auto& g : j.groups()) {
    if (g.group_id() == group &&
        (g.state() == "evicted" || (g.state() == "left" && g.reason() == "evicted"))) {
      return true;
    }
  }
  return false;
}

// After `hung` stopped: it is evicted and `alive` goes on alone, its agent never failing.
void CheckEvictedAndGoneOn(Cluster& c, const std::string& hung, const std::string& alive) {
  c.WaitForMembers({alive}, 15s);
  CHECK(Evicted(c, hung));
  CHECK_FALSE(c.lh.process->WaitForLog("group_evicted job=t group=" + hung, 1s).empty());
  // `alive` waited on `hung` in the allreduce all that time (its trainer said so: peer_wait, on
  // the poll board), which is not a stall of its own: it stays and goes on alone.
  CHECK_FALSE(WaitForLine(c.groups[alive].logs[0], 20s, [](const std::string& l) {
                return JsonField(l, "event") == "allreduce" && JsonField(l, "world") == "1" &&
                       JsonField(l, "ok") == "true";
              }).empty());
  CHECK(c.groups[alive].agent->Running());
  CHECK(c.groups[alive].agent->WaitForLog("group_failed", 100ms).empty());
}

TEST_CASE("a hung trainer whose agent still heartbeats is evicted after progress_timeout_ms") {
  Cluster c("agent-hung", {"--heartbeat-timeout-ms", "60000", "--join-timeout-ms", "300",
                           "--progress-timeout-ms", "4000"});
  c.Start("a", 1, 100000, 20);
  // b's inner steps are long, so that the stop below lands in them (its allreduce, where a
  // already waits for it, takes a moment of each step).
  c.Start("b", 1, 100000, 400);
  c.WaitForMembers({"a", "b"}, 30s);
  for (auto name : {"a", "b"}) {
    REQUIRE_FALSE(WaitForLine(c.groups[name].logs[0], 20s, [](const std::string& l) {
                    return JsonField(l, "event") == "allreduce" && StepAtLeast(l, 3);
                  }).empty());
  }
  c.groups["b"].trainers[0]->Signal(SIGSTOP);  // hung in its inner steps: alive, no progress
  CheckEvictedAndGoneOn(c, "b", "a");
  c.groups["b"].trainers[0]->Signal(SIGCONT);
}

TEST_CASE("a trainer hung inside an allreduce its peers finished is evicted - they go on") {
  // b's trainer stops once its first allreduce with a from step 3 on has returned, before it
  // says the wait is over: to the lighthouse b waits on peers, yet a is past that step and
  // waits on b. Both wait on peers; only b's wait has nobody behind it, so only b's progress
  // clock runs.
  Cluster c("agent-hung-ar", {"--heartbeat-timeout-ms", "60000", "--join-timeout-ms", "300",
                              "--progress-timeout-ms", "4000"});
  c.trainer_flags["b"] = {"--hang-in-allreduce-step", "3"};
  c.Start("a", 1, 100000, 20);
  c.Start("b", 1, 100000, 20);
  c.WaitForMembers({"a", "b"}, 30s);
  REQUIRE_FALSE(WaitForLine(c.groups["b"].logs[0], 30s, [](const std::string& l) {
                  return JsonField(l, "event") == "hanging";
                }).empty());
  CheckEvictedAndGoneOn(c, "b", "a");
  // Evicted by its progress clock: a's allreduce was aborted by the notice, none of a's
  // failed on the 30 s transport timeout.
  for (const auto& l : ReadLines(c.groups["a"].logs[0])) {
    INFO(l);
    bool timed_out = JsonField(l, "ok") == "false" && JsonField(l, "aborted") == "false";
    CHECK_FALSE(timed_out);
  }
  c.groups["b"].trainers[0]->Signal(SIGCONT);
}

TEST_CASE("bad input on the trainer socket: a clear error - nothing changes") {
  Cluster c("agent-bad", {"--heartbeat-timeout-ms", "3000"});
  auto& g = c.Start("a", 0, 0);  // the agent alone; the test is the trainer
  auto client = http::Client::Create("unix:" + g.socket);
  REQUIRE(client.ok());
  auto call = [&](std::string method, std::string path, std::string body) {
    auto r = (*client)->Do(method, path, body, http::kJsonType, Millis(5000));
    REQUIRE(r.ok());
    return *r;
  };
  auto r = call("POST", "/v1/trainer/poll", "garbage{");
  CHECK(r.status == 400);
  r = call("POST", "/v1/trainer/poll", R"({"group_rank":2,"group_size":2,"step":0})");
  CHECK(r.status == 400);
  CHECK(r.body.find("group_rank 2 is not below group_size 2") != std::string::npos);
  r = call("POST", "/v1/trainer/commit", R"({"group_rank":0,"step":1})");
  CHECK(r.status == 400);  // never polled
  r = call("POST", "/v1/trainer/nothing", "{}");
  CHECK(r.status == 404);
  // A real poll works, then a step that goes backwards is refused.
  r = call("POST", "/v1/trainer/poll", R"({"group_rank":0,"group_size":1,"step":0})");
  REQUIRE(r.status == 200);
  CHECK(JsonField(r.body, "quorum_id") == "1");
  r = call("POST", "/v1/trainer/commit", R"({"group_rank":0,"step":1})");
  REQUIRE(r.status == 200);
  r = call("POST", "/v1/trainer/commit", R"({"group_rank":0,"step":1})");
  CHECK(r.status == 409);
  r = call("POST", "/v1/trainer/poll", R"({"group_rank":0,"group_size":1,"step":0})");
  CHECK(r.status == 409);
  CHECK(r.body.find("below this trainer's committed step 1") != std::string::npos);
  r = call("POST", "/v1/trainer/poll", R"({"group_rank":0,"group_size":3,"step":1})");
  CHECK(r.status == 400);
  CHECK(g.agent->Running());
  r = call("POST", "/v1/trainer/poll", R"({"group_rank":0,"group_size":1,"step":1})");
  CHECK(r.status == 200);
}

}  // namespace
}  // namespace lk::test

namespace lk::test {
namespace {

// The agent forwards /v1/trainer/kv/QID/KEY to the lighthouse's /v1/kv/JOB/QID/KEY. The path it
// received was percent-decoded, so a key holding '?', '#', '%' or a space must be encoded again
// on the way: raw, '?' cut the key short (the rest became a query) and a space made a request
// line the lighthouse refused.
TEST_CASE("a rendezvous key with '?', '%', '#' or spaces reaches the lighthouse as that key") {
  Cluster c("agent-kvkey", {"--heartbeat-timeout-ms", "60000"});
  auto& g = c.Start("a", 0, 0);
  auto raw = http::Client::Create("unix:" + g.socket);
  REQUIRE(raw.ok());
  auto r = (*raw)->Do("POST", "/v1/trainer/poll", R"({"group_rank":0,"group_size":1,"step":0})",
                      http::kJsonType, Millis(10'000));
  REQUIRE(r.ok());
  REQUIRE(r->status == 200);
  const std::string qid = JsonField(r->body, "quorum_id");
  REQUIRE_FALSE(qid.empty());
  auto lh = http::Client::Create(c.lh.url());
  REQUIRE(lh.ok());
  for (std::string key : {"a?b", "x y", "p%q", "n/slot#1", "plain"}) {
    CAPTURE(key);
    std::string encoded;
    for (char ch : key) encoded += ch == '/' ? std::string("/") : http::PercentEncode(std::string(1, ch));
    auto put = (*raw)->Do("PUT", "/v1/trainer/kv/" + qid + "/" + encoded, "value-" + key,
                          "application/octet-stream", Millis(10'000));
    REQUIRE(put.ok());
    CHECK(put->status == 204);
    auto got = (*raw)->Do("GET", "/v1/trainer/kv/" + qid + "/" + encoded + "?timeout_ms=0", "", "",
                          Millis(10'000));
    REQUIRE(got.ok());
    CHECK(got->status == 200);
    CHECK(got->body == "value-" + key);
    // At the lighthouse, under exactly that key.
    auto at_lh = (*lh)->Do("GET", "/v1/kv/t/" + qid + "/" + encoded + "?timeout_ms=0", "", "",
                           Millis(10'000));
    REQUIRE(at_lh.ok());
    CHECK(at_lh->status == 200);
    CHECK(at_lh->body == "value-" + key);
  }
  // And nothing under the key's first part, where an unencoded '?' would have put it.
  auto cut = (*lh)->Do("GET", "/v1/kv/t/" + qid + "/a?timeout_ms=0", "", "", Millis(10'000));
  REQUIRE(cut.ok());
  CHECK(cut->status == 404);
  // The client library encodes the key it is given: every byte of it arrives as it was ('+'
  // and "%41" included, which a decoder would otherwise turn into ' ' and 'A').
  auto session = client::Session::Connect(g.socket, 0, 1);
  REQUIRE(session.ok());
  const uint32_t q = static_cast<uint32_t>(std::stoul(qid));
  for (std::string key : {"s?e", "x y+z", "pct%41", "gloo/rank 0#addr"}) {
    CAPTURE(key);
    REQUIRE((*session)->KvPut(q, key, "v-" + key).ok());
    auto back = (*session)->KvGet(q, key, Millis(0));
    REQUIRE_MESSAGE(back.ok(), back.status().ToString());
    CHECK(*back == "v-" + key);
    auto at_lh = (*lh)->Do("GET", "/v1/kv/t/" + qid + "/" + http::PercentEncodePath(key) +
                                      "?timeout_ms=0", "", "", Millis(10'000));
    REQUIRE(at_lh.ok());
    CHECK(at_lh->status == 200);
    CHECK(at_lh->body == "v-" + key);
  }
  CHECK(g.agent->Running());
}

TEST_CASE("a trainer that finishes says goodbye: the group leaves with reason finished - exit 0") {
  Cluster c("agent-done", {"--heartbeat-timeout-ms", "60000", "--join-timeout-ms", "300"});
  c.Start("a", 2, 5, 10);
  auto code = c.groups["a"].agent->Wait(30s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  CHECK_FALSE(c.groups["a"].agent->WaitForLog("left reason=finished", 1s).empty());
  for (auto& t : c.groups["a"].trainers) CHECK(t->Wait(10s) == 0);
}

TEST_CASE("a group on two nodes: the node whose trainer ends last finishes after the other left - "
          "both exit 0") {
  // Node 1's trainer says goodbye first and its agent leaves the group finished; node 0's
  // trainer is still busy at the end (a final save). Its agent hears GROUP_FINISHED from the
  // lighthouse meanwhile: it must let the trainer end and exit 0, not fail the group (srun
  // would fail the whole Slurm step on the exit code 3).
  Cluster c("agent-two-nodes", {"--heartbeat-timeout-ms", "60000", "--join-timeout-ms", "300"});
  const std::string go = c.dir + "/go";
  std::vector<std::unique_ptr<Process>> agents, trainers;
  for (uint32_t node : {0u, 1u}) {
    const std::string socket = fmt::format("{}/a-n{}.sock", c.dir, node);
    agents.push_back(std::make_unique<Process>(
        std::vector<std::string>{BinDir() + "/replica_agent", "--lighthouse", c.lh.url(), "--job",
                                 "t", "--group-id", "a", "--socket", socket, "--serve",
                                 "127.0.0.1:0", "--node-rank", std::to_string(node), "--nodes",
                                 "2", "--incarnation", "two-nodes-1", "--heartbeat-interval-ms",
                                 "100", "--drain-timeout-ms", "10000"},
        fmt::format("{}/agent-n{}.log", c.dir, node)));
    REQUIRE_FALSE(agents.back()->WaitForLog("agent_listening", 10s).empty());
    const std::string log = fmt::format("{}/trainer-n{}.jsonl", c.dir, node);
    std::vector<std::string> argv{BinDir() + "/test_trainer", "--group-rank", std::to_string(node),
                                  "--group-size", "2", "--steps", "4", "--step-sleep-ms", "10",
                                  "--log", log};
    if (node == 0) argv.insert(argv.end(), {"--goodbye-after-file", go});
    trainers.push_back(std::make_unique<Process>(
        argv, log + ".stderr", std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}}));
  }
  INFO("logs in " << c.dir);
  CHECK(trainers[1]->Wait(30s) == std::optional<int>(0));
  CHECK(agents[1]->Wait(30s) == std::optional<int>(0));
  CHECK_FALSE(agents[1]->WaitForLog("left reason=finished result=ok", 1s).empty());
  REQUIRE_FALSE(agents[0]->WaitForLog("group_finished_by_peer", 20s).empty());
  std::ofstream(go).put('\n');
  CHECK(trainers[0]->Wait(30s) == std::optional<int>(0));
  CHECK(agents[0]->Wait(30s) == std::optional<int>(0));
  CHECK(agents[0]->WaitForLog("group_failed", 0s).empty());
  CHECK(c.Status().committed_step() == 4);
}

// Both trainers of a group report a failed join, but one may report after the lighthouse has
// already formed the next quorum; that late report names the failed quorum and must not fail
// the one formed to recover.
TEST_CASE("a failure report about a quorum already replaced changes nothing") {
  Cluster c("agent-stale", {"--heartbeat-timeout-ms", "60000"});
  auto& g = c.Start("a", 0, 0);
  auto session = client::Session::Connect(g.socket, 0, 1);
  REQUIRE(session.ok());
  auto p1 = (*session)->Poll(0, Millis(10'000));
  REQUIRE(p1.ok());
  REQUIRE((*session)->ReportFailed(1, p1->quorum_id).ok());
  // The report travels to the lighthouse on the agent's own thread; until the new round is back,
  // a poll still gets the failed quorum (a trainer retries, as DiLoCo does after MarkBad).
  auto poll_past = [&](uint32_t quorum_id) {
    client::PollResult last;
    (void)WaitUntil(
        [&] {
          auto p = (*session)->Poll(0, Millis(10'000));
          REQUIRE(p.ok());
          last = *p;
          return p->quorum_id != quorum_id;
        },
        10s, "a poll past the failed quorum");
    return last;
  };
  client::PollResult p2 = poll_past(p1->quorum_id);
  CHECK(p2.quorum_id > p1->quorum_id);  // the report about the current quorum replaced it
  REQUIRE((*session)->ReportFailed(1, p1->quorum_id).ok());
  CHECK_FALSE(g.agent->WaitForLog("outer_step_failed_stale", 5s).empty());
  // The late one did not: the quorum stays for as long as a real failure took to replace it.
  // Kept: the sleep is what is under test (nothing replaces the quorum for a while).
  std::this_thread::sleep_for(500ms);
  auto p3 = (*session)->Poll(0, Millis(10'000));
  REQUIRE(p3.ok());
  CHECK(p3->quorum_id == p2.quorum_id);
  REQUIRE((*session)->Commit(1, true).ok());
  CHECK(g.agent->Running());
}

// The poll board as a node with two trainers sees it: one reads the board through the client
// library, the other polls over the socket in JSON (as a trainer in another language could).
// Whichever polls first, both get the node's one answer for the step, at once.
TEST_CASE("unchanged polls come from the poll board - a socket poller on the node gets the same answer") {
  // Heartbeats far apart, so that nothing but the board's doorbell applies a commit left in a
  // slot before the test looks (the heartbeat thread would, at its next beat).
  Cluster c("agent-board", {"--heartbeat-timeout-ms", "300000"});
  c.agent_flags = {"--heartbeat-interval-ms", "120000"};
  auto& g = c.Start("a", 0, 0);
  auto raw = http::Client::Create("unix:" + g.socket);
  REQUIRE(raw.ok());
  auto raw_poll = [&](uint32_t step) {
    auto r = (*raw)->Do("POST", "/v1/trainer/poll",
                        fmt::format(R"({{"group_rank":1,"group_size":2,"step":{}}})", step),
                        http::kJsonType, Millis(10'000));
    REQUIRE(r.ok());
    REQUIRE(r->status == 200);
    return r->body;
  };
  auto raw_commit = [&](uint32_t step) {
    auto r = (*raw)->Do("POST", "/v1/trainer/commit",
                        fmt::format(R"({{"group_rank":1,"step":{}}})", step), http::kJsonType,
                        Millis(10'000));
    REQUIRE(r.ok());
    REQUIRE(r->status == 200);
  };
  // Waits until the agent has the answer for `step` up on the board.
  auto wait_ready = [&](uint32_t step) {
    bool ready = WaitUntil(
        [&] {
          auto r = (*raw)->Do("GET", "/v1/agent/status", "", "", Millis(2000));
          REQUIRE(r.ok());
          return JsonField(r->body, "board_ready_step") == std::to_string(step);
        },
        10s, "the board's answer for the step");
    if (!ready) FAIL("the answer for step " << step << " never went up on the board");
  };
  auto session = client::Session::Connect(g.socket, 0, 2);
  REQUIRE(session.ok());
  CHECK(access((g.socket + ".board").c_str(), F_OK) == 0);

  // Step 0: the first round, over the socket for both (it is a barrier: one thread each).
  std::optional<Result<client::PollResult>> first;
  std::thread t([&] { first = (*session)->Poll(0, Millis(10'000)); });
  std::string body = raw_poll(0);
  t.join();
  REQUIRE(first->ok());
  CHECK_FALSE((*first)->from_board);
  uint32_t qid = (*first)->quorum_id;
  CHECK(JsonField(body, "quorum_id") == std::to_string(qid));
  REQUIRE((*session)->Commit(1, true).ok());
  raw_commit(1);

  // Step 1: the board reader first, from memory; then the socket poller, answered at once
  // with the same quorum (no barrier wait: the node's answer was taken).
  wait_ready(1);
  auto p1 = (*session)->Poll(1, Millis(10'000));
  REQUIRE(p1.ok());
  CHECK(p1->from_board);
  CHECK(p1->quorum_id == qid);
  CHECK_FALSE(p1->reconfigure);
  CHECK_FALSE(p1->heal);
  CHECK(JsonField(raw_poll(1), "quorum_id") == std::to_string(qid));
  // This time the board reader commits last: its commit is left in its board slot, and only
  // the agent's doorbell wake-up can make it the node's commit and start the ask ahead.
  raw_commit(2);
  REQUIRE((*session)->Commit(2, true).ok());
  auto twice = (*session)->Commit(2, true);
  CHECK(twice.code() == Code::kConflict);  // refused as the socket refuses it
  CHECK(twice.message().find("not after the committed step 2") != std::string::npos);
  // Watched at the lighthouse, not at the agent (any call to the agent would apply the slot).
  (void)WaitUntil([&] { return c.Status().committed_step() >= 2; }, 10s,
                  "committed step 2 at the lighthouse");
  CHECK(c.Status().committed_step() == 2);

  // Step 2: the socket poller first (the agent takes the answer for it); the board reader
  // then gets that same answer from memory.
  wait_ready(2);
  {
    auto st = (*raw)->Do("GET", "/v1/agent/status", "", "", Millis(2000));
    REQUIRE(st.ok());
    CHECK(JsonField(st->body, "committed_step") == "2");
  }
  CHECK(JsonField(raw_poll(2), "quorum_id") == std::to_string(qid));
  auto p2 = (*session)->Poll(2, Millis(10'000));
  REQUIRE(p2.ok());
  CHECK(p2->from_board);
  CHECK(p2->quorum_id == qid);

  // Step 2 again, as after a failed outer step: the board is not read twice for a step; both
  // go over the socket to a new round.
  std::optional<Result<client::PollResult>> again;
  std::thread t2([&] { again = (*session)->Poll(2, Millis(10'000)); });
  body = raw_poll(2);
  t2.join();
  REQUIRE(again->ok());
  CHECK_FALSE((*again)->from_board);
  CHECK(JsonField(body, "quorum_id") == std::to_string((*again)->quorum_id));
  CHECK(g.agent->Running());
}

TEST_CASE("a poll that timed out just before its answer came gets that answer when it polls again") {
  // One round that cannot form until a second group comes: the first group's trainer 0 gives
  // up on it, the round then forms and the agent answers both of the group's trainers, trainer
  // 0's answer going to a connection nobody reads. Its next poll of the step must get that
  // quorum (its group peer is already in it), not wait for a round nobody else joins.
  // At debug the lighthouse logs every commit, failed ones too (waited for below).
  Cluster c("agent-resumed",
            {"--heartbeat-timeout-ms", "3000", "--min-replicas", "2", "--log-level", "debug"});
  auto& a = c.Start("a", 0, 0);
  auto s0 = client::Session::Connect(a.socket, 0, 2);
  REQUIRE(s0.ok());
  auto raw = http::Client::Create("unix:" + a.socket);
  REQUIRE(raw.ok());
  std::optional<Result<http::Response>> peer;
  std::thread t([&] {
    peer = (*raw)->Do("POST", "/v1/trainer/poll", R"({"group_rank":1,"group_size":2,"step":0})",
                      http::kJsonType, Millis(20'000));
  });
  auto timed_out = (*s0)->Poll(0, Millis(800));
  CHECK(timed_out.status().code() == Code::kDeadlineExceeded);

  // The second group, of the same size: both its trainers poll, and the round forms.
  auto& b = c.Start("b", 0, 0);
  auto b0 = client::Session::Connect(b.socket, 0, 2);
  auto b1 = client::Session::Connect(b.socket, 1, 2);
  REQUIRE(b0.ok());
  REQUIRE(b1.ok());
  auto poll_b = [&] {
    std::optional<Result<client::PollResult>> other;
    std::thread tb([&] { other = (*b1)->Poll(0, Millis(10'000)); });
    auto p = (*b0)->Poll(0, Millis(10'000));
    tb.join();
    REQUIRE(p.ok());
    REQUIRE(other->ok());
    CHECK((*other)->quorum_id == p->quorum_id);
    return p->quorum_id;
  };
  const uint32_t qid = poll_b();
  t.join();
  REQUIRE(peer->ok());
  REQUIRE((*peer)->status == 200);
  CHECK(JsonField((*peer)->body, "quorum_id") == std::to_string(qid));

  auto again = (*s0)->Poll(0, Millis(5'000));
  REQUIRE(again.ok());
  CHECK(again->quorum_id == qid);
  CHECK_FALSE(a.agent->WaitForLog("poll_answer_resent group_rank=0 step=0", 5s).empty());

  // The resend is for that one poll: polling the step again after it was answered is a retry
  // after a failed step and goes to a new round, here with both groups' trainers.
  REQUIRE((*b0)->Commit(1, false).ok());
  // The agent passes the report on by itself: the new round must come after the lighthouse has
  // it, or it hands the same quorum back.
  REQUIRE_FALSE(c.lh.process->WaitForLog("ok=false", 10s).empty());
  std::optional<Result<client::PollResult>> retry;
  std::thread t2([&] { retry = (*s0)->Poll(0, Millis(10'000)); });
  std::thread t3([&] {
    peer = (*raw)->Do("POST", "/v1/trainer/poll", R"({"group_rank":1,"group_size":2,"step":0})",
                      http::kJsonType, Millis(10'000));
  });
  const uint32_t qid2 = poll_b();
  t2.join();
  t3.join();
  REQUIRE(retry->ok());
  CHECK((*retry)->quorum_id == qid2);
  CHECK(qid2 != qid);
  CHECK(a.agent->Running());
}

TEST_CASE("an agent run with --poll-board=false answers every poll over the socket") {
  Cluster c("agent-noboard", {"--heartbeat-timeout-ms", "3000"});
  c.agent_flags = {"--poll-board=false"};
  auto& g = c.Start("a", 0, 0);
  CHECK(access((g.socket + ".board").c_str(), F_OK) != 0);
  auto session = client::Session::Connect(g.socket, 0, 1);
  REQUIRE(session.ok());
  auto raw = http::Client::Create("unix:" + g.socket);
  REQUIRE(raw.ok());
  for (uint32_t step = 0; step < 20; ++step) {
    // The ask ahead came back (the agent holds the quorum for this step), so the poll is answered
    // from the agent's memory, which is what a board would have carried.
    if (step > 0) {
      REQUIRE(WaitUntil(
          [&] {
            auto r = (*raw)->Do("GET", "/v1/agent/status", "", "", Millis(2000));
            REQUIRE(r.ok());
            return JsonField(r->body, "ahead_step") == std::to_string(step);
          },
          10s, "the agent's ask ahead for the step answered"));
    }
    auto p = (*session)->Poll(step, Millis(10'000));
    REQUIRE(p.ok());
    CHECK_FALSE(p->from_board);
    REQUIRE((*session)->Commit(step + 1, true).ok());
  }
}

// A quorum of a group of one and a group of two, polled through the C API: the group sizes come
// back by replica_rank, and a buffer too small for them is refused with the size it needs.
TEST_CASE("the C API's poll group sizes: by replica_rank, and too small a buffer is too large") {
  Cluster c("agent-c-sizes", {"--heartbeat-timeout-ms", "3000", "--min-replicas", "2",
                              "--join-timeout-ms", "5000"});
  auto& a = c.Start("a", 0, 0);
  auto& b = c.Start("b", 0, 0);
  std::vector<lk_session*> sessions = {lk_session_open(a.socket.c_str(), 0, 1),
                                       lk_session_open(b.socket.c_str(), 0, 2),
                                       lk_session_open(b.socket.c_str(), 1, 2)};
  for (lk_session* s : sessions) {
    REQUIRE_MESSAGE(s != nullptr, lk_last_error());
    REQUIRE(lk_session_set_mixed_group_sizes(s, 1) == 0);
  }
  std::vector<lk_poll_result> polls(sessions.size());
  std::vector<int> rcs(sessions.size(), -1);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < sessions.size(); ++i) {
    threads.emplace_back([&, i] { rcs[i] = lk_session_poll(sessions[i], 0, &polls[i]); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < sessions.size(); ++i) REQUIRE(rcs[i] == 0);
  REQUIRE(polls[0].replica_world_size == 2);
  for (lk_session* s : sessions) {
    size_t count = 99;
    uint32_t out[2] = {77, 77};
    CHECK(lk_session_poll_group_sizes(s, nullptr, 0, &count) == -1);
    CHECK(lk_last_error_code() == LK_ERR_TOO_LARGE);
    CHECK(count == 2);
    CHECK(lk_session_poll_group_sizes(s, out, 1, &count) == -1);
    CHECK(lk_last_error_code() == LK_ERR_TOO_LARGE);
    CHECK(std::string(lk_last_error()).find("room for 1 group sizes, 2 to give") !=
          std::string::npos);
    CHECK(out[0] == 77);  // untouched
    REQUIRE(lk_session_poll_group_sizes(s, out, 2, &count) == 0);
    CHECK(count == 2);
    const uint32_t a_rank = polls[0].replica_rank;
    CHECK(out[a_rank] == 1);
    CHECK(out[1 - a_rank] == 2);
  }
  for (lk_session* s : sessions) lk_session_close(s);
}

TEST_CASE(
    "a DiLoCo trainer in C gets back the extra state it handed with the step it restored; a "
    "sharded object takes its rows only") {
  Cluster c("agent-c-extra", {"--heartbeat-timeout-ms", "3000"});
  const std::string ckpt = std::filesystem::absolute(c.dir + "/ckpt").string();
  auto run = [&](const char* steps, const std::string& log) {
    auto& g = c.Start("a", 0, 0);
    Process trainer({BinDir() + "/c_diloco", g.socket, ckpt, steps}, log);
    auto code = trainer.Wait(60s);
    REQUIRE(code.has_value());
    CHECK_MESSAGE(*code == 0, trainer.Log());
    CHECK_FALSE(trainer.WaitForLog("bound ok", 1s).empty());
    CHECK_FALSE(trainer.WaitForLog("dtypes ok", 1s).empty());
    CHECK_FALSE(trainer.WaitForLog("sharded ok", 1s).empty());
    CHECK_FALSE(trainer.WaitForLog("done", 1s).empty());
    g.agent->Signal(SIGKILL);  // a whole-job restart: no live state anywhere
    (void)g.agent->Wait(5s);
    return trainer.Log();
  };
  const std::string first = run("3", c.dir + "/c_diloco-1.log");
  CHECK(first.find("restored=none") != std::string::npos);
  CHECK(first.find("step=3 saved=1") != std::string::npos);
  // The new life restores step 3 and the bytes handed with the sync that committed it.
  const std::string second = run("5", c.dir + "/c_diloco-2.log");
  INFO(second);
  CHECK(second.find("restored=pos=3\n") != std::string::npos);
  CHECK(second.find("step=5") != std::string::npos);
}

TEST_CASE("a trainer in C: polls, the KV, peer wait, commits, checkpoint registration and goodbye "
          "through lightkeeper.h") {
  Cluster c("agent-c", {"--heartbeat-timeout-ms", "3000"});
  auto& g = c.Start("a", 0, 0);
  const std::string ckpt = std::filesystem::absolute(c.dir + "/ckpt").string();
  Process trainer({BinDir() + "/c_trainer", g.socket, "30", ckpt}, c.dir + "/c_trainer.log");
  auto code = trainer.Wait(60s);
  REQUIRE(code.has_value());
  CHECK_MESSAGE(*code == 0, trainer.Log());
  auto lines = ReadLines(c.dir + "/c_trainer.log");
  int steps = 0, from_board = 0;
  for (const auto& l : lines) {
    if (l.rfind("step=", 0) != 0) continue;
    ++steps;
    from_board += l.find("from_board=1") != std::string::npos;
  }
  CHECK(steps == 30);
  // Nothing changes after the first step: the C trainer reads most answers from the board.
  CHECK(from_board > 0);
  CHECK_FALSE(trainer.WaitForLog("done", 1s).empty());
  // The communicator calls of the C API worked at the first quorum (c_trainer checks them).
  CHECK_FALSE(trainer.WaitForLog("comm ok", 1s).empty());
  // lk_session_register_checkpoint reached the lighthouse's registry (and the refusals were
  // the ones c_trainer expects).
  CHECK_FALSE(trainer.WaitForLog("checkpoint ok", 1s).empty());
  auto job = c.Status();
  REQUIRE(job.checkpoints_size() == 1);
  CHECK(job.checkpoints(0).step() == 30);
  CHECK(job.checkpoints(0).location() == ckpt);
  CHECK(job.checkpoints(0).group_id() == "a");
  // Its goodbye is the group's: the agent leaves with reason finished and exits 0.
  auto agent_code = g.agent->Wait(10s);
  REQUIRE(agent_code.has_value());
  CHECK(*agent_code == 0);
  CHECK_FALSE(g.agent->WaitForLog("reason=finished", 1s).empty());
}

TEST_CASE("an agent restarted under a live trainer: the trainer's next socket poll fails with the reason") {
  Cluster c("agent-restart", {"--heartbeat-timeout-ms", "3000"});
  auto& g = c.Start("a", 0, 0);
  auto session = client::Session::Connect(g.socket, 0, 1);
  REQUIRE(session.ok());
  REQUIRE((*session)->Poll(0, Millis(10'000)).ok());
  REQUIRE((*session)->Commit(1, true).ok());
  g.agent->Signal(SIGKILL);
  REQUIRE(g.agent->Wait(5s).has_value());
  // A new life of the group's agent on the same socket (and so the same board path).
  Process again({BinDir() + "/replica_agent", "--lighthouse", c.lh.url(), "--job", "t",
                 "--group-id", "a", "--socket", g.socket, "--heartbeat-interval-ms", "100"},
                c.dir + "/agent-again.log");
  REQUIRE_FALSE(again.WaitForLog("agent_listening", 10s).empty());
  // The trainer may still read one answer the old agent left on its board; its first poll
  // over the socket meets the new life and fails, so it never commits into a board nobody reads.
  Status failed;
  for (uint32_t step = 1; step <= 3 && failed.ok(); ++step) {
    auto p = (*session)->Poll(step, Millis(10'000));
    if (!p.ok()) {
      failed = p.status();
      break;
    }
    (void)(*session)->Commit(step + 1, true);
  }
  CHECK(failed.code() == Code::kConflict);
  CHECK(failed.message().find("the agent was restarted") != std::string::npos);
  CHECK(again.Running());
}

// A group whose trainers failed at start (a mistyped flag) used to heartbeat as healthy and
// never ask, holding the other group's first quorum for good ("wait: 1 of 2 healthy groups
// asked, a majority needs 2"). Its agent now leaves with no_trainers after --hello-timeout-ms
// and exits 3, and the other group's quorum forms without it. The heartbeat timeout is long,
// so that only the leave can let the quorum form within the wait.
TEST_CASE("a group whose trainers never start leaves with no_trainers and holds no quorum") {
  Cluster c("agent-no-trainers", {"--heartbeat-timeout-ms", "120000", "--join-timeout-ms", "300"});
  c.agent_flags = {"--hello-timeout-ms", "1500"};
  c.Start("g1", 0, 0);  // its trainers never come
  c.Start("g0", 1, 1000);
  REQUIRE_FALSE(c.groups["g1"].agent->WaitForLog("no_trainers hello_timeout_ms=1500", 20s).empty());
  auto code = c.groups["g1"].agent->Wait(20s);
  REQUIRE(code.has_value());
  CHECK(*code == 3);
  CHECK_FALSE(c.groups["g1"].agent->WaitForLog("left reason=no_trainers", 1s).empty());
  c.WaitForMembers({"g0"}, 30s);
  auto line = WaitForLine(c.groups["g0"].logs[0], 30s, [](const std::string& l) {
    return JsonField(l, "event") == "allreduce";
  });
  CHECK_FALSE(line.empty());
  // The group with a trainer is not touched by the bound.
  CHECK(c.groups["g0"].agent->Running());
}

}  // namespace
}  // namespace lk::test
