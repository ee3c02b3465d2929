// Helpers shared by the tests that run against the real local Slurm (slurm_local_test,
// slurm_e2e_test): a shell with a bound, file reading, bounded waits, and starting the local
// Slurm when it does not answer. Test-only; include after doctest.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "slurm/command.h"

namespace lk::slurm::testing {

inline std::string Env(const char* name, std::string fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

inline CommandResult Sh(const std::string& script,
                        std::chrono::seconds timeout = std::chrono::seconds(30)) {
  SubprocessRunner runner;
  Command cmd;
  cmd.argv = {"bash", "-c", script};
  cmd.timeout = timeout;
  auto r = runner.Run(cmd);
  REQUIRE_MESSAGE(r.ok(), script << ": " << r.status().ToString());
  return *r;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

// Polls `done` every `every` until it holds or `limit` passed; the last answer is returned.
inline bool WaitFor(const std::function<bool()>& done, std::chrono::seconds limit,
                    std::chrono::milliseconds every = std::chrono::milliseconds(100)) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(every);
  }
  return done();
}

// The local Slurm's base: $SLURM_BASE (scripts/test.sh sets one per run), else lk-slurm under
// the temp directory.
inline std::string SlurmBase() {
  std::string base = Env("SLURM_BASE");
  if (!base.empty()) return base;
  return (std::filesystem::temp_directory_path() / "lk-slurm").string();
}

// Points SLURM_CONF at the local Slurm and starts it (scripts/slurm-local.sh) unless it answers.
// Nothing is taken from an earlier run: without a config there is nothing to ask, and the
// probe's bound ends sinfo with SIGKILL if SIGTERM does not (sinfo retries a missing config for
// 60 s).
inline void EnsureSlurm() {
  std::string base = SlurmBase();
  std::string conf = base + "/slurm.conf";
  if (Env("SLURM_CONF").empty()) setenv("SLURM_CONF", conf.c_str(), 1);
  REQUIRE_MESSAGE(!Env("LK_BIN_DIR").empty(), "LK_BIN_DIR is not set (run through ctest)");
  REQUIRE_MESSAGE(Sh("command -v sbatch").exit_code == 0,
                  "Slurm is not installed: run scripts/install-deps.sh, or skip these tests "
                  "with `ctest -LE slurm`");
  if (std::filesystem::exists(Env("SLURM_CONF")) &&
      Sh("timeout -k 2 5 sinfo -h -p low >/dev/null 2>&1").exit_code == 0) {
    return;
  }
  Command up;
  up.argv = {"bash", Env("LK_SOURCE_DIR", LK_SOURCE_DIR_BUILT) + "/scripts/slurm-local.sh", "up"};
  up.env["SLURM_BASE"] = base;
  up.timeout = std::chrono::seconds(90);
  auto ran = SubprocessRunner().Run(up);
  REQUIRE_MESSAGE(ran.ok(), "slurm-local.sh up: " << ran.status().ToString());
  REQUIRE_MESSAGE(ran->exit_code == 0, "slurm-local.sh up failed:\n" << ran->out << ran->err);
}

}  // namespace lk::slurm::testing
