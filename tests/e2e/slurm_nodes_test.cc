// A replica group that spans two Slurm nodes, on the real Slurm the project starts with two
// nodes (scripts/slurm-local.sh with SLURM_LOCAL_NODES=2: n1 on 127.0.0.1 and n2 on 127.0.0.2,
// two slurmds on this host). The batch script of `lkctl slurm script --nodes 2` runs one real
// replica_agent per node (node ranks from SLURM_NODEID, one incarnation for both) and one
// diloco_trainer per node with no rank flags: each takes its group rank and size from Slurm's
// task variables, and its bind address from --bind-iface. The group trains to the end against
// a real lighthouse, which shows it as one group of two nodes.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <set>
#include <string>

#include "slurm/slurm_test_util.h"
#include "tests/e2e/chaos_util.h"
#include "tests/support/process.h"

namespace lk::e2e {
namespace {

using namespace std::chrono_literals;
using namespace lk::slurm::testing;  // NOLINT

constexpr uint32_t kSteps = 6;
constexpr int kPort = 6837;  // slurmctld of the two-node cluster; its slurmds take the next two

// Starts the two-node cluster beside the one-node one (its own base and ports) and stops it.
struct TwoNodeSlurm {
  std::string base = SlurmBase() + "-2n";
  std::string conf = base + "/slurm.conf";
  std::string Env() const {
    return fmt::format("SLURM_BASE={} SLURM_LOCAL_NODES=2 SLURM_LOCAL_PORT={} ", base, kPort);
  }
  TwoNodeSlurm() {
    REQUIRE_MESSAGE(Sh("command -v sbatch").exit_code == 0,
                    "Slurm is not installed: run scripts/install-deps.sh, or skip these tests "
                    "with `ctest -LE slurm`");
    auto up = Sh(Env() + "bash " + slurm::testing::Env("LK_SOURCE_DIR", LK_SOURCE_DIR_BUILT) +
                     "/scripts/slurm-local.sh up",
                 std::chrono::seconds(90));
    REQUIRE_MESSAGE(up.exit_code == 0, up.err);
  }
  ~TwoNodeSlurm() {
    (void)Sh(Env() + "bash " + slurm::testing::Env("LK_SOURCE_DIR", LK_SOURCE_DIR_BUILT) +
             "/scripts/slurm-local.sh down >/dev/null 2>&1; true");
  }
  // A client command against this cluster.
  slurm::CommandResult Run(const std::string& cmd) const {
    return Sh("export SLURM_CONF=" + conf + "; " + cmd);
  }
};

TEST_SUITE_BEGIN("slurm");

TEST_CASE("slurm nodes: a group of two nodes takes its ranks from Slurm and trains to the end") {
  TwoNodeSlurm slurm;
  auto nodes = slurm.Run("sinfo -h -N -p debug -o %N");
  CHECK(nodes.out == "n1\nn2\n");
  const std::string dir = test::TempDir("slurm-nodes");
  const std::string bin = slurm::testing::Env("LK_BIN_DIR");
  test::Lighthouse lh = test::StartLighthouse(dir + "/lh-data", {"--min-replicas", "1"},
                                              dir + "/lighthouse.log");
  // Each task logs its node and writes its own files; the trainer has no --group-rank or
  // --group-size.
  const std::string task = dir + "/r${SLURM_PROCID}";
  const std::string trainer = fmt::format(
      "echo $SLURMD_NODENAME > {0}.node; exec {1}/diloco_trainer --inner-steps 8 --outer-steps "
      "{2} --seed 5 --model-width 32 --layers 1 --heads 2 --seq-len 32 --batch 8 "
      "--corpus-bytes 16384 --op-timeout-ms 20000 --ckpt-dir {3}/ckpt --log {0}.jsonl "
      "2> {0}.stderr",
      task, bin, kSteps, dir);
  auto made = Sh(fmt::format(
      "cd {0} && LK_HEARTBEAT_INTERVAL_MS=100 {1}/lkctl slurm script --job nodes --group-id g0 "
      "--lighthouse {2} --nodes 2 --tasks-per-node 1 --time 10:00 --signal-before-s 60 "
      "--bind-iface lo --output {0}/batch-%j.log --agent-bin {1}/replica_agent --lkctl-bin "
      "{1}/lkctl --agent-exit-wait-s 30 -- bash -c '{3}' > {0}/job.sh",
      dir, bin, lh.url(), trainer));
  REQUIRE_MESSAGE(made.exit_code == 0, made.err);
  auto sub = slurm.Run(fmt::format("cd {} && sbatch --parsable --overcommit job.sh", dir));
  REQUIRE_MESSAGE(sub.exit_code == 0, sub.err);
  const std::string id = sub.out.substr(0, sub.out.find_first_of(";\n"));
  REQUIRE(!id.empty());
  auto logs = [&] {
    return slurm.Run(fmt::format("cd {0}; for f in batch-*.log r*.stderr; do echo \"== $f\"; "
                                 "tail -n 30 \"$f\"; done",
                                 dir))
        .out;
  };
  REQUIRE_MESSAGE(WaitFor(
                      [&] {
                        return slurm.Run("squeue -h -j " + id + " 2>/dev/null").out.empty();
                      },
                      180s),
                  logs());
  const std::string batch = ReadFile(fmt::format("{}/batch-{}.log", dir, id));
  CAPTURE(batch);
  CHECK(batch.find("event=trainers_exited rc=0") != std::string::npos);
  // One agent per node, node ranks from SLURM_NODEID, both of one incarnation of one group.
  CHECK(batch.find("node_rank=0 nodes=2") != std::string::npos);
  CHECK(batch.find("node_rank=1 nodes=2") != std::string::npos);
  CHECK(batch.find("agent_exit code=0") != std::string::npos);
  std::vector<TrainerLog> trainer_logs;
  std::set<std::string> hosts;
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string err = ReadFile(fmt::format("{}/r{}.stderr", dir, r));
    INFO("trainer " << r << ":\n" << err);
    CHECK(err.find(fmt::format("trainer_config group_rank={} group_size=2 ", r)) !=
          std::string::npos);
    CHECK(err.find("place=slurm") != std::string::npos);
    CHECK(err.find("bind_host=127.0.0.1 ") != std::string::npos);
    hosts.insert(ReadFile(fmt::format("{}/r{}.node", dir, r)));
    trainer_logs.push_back({fmt::format("{}/r{}.jsonl", dir, r), true});
  }
  CHECK(hosts == std::set<std::string>{"n1\n", "n2\n"});  // one trainer on each node
  CheckLogs(trainer_logs, kSteps, 2);
  const std::string lh_log = ReadFile(dir + "/lighthouse.log");
  CHECK(lh_log.find("group_new job=nodes group=g0 incarnation=" + id + ".r0.") !=
        std::string::npos);
  CHECK(lh_log.find("nodes=2") != std::string::npos);
}

TEST_SUITE_END();

}  // namespace
}  // namespace lk::e2e
