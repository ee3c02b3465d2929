// comm_bench: figures for the cross-group communicator (Gloo), on loopback, with a real
// lighthouse as the rendezvous store. Members are comm_test_peer processes.
//
//  1. Rebuild: time from a new quorum_id to the first allreduce done on every member (the
//     Reconfigure, the KV round trips, the connects and one 4 KiB allreduce), 2/4/8 members.
//  2. Kill -9: one member is killed mid-collective; time until every survivor's allreduce has
//     returned Aborted, and until the survivors' first allreduce on the new quorum is done.
//  3. Throughput: ring allreduce bus bandwidth (2(n-1)/n * bytes / time, what each member's
//     links carry) against iperf3 on the same loopback in the same run.
//
// Usage: comm_bench [--rounds N] [--mib M] [--iperf-seconds S]; prints Markdown to stdout.
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "replica_agent/comm/test_support.h"

namespace lk::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;
using testing::Child;

double MsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t).count();
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "comm_bench: %s\n", what.c_str());
  std::exit(1);
}

struct Peers {
  std::string dir;
  testing::Lighthouse* lh;
  std::vector<std::unique_ptr<Child>> p;

  static inline uint32_t segment_kib = 1024;

  Peers(testing::Lighthouse* lighthouse, const std::string& d, size_t n) : dir(d), lh(lighthouse) {
    for (size_t i = 0; i < n; ++i) Spawn(i);
    for (auto& c : p) Expect(*c, "ok ready");
  }
  void Spawn(size_t i) {
    auto child = std::make_unique<Child>(
        std::vector<std::string>{testing::BinDir() + "/comm_test_peer", "--store", lh->url(),
                                 "--job", "bench", "--op-timeout-ms", "60000", "--segment-kib",
                                 std::to_string(segment_kib)},
        fmt::format("{}/peer{}.log", dir, i));
    if (i < p.size()) {
      p[i] = std::move(child);
    } else {
      p.push_back(std::move(child));
    }
  }
  static std::string Expect(Child& c, const std::string& prefix) {
    auto a = c.ReadLine(std::chrono::seconds(120));
    if (!a || a->rfind(prefix, 0) != 0) Die("peer answered " + a.value_or("nothing"));
    return *a;
  }
  uint32_t NewQuorum() {
    auto q = testing::NewQuorum(lh->url(), "bench");
    if (!q.ok()) Die(q.status().ToString());
    return *q;
  }
  // Sends reconfigure + one allreduce to `members` (in rank order) and waits for both answers.
  void Rebuild(const std::vector<size_t>& members, uint32_t q) {
    for (size_t r = 0; r < members.size(); ++r) {
      p[members[r]]->Send(
          fmt::format("reconfigure {} {} {}\nallreduce f32 sum 1024 1", q, r, members.size()));
    }
    for (size_t m : members) {
      Expect(*p[m], "ok reconfigure");
      Expect(*p[m], "ok allreduce");
    }
  }
};

std::vector<size_t> Range(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

void BenchRebuild(testing::Lighthouse* lh, const std::string& dir, uint32_t rounds) {
  fmt::print("\n### Rebuild: new quorum_id -> first allreduce done on every member\n\n");
  fmt::print("| members | p50 ms | max ms | rounds |\n|---|---|---|---|\n");
  for (size_t n : {2, 4, 8}) {
    Peers peers(lh, dir, n);
    std::vector<double> ms;
    for (uint32_t i = 0; i < rounds + 1; ++i) {
      uint32_t q = peers.NewQuorum();
      auto start = SteadyClock::now();
      peers.Rebuild(Range(n), q);
      if (i > 0) ms.push_back(MsSince(start));  // the first round also warms the processes
    }
    fmt::print("| {} | {:.1f} | {:.1f} | {} |\n", n, Percentile(ms, 0.5),
               *std::max_element(ms.begin(), ms.end()), rounds);
    std::fflush(stdout);
  }
}

void BenchKill(testing::Lighthouse* lh, const std::string& dir, uint32_t rounds) {
  fmt::print("\n### kill -9 of one member mid-allreduce (4 members, 16 MiB float32)\n\n");
  fmt::print("| measured from the kill | p50 ms | max ms | rounds |\n|---|---|---|---|\n");
  const size_t n = 4;
  Peers peers(lh, dir, n);
  std::vector<double> aborted_ms, rebuilt_ms;
  for (uint32_t i = 0; i < rounds; ++i) {
    peers.Rebuild(Range(n), peers.NewQuorum());
    for (auto& c : peers.p) c->Send("bench 4194304 100000");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    size_t victim = 1 + i % (n - 1);
    peers.p[victim]->Signal(SIGKILL);
    auto killed = SteadyClock::now();
    std::vector<size_t> survivors;
    for (size_t k = 0; k < n; ++k) {
      if (k != victim) survivors.push_back(k);
    }
    for (size_t k : survivors) Peers::Expect(*peers.p[k], "err aborted");
    aborted_ms.push_back(MsSince(killed));
    // The new quorum (here made at once; in production the lighthouse's notice) and the first
    // allreduce of the survivors on it.
    peers.Rebuild(survivors, peers.NewQuorum());
    rebuilt_ms.push_back(MsSince(killed));
    (void)peers.p[victim]->Wait(std::chrono::seconds(10));
    peers.Spawn(victim);
    Peers::Expect(*peers.p[victim], "ok ready");
  }
  fmt::print("| every survivor's allreduce returned Aborted | {:.1f} | {:.1f} | {} |\n",
             Percentile(aborted_ms, 0.5), *std::max_element(aborted_ms.begin(), aborted_ms.end()),
             rounds);
  fmt::print("| + new quorum, rebuild, first allreduce done | {:.1f} | {:.1f} | {} |\n",
             Percentile(rebuilt_ms, 0.5), *std::max_element(rebuilt_ms.begin(), rebuilt_ms.end()),
             rounds);
  std::fflush(stdout);
}

// iperf3 over loopback: the sum received in bits/s, in GB/s (1e9 bytes).
double Iperf(const std::string& dir, uint32_t seconds, bool bidir) {
  static int next = 0;
  int port = 20000 + static_cast<int>((getpid() * 2 + next++) % 20000);
  Child server({"/usr/bin/iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", std::to_string(port)},
               dir + "/iperf-server.log");
  std::string cmd = fmt::format("iperf3 -c 127.0.0.1 -p {} -t {} -J {} 2>/dev/null", port, seconds,
                                bidir ? "--bidir" : "");
  std::string out;
  // The server may take a moment to listen on a loaded machine: retry the connect.
  for (int attempt = 0; attempt < 50; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) Die("popen iperf3");
    out.clear();
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
    pclose(f);
    if (out.find("unable to connect") == std::string::npos) break;
  }
  (void)server.Wait(std::chrono::seconds(5));
  // end.sum_received (and, with --bidir, end.sum_received_bidir_reverse) carry the rates.
  double total = 0;
  for (const char* key : {"\"sum_received\"", "\"sum_received_bidir_reverse\""}) {
    auto at = out.rfind(key);
    if (at == std::string::npos) continue;
    auto bps = out.find("\"bits_per_second\":", at);
    total += std::strtod(out.c_str() + bps + 18, nullptr);
  }
  if (total == 0) Die("no iperf3 figure: " + out.substr(0, 300));
  return total / 8 / 1e9;
}

void BenchThroughput(testing::Lighthouse* lh, const std::string& dir, uint32_t mib,
                     uint32_t iperf_seconds) {
  double one_way = Iperf(dir, iperf_seconds, false);
  double both_ways = Iperf(dir, iperf_seconds, true);
  fmt::print("\n### Allreduce throughput vs raw loopback TCP (iperf3, same run)\n\n");
  fmt::print("iperf3 one stream: {:.2f} GB/s; --bidir (both directions summed): {:.2f} GB/s\n\n",
             one_way, both_ways);
  fmt::print(
      "| members | MiB | busbw GB/s | / iperf3 one stream | total moved GB/s | / iperf3 "
      "bidir |\n|---|---|---|---|---|---|\n");
  for (size_t n : {2, 4}) {
    Peers peers(lh, dir, n);
    peers.Rebuild(Range(n), peers.NewQuorum());
    const size_t count = static_cast<size_t>(mib) * 1024 * 1024 / 4;
    const uint32_t rounds = 20;
    for (auto& c : peers.p) c->Send(fmt::format("bench {} 2", count));  // warm-up
    for (auto& c : peers.p) Peers::Expect(*c, "ok bench");
    auto start = SteadyClock::now();
    for (auto& c : peers.p) c->Send(fmt::format("bench {} {}", count, rounds));
    for (auto& c : peers.p) Peers::Expect(*c, "ok bench");
    double seconds = MsSince(start) / 1000 / rounds;
    double bytes = static_cast<double>(count) * 4;
    // busbw: what each member sends (and receives) per second; total: all members together,
    // which is what the one loopback (the same CPUs) carries.
    double busbw = bytes * 2 * static_cast<double>(n - 1) / static_cast<double>(n) / seconds / 1e9;
    double total = busbw * static_cast<double>(n);
    fmt::print("| {} | {} | {:.2f} | {:.2f}x | {:.2f} | {:.2f}x |\n", n, mib, busbw,
               busbw / one_way, total, total / both_ways);
    std::fflush(stdout);
  }
}

int Main(int argc, char** argv) {
  uint32_t rounds = 10, mib = 64, iperf_seconds = 5;
  std::string only;
  Flags flags("comm_bench", "Communicator rebuild, kill -9 and throughput figures (Gloo).");
  flags.Add("rounds", &rounds, "rounds per rebuild/kill figure");
  flags.Add("mib", &mib, "allreduce size for the throughput figure, MiB");
  flags.Add("iperf-seconds", &iperf_seconds, "iperf3 run length");
  flags.Add("only", &only, "rebuild, kill or throughput (default: all)");
  flags.Add("segment-kib", &Peers::segment_kib, "Gloo ring segment size, KiB");
  if (Status st = flags.Parse(argc, argv); !st.ok()) Die(st.ToString());
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    return 0;
  }
  std::string dir = testing::TempDir("bench");
  auto lh = testing::StartLighthouse(dir);
  if (!lh.ok()) Die(lh.status().ToString());
  fmt::print(
      "comm_bench: lighthouse KV rendezvous, Gloo backend, {} CPUs, rounds={}, "
      "segment={} KiB\n",
      std::thread::hardware_concurrency(), rounds, Peers::segment_kib);
  // Loopback throughput is CPU time: a busy machine changes every figure, so say how busy.
  std::ifstream loadavg("/proc/loadavg");
  std::string load1;
  loadavg >> load1;
  fmt::print("load average (1 min) at start: {}\n", load1);
  if (only.empty() || only == "rebuild") BenchRebuild(&*lh, dir, rounds);
  if (only.empty() || only == "kill") BenchKill(&*lh, dir, rounds);
  if (only.empty() || only == "throughput") BenchThroughput(&*lh, dir, mib, iperf_seconds);
  return 0;
}

}  // namespace
}  // namespace lk::comm

int main(int argc, char** argv) { return lk::comm::Main(argc, argv); }
