// comm_bench: figures for the cross-group communicator (Gloo), on loopback, with a real
// lighthouse as the rendezvous store. Members are comm_test_peer processes.
//
//  1. Rebuild: time from a new quorum_id to the first allreduce done on every member (the
//     Reconfigure, the KV round trips, the connects and one 4 KiB allreduce), 2/4/8 members.
//  2. Kill -9: one member is killed mid-collective; time until every survivor's allreduce has
//     returned Aborted, and until the survivors' first allreduce on the new quorum is done.
//  3. Throughput: ring allreduce bus bandwidth (2(n-1)/n * bytes / time, what each member's
//     links carry) against iperf3 on the same loopback in the same run, and bytes moved per
//     CPU second against iperf3's (on loopback the link is the CPU).
//
// Usage: comm_bench [--rounds N] [--mib M] [--iperf-seconds S]; prints Markdown to stdout.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "comm/comm.h"
#include "comm/test_support.h"

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

// With --netns PREFIX, member i runs in network namespace PREFIX{i} at 10.77.0.{i+2} and the
// lighthouse listens on the bridge at 10.77.0.1 (bench/comm_netns.sh sets this up, with every
// member's link shaped like a NIC); otherwise everything is on 127.0.0.1.
std::string g_netns;
std::string MemberIp(size_t i) { return g_netns.empty() ? "127.0.0.1" : fmt::format("10.77.0.{}", i + 2); }
std::vector<std::string> InNetns(size_t i, std::vector<std::string> argv) {
  if (g_netns.empty()) return argv;
  std::vector<std::string> out{"/usr/sbin/ip", "netns", "exec", fmt::format("{}{}", g_netns, i)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

struct Peers {
  std::string dir;
  testing::Lighthouse* lh;
  std::vector<std::unique_ptr<Child>> p;

  static inline uint32_t segment_kib = 1024;
  static inline uint32_t inflight_kib = static_cast<uint32_t>(CommOptions().inflight_bytes / 1024);

  // More flags for member i (the gateway backend's).
  std::function<std::vector<std::string>(size_t)> extra;

  Peers(testing::Lighthouse* lighthouse, const std::string& d, size_t n,
        std::function<std::vector<std::string>(size_t)> more = nullptr)
      : dir(d), lh(lighthouse), extra(std::move(more)) {
    for (size_t i = 0; i < n; ++i) Spawn(i);
    for (auto& c : p) Expect(*c, "ok ready");
  }
  void Spawn(size_t i) {
    std::vector<std::string> argv{testing::BinDir() + "/comm_test_peer", "--store", lh->url(),
                                  "--job", "bench", "--op-timeout-ms", "60000", "--segment-kib",
                                  std::to_string(segment_kib), "--inflight-kib",
                                  std::to_string(inflight_kib), "--bind", MemberIp(i)};
    if (extra) {
      auto more = extra(i);
      argv.insert(argv.end(), more.begin(), more.end());
    }
    auto child = std::make_unique<Child>(InNetns(i, argv), fmt::format("{}/peer{}.log", dir, i));
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

// CPU seconds (user + system) a process has used so far, from /proc/PID/stat. Loopback TCP
// traffic is processed in the sending and receiving processes' own system time, so this counts
// the copies as well as the reduction.
double CpuSeconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start at its closing parenthesis;
  // utime and stime are fields 14 and 15, i.e. the 12th and 13th after it.
  auto at = stat.rfind(')');
  if (at == std::string::npos) Die("cannot read /proc/" + std::to_string(pid) + "/stat");
  std::istringstream fields(stat.substr(at + 2));
  std::string skip;
  for (int i = 0; i < 11; ++i) fields >> skip;
  double utime = 0, stime = 0;
  fields >> utime >> stime;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// A JSON number field after `key` (and after position `from`), or 0.
double JsonNumber(const std::string& json, const std::string& key, size_t from = 0) {
  auto at = json.find("\"" + key + "\":", from);
  if (at == std::string::npos) return 0;
  return std::strtod(json.c_str() + at + key.size() + 3, nullptr);
}

struct IperfResult {
  double gbps = 0;          // received, all directions summed, GB/s (1e9 bytes)
  double gb_per_cpu_s = 0;  // received bytes per CPU second of client and server together
};

// iperf3 over loopback.
IperfResult Iperf(const std::string& dir, uint32_t seconds, bool bidir) {
  static int next = 0;
  int port = 20000 + static_cast<int>((getpid() * 2 + next++) % 20000);
  // Between members 0 and 1's places: the same loopback, or the same two shaped links.
  Child server(InNetns(0, {"/usr/bin/iperf3", "-s", "-1", "-B", MemberIp(0), "-p", std::to_string(port)}),
               dir + "/iperf-server.log");
  std::string cmd = fmt::format("{}iperf3 -c {} -p {} -t {} -J {} 2>/dev/null",
                                g_netns.empty() ? "" : fmt::format("ip netns exec {}1 ", g_netns),
                                MemberIp(0), port, seconds, bidir ? "--bidir" : "");
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
  // end.sum_received (and, with --bidir, end.sum_received_bidir_reverse) carry the rates;
  // end.cpu_utilization_percent the client's (host) and server's (remote) CPU use over the
  // test, in percent of one CPU.
  double total = 0;
  for (const char* key : {"\"sum_received\"", "\"sum_received_bidir_reverse\""}) {
    auto at = out.rfind(key);
    if (at == std::string::npos) continue;
    total += JsonNumber(out, "bits_per_second", at);
  }
  if (total == 0) Die("no iperf3 figure: " + out.substr(0, 300));
  auto cpu_at = out.rfind("\"cpu_utilization_percent\"");
  double cpus =
      cpu_at == std::string::npos
          ? 0
          : (JsonNumber(out, "host_total", cpu_at) + JsonNumber(out, "remote_total", cpu_at)) / 100;
  IperfResult r;
  r.gbps = total / 8 / 1e9;
  r.gb_per_cpu_s = cpus > 0 ? r.gbps / cpus : 0;
  return r;
}

void BenchThroughput(testing::Lighthouse* lh, const std::string& dir, uint32_t mib,
                     uint32_t iperf_seconds) {
  IperfResult one_way = Iperf(dir, iperf_seconds, false);
  IperfResult both_ways = Iperf(dir, iperf_seconds, true);
  fmt::print("\n### Allreduce throughput vs {}\n\n",
             g_netns.empty() ? "raw loopback TCP (iperf3, same run)"
                             : "iperf3 between two members' namespaces (same shaped links, same run)");
  fmt::print(
      "iperf3 one stream: {:.2f} GB/s, {:.2f} GB per CPU-second; --bidir (both directions "
      "summed): {:.2f} GB/s, {:.2f} GB per CPU-second\n\n",
      one_way.gbps, one_way.gb_per_cpu_s, both_ways.gbps, both_ways.gb_per_cpu_s);
  fmt::print(
      "| members | dtype op | MiB | busbw GB/s | / iperf3 one stream | total moved GB/s | / iperf3 "
      "one stream | / iperf3 bidir | GB per CPU-s | / iperf3 one stream |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  struct Case {
    size_t n;
    const char* dtype;
    const char* op;
  };
  for (Case c : {Case{2, "f32", "sum"}, Case{4, "f32", "sum"}, Case{2, "bf16", "avg"},
                 Case{4, "bf16", "avg"}}) {
    const size_t n = c.n;
    Peers peers(lh, dir, n);
    peers.Rebuild(Range(n), peers.NewQuorum());
    const size_t elem_bytes = std::string(c.dtype) == "bf16" ? 2 : 4;
    const size_t count = static_cast<size_t>(mib) * 1024 * 1024 / elem_bytes;
    const uint32_t rounds = 20;
    for (auto& p : peers.p) p->Send(fmt::format("bench {} 2 {} {}", count, c.dtype, c.op));
    for (auto& p : peers.p) Peers::Expect(*p, "ok bench");  // warm-up
    double cpu_before = 0;
    for (auto& p : peers.p) cpu_before += CpuSeconds(p->pid());
    auto start = SteadyClock::now();
    for (auto& p : peers.p) p->Send(fmt::format("bench {} {} {} {}", count, rounds, c.dtype, c.op));
    for (auto& p : peers.p) Peers::Expect(*p, "ok bench");
    double seconds = MsSince(start) / 1000 / rounds;
    double cpu = 0;
    for (auto& p : peers.p) cpu += CpuSeconds(p->pid());
    cpu = (cpu - cpu_before) / rounds;
    // Bytes of the caller's buffer: for bfloat16 that is half of a float32 buffer of the same
    // element count, whatever the ring puts on the wire.
    double bytes = static_cast<double>(count * elem_bytes);
    // busbw: what each member sends (and receives) per second; total: all members together,
    // which is what the one loopback (the same CPUs) carries.
    double busbw = bytes * 2 * static_cast<double>(n - 1) / static_cast<double>(n) / seconds / 1e9;
    double total = busbw * static_cast<double>(n);
    // Bytes per CPU second of all members: the copies, the reduction and every wake-up,
    // independent of how much CPU the other tenants of the machine left us.
    double per_cpu = total * seconds / cpu;
    fmt::print(
        "| {} | {} {} | {} | {:.2f} | {:.2f}x | {:.2f} | {:.2f}x | {:.2f}x | {:.2f} | {:.2f}x |\n",
        n, c.dtype, c.op, mib, busbw, busbw / one_way.gbps, total, total / one_way.gbps,
        total / both_ways.gbps, per_cpu, per_cpu / one_way.gb_per_cpu_s);
    std::fflush(stdout);
  }
}

// The value of " KEY=" in the first line of `path` that has `needle`, waiting up to 20 s.
std::string LogValue(const std::string& path, const std::string& needle, const std::string& key) {
  for (int i = 0; i < 200; ++i) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.find(needle) == std::string::npos) continue;
      auto pos = line.find(" " + key + "=");
      if (pos == std::string::npos) return "";
      pos += key.size() + 2;
      return line.substr(pos, line.find(' ', pos) - pos);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  Die("no " + needle + " in " + path);
}

// Two sites, each with a gateway, k members per site: the gateway backend's allreduce against
// the Gloo ring of the same 2k members on the same loopback, and the bytes each puts between
// the sites (measured at the gateways; the ring's from its schedule: 2(n-1)/n of the buffer on
// every ring edge that joins members of different sites).
void BenchGateway(testing::Lighthouse* lh, const std::string& dir, uint32_t mib) {
  fmt::print("\n### Allreduce through two sites' gateways vs the direct Gloo ring (same members, "
             "same loopback, same run)\n\n");
  fmt::print(
      "| members per site | MiB | ring ms | gateways ms | gateways / ring throughput | WAN MiB "
      "per allreduce: gateways | ring, sites in rank blocks | ring, sites interleaved | "
      "gateways / ring (blocks) | gateways / ring (interleaved) |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  const size_t count = static_cast<size_t>(mib) * 1024 * 1024 / 4;
  const uint32_t rounds = 10;
  for (size_t k : {1, 2, 4}) {
    const size_t n = 2 * k;
    auto time_rounds = [&](Peers& peers) {
      for (auto& p : peers.p) p->Send(fmt::format("bench {} 2", count));
      for (auto& p : peers.p) Peers::Expect(*p, "ok bench");  // warm-up
      auto start = SteadyClock::now();
      for (auto& p : peers.p) p->Send(fmt::format("bench {} {}", count, rounds));
      for (auto& p : peers.p) Peers::Expect(*p, "ok bench");
      return MsSince(start) / rounds;
    };
    double ring_ms;
    {
      Peers ring(lh, dir, n);
      ring.Rebuild(Range(n), ring.NewQuorum());
      ring_ms = time_rounds(ring);
    }
    const std::string a_log = fmt::format("{}/gw-a-{}.log", dir, k);
    const std::string b_log = fmt::format("{}/gw-b-{}.log", dir, k);
    auto a = std::make_unique<Child>(
        std::vector<std::string>{testing::BinDir() + "/lk_gateway", "--site", "site-a",
                                 "--lighthouse", lh->url(), "--listen", "127.0.0.1:0",
                                 "--wan-listen", "127.0.0.1:0"},
        a_log);
    const std::string a_listen = LogValue(a_log, "gateway_listening", "listen");
    const std::string a_wan = LogValue(a_log, "gateway_wan", "wan_listen");
    auto b = std::make_unique<Child>(
        std::vector<std::string>{testing::BinDir() + "/lk_gateway", "--site", "site-b",
                                 "--lighthouse", lh->url(), "--listen", "127.0.0.1:0",
                                 "--wan-connect", a_wan},
        b_log);
    const std::string b_listen = LogValue(b_log, "gateway_listening", "listen");
    double gw_ms;
    {
      Peers gw(lh, dir, n, [&](size_t i) {
        return std::vector<std::string>{"--backend", "gateway", "--gateway",
                                        "http://" + (i < k ? a_listen : b_listen)};
      });
      gw.Rebuild(Range(n), gw.NewQuorum());  // verifies the sums through the gateways
      gw_ms = time_rounds(gw);
    }
    ::kill(a->pid(), SIGTERM);
    ::kill(b->pid(), SIGTERM);
    const double sent = std::stod(LogValue(a_log, "gateway_exchange_totals", "wan_sent_bytes")) +
                        std::stod(LogValue(b_log, "gateway_exchange_totals", "wan_sent_bytes"));
    // Allreduces through the gateways: the rebuild's one of 1024 elements, two warm-ups and
    // the timed rounds.
    const double big = static_cast<double>(rounds + 2);
    const double gw_wan = (sent - 2 * 1024 * 4) / big / (1 << 20);
    const double per_edge = static_cast<double>(mib) * 2 * static_cast<double>(n - 1) /
                            static_cast<double>(n);
    const double ring_blocks = 2 * per_edge;                     // two edges cross
    const double ring_mixed = static_cast<double>(n) * per_edge;  // every edge crosses
    fmt::print("| {} | {} | {:.1f} | {:.1f} | {:.2f}x | {:.1f} | {:.1f} | {:.1f} | {:.2f} | {:.2f} |\n",
               k, mib, ring_ms, gw_ms, ring_ms / gw_ms, gw_wan, ring_blocks, ring_mixed,
               gw_wan / ring_blocks, gw_wan / ring_mixed);
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
  flags.Add("only", &only, "rebuild, kill, throughput or gateway (default: all)");
  flags.Add("segment-kib", &Peers::segment_kib, "Gloo ring segment size, KiB");
  flags.Add("inflight-kib", &Peers::inflight_kib, "Gloo reduce-scatter receives posted ahead, KiB");
  flags.Add("netns", &g_netns,
            "run member i in network namespace NETNS{i} at 10.77.0.{i+2}, the lighthouse on "
            "10.77.0.1 (see bench/comm_netns.sh)");
  if (Status st = flags.Parse(argc, argv); !st.ok()) Die(st.ToString());
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    return 0;
  }
  std::string dir = testing::TempDir("bench");
  auto lh = testing::StartLighthouse(dir, g_netns.empty() ? "127.0.0.1:0" : "10.77.0.1:0");
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
  if (!g_netns.empty()) fmt::print("members in network namespaces {}0.., links shaped (see the script)\n", g_netns);
  if (only.empty() || only == "rebuild") BenchRebuild(&*lh, dir, rounds);
  if (only.empty() || only == "kill") BenchKill(&*lh, dir, rounds);
  if (only.empty() || only == "throughput") BenchThroughput(&*lh, dir, mib, iperf_seconds);
  if (g_netns.empty() && (only.empty() || only == "gateway")) BenchGateway(&*lh, dir, mib);
  return 0;
}

}  // namespace
}  // namespace lk::comm

int main(int argc, char** argv) { return lk::comm::Main(argc, argv); }
