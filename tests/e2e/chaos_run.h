// The chaos tests' run on plain processes: a lighthouse, and groups of one replica_agent and
// their trainers, started, killed, drained and restarted as the tests' schedules say. Shared by
// chaos_test.cc (C++ diloco_trainer groups) and python_chaos_test.cc (Python trainers, and a
// job that mixes both): each group runs one trainer kind, every group the same model flags.
// Test-only; include after doctest. Thread-safety: one test thread.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e/chaos_util.h"
#include "tests/support/process.h"

namespace lk::e2e {

using namespace std::chrono_literals;

// Which trainer a group runs: the C++ diloco_trainer, or examples/python/diloco_trainer.py on
// Debian's python3 with the lightkeeper package from build/python. Both take the same flags.
enum class TrainerKind { kCpp, kPython };

// What every trainer of a run shares.
struct RunOptions {
  std::string job = "chaos";
  uint32_t steps = 36;      // T
  uint32_t group_size = 2;  // trainers per group
  uint32_t seed = 11;       // the trainers' --seed (model init and data)
  uint32_t inner_steps = 8;
  // Appended to every trainer's command line (e.g. {"--outer-compress", "int8"}).
  std::vector<std::string> trainer_flags;
  // Per group (by name): flags appended to its trainers' command lines (a later flag wins), and
  // a trainer count other than group_size.
  std::map<std::string, std::vector<std::string>> group_flags;
  std::map<std::string, uint32_t> group_sizes;
  std::vector<std::string> lighthouse_flags;  // empty: Run::LighthouseFlags()
};

// The interpreter and script of the Python trainer, and its PYTHONPATH.
inline std::string PythonInterpreter() { return "/usr/bin/python3"; }
inline std::string PythonTrainerScript() {
  return test::SourceDir() + "/examples/python/diloco_trainer.py";
}
inline std::string PythonPackageDir() { return test::BinDir() + "/../python"; }

// One life of a group: an agent and its trainers. A group that comes back is a new life.
struct Life {
  std::string group;
  uint32_t index = 0;
  TrainerKind kind = TrainerKind::kCpp;
  std::unique_ptr<test::Process> agent;
  std::vector<std::unique_ptr<test::Process>> trainers;
  std::vector<std::string> logs;
  bool killed = false;  // a process of this life was killed: its exit codes are not checked
  bool left = false;    // drained by a SIGTERM to its agent: exits 0 before T
};

struct Run {
  using Clock = std::chrono::steady_clock;
  RunOptions options;
  std::string dir;
  std::string lh_data;
  test::Lighthouse lh;
  std::vector<std::unique_ptr<Life>> lives;
  std::map<std::string, Life*> current;
  uint32_t restarts_of_lighthouse = 0;

  Run(const std::string& tag, RunOptions o)
      : options(std::move(o)), dir(test::TempDir(tag)), lh_data(dir + "/lh") {
    lh = test::StartLighthouse(lh_data, LhFlags(), dir + "/lighthouse.log");
  }
  std::vector<std::string> LhFlags() const {
    return options.lighthouse_flags.empty() ? LighthouseFlags() : options.lighthouse_flags;
  }
  uint32_t SizeOf(const std::string& group) const {
    auto it = options.group_sizes.find(group);
    return it == options.group_sizes.end() ? options.group_size : it->second;
  }
  static std::vector<std::string> LighthouseFlags() {
    return {"--min-replicas", "2", "--join-timeout-ms", "2000", "--heartbeat-timeout-ms", "2000"};
  }

  // The trainer's command line: the same flags for both kinds (the tests' tiny model).
  std::vector<std::string> TrainerArgv(TrainerKind kind, const std::string& name, uint32_t rank,
                                       const std::string& log, const std::string& live) const {
    std::vector<std::string> argv;
    if (kind == TrainerKind::kPython) {
      argv = {PythonInterpreter(), PythonTrainerScript()};
    } else {
      argv = {test::BinDir() + "/diloco_trainer"};
    }
    std::vector<std::string> flags = {
        "--group-rank", std::to_string(rank), "--group-size", std::to_string(SizeOf(name)),
        "--inner-steps", std::to_string(options.inner_steps), "--outer-steps",
        std::to_string(options.steps), "--seed", std::to_string(options.seed), "--ckpt-dir",
        dir + "/ckpt-" + name, "--log", log, "--model-width", "32", "--layers", "1", "--heads",
        "2", "--seq-len", "32", "--batch", "8", "--corpus-bytes", "16384", "--op-timeout-ms",
        "20000", "--live-dir", live, "--eval-batches", "8"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), options.trainer_flags.begin(), options.trainer_flags.end());
    if (auto it = options.group_flags.find(name); it != options.group_flags.end()) {
      argv.insert(argv.end(), it->second.begin(), it->second.end());
    }
    return argv;
  }

  Life* StartGroup(const std::string& name, TrainerKind kind = TrainerKind::kCpp) {
    auto life = std::make_unique<Life>();
    life->group = name;
    life->kind = kind;
    life->index = static_cast<uint32_t>(lives.size());
    std::string socket = fmt::format("{}/{}.{}.sock", dir, name, life->index);
    std::string live = fmt::format("{}/live-{}", dir, name);
    life->agent = std::make_unique<test::Process>(
        std::vector<std::string>{test::BinDir() + "/replica_agent", "--lighthouse", lh.url(),
                                 "--job", options.job, "--group-id", name, "--socket", socket,
                                 "--serve", "127.0.0.1:0", "--serve-dir", live,
                                 "--heartbeat-interval-ms", "100", "--quorum-timeout-ms", "5000"},
        fmt::format("{}/agent-{}.{}.log", dir, name, life->index));
    REQUIRE_FALSE(life->agent->WaitForLog("agent_listening", 20s).empty());
    std::map<std::string, std::string> env = {{"LK_AGENT_SOCKET", socket}, {"LK_GROUP_ID", name}};
    if (kind == TrainerKind::kPython) {
      // insert, not operator[] and assignment: GCC 12 warns falsely (-Wrestrict) on the
      // latter at -O2.
      env.insert({"PYTHONPATH", PythonPackageDir()});
      env.insert({"PYTHONDONTWRITEBYTECODE", "1"});  // nothing written into the source tree
    }
    for (uint32_t r = 0; r < SizeOf(name); ++r) {
      std::string log = fmt::format("{}/trainer-{}-{}.{}.jsonl", dir, name, r, life->index);
      life->logs.push_back(log);
      life->trainers.push_back(std::make_unique<test::Process>(
          TrainerArgv(kind, name, r, log, live), log + ".stderr", env));
    }
    Life* p = life.get();
    current[name] = p;
    lives.push_back(std::move(life));
    return p;
  }

  // Waits until one of `life`'s trainers logged a commit (it joined the quorum and committed).
  // A trainer that exits first (e.g. it came back after the job finished and only restored the
  // final step) ends the wait at once, with its stderr named.
  bool WaitFirstCommit(Life* life, std::chrono::seconds bound) {
    auto deadline = Clock::now() + bound;
    while (Clock::now() < deadline) {
      if (!ReadLog(life->logs[0]).empty()) return true;
      if (!life->trainers[0]->Running()) {
        if (!ReadLog(life->logs[0]).empty()) return true;
        MESSAGE("trainer 0 of " << life->group << " exited before its first commit; stderr in "
                                << life->trainers[0]->log_path());
        return false;
      }
      std::this_thread::sleep_for(100ms);
    }
    MESSAGE("no commit from " << life->group << " in " << bound.count() << " s; stderr in "
                              << life->trainers[0]->log_path());
    return false;
  }

  // After a kill in `life`: the rest of the group stops (the agent ends its trainers when one
  // dies; trainers whose agent died stop on their own). Whatever still runs after `bound` is
  // killed. Returns the agent's exit code when it exited.
  std::optional<int> Reap(Life* life, std::chrono::seconds bound) {
    life->killed = true;
    auto deadline = Clock::now() + bound;
    auto left = [&] {
      return std::max(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()), 1ms);
    };
    // The trainers first: they are this test's children, and the agent counts a trainer that is
    // not reaped yet (a zombie) as still running.
    for (auto& t : life->trainers) {
      if (!t->Wait(left())) {
        MESSAGE("trainer of " << life->group << " still runs after " << bound.count()
                              << " s: killed");
        t->Signal(SIGKILL);
        t->Wait(5s);
      }
    }
    std::optional<int> agent_code = life->agent->Wait(left());
    if (!agent_code) {
      life->agent->Signal(SIGKILL);
      life->agent->Wait(5s);
    }
    return agent_code;
  }

  void RestartLighthouse(std::mt19937& rng) {
    std::string address = lh.address;
    lh.process->Signal(SIGKILL);
    REQUIRE(lh.process->Wait(10s).has_value());
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 800));
    lh = test::StartLighthouse(lh_data, LhFlags(),
                               fmt::format("{}/lighthouse.{}.log", dir, ++restarts_of_lighthouse),
                               address);
    REQUIRE(lh.address == address);
  }

  std::vector<TrainerLog> AllLogs() const {
    std::vector<TrainerLog> out;
    for (const auto& l : lives) {
      for (const std::string& p : l->logs) out.push_back({p, !l->killed && !l->left});
    }
    return out;
  }

  // Waits for the trainers and agents of every life that was not killed; all must exit 0.
  void WaitSurvivors(std::chrono::seconds bound) {
    auto deadline = Clock::now() + bound;
    auto left = [&] {
      return std::max(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()), 1ms);
    };
    for (auto& life : lives) {
      if (life->killed) continue;
      for (size_t r = 0; r < life->trainers.size(); ++r) {
        auto code = life->trainers[r]->Wait(left());
        INFO("trainer " << life->group << "/" << r << " (life " << life->index << ") stderr in "
                        << life->trainers[r]->log_path());
        REQUIRE(code.has_value());
        CHECK(*code == 0);
      }
      auto code = life->agent->Wait(left());
      INFO("agent " << life->group << " (life " << life->index << ") log "
                    << life->agent->log_path());
      REQUIRE(code.has_value());
      CHECK(*code == 0);
    }
  }

  // SIGTERM to the agent of `g`: the group drains, its trainers and agent exit 0, it leaves.
  void Leave(const std::string& g) {
    Life* life = current[g];
    life->left = true;
    life->agent->Signal(SIGTERM);
    for (auto& t : life->trainers) {
      auto code = t->Wait(30s);
      INFO("trainer stderr " << t->log_path());
      REQUIRE(code.has_value());
      CHECK(*code == 0);
    }
    auto code = life->agent->Wait(10s);
    REQUIRE(code.has_value());
    CHECK(*code == 0);
  }
};

// Waits until the job's committed step reaches `step`.
inline bool WaitCommitted(const StatusWatch& w, uint32_t step, std::chrono::seconds bound) {
  auto deadline = std::chrono::steady_clock::now() + bound;
  while (std::chrono::steady_clock::now() < deadline) {
    if (w.committed() >= step) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

}  // namespace lk::e2e
