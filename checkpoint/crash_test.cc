// Crash consistency, two ways.
// Process kills: a writer process saving a 2-rank checkpoint after checkpoint is killed with
// SIGKILL at random instants. Every time, restore must find the last checkpoint the writer
// reported committed (or the one after it, if the kill came between commit and report), verify
// every checksum, and restore it bitwise. Seed: LK_CRASH_SEED (printed); kills: LK_CRASH_KILLS.
// Machine crashes: FaultEnv's lost-writes mode stops the writer at every mutating call in turn
// and drops what was not synced (file data, directory entries), as a power cut would; restore
// must then find the previous or the new checkpoint, verified, and no torn step directory.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <thread>

#include "checkpoint/store.h"
#include "checkpoint/test_util.h"
#include "common/log.h"

namespace lk::ckpt {
namespace {

using namespace testing;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

// The child: continue from the newest checkpoint, forever; report each commit on `fd`.
[[noreturn]] void WriterChild(const std::string& root, const std::vector<TensorSpec>& model, int fd) {
  SetLogLevel(LogLevel::kError);
  auto latest = FindLatest(Env::Default(), root);
  int64_t step = latest.ok() ? latest->step + 1 : 1;
  WriterOptions o;
  o.root = root;
  o.chunk_bytes = 64 << 10;
  o.keep = 2;
  CheckpointWriter w(o);
  std::string attempt = std::to_string(::getpid());
  for (;; ++step) {
    for (uint32_t r = 0; r < 2; ++r) {
      auto res = w.Save(MakeSnapshot(model, step, r, 2, attempt));
      if (!res.ok()) {
        std::fprintf(stderr, "writer child: %s\n", res.status().ToString().c_str());
        ::_exit(3);
      }
    }
    if (::write(fd, &step, sizeof step) != sizeof step) ::_exit(4);
  }
}

TEST_CASE("kill -9 of the writer at random instants never loses the last complete checkpoint") {
  uint64_t seed = EnvOr("LK_CRASH_SEED", std::random_device()());
  uint64_t kills = EnvOr("LK_CRASH_KILLS", 100);
  std::printf("crash_test seed=%llu kills=%llu (replay: LK_CRASH_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(kills),
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  TempDir tmp;
  std::string root = tmp.path();
  auto model = SmallModel();
  // Calibrate: the kill instants spread over about three saves, whatever the disk's fsync cost.
  auto t0 = std::chrono::steady_clock::now();
  SaveModel(tmp.Sub("calibrate"), model, 1, 2);
  auto save_us = std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::steady_clock::now() - t0).count();
  std::printf("crash_test save_us=%lld\n", static_cast<long long>(save_us));
  int64_t reported = 0;  // the newest step a child reported committed
  int64_t found = 0;     // the step restore found after the previous kill: durable since
  uint64_t interrupted = 0;
  for (uint64_t i = 0; i < kills; ++i) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::fflush(nullptr);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(fds[0]);
      WriterChild(root, model, fds[1]);
    }
    ::close(fds[1]);
    auto delay = std::chrono::microseconds(std::uniform_int_distribution<int64_t>(0, 3 * save_us)(rng));
    // Kept: the kill at a random moment of the save is what is under test, not an order.
    std::this_thread::sleep_for(delay);
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE_MESSAGE((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL),
                    "the writer failed on its own, status " << status);
    int64_t step = 0;
    while (::read(fds[0], &step, sizeof step) == sizeof step) reported = step;
    ::close(fds[0]);

    auto names = Env::Default()->ListDir(root);
    REQUIRE(names.ok());
    for (const auto& n : *names) interrupted += n.rfind(".tmp-", 0) == 0 ? 1 : 0;
    auto ref = FindLatest(Env::Default(), root);
    int64_t known = std::max(reported, found);
    if (known == 0 && !ref.ok()) continue;  // killed before the first commit
    REQUIRE_MESSAGE(ref.ok(), "kill " << i << " seed " << seed << ": " << ref.status().ToString());
    // Never older than a known commit; at most one newer (committed, killed before reporting).
    CHECK_MESSAGE((ref->step >= known && ref->step <= known + 1),
                  "kill " << i << " seed " << seed << ": found " << ref->step << " after " << known
                          << " was known committed");
    found = ref->step;
    Status st = VerifyCheckpoint(Env::Default(), ref->dir);
    REQUIRE_MESSAGE(st.ok(), "kill " << i << " seed " << seed << ": " << st.ToString());
    auto state = RestoreLatest(root, SmallReads(3, static_cast<uint32_t>(i % 3)));
    REQUIRE_MESSAGE(state.ok(), state.status().ToString());
    CHECK(state->step == ref->step);
    CheckState(*state, model, ref->step);
  }
  std::printf("crash_test reported_commits=%lld kills_mid_save=%llu\n",
              static_cast<long long>(reported), static_cast<unsigned long long>(interrupted));
  CHECK(reported > 0);
  CHECK(interrupted > 0);  // the kills did land inside saves, not only between them
}

// Small enough that a few hundred saves take seconds, with several chunks and several appends
// per tensor so that crash points fall inside the data too.
std::vector<TensorSpec> TinyModel() {
  return {{"a.weight", DType::kF32, {37, 19}}, {"b.bias", DType::kBF16, {5}},
          {"d.step", DType::kI64, {}}, {"e.emb", DType::kF16, {100, 16}}};
}

struct CrashRun {
  int64_t committed = 0;  // the newest step a Save reported committed before the crash
  bool crashed = false;
};

// Saves steps 1..3 with 2 ranks into `root` through `env` until the first error.
CrashRun SaveUntilCrash(FaultEnv* env, const std::string& root, const std::vector<TensorSpec>& model) {
  WriterOptions o;
  o.root = root;
  o.keep = 2;  // step 3 retires step 1: retention is crashed into too
  o.chunk_bytes = 1024;
  o.write_bytes_max = 2048;
  o.env = env;
  CheckpointWriter w(o);
  CrashRun run;
  for (int64_t step = 1; step <= 3; ++step) {
    for (uint32_t r = 0; r < 2; ++r) {
      auto res = w.Save(MakeSnapshot(model, step, r, 2, "a"));
      if (!res.ok()) {
        run.crashed = true;
        return run;
      }
      if (res->committed) run.committed = step;
    }
  }
  return run;
}

TEST_CASE("lost writes: a machine crash at every point of three saves leaves the previous or the new checkpoint") {
  SetLogLevel(LogLevel::kError);
  auto model = TinyModel();
  // Count the mutating calls of the whole sequence once; then crash at each of them.
  uint64_t points = 0;
  {
    TempDir tmp;
    FaultEnv env(Env::Default());
    env.TrackUnsynced();
    CrashRun run = SaveUntilCrash(&env, tmp.Sub("ckpt"), model);
    REQUIRE(!run.crashed);
    REQUIRE(run.committed == 3);
    points = env.mutating_ops();
  }
  std::printf("lost_writes crash_points=%llu\n", static_cast<unsigned long long>(points));
  CHECK(points >= 100);
  std::map<int64_t, uint64_t> found_counts;
  // Point `points` is the power cut right after the last call returned.
  for (uint64_t k = 0; k <= points; ++k) {
    CAPTURE(k);
    TempDir tmp;
    // The root is created by the first save: its own entry must survive as well.
    std::string root = tmp.Sub("ckpt");
    FaultEnv env(Env::Default());
    env.TrackUnsynced();
    env.CrashAfter(k);
    CrashRun run = SaveUntilCrash(&env, root, model);
    // The writer may go on past a failed call it tolerates (lock removal, retention: logged),
    // so only the env says whether the crash point was reached.
    REQUIRE(env.crashed() == (k < points));
    if (k == points) REQUIRE(run.committed == 3);
    REQUIRE(env.DropUnsynced().ok());

    // No torn checkpoint: every step directory that exists after the crash is whole.
    auto dirs = Env::Default()->Exists(root) ? ListCommitted(Env::Default(), root)
                                             : Result<std::vector<CheckpointRef>>(std::vector<CheckpointRef>{});
    REQUIRE(dirs.ok());
    for (const auto& d : *dirs) {
      Status st = VerifyCheckpoint(Env::Default(), d.dir);
      CHECK_MESSAGE(st.ok(), "crash point " << k << ": torn " << d.name << ": " << st.ToString());
    }
    auto ref = Env::Default()->Exists(root) ? FindLatest(Env::Default(), root)
                                            : Result<CheckpointRef>(Error(Code::kNotFound, "no root"));
    if (!ref.ok()) {
      // Only before the first commit was reported.
      CHECK_MESSAGE(run.committed == 0, "crash point " << k << ": lost step " << run.committed
                                                       << ": " << ref.status().ToString());
      ++found_counts[0];
      continue;
    }
    // The previous checkpoint, or the new one if the crash came after its commit was durable.
    CHECK_MESSAGE((ref->step == run.committed || ref->step == run.committed + 1),
                  "crash point " << k << ": found step " << ref->step << " after step "
                                 << run.committed << " was reported committed");
    ++found_counts[ref->step];
    auto state = RestoreLatest(root, SmallReads(3, static_cast<uint32_t>(k % 3)));
    REQUIRE_MESSAGE(state.ok(), state.status().ToString());
    CHECK(state->step == ref->step);
    CheckState(*state, model, ref->step);
  }
  for (const auto& [step, n] : found_counts) {
    std::printf("lost_writes restored_step=%lld crash_points=%llu\n", static_cast<long long>(step),
                static_cast<unsigned long long>(n));
  }
  // The crash points reach every outcome: nothing yet, and each of the three steps.
  CHECK(found_counts.size() == 4);
}

}  // namespace
}  // namespace lk::ckpt
