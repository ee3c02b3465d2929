// lighthouse_bench: the lighthouse's figures, each beside a peer measured in the same run.
// (1) heartbeat throughput against nginx serving a static 204 to the same connections and bytes;
// (2) quorum formation and (3) the unchanged quorum against a raw TCP barrier on loopback;
// (4) simultaneous cold starts; (5) restart to serving after kill -9 with 10,000 groups of state;
// (6) memory per tracked group. Prints a markdown table; bench/lighthouse_bench.sh runs it.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>

#include "bench/lighthouse_bench_modes.h"
#include "common/flags.h"
#include "common/log.h"

namespace lk::bench {
namespace {

std::string Rate(double r) { return fmt::format("{:.0f}/s", r); }
std::string MsText(double ms) {
  return ms < 1 ? fmt::format("{:.3f} ms", ms) : fmt::format("{:.2f} ms", ms);
}
std::string Ratio(double a, double b) { return b > 0 ? fmt::format("{:.2f}x", a / b) : "n/a"; }
std::string Met(bool ok) { return ok ? "met" : "**missed**"; }

void Row(const std::string& figure, const std::string& ours, const std::string& peer,
         const std::string& ratio, const std::string& goal, const std::string& met) {
  std::printf("| %s | %s | %s | %s | %s | %s |\n", figure.c_str(), ours.c_str(), peer.c_str(),
              ratio.c_str(), goal.c_str(), met.c_str());
}

std::string Failures(const LatencyStats& s) {
  return s.failures == 0 ? "" : fmt::format(" ({} failed: {})", s.failures, s.first_error);
}

void PrintHeartbeat(const HeartbeatFigures& f) {
  const auto& l = f.lighthouse;
  const auto& n = f.nginx;
  std::string ours = fmt::format("{} (p99 {}, {:.1f} us CPU/req, {:.1f} in kernel{})",
                                 Rate(l.rate_per_s), MsText(l.p99_ms), l.server_cpu_us,
                                 l.server_sys_us,
                                 l.errors ? fmt::format(", {} errors: {}", l.errors, l.first_error)
                                          : "");
  std::string peer = n.ran ? fmt::format("nginx 204: {} (p99 {}, {:.1f} us CPU/req, {:.1f} in "
                                         "kernel{})",
                                         Rate(n.rate_per_s), MsText(n.p99_ms), n.server_cpu_us,
                                         n.server_sys_us,
                                         n.errors ? fmt::format(", {} errors", n.errors) : "")
                           : "nginx not run";
  bool ok = l.rate_per_s >= 50'000 && (!n.ran || l.rate_per_s >= 0.5 * n.rate_per_s) &&
            l.errors == 0;
  Row(fmt::format("heartbeats/s, {} agents", f.agents), ours, peer,
      Ratio(l.rate_per_s, n.rate_per_s), ">= 0.5x nginx and >= 50k/s", Met(ok));
  std::fprintf(stderr,
               "heartbeat agents=%zu lighthouse_rate=%.0f nginx_rate=%.0f client_cpu=%.2f/%.2f "
               "lh_p50_ms=%.3f nginx_p50_ms=%.3f\n",
               f.agents, l.rate_per_s, n.rate_per_s, l.client_cpu_frac, n.client_cpu_frac,
               l.p50_ms, n.p50_ms);
}

void PrintFormation(const FormationFigures& f) {
  const auto& l = f.lighthouse;
  const auto& b = f.barrier;
  std::string goal50 = f.groups == 16 ? "< 1 ms" : "";
  std::string goal99 = f.groups == 1024 ? "< 20 ms" : "";
  Row(fmt::format("quorum formation p50, {} groups (n={})", f.groups, l.samples),
      MsText(l.p50_ms) + Failures(l), "TCP barrier " + MsText(b.p50_ms), Ratio(l.p50_ms, b.p50_ms),
      goal50, goal50.empty() ? "" : Met(l.p50_ms < 1 && l.failures == 0));
  Row(fmt::format("quorum formation p99, {} groups", f.groups), MsText(l.p99_ms),
      "TCP barrier " + MsText(b.p99_ms), Ratio(l.p99_ms, b.p99_ms), goal99,
      goal99.empty() ? "" : Met(l.p99_ms < 20 && l.failures == 0));
}

int Main(int argc, char** argv) {
  BenchOptions o;
  std::string modes = "heartbeat,formation,unchanged,coldstart,restart";
  std::string groups_text = "2,4,16,64,256,1024";
  std::string agents_text = "1000,10000";
  uint32_t cold_sets = 1000, cold_set_groups = 8, cold_at_once = 100;
  uint32_t restart_jobs = 100, restart_groups_per_job = 100;
  int64_t nginx_pid = 0;
  bool free_port = false;
  Flags flags("lighthouse_bench",
              "Measures the lighthouse beside peers in the same run and prints a markdown table.");
  flags.Add("bin-dir", &o.bin_dir, "directory holding the lighthouse binary (default: this one's)",
            "LK_BENCH_BIN_DIR");
  flags.Add("work-dir", &o.work_dir, "scratch directory for data and logs (default: a new /tmp dir)",
            "LK_BENCH_WORK_DIR");
  flags.Add("nginx", &o.nginx, "HOST:PORT of nginx serving a static 204 (empty: no peer)",
            "LK_BENCH_NGINX");
  flags.Add("nginx-pid", &nginx_pid, "nginx worker pid, for its CPU per request (0: skip)",
            "LK_BENCH_NGINX_PID");
  flags.Add("modes", &modes, "comma list of heartbeat,formation,unchanged,coldstart,restart",
            "LK_BENCH_MODES");
  flags.Add("groups", &groups_text, "group counts for quorum formation", "LK_BENCH_GROUPS");
  flags.Add("agents", &agents_text, "agent counts for heartbeat throughput", "LK_BENCH_AGENTS");
  flags.Add("warm-s", &o.warm_s, "seconds of load before a throughput window", "LK_BENCH_WARM_S");
  flags.Add("measure-s", &o.measure_s, "seconds of a throughput window", "LK_BENCH_MEASURE_S");
  flags.Add("scale", &o.scale, "multiplies the repetitions of every latency figure",
            "LK_BENCH_SCALE");
  flags.Add("cold-sets", &cold_sets, "group sets started cold", "LK_BENCH_COLD_SETS");
  flags.Add("cold-set-groups", &cold_set_groups, "groups per cold-started set",
            "LK_BENCH_COLD_SET_GROUPS");
  flags.Add("cold-at-once", &cold_at_once, "sets started at the same instant",
            "LK_BENCH_COLD_AT_ONCE");
  flags.Add("restart-jobs", &restart_jobs, "jobs of state for restart and memory",
            "LK_BENCH_RESTART_JOBS");
  flags.Add("restart-groups-per-job", &restart_groups_per_job, "groups per job of that state",
            "LK_BENCH_RESTART_GROUPS_PER_JOB");
  flags.Add("free-port", &free_port, "print a free TCP port on 127.0.0.1 and exit",
            "LK_BENCH_FREE_PORT");
  if (auto code = flags.ParseCommandLine(argc, argv)) return *code;
  if (free_port) {
    asio::io_context ioc;
    tcp::acceptor a(ioc, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    std::printf("%u\n", a.local_endpoint().port());
    return 0;
  }
  o.nginx_worker_pid = static_cast<pid_t>(nginx_pid);
  if (o.bin_dir.empty()) o.bin_dir = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  if (o.work_dir.empty()) {
    char tmpl[] = "/tmp/lk-lighthouse-bench-XXXXXX";
    if (!mkdtemp(tmpl)) return 1;
    o.work_dir = tmpl;
  }
  setenv("LK_BIN_DIR", o.bin_dir.c_str(), 1);  // for test::StartLighthouse
  std::set<std::string> want;
  std::stringstream ms(modes);
  for (std::string m; std::getline(ms, m, ',');) want.insert(m);
  auto numbers = [](const std::string& text) {
    std::vector<uint32_t> out;
    std::stringstream in(text);
    for (std::string v; std::getline(in, v, ',');) out.push_back(std::stoul(v));
    return out;
  };
  const std::vector<uint32_t> groups = numbers(groups_text), agents = numbers(agents_text);
  std::fprintf(stderr, "lighthouse_bench %s work_dir=%s\n", flags.Effective().c_str(),
               o.work_dir.c_str());

  Loop loop;
  std::printf("| figure | Lighthouse | peer, same run | ratio | goal | |\n");
  std::printf("|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  if (want.count("heartbeat")) {
    for (uint32_t n : agents) {
      PrintHeartbeat(RunHeartbeat(loop, o, n));
      std::fflush(stdout);
    }
  }
  if (want.count("formation")) {
    for (const auto& f : RunFormation(loop, o, groups)) PrintFormation(f);
    for (bool append : {false, true}) {
      auto sync = RunFsync(o.work_dir, 200, append);
      Row(fmt::format("100 B {} + fdatasync on the data dir's disk (context)",
                      append ? "append" : "overwrite"),
          "", MsText(sync.p50_ms) + " p50, " + MsText(sync.p99_ms) + " p99", "", "", "");
    }
    std::fflush(stdout);
  }
  if (want.count("unchanged")) {
    auto f = RunUnchanged(loop, o, 16);
    Row(fmt::format("unchanged quorum p50, 16 groups (n={})", f.lighthouse.samples),
        MsText(f.lighthouse.p50_ms) + Failures(f.lighthouse),
        "TCP barrier " + MsText(f.barrier.p50_ms), Ratio(f.lighthouse.p50_ms, f.barrier.p50_ms),
        "< 0.3 ms", Met(f.lighthouse.p50_ms < 0.3 && f.lighthouse.failures == 0));
    Row("unchanged quorum p99, 16 groups", MsText(f.lighthouse.p99_ms),
        "TCP barrier " + MsText(f.barrier.p99_ms), Ratio(f.lighthouse.p99_ms, f.barrier.p99_ms),
        "", "");
    BarrierServer echo;
    auto rtt = RunEchoRtt(echo, 2000);
    Row("raw TCP round trip, 1 connection (context)", "", MsText(rtt.p50_ms) + " p50, " +
        MsText(rtt.p99_ms) + " p99", "", "", "");
    std::fprintf(stderr, "unchanged reason=%s\n", f.lighthouse.reason.c_str());
    std::fflush(stdout);
  }
  if (want.count("coldstart")) {
    auto f = RunColdStarts(loop, o, cold_sets, cold_set_groups, cold_at_once);
    Row(fmt::format("cold starts: {} sets of {} groups, {} at once", f.sets, f.groups_per_set,
                    cold_at_once),
        fmt::format("{} of {} joins hung (> {:.0f} ms), {} failed, {} sets inconsistent; "
                    "answer p50 {} p99 {} max {}",
                    f.hung, f.joins, f.bound_ms, f.failed, f.inconsistent_sets,
                    MsText(f.latency.p50_ms), MsText(f.latency.p99_ms), MsText(f.latency.max_ms)),
        "PCCL (issue): hung in 13 of 46", "", "0 hung",
        Met(f.hung == 0 && f.failed == 0 && f.inconsistent_sets == 0));
    if (!f.latency.first_error.empty()) {
      std::fprintf(stderr, "coldstart first_error=%s\n", f.latency.first_error.c_str());
    }
    std::fflush(stdout);
  }
  if (want.count("restart")) {
    auto f = RunRestartAndMemory(loop, o, restart_jobs, restart_groups_per_job);
    std::string err = f.ok ? "" : " (" + f.error + ")";
    Row(fmt::format("restart to /healthz, {} groups in {} jobs", f.groups, f.jobs),
        MsText(f.healthz_ms) + fmt::format(" (RocksDB load {:.0f} ms)", f.load_ms) + err, "", "",
        "", "");
    Row("restart to a quorum issued", MsText(f.quorum_ms) + fmt::format(
        "; a {}-group job re-formed: {}", restart_groups_per_job, MsText(f.job_quorum_ms)),
        "", "", "< 1 s", Met(f.ok && f.quorum_ms < 1000));
    Row(fmt::format("memory per tracked group ({} groups)", f.groups),
        fmt::format("{:.0f} B heartbeating; {:.0f} B with every group in a quorum",
                    f.bytes_per_group_tracked, f.bytes_per_group_quorum),
        "", "", "< 2 KiB",
        Met(f.ok && std::max(f.bytes_per_group_tracked, f.bytes_per_group_quorum) < 2048));
    std::fprintf(stderr,
                 "restart rss_base=%ld rss_heartbeats=%ld rss_quorums=%ld rss_restarted=%ld\n",
                 static_cast<long>(f.rss_base), static_cast<long>(f.rss_heartbeats),
                 static_cast<long>(f.rss_quorums), static_cast<long>(f.rss_restarted));
  }
  return 0;
}

}  // namespace
}  // namespace lk::bench

int main(int argc, char** argv) { return lk::bench::Main(argc, argv); }
