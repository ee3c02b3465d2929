// The DiLoCo trainer as users run it: a real lighthouse, one replica_agent per group and
// diloco_trainer processes (small model, few steps). Checks what DiLoCo under Lightkeeper
// promises: after every committed outer step all groups hold bitwise the same global weights
// (per shard), the loss falls, and a group that joins late heals and then matches the others.
// Every wait is bounded so a hang fails the test instead of stalling CI.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <boost/json.hpp>

#include <chrono>
#include <csignal>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "tests/support/process.h"
#include "tests/support/trainer_log.h"

namespace lk::diloco {
namespace {

using namespace std::chrono_literals;
using test::BinDir;
using test::Process;

struct LogLine {
  uint32_t step = 0;
  uint32_t quorum_id = 0;
  uint32_t world = 0;
  double loss = 0;
  std::string hash;
  bool healed = false;
};

std::vector<LogLine> ReadLog(const std::string& path) {
  std::vector<LogLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::json::object o = boost::json::parse(line).as_object();
    out.push_back(LogLine{static_cast<uint32_t>(o.at("step").to_number<int64_t>()),
                          static_cast<uint32_t>(o.at("quorum_id").to_number<int64_t>()),
                          static_cast<uint32_t>(o.at("replica_world_size").to_number<int64_t>()),
                          o.at("loss").to_number<double>(),
                          std::string(o.at("param_hash").as_string()), o.at("healed").as_bool()});
  }
  return out;
}

struct Group {
  std::string name;
  std::unique_ptr<Process> agent;
  std::vector<std::unique_ptr<Process>> trainers;
  std::vector<std::string> logs;  // per group_rank
};

// One run: a lighthouse and groups of `group_size` trainers with a tiny model.
struct Run {
  std::string dir;
  test::Lighthouse lh;
  uint32_t group_size;
  uint32_t outer_steps;
  std::map<std::string, Group> groups;

  Run(const std::string& tag, uint32_t min_replicas, uint32_t group_size_in, uint32_t steps)
      : dir(test::TempDir(tag)), group_size(group_size_in), outer_steps(steps) {
    lh = test::StartLighthouse(dir + "/lh", {"--min-replicas", std::to_string(min_replicas),
                                             "--join-timeout-ms", "20000",
                                             "--heartbeat-timeout-ms", "5000"},
                               dir + "/lighthouse.log");
  }

  // Each group plays one node: its trainers publish their live state here and its agent
  // serves it to healing peers.
  std::string LiveDir(const std::string& name) const { return dir + "/live-" + name; }

  void StartGroup(const std::string& name, std::vector<std::string> extra = {}) {
    Group& g = groups[name];
    g.name = name;
    std::string socket = fmt::format("{}/{}.sock", dir, name);
    g.agent = std::make_unique<Process>(
        std::vector<std::string>{BinDir() + "/replica_agent", "--lighthouse", lh.url(), "--job",
                                 "demo", "--group-id", name, "--socket", socket, "--serve",
                                 "127.0.0.1:0", "--heartbeat-interval-ms", "200", "--serve-dir",
                                 LiveDir(name)},
        fmt::format("{}/agent-{}.log", dir, name));
    REQUIRE_FALSE(g.agent->WaitForLog("agent_listening", 20s).empty());
    for (uint32_t r = 0; r < group_size; ++r) {
      std::string log = fmt::format("{}/trainer-{}-{}.jsonl", dir, name, r);
      g.logs.push_back(log);
      std::vector<std::string> argv = {
          BinDir() + "/diloco_trainer", "--group-rank", std::to_string(r), "--group-size",
          std::to_string(group_size), "--inner-steps", "8", "--outer-steps",
          std::to_string(outer_steps), "--seed", "7", "--ckpt-dir", dir + "/ckpt-" + name,
          "--log", log, "--model-width", "32", "--layers", "1", "--heads", "2",
          "--seq-len", "32", "--batch", "8", "--corpus-bytes", "16384",
          "--op-timeout-ms", "30000", "--live-dir", LiveDir(name)};
      argv.insert(argv.end(), extra.begin(), extra.end());
      g.trainers.push_back(std::make_unique<Process>(
          argv, log + ".stderr",
          std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}, {"LK_GROUP_ID", name}}));
    }
  }

  // Waits for every trainer to exit and requires exit code 0.
  void WaitAll(std::chrono::seconds bound) {
    auto deadline = std::chrono::steady_clock::now() + bound;
    for (auto& [name, g] : groups) {
      for (size_t r = 0; r < g.trainers.size(); ++r) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        auto code = g.trainers[r]->Wait(std::max(left, std::chrono::milliseconds(1)));
        INFO("trainer " << name << "/" << r << " log:\n" << g.trainers[r]->Log());
        REQUIRE(code.has_value());
        CHECK(*code == 0);
      }
    }
  }

  // For every (step, group_rank) that several groups committed, the hashes must be one.
  // Returns the number of (step, group_rank) pairs compared across at least two groups.
  size_t CheckHashesAgree() {
    std::map<std::pair<uint32_t, uint32_t>, std::map<std::string, std::string>> seen;
    for (auto& [name, g] : groups) {
      for (uint32_t r = 0; r < g.logs.size(); ++r) {
        for (const LogLine& l : ReadLog(g.logs[r])) seen[{l.step, r}][name] = l.hash;
      }
    }
    size_t compared = 0;
    for (const auto& [key, by_group] : seen) {
      std::set<std::string> hashes;
      for (const auto& [name, h] : by_group) hashes.insert(h);
      INFO("step " << key.first << " shard " << key.second);
      CHECK(hashes.size() == 1);
      compared += by_group.size() > 1;
    }
    return compared;
  }
};

// Loss of the first and last committed step of one log.
std::pair<double, double> FirstLastLoss(const std::vector<LogLine>& log) {
  REQUIRE_FALSE(log.empty());
  return {log.front().loss, log.back().loss};
}

TEST_CASE("diloco three groups of one trainer: identical global weights every step and loss falls") {
  Run run("diloco-3x1", 3, 1, 6);
  for (const char* g : {"g0", "g1", "g2"}) run.StartGroup(g);
  run.WaitAll(50s);
  CHECK(run.CheckHashesAgree() == 6);
  for (auto& [name, g] : run.groups) {
    std::vector<LogLine> log = ReadLog(g.logs[0]);
    REQUIRE(log.size() == 6);
    for (uint32_t i = 0; i < log.size(); ++i) {
      CHECK(log[i].step == i + 1);
      CHECK(log[i].world == 3);
    }
    auto [first, last] = FirstLastLoss(log);
    INFO("group " << name << " loss " << first << " -> " << last);
    CHECK(last < 0.85 * first);
  }
}

TEST_CASE("diloco two groups of two trainers: each shard identical across groups, shards differ") {
  Run run("diloco-2x2", 2, 2, 5);
  run.StartGroup("g0", {"--ckpt-every", "5"});
  run.StartGroup("g1", {"--ckpt-every", "5"});
  run.WaitAll(50s);
  CHECK(run.CheckHashesAgree() == 2 * 5);
  // The two shards of one group are different halves of the weights.
  std::vector<LogLine> shard0 = ReadLog(run.groups["g0"].logs[0]);
  std::vector<LogLine> shard1 = ReadLog(run.groups["g0"].logs[1]);
  REQUIRE(shard0.size() == 5);
  REQUIRE(shard1.size() == 5);
  CHECK(shard0.back().hash != shard1.back().hash);
  // Both trainers of a group report the group-mean loss of the same inner steps.
  CHECK(shard0.back().loss == doctest::Approx(shard1.back().loss).epsilon(1e-5));
  auto [first, last] = FirstLastLoss(shard0);
  CHECK(last < 0.9 * first);
  // --ckpt-every 5: both trainers of each group wrote their shard of step 5 and one committed.
  for (const char* g : {"g0", "g1"}) {
    std::string step_dir = run.dir + "/ckpt-" + g + "/step-000000000005";
    CHECK(std::ifstream(step_dir + "/MANIFEST").good());
    CHECK(std::ifstream(step_dir + "/shard-00000-of-00002.safetensors").good());
    CHECK(std::ifstream(step_dir + "/shard-00001-of-00002.safetensors").good());
  }
}

// The bf16 fields of every line of one trainer's log: step -> (global_hash, model_hash).
struct HalfLine {
  std::string global_hash, model_hash, param_dtype;
  uint64_t model_bytes = 0, outer_state_bytes = 0, params = 0, shard = 0;
};
std::map<uint32_t, HalfLine> ReadHalfLog(const std::string& path) {
  std::map<uint32_t, HalfLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::json::object o = boost::json::parse(line).as_object();
    HalfLine h;
    h.global_hash = std::string(o.at("global_hash").as_string());
    h.model_hash = std::string(o.at("model_hash").as_string());
    h.param_dtype = std::string(o.at("param_dtype").as_string());
    h.model_bytes = static_cast<uint64_t>(o.at("model_bytes").to_number<int64_t>());
    h.outer_state_bytes = static_cast<uint64_t>(o.at("outer_state_bytes").to_number<int64_t>());
    h.params = static_cast<uint64_t>(o.at("params").to_number<int64_t>());
    h.shard = static_cast<uint64_t>(o.at("shard").to_number<int64_t>());
    out[static_cast<uint32_t>(o.at("step").to_number<int64_t>())] = h;
  }
  return out;
}

// Two groups of two trainers holding bf16 weights (optionally with more flags): after every
// commit every trainer of every group holds the same float32 global weights (global_hash) and
// the same bf16 model weights (model_hash), each shard of the float32 state equal across
// groups, and the log's byte counts are the bf16 model's and the float32 outer state's.
void CheckHalfJob(const std::string& tag, const char* dtype, std::vector<std::string> extra) {
  const uint32_t steps = 4;
  Run run(tag, 2, 2, steps);
  extra.insert(extra.end(), {"--param-dtype", dtype});
  run.StartGroup("g0", extra);
  run.StartGroup("g1", extra);
  run.WaitAll(60s);
  CHECK(run.CheckHashesAgree() == 2 * steps);
  std::map<uint32_t, std::set<std::string>> global, model;
  for (auto& [name, g] : run.groups) {
    for (const std::string& log : g.logs) {
      std::map<uint32_t, HalfLine> lines = ReadHalfLog(log);
      CHECK(lines.size() == steps);
      for (const auto& [step, h] : lines) {
        global[step].insert(h.global_hash);
        model[step].insert(h.model_hash);
        CHECK(h.param_dtype == dtype);
        CHECK(h.model_bytes == h.params * 2);
        // The float32 shard of global weights and momentum, and the float32 staging buffer.
        CHECK(h.outer_state_bytes >= (2 * h.shard + h.params) * 4);
      }
    }
  }
  REQUIRE(global.size() == steps);
  for (uint32_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
    CHECK(global[step].size() == 1);
    CHECK(model[step].size() == 1);
    CHECK_FALSE(global[step].begin()->empty());
  }
  // 16-bit weights differ from the float32 global weights they are rounded from.
  CHECK(*global[steps].begin() != *model[steps].begin());
  auto [first, last] = FirstLastLoss(ReadLog(run.groups["g0"].logs[0]));
  CHECK(last < 0.9 * first);
}

TEST_CASE("diloco bf16 weights: two groups of two hold bitwise-equal float32 global and bf16 "
          "model weights after every commit") {
  CheckHalfJob("diloco-bf16", "bf16", {});
}

TEST_CASE("diloco fp16 weights with int8 exchange and overlap: every member equal at every "
          "commit") {
  // With overlap the model carries the stand-in step, so the model hash is compared after the
  // final Flush only through the global hash; the float32 global weights agree at every commit.
  const uint32_t steps = 4;
  Run run("diloco-fp16-ov", 2, 1, steps);
  std::vector<std::string> extra = {"--param-dtype", "fp16", "--outer-compress", "int8",
                                    "--outer-overlap"};
  run.StartGroup("g0", extra);
  run.StartGroup("g1", extra);
  run.WaitAll(60s);
  CHECK(run.CheckHashesAgree() == steps);
  std::map<uint32_t, std::set<std::string>> global;
  for (auto& [name, g] : run.groups) {
    for (const auto& [step, h] : ReadHalfLog(g.logs[0])) {
      global[step].insert(h.global_hash);
      CHECK(h.param_dtype == "fp16");
      CHECK(h.model_bytes == h.params * 2);
    }
  }
  REQUIRE(global.size() == steps);
  for (const auto& [step, hashes] : global) {
    INFO("step " << step);
    CHECK(hashes.size() == 1);
  }
}

TEST_CASE("diloco a group that joins mid-run heals from the others and then matches their hashes") {
  // Enough steps that the joiner (a second or two of LibTorch start-up on a loaded CI machine)
  // arrives while the others still run; otherwise it finds the job finished and catches up
  // from the final checkpoint alone (tested in the chaos tests).
  constexpr uint32_t kSteps = 40;
  Run run("diloco-join", 2, 1, kSteps);
  run.StartGroup("g0");
  run.StartGroup("g1");
  // Let the first two groups commit a few steps before the third appears.
  REQUIRE_FALSE(run.groups["g0"].trainers[0]->WaitForLog("outer_committed step=2", 40s).empty());
  run.StartGroup("g2");
  run.WaitAll(90s);
  std::vector<LogLine> joiner = ReadLog(run.groups["g2"].logs[0]);
  REQUIRE_FALSE(joiner.empty());
  CHECK(joiner.front().step > 2);  // it never committed the steps before it joined
  CHECK(joiner.front().healed);
  // It fetched the state from the other groups' agents (their live copies), not over the
  // communicator fallback.
  CHECK_FALSE(run.groups["g2"].trainers[0]->WaitForLog("heal_fetched", 1s).empty());
  CHECK(joiner.front().world == 3);
  CHECK(joiner.back().step == kSteps);
  CHECK(run.CheckHashesAgree() == kSteps);
  std::vector<LogLine> first = ReadLog(run.groups["g0"].logs[0]);
  REQUIRE(first.size() == kSteps);
  CHECK(first.front().world == 2);
  CHECK(first.back().world == 3);
  for (size_t i = 1; i < first.size(); ++i) CHECK(first[i].quorum_id >= first[i - 1].quorum_id);
  // Without --ckpt-every the final weights are still saved durably, by every group.
  for (const char* g : {"g0", "g1", "g2"}) {
    CHECK(std::ifstream(run.dir + "/ckpt-" + g + "/step-000000000040/MANIFEST").good());
  }
}

TEST_CASE("diloco groups of float32 and bf16 weights train one job, and a bf16 group that joins "
          "mid-run heals from them and then matches their hashes") {
  constexpr uint32_t kSteps = 30;
  Run run("diloco-bf16-join", 2, 1, kSteps);
  run.StartGroup("g0");  // float32
  run.StartGroup("g1", {"--param-dtype", "bf16"});
  REQUIRE_FALSE(run.groups["g0"].trainers[0]->WaitForLog("outer_committed step=2", 40s).empty());
  run.StartGroup("g2", {"--param-dtype", "bf16"});
  run.WaitAll(90s);
  std::vector<LogLine> joiner = ReadLog(run.groups["g2"].logs[0]);
  REQUIRE_FALSE(joiner.empty());
  CHECK(joiner.front().step > 2);
  CHECK(joiner.front().healed);
  CHECK(joiner.back().step == kSteps);
  // The float32 outer state is one across the dtypes: shard hashes and global hashes agree.
  CHECK(run.CheckHashesAgree() == kSteps);
  std::map<uint32_t, std::set<std::string>> global, model16;
  std::map<std::string, std::map<uint32_t, HalfLine>> lines;
  for (const char* g : {"g0", "g1", "g2"}) lines[g] = ReadHalfLog(run.groups[g].logs[0]);
  for (const auto& [g, by_step] : lines) {
    for (const auto& [step, h] : by_step) {
      global[step].insert(h.global_hash);
      if (g != "g0") model16[step].insert(h.model_hash);
      CHECK(h.param_dtype == (g == "g0" ? "float32" : "bf16"));
    }
  }
  size_t both16 = 0;
  for (uint32_t step = 1; step <= kSteps; ++step) {
    INFO("step " << step);
    CHECK(global[step].size() == 1);
    CHECK(model16[step].size() == 1);  // the bf16 groups hold the same bf16 weights
    both16 += lines["g2"].count(step);
  }
  CHECK(both16 > 0);
}

TEST_CASE("diloco a group that comes back after the job finished catches up and exits 0") {
  // Its earlier life saved the final step into the same checkpoint root; the new life restores
  // the final checkpoint, and its own final save finds that step committed already: the run's
  // result is saved, so it is no failure (it was, exit 1, in a chaos run whose killed group
  // came back late).
  constexpr uint32_t kSteps = 3;
  Run run("diloco-late", 2, 1, kSteps);
  run.StartGroup("g0");
  run.StartGroup("g1");
  run.WaitAll(60s);
  run.groups["g1"].agent->Signal(SIGKILL);
  (void)run.groups["g1"].agent->Wait(5s);
  run.StartGroup("g1");
  run.WaitAll(60s);
  std::string log = run.groups["g1"].trainers.back()->Log();
  INFO(log);
  CHECK(log.find("reached_by_heal step=3") != std::string::npos);
  CHECK(log.find("final_save_exists step=3") != std::string::npos);
  CHECK(log.find("final_save_failed") == std::string::npos);
  std::vector<LogLine> late = ReadLog(run.groups["g1"].logs[0]);
  REQUIRE_FALSE(late.empty());
  CHECK(late.back().step == kSteps);
  CHECK(late.back().healed);
  CHECK(late.back().hash == ReadLog(run.groups["g0"].logs[0]).back().hash);
}

// The value of `key=` on the first line of `log` that contains `needle`, or "".
std::string LogField(const std::string& log, const std::string& needle, const std::string& key) {
  auto at = log.find(needle);
  if (at == std::string::npos) return "";
  auto line_end = log.find('\n', at);
  std::string line = log.substr(at, line_end == std::string::npos ? std::string::npos : line_end - at);
  auto k = line.find(" " + key + "=");
  if (k == std::string::npos) return "";
  k += key.size() + 2;
  return line.substr(k, line.find(' ', k) - k);
}

TEST_CASE("diloco a group restored from its durable checkpoint resumes AdamW bit for bit") {
  // One group of two trainers saves at steps 2 and 4 and finishes; the same group comes back
  // as a new life with no live state anywhere, so the lighthouse names the durable checkpoint.
  Run run("diloco-inner", 1, 2, 4);
  run.StartGroup("g0", {"--ckpt-every", "2"});
  run.WaitAll(50s);
  std::vector<std::string> saved(2);
  for (uint32_t r = 0; r < 2; ++r) {
    std::string log = run.groups["g0"].trainers[r]->Log();
    saved[r] = LogField(log, "inner_state_saved step=4", "hash");
    INFO(log);
    REQUIRE_FALSE(saved[r].empty());
  }
  // Both trainers of the group hold the same optimizer (their gradients are averaged).
  CHECK(saved[0] == saved[1]);
  run.groups["g0"].agent->Signal(SIGKILL);
  (void)run.groups["g0"].agent->Wait(5s);
  run.outer_steps = 6;
  run.StartGroup("g0", {"--ckpt-every", "2"});
  run.WaitAll(50s);
  for (uint32_t r = 0; r < 2; ++r) {
    std::string log = run.groups["g0"].trainers[r]->Log();
    INFO(log);
    CHECK(log.find("heal_fetched from=\"durable") != std::string::npos);
    // The state the library restored, and the state AdamW holds after loading it, are the
    // state at the save, bit for bit.
    CHECK(LogField(log, "inner_state_restored step=4", "hash") == saved[r]);
    CHECK(LogField(log, "inner_optimizer_loaded step=4", "hash") == saved[r]);
    CHECK(log.find("inner_state=restored") != std::string::npos);
  }
  std::vector<LogLine> log = ReadLog(run.groups["g0"].logs[0]);
  REQUIRE(log.size() == 6);  // steps 1-4, then 5-6 after the restore
  CHECK(log[4].step == 5);
  CHECK(log[4].healed);
  CHECK(log[5].step == 6);
}

TEST_CASE("diloco a heal from live peers starts the inner optimizer afresh and says so") {
  // g0 must still be training when g1 has started, or g1 finds only g0's final checkpoint. Its
  // inner steps are paced (at least 6 s for the 38 steps after g1 is started) rather than
  // counted on to be slow: with denormals flushed, 40 unpaced steps ended before g1's start.
  Run run("diloco-fresh-inner", 1, 1, 40);
  run.StartGroup("g0", {"--inner-step-min-ms", "20"});
  REQUIRE_FALSE(run.groups["g0"].trainers[0]->WaitForLog("outer_committed step=2", 40s).empty());
  run.StartGroup("g1");
  run.WaitAll(50s);
  std::string log = run.groups["g1"].trainers[0]->Log();
  INFO(log);
  CHECK(log.find("heal_fetched from=peers") != std::string::npos);
  CHECK(log.find("inner_state=fresh") != std::string::npos);
  CHECK(log.find("inner_optimizer_loaded") == std::string::npos);
  CHECK(run.CheckHashesAgree() > 0);
}

// Every committed step of one trainer's log: step -> (batch hashes of its inner steps, the
// global weights' hash). The last line of a step wins (a log appended to by two lives).
std::map<uint32_t, std::pair<std::vector<std::string>, std::string>> BatchesByStep(
    const std::string& path) {
  std::map<uint32_t, std::pair<std::vector<std::string>, std::string>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::json::object o = boost::json::parse(line).as_object();
    std::vector<std::string> batches;
    for (const auto& b : o.at("batches").as_array()) batches.emplace_back(b.as_string());
    out[static_cast<uint32_t>(o.at("step").to_number<int64_t>())] = {
        std::move(batches), std::string(o.at("global_hash").as_string())};
  }
  return out;
}

TEST_CASE(
    "diloco a group drained with a checkpoint and restored from it draws the batches of a run "
    "that never stopped") {
  // A group of two trainers trains until its agent is told to stop (SIGUSR2, Slurm's warning
  // before the time limit: checkpoint and drain). The drain saves the last committed step with each trainer's data position and
  // inner step (the library's extra state); the inner steps run after that commit are dropped.
  Run run("diloco-extra", 1, 2, 1000);
  run.StartGroup("g0", {"--inner-step-min-ms", "20"});
  for (auto& t : run.groups["g0"].trainers) {
    REQUIRE_FALSE(t->WaitForLog("outer_committed step=2", 60s).empty());
  }
  run.groups["g0"].agent->Signal(SIGUSR2);  // Slurm's warning before the time limit
  run.WaitAll(60s);
  (void)run.groups["g0"].agent->Wait(30s);
  const std::string drained = run.groups["g0"].trainers[0]->Log();
  const std::string saved_step = LogField(drained, "extra_state_saved", "step");
  INFO(drained);
  REQUIRE_FALSE(saved_step.empty());
  CHECK(drained.find("drain step=" + saved_step + " checkpoint_now=true") != std::string::npos);
  const uint32_t k = static_cast<uint32_t>(std::stoul(saved_step));
  // The new life restores step k and its data position, and trains two steps more.
  run.outer_steps = k + 2;
  run.StartGroup("g0");
  run.WaitAll(60s);
  // The same group (name, seed, size) run from the start without a stop.
  Run ref("diloco-extra-ref", 1, 2, k + 2);
  ref.StartGroup("g0");
  ref.WaitAll(60s);
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string log = run.groups["g0"].trainers[2 + r]->Log();
    INFO("restored trainer " << r << ":\n" << log);
    CHECK(log.find("heal_fetched from=\"durable") != std::string::npos);
    CHECK_FALSE(LogField(log, fmt::format("extra_state_loaded step={}", k), "rng").empty());
    auto restored = BatchesByStep(run.groups["g0"].logs[r]);
    auto want = BatchesByStep(ref.groups["g0"].logs[r]);
    for (uint32_t step = 1; step <= k + 2; ++step) {
      INFO("step " << step);
      REQUIRE(restored.count(step) == 1);
      REQUIRE(want.count(step) == 1);
      CHECK(restored[step].first.size() == 8);
      // Before the stop and after the restore alike: the batches of the run that never
      // stopped. The weights are its weights up to the saved step; after it they differ,
      // because the drain's save takes AdamW's state as it is at the drain, after the inner
      // steps it dropped (the inner state's hook is called at the save, not at the commit).
      CHECK(restored[step].first == want[step].first);
      if (step <= k) CHECK(restored[step].second == want[step].second);
    }
  }
}

TEST_CASE("diloco a requeued group that heals from live peers continues its own data stream") {
  // g0 trains on while g1 gets Slurm's warning (checkpoint and drain) and comes back as a new
  // life. g0 is still training, so g1's weights come from g0's live state; its data position
  // comes from its own drain checkpoint. g1's batches, over both lives, are those of a g1 that
  // never stopped: the inner steps the drain dropped are drawn again, nothing is skipped.
  constexpr uint32_t kSteps = 40;
  Run run("diloco-extra-live", 1, 1, kSteps);
  run.StartGroup("g0", {"--inner-step-min-ms", "20"});
  run.StartGroup("g1", {"--inner-step-min-ms", "20"});
  REQUIRE_FALSE(run.groups["g1"].trainers[0]->WaitForLog("outer_committed step=3", 60s).empty());
  run.groups["g1"].agent->Signal(SIGUSR2);
  auto code = run.groups["g1"].trainers[0]->Wait(60s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  (void)run.groups["g1"].agent->Wait(30s);
  const std::string drained = run.groups["g1"].trainers[0]->Log();
  const std::string saved_step = LogField(drained, "extra_state_saved", "step");
  INFO(drained);
  REQUIRE_FALSE(saved_step.empty());
  run.StartGroup("g1");
  run.WaitAll(120s);
  const std::string log = run.groups["g1"].trainers[1]->Log();
  INFO("g1's new life:\n" << log);
  CHECK(log.find("heal_fetched from=peers") != std::string::npos);
  CHECK(LogField(log, "extra_state_from_own_checkpoint", "step") == saved_step);
  CHECK(log.find("extra_state_loaded") != std::string::npos);
  CHECK(run.CheckHashesAgree() > 0);

  const std::vector<std::string> got = test::BatchSequence(run.groups["g1"].logs[0]);
  REQUIRE(got.size() % 8 == 0);
  // The same group (name, seed) alone and without a stop, for as many outer steps.
  Run ref("diloco-extra-live-ref", 1, 1, static_cast<uint32_t>(got.size() / 8));
  ref.StartGroup("g1");
  ref.WaitAll(120s);
  const std::vector<std::string> want = test::BatchSequence(ref.groups["g1"].logs[0]);
  REQUIRE(want.size() == got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("batch " << i << " (outer step " << i / 8 + 1 << " of g1's own)");
    CHECK(got[i] == want[i]);
  }
}

}  // namespace
}  // namespace lk::diloco
