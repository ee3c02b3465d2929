// Agent and client-library figures, each beside its physical floor measured in the same run:
//   1. Poll when nothing changed, answered from the poll board (shared memory), against taking
//      a value another process wrote into shared memory after the same idle gap; and the same
//      poll over the socket (an agent run with --poll-board=false) against raw Unix-socket and
//      loopback TCP round trips after that gap.
//   2. A node that dies silently (its agent and trainer stopped with SIGSTOP: no socket closes):
//      time from the stop until the survivor's Poll returns the new quorum, against the
//      lighthouse's --heartbeat-timeout-ms.
// Run: bench/agent_bench.sh (builds and prints a markdown table).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <thread>
#include <vector>

#include "common/log.h"
#include "client/poll_board_reader.h"
#include "replica_agent/poll_board_writer.h"
#include <lightkeeper/session.h>
#include "tests/support/process.h"

namespace lk {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// Answers `rounds` 64-byte messages on fd with the same bytes.
void Echo(int fd, int rounds) {
  char buf[64];
  for (int i = 0; i < rounds; ++i) {
    if (read(fd, buf, sizeof(buf)) != 64 || write(fd, buf, 64) != 64) break;
  }
}

// Round trips of 64 bytes on fd against an Echo, in microseconds, each after gap_ms of idleness
// (as a poll comes after the inner steps): an idle virtual CPU takes far longer to wake than a
// busy one, and both sides of the comparison should pay that.
std::vector<double> RoundTrips(int fd, int rounds, int gap_ms) {
  std::vector<double> us;
  char buf[64] = {};
  for (int i = 0; i < rounds; ++i) {
    if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
    auto t0 = Clock::now();
    if (write(fd, buf, 64) != 64 || read(fd, buf, 64) != 64) break;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// Over one loopback TCP connection with Nagle off.
std::vector<double> TcpPingPong(int rounds, int gap_ms = 0) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  listen(ls, 1);
  std::thread echo([ls, rounds] {
    int c = accept(ls, nullptr, nullptr);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Echo(c, rounds);
    close(c);
  });
  int s = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  auto us = RoundTrips(s, rounds, gap_ms);
  close(s);
  echo.join();
  close(ls);
  return us;
}

// Over a Unix-domain socket pair, the transport between a trainer and its agent.
std::vector<double> UnixPingPong(int rounds, int gap_ms) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return {};
  std::thread echo([fd = sv[1], rounds] { Echo(fd, rounds); });
  auto us = RoundTrips(sv[0], rounds, gap_ms);
  echo.join();
  close(sv[0]);
  close(sv[1]);
  return us;
}

// The floor of an answer read from memory: another process publishes a word in a shared page
// (as the agent does on the board) and this one, after gap_ms of sleep, takes it with a
// compare-and-swap and reads the 64-byte line it sits in. The line was last written by the
// other process's core, so the take pays the cache-line transfer, as a poll does.
std::vector<double> SharedMemoryTakes(int rounds, int gap_ms) {
  struct alignas(64) Line {
    std::atomic<uint64_t> word;
    uint64_t payload[7];
  };
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return {};
  auto* line = new (mem) Line{};
  pid_t child = fork();
  if (child == 0) {
    // Publishes 2i+1 once the parent took 2i-1 (it wrote 2i), checking every 200 us: long
    // before the parent's next gap ends.
    for (uint64_t i = 0; i < static_cast<uint64_t>(rounds); ++i) {
      while (line->word.load(std::memory_order_acquire) != 2 * i) usleep(200);
      for (auto& p : line->payload) p = i;
      line->word.store(2 * i + 1, std::memory_order_release);
    }
    _exit(0);
  }
  std::vector<double> us;
  uint64_t sink = 0;
  for (uint64_t i = 0; i < static_cast<uint64_t>(rounds); ++i) {
    if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
    while (line->word.load(std::memory_order_relaxed) != 2 * i + 1) {
    }
    auto t0 = Clock::now();
    uint64_t want = 2 * i + 1;
    bool took = line->word.compare_exchange_strong(want, 2 * i + 2, std::memory_order_acq_rel);
    for (auto p : line->payload) sink += p;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!took) break;
  }
  waitpid(child, nullptr, 0);
  munmap(mem, 4096);
  if (sink == 1) std::puts("");  // keeps the payload reads
  return us;
}

// The board's take alone, without an agent or a Session: publish, sleep gap_ms, take. Splits the
// poll's time between the take and what Session::Poll adds around it.
std::vector<double> BoardTakes(const std::string& dir, int rounds, int gap_ms) {
  auto b = board::Board::Create(dir + "/alone.board");
  if (!b.ok()) return {};
  auto v = board::View::Open((*b)->path(), 0);
  if (!v.ok()) return {};
  std::vector<double> us;
  for (int i = 0; i < rounds; ++i) {
    board::Answer a;
    a.step = static_cast<uint32_t>(i);
    a.quorum_id = 1;
    a.reason = "fast_path: all 1 previous members rejoined";
    (*b)->Publish(a);
    if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
    auto t0 = Clock::now();
    auto got = (*v)->Take(a.step);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!got) return {};
  }
  return us;
}

std::unique_ptr<test::Process> StartAgent(const std::string& dir, const std::string& url,
                                          const std::string& group, const std::string& job = "bench",
                                          std::vector<std::string> extra = {}) {
  std::vector<std::string> argv{test::BinDir() + "/replica_agent", "--lighthouse", url, "--job",
                                job, "--group-id", group, "--socket", dir + "/" + group + ".sock",
                                "--heartbeat-interval-ms", "100"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto p = std::make_unique<test::Process>(argv, dir + "/agent-" + group + ".log");
  if (p->WaitForLog("agent_listening", 10s).empty()) {
    std::fprintf(stderr, "agent %s did not start\n", group.c_str());
    std::exit(1);
  }
  return p;
}

int Main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 2000;
  int inner_ms = argc > 2 ? std::atoi(argv[2]) : 5;
  uint32_t hb_timeout_ms = 1000;
  SetLogLevel(LogLevel::kWarn);
  auto dir = test::TempDir("agent-bench");
  auto lh = test::StartLighthouse(dir + "/data",
                                  {"--heartbeat-timeout-ms", std::to_string(hb_timeout_ms),
                                   "--join-timeout-ms", "200"},
                                  dir + "/lighthouse.log");
  // 1. Poll, one group, nothing changes between steps. A trainer polls after its inner steps
  // (modelled as inner_ms of sleep): the agent asked the lighthouse for the round right after
  // the commit, so the answer is known before the poll. With the board (the default) it is
  // read from shared memory; an agent of another job, run with --poll-board=false, answers the
  // same poll over its socket. For reference, the same with no inner work at all, where the
  // poll waits for the whole lighthouse round.
  auto agent_a = StartAgent(dir, lh.url(), "a");
  auto agent_s = StartAgent(dir, lh.url(), "s", "bench-socket", {"--poll-board=false"});
  auto sa = client::Session::Connect(dir + "/a.sock", 0, 1);
  auto ss = client::Session::Connect(dir + "/s.sock", 0, 1);
  if (!sa.ok() || !ss.ok()) return 1;
  uint32_t step = 0, socket_step = 0;
  int from_board = 0;
  std::vector<double> commit_us;  // of the last poll_loop
  auto poll_loop = [&](client::Session& session, uint32_t& at, int n,
                       int inner_ms) -> std::optional<std::vector<double>> {
    std::vector<double> us;
    from_board = 0;
    commit_us.clear();
    for (int i = 0; i < n + 50; ++i) {
      if (inner_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(inner_ms));
      auto t0 = Clock::now();
      auto p = session.Poll(at);
      double t = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!p.ok()) return std::nullopt;
      if (i >= 50) {  // the first rounds warm connections up
        us.push_back(t);
        from_board += p->from_board;
      }
      auto c0 = Clock::now();
      if (!session.Commit(++at, true, "h").ok()) return std::nullopt;
      if (i >= 50) commit_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - c0).count());
    }
    return us;
  };
  auto poll_us = poll_loop(**sa, step, rounds, inner_ms);
  int board_share = from_board;
  auto board_commit_us = commit_us;
  auto socket_us = poll_loop(**ss, socket_step, rounds, inner_ms);
  auto socket_commit_us = commit_us;
  auto poll_now_us = poll_loop(**sa, step, std::min(rounds, 500), 0);
  if (!poll_us || !socket_us || !poll_now_us) return 1;
  auto shm_gap_us = SharedMemoryTakes(rounds, inner_ms);
  auto take_gap_us = BoardTakes(dir, rounds, inner_ms);
  auto tcp_gap_us = TcpPingPong(rounds, inner_ms);
  auto tcp_us = TcpPingPong(rounds);
  auto unix_gap_us = UnixPingPong(rounds, inner_ms);
  if (shm_gap_us.empty() || unix_gap_us.empty() || take_gap_us.empty()) return 1;
  std::printf("| Poll, nothing changed, from the poll board (1 group, %d ms inner steps; %d of %d "
              "polls from the board) | p50 %.1f us, p99 %.1f us | a compare-and-swap on a line another "
              "process wrote, after the same %d ms idle: p50 %.1f us, p99 %.1f us | %.1fx / %.1fx |\n",
              inner_ms, board_share, rounds, Pct(*poll_us, 0.5), Pct(*poll_us, 0.99), inner_ms,
              Pct(shm_gap_us, 0.5), Pct(shm_gap_us, 0.99), Pct(*poll_us, 0.5) / Pct(shm_gap_us, 0.5),
              Pct(*poll_us, 0.99) / Pct(shm_gap_us, 0.99));
  std::printf("| (of which) the board's take alone, no agent, after the same %d ms idle | p50 %.1f us, "
              "p99 %.1f us | the same compare-and-swap floor | %.1fx / %.1fx |\n",
              inner_ms, Pct(take_gap_us, 0.5), Pct(take_gap_us, 0.99),
              Pct(take_gap_us, 0.5) / Pct(shm_gap_us, 0.5), Pct(take_gap_us, 0.99) / Pct(shm_gap_us, 0.99));
  std::printf("| (the same poll) | | raw Unix-socket round trip after the same %d ms idle: p50 %.0f us, "
              "p99 %.0f us | %.2fx / %.2fx |\n",
              inner_ms, Pct(unix_gap_us, 0.5), Pct(unix_gap_us, 0.99),
              Pct(*poll_us, 0.5) / Pct(unix_gap_us, 0.5), Pct(*poll_us, 0.99) / Pct(unix_gap_us, 0.99));
  std::printf("| Poll, nothing changed, over the socket (--poll-board=false, %d ms inner steps) | "
              "p50 %.0f us, p99 %.0f us | raw Unix-socket round trip after the same idle: p50 %.0f us, "
              "p99 %.0f us; loopback TCP: p50 %.0f us, p99 %.0f us | %.1fx / %.1fx of the Unix socket |\n",
              inner_ms, Pct(*socket_us, 0.5), Pct(*socket_us, 0.99), Pct(unix_gap_us, 0.5),
              Pct(unix_gap_us, 0.99), Pct(tcp_gap_us, 0.5), Pct(tcp_gap_us, 0.99),
              Pct(*socket_us, 0.5) / Pct(unix_gap_us, 0.5), Pct(*socket_us, 0.99) / Pct(unix_gap_us, 0.99));
  std::printf("| Commit of a step (right after the poll), on the board | p50 %.1f us, p99 %.1f us | "
              "the same commit over the socket (--poll-board=false): p50 %.0f us, p99 %.0f us | "
              "%.2fx / %.2fx |\n",
              Pct(board_commit_us, 0.5), Pct(board_commit_us, 0.99), Pct(socket_commit_us, 0.5),
              Pct(socket_commit_us, 0.99), Pct(board_commit_us, 0.5) / Pct(socket_commit_us, 0.5),
              Pct(board_commit_us, 0.99) / Pct(socket_commit_us, 0.99));
  std::printf("| Poll right after the commit (no inner steps: the lighthouse round is waited for) | "
              "p50 %.0f us, p99 %.0f us | raw loopback TCP RTT back to back: p50 %.0f us, p99 %.0f us | %.1fx / %.1fx |\n",
              Pct(*poll_now_us, 0.5), Pct(*poll_now_us, 0.99), Pct(tcp_us, 0.5), Pct(tcp_us, 0.99),
              Pct(*poll_now_us, 0.5) / Pct(tcp_us, 0.5), Pct(*poll_now_us, 0.99) / Pct(tcp_us, 0.99));

  // 2. A second group joins; then its node dies silently.
  auto agent_b = StartAgent(dir, lh.url(), "b");
  auto sb = client::Session::Connect(dir + "/b.sock", 0, 1);
  if (!sb.ok()) return 1;
  std::atomic<uint32_t> b_step{0};
  std::thread b_loop([&] {
    uint32_t s = 0;
    while (true) {
      auto p = (*sb)->Poll(s);
      if (!p.ok() || p->drain) return;
      if (p->heal) s = p->max_step;
      if (!(*sb)->Commit(++s, true).ok()) return;
      b_step = s;
    }
  });
  while (true) {
    auto p = (*sa)->Poll(step);
    if (!p.ok()) return 1;
    if (!(*sa)->Commit(++step, true).ok()) return 1;
    if (p->replica_world_size == 2 && b_step > 5) break;
  }
  auto stopped = Clock::now();
  agent_b->Signal(SIGSTOP);
  double to_quorum_ms = 0;
  while (true) {
    auto p = (*sa)->Poll(step);
    if (!p.ok()) return 1;
    if (p->replica_world_size == 1) {
      to_quorum_ms = std::chrono::duration<double, std::milli>(Clock::now() - stopped).count();
      break;
    }
    if (!(*sa)->Commit(++step, true).ok()) return 1;
  }
  std::printf("| silent node death -> survivor's new quorum | %.0f ms | heartbeat_timeout_ms %u "
              "(agent heartbeats every 100 ms) | %.2fx |\n",
              to_quorum_ms, hb_timeout_ms, to_quorum_ms / hb_timeout_ms);
  // _Exit skips the destructors (b_loop is blocked in a poll), so stop every child here.
  agent_b->Signal(SIGKILL);
  agent_a->Signal(SIGKILL);
  agent_s->Signal(SIGKILL);
  lh.process->Signal(SIGKILL);
  b_loop.detach();
  std::fflush(stdout);
  std::_Exit(0);
}

}  // namespace
}  // namespace lk

int main(int argc, char** argv) { return lk::Main(argc, argv); }
