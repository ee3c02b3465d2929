// Modes (1)-(3): heartbeat throughput against nginx, quorum formation and the unchanged quorum
// against a raw TCP barrier. Cold starts, restart and memory are in lighthouse_bench_restart.cc.
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "bench/lighthouse_bench_modes.h"
#include "bench/lighthouse_bench_proto.h"

namespace lk::bench {

using namespace std::chrono_literals;
using Ms = std::chrono::duration<double, std::milli>;

LighthouseProc StartBenchLighthouse(const BenchOptions& o, const std::string& tag,
                                    const std::vector<std::string>& extra_flags) {
  LighthouseProc p;
  p.data_dir = o.work_dir + "/lh-" + tag;
  p.log_path = o.work_dir + "/lh-" + tag + ".log";
  std::filesystem::remove_all(p.data_dir);
  auto lh = test::StartLighthouse(p.data_dir, extra_flags, p.log_path);
  p.process = std::move(lh.process);
  p.address = lh.address;
  return p;
}

LatencyStats Summarize(std::vector<double> ms, size_t failures, std::string first_error) {
  LatencyStats s;
  s.samples = ms.size();
  s.failures = failures;
  s.first_error = std::move(first_error);
  s.p50_ms = Percentile(ms, 0.50);
  s.p99_ms = Percentile(ms, 0.99);
  s.max_ms = ms.empty() ? 0 : ms.back();
  return s;
}

// ---- (1) heartbeat throughput ----

namespace {

// Closed loop: every connection sends its request again as soon as the answer is in. The rate is
// counted inside [warm, warm + measure] only.
LoadResult ClosedLoop(Loop& loop, const tcp::endpoint& ep, size_t n,
                      const std::function<std::string(size_t)>& request_of, pid_t server,
                      const BenchOptions& o) {
  LoadResult res;
  auto conns = ConnectAll(loop, ep, n, 256, 60s);
  res.connections = conns.size();
  if (conns.size() != n) {
    res.first_error = fmt::format("connected {} of {}", conns.size(), n);
    CloseAll(loop, conns);
    return res;
  }
  std::vector<std::shared_ptr<const std::string>> reqs(n);
  for (size_t i = 0; i < n; ++i) reqs[i] = std::make_shared<const std::string>(request_of(i));
  std::vector<SteadyClock::time_point> sent(n);
  std::vector<double> lat_ms;
  lat_ms.reserve(1 << 20);
  bool running = true, measuring = false;
  size_t in_flight = 0;
  std::function<void(size_t)> fire = [&](size_t i) {
    ++in_flight;
    sent[i] = SteadyClock::now();
    conns[i]->Send(reqs[i], [&, i](HttpResult&& r) {
      --in_flight;
      if (r.status >= 200 && r.status < 300) {
        if (measuring) {
          ++res.ok;
          if (lat_ms.size() < lat_ms.capacity()) lat_ms.push_back(Ms(r.done - sent[i]).count());
        }
      } else {
        ++res.errors;
        if (res.first_error.empty()) res.first_error = fmt::format("{} {}", r.status, r.error);
      }
      if (running && conns[i]->open()) fire(i);
    });
  };
  for (size_t i = 0; i < n; ++i) fire(i);
  loop.RunFor(std::chrono::milliseconds(static_cast<int64_t>(o.warm_s * 1000)));
  CpuSeconds cpu0 = server > 0 ? ProcessCpuSeconds(server) : CpuSeconds{};
  double client0 = ThreadCpuSeconds();
  auto t0 = SteadyClock::now();
  measuring = true;
  loop.RunFor(std::chrono::milliseconds(static_cast<int64_t>(o.measure_s * 1000)));
  measuring = false;
  auto t1 = SteadyClock::now();
  CpuSeconds cpu1 = server > 0 ? ProcessCpuSeconds(server) : CpuSeconds{};
  double client1 = ThreadCpuSeconds();
  running = false;
  if (!loop.RunUntil([&] { return in_flight == 0; }, 10s)) {
    res.first_error = fmt::format("{} requests unanswered 10 s after the window", in_flight);
  }
  CloseAll(loop, conns);
  double secs = std::chrono::duration<double>(t1 - t0).count();
  res.ran = true;
  res.rate_per_s = static_cast<double>(res.ok) / secs;
  res.client_cpu_frac = (client1 - client0) / secs;
  if (server > 0 && res.ok > 0 && cpu0.user >= 0 && cpu1.user >= 0) {
    const double per = 1e6 / static_cast<double>(res.ok);
    res.server_cpu_us = (cpu1.user + cpu1.sys - cpu0.user - cpu0.sys) * per;
    res.server_sys_us = (cpu1.sys - cpu0.sys) * per;
  }
  res.p50_ms = Percentile(lat_ms, 0.50);
  res.p99_ms = Percentile(lat_ms, 0.99);
  return res;
}

}  // namespace

HeartbeatFigures RunHeartbeat(Loop& loop, const BenchOptions& o, size_t agents) {
  HeartbeatFigures f;
  f.agents = agents;
  // One agent per group, 100 groups per job (a lighthouse shared by many jobs), each on its own
  // keep-alive connection; the body is what replica_agent sends.
  auto request_of = [](size_t i) {
    return RequestBytes("POST", "/v1/heartbeat",
                        HeartbeatBody(fmt::format("hb-{:03}", i / 100),
                                      fmt::format("group-{:05}", i), 0),
                        kProtoType);
  };
  {
    auto lh = StartBenchLighthouse(o, fmt::format("hb{}", agents), {});
    f.lighthouse = ClosedLoop(loop, ParseEndpoint(lh.address), agents, request_of,
                              lh.process->pid(), o);
    lh.process->Signal(SIGTERM);
    lh.process->Wait(10s);
  }
  if (!o.nginx.empty()) {
    f.nginx = ClosedLoop(loop, ParseEndpoint(o.nginx), agents, request_of, o.nginx_worker_pid, o);
  }
  return f;
}

// ---- (2) quorum formation, (3) unchanged quorum: the lighthouse side ----

namespace {

// At least 100 rounds for every size: with 20, the "p99" was the largest of 20 samples, one
// scheduling hiccup of this shared machine, and moved from 10 to 38 ms between runs.
size_t Reps(const BenchOptions& o, uint32_t groups) {
  size_t base = groups <= 16 ? 200 : 100;
  return std::max<size_t>(3, static_cast<size_t>(static_cast<double>(base) * o.scale));
}

// Drives one job's rounds on one connection per group plus a control connection.
class Rounds {
 public:
  Rounds(Loop& loop, std::vector<ConnPtr>& conns, ConnPtr control)
      : loop_(loop), conns_(conns), control_(std::move(control)) {}

  // Heartbeats every group of `job` so that all are healthy before the first ask.
  Status Register(const std::string& job) {
    std::vector<std::shared_ptr<const std::string>> reqs;
    for (size_t i = 0; i < conns_.size(); ++i) {
      reqs.push_back(Shared(RequestBytes("POST", "/v1/heartbeat",
                                         HeartbeatBody(job, GroupName(i), 0), kProtoType)));
    }
    for (auto& r : SendAll(loop_, conns_, reqs, 30s)) {
      if (r.status != 200) return Error(Code::kInternal, "heartbeat: {} {}", r.status, r.error);
    }
    return Status::Ok();
  }

  // One round at `step`: every group but the last asks, the lighthouse is seen to hold those
  // asks, then the last asks; the figure is from the last ask to the last answer read.
  Result<double> Round(const std::string& job, uint32_t step, std::string* reason) {
    const size_t n = conns_.size();
    std::vector<HttpResult> results(n);
    // Built before the clock starts: the figure is the lighthouse's, not protobuf's.
    std::vector<std::shared_ptr<const std::string>> asks(n);
    for (size_t i = 0; i < n; ++i) {
      asks[i] = Shared(RequestBytes("POST", "/v1/quorum", QuorumBody(job, GroupName(i), step),
                                    kProtoType));
    }
    size_t answered = 0;
    auto ask = [&](size_t i) {
      conns_[i]->Send(asks[i],
                      [&, i](HttpResult&& r) {
                        results[i] = std::move(r);
                        ++answered;
                      },
                      true);
    };
    for (size_t i = 0; i + 1 < n; ++i) ask(i);
    Status st = WaitForAsks(job, n - 1, &answered);
    if (st.ok() && answered != 0) st = Error(Code::kInternal, "answered before the last ask");
    auto t0 = SteadyClock::now();
    ask(n - 1);
    bool all = loop_.RunUntil([&] { return answered == n; }, 30s);
    if (!all) {
      // Unanswered asks still reference this frame: drop their connections.
      for (auto& c : conns_) {
        if (c->busy()) c->Close();
      }
      loop_.RunUntil([&] { return answered == n; }, 5s);
      return Error(Code::kDeadlineExceeded, "{} of {} asks unanswered after 30 s", n - answered, n);
    }
    if (!st.ok()) return st;
    auto t1 = t0;
    for (const auto& r : results) t1 = std::max(t1, r.done);
    LK_RETURN_IF_ERROR(CheckAnswers(results, reason));
    return Ms(t1 - t0).count();
  }

  Status Forget(const std::string& job) {
    auto r = SendAll(loop_, {control_},
                     {Shared(RequestBytes("POST", "/v1/admin/forget", ForgetBody(job),
                                          kProtoType))}, 10s);
    if (r[0].status != 200) return Error(Code::kInternal, "forget: {} {}", r[0].status, r[0].error);
    return Status::Ok();
  }

  static std::string GroupName(size_t i) { return fmt::format("group-{:05}", i); }

 private:
  static std::shared_ptr<const std::string> Shared(std::string s) {
    return std::make_shared<const std::string>(std::move(s));
  }

  // Polls /status until `want` groups of `job` are participants (asked), at most 10 s.
  Status WaitForAsks(const std::string& job, size_t want, const size_t* answered) {
    auto req = Shared(RequestBytes("GET", "/status?job=" + job, "", kProtoType));
    for (int i = 0; i < 10'000; ++i) {
      auto r = SendAll(loop_, {control_}, {req}, 10s, true);
      if (r[0].status != 200) return Error(Code::kInternal, "status: {} {}", r[0].status, r[0].error);
      if (*answered != 0 || CountParticipants(r[0].body) >= want) return Status::Ok();
      loop_.RunFor(1ms);
    }
    return Error(Code::kDeadlineExceeded, "asks not seen in /status");
  }

  // Every answer is a quorum of all groups with one quorum_id. At 1,024 groups a sample is
  // parsed: the full check would cost the load generator a second per round.
  Status CheckAnswers(const std::vector<HttpResult>& results, std::string* reason) {
    const size_t n = results.size();
    const size_t stride = n > 256 ? n / 16 : 1;
    uint32_t qid = 0;
    for (size_t i = 0; i < n; ++i) {
      if (results[i].status != 200) {
        return Error(Code::kInternal, "group {}: {} {} {}", i, results[i].status, results[i].error,
                     results[i].body.substr(0, 200));
      }
      if (i % stride != 0 && i + 1 != n) continue;
      auto q = ParseQuorum(results[i].body);
      if (!q) return Error(Code::kInternal, "group {}: unparsable quorum", i);
      if (q->members != n || q->replica_rank != i || (qid != 0 && q->quorum_id != qid)) {
        return Error(Code::kInternal, "group {}: quorum {} of {} members, rank {}", i,
                     q->quorum_id, q->members, q->replica_rank);
      }
      qid = q->quorum_id;
      if (reason) *reason = q->reason;
    }
    return Status::Ok();
  }

  Loop& loop_;
  std::vector<ConnPtr>& conns_;
  ConnPtr control_;
};

// The raw TCP barrier side of the same measurement, with one socket per group.
class BarrierRounds {
 public:
  BarrierRounds(Loop& loop, const BarrierServer& server, size_t n) : loop_(loop), server_(server) {
    tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), server.port());
    for (size_t i = 0; i < n; ++i) {
      auto s = std::make_shared<tcp::socket>(loop.ioc());
      s->connect(ep);
      s->set_option(tcp::no_delay(true));
      socks_.push_back(s);
    }
  }

  Result<double> Round() {
    const size_t n = socks_.size();
    const uint32_t size = static_cast<uint32_t>(n);
    std::vector<SteadyClock::time_point> done(n);
    std::vector<char> byte(n);
    size_t answered = 0;
    auto arrive = [&](size_t i) {
      asio::write(*socks_[i], asio::buffer(&size, 4));
      asio::async_read(*socks_[i], asio::buffer(&byte[i], 1),
                       [&, i](const boost::system::error_code& ec, size_t) {
                         done[i] = SteadyClock::now();
                         if (!ec) ++answered;
                       });
    };
    for (size_t i = 0; i + 1 < n; ++i) arrive(i);
    bool seen = loop_.RunUntil([&] { return server_.waiting() == n - 1; }, 10s);
    auto t0 = SteadyClock::now();
    arrive(n - 1);
    if (!seen || !loop_.RunUntil([&] { return answered == n; }, 10s)) {
      for (auto& s : socks_) s->close();
      loop_.RunFor(10ms);
      return Error(Code::kDeadlineExceeded, "barrier of {} did not release", n);
    }
    return Ms(*std::max_element(done.begin(), done.end()) - t0).count();
  }

 private:
  Loop& loop_;
  const BarrierServer& server_;
  std::vector<std::shared_ptr<tcp::socket>> socks_;
};

// `reps` rounds of the raw TCP barrier with n members, given up after a fourth failure.
LatencyStats BarrierFigures(Loop& loop, const BarrierServer& barrier, uint32_t n, size_t reps) {
  BarrierRounds br(loop, barrier, n);
  std::vector<double> ms;
  size_t failures = 0;
  for (size_t r = 0; r < reps && failures <= 3; ++r) {
    auto t = br.Round();
    if (t.ok()) ms.push_back(*t);
    else ++failures;
  }
  return Summarize(ms, failures, "");
}

}  // namespace

std::vector<FormationFigures> RunFormation(Loop& loop, const BenchOptions& o,
                                           const std::vector<uint32_t>& group_counts) {
  std::vector<FormationFigures> out;
  BarrierServer barrier;
  // Timeouts well past a round, so that a slow round is measured, not cut short.
  auto lh = StartBenchLighthouse(o, "formation",
                                 {"--join-timeout-ms", "30000", "--heartbeat-timeout-ms", "30000"});
  auto ep = ParseEndpoint(lh.address);
  for (uint32_t n : group_counts) {
    FormationFigures f;
    f.groups = n;
    auto conns = ConnectAll(loop, ep, n + 1, 256, 30s);
    if (conns.size() != n + 1) {
      f.lighthouse.first_error = "connect failed";
      out.push_back(f);
      continue;
    }
    ConnPtr control = conns.back();
    conns.pop_back();
    Rounds rounds(loop, conns, control);
    std::vector<double> ms;
    size_t failures = 0;
    std::string first_error, reason;
    for (size_t rep = 0; rep < Reps(o, n); ++rep) {
      std::string job = fmt::format("form{}-r{}", n, rep);
      Status st = rounds.Register(job);
      Result<double> t = st.ok() ? rounds.Round(job, 0, &reason) : Result<double>(st);
      if (t.ok()) ms.push_back(*t);
      else if (++failures == 1) first_error = t.status().ToString();
      // Forgetting keeps the lighthouse at one job of state, so every rep sees the same core.
      if (Status fs = rounds.Forget(job); !fs.ok() && first_error.empty()) first_error = fs.ToString();
      if (failures > 3) break;
    }
    f.lighthouse = Summarize(ms, failures, first_error);
    f.lighthouse.reason = reason;
    conns.push_back(control);
    CloseAll(loop, conns);
    f.barrier = BarrierFigures(loop, barrier, n, Reps(o, n));
    out.push_back(f);
  }
  lh.process->Signal(SIGTERM);
  lh.process->Wait(10s);
  return out;
}

FormationFigures RunUnchanged(Loop& loop, const BenchOptions& o, uint32_t n) {
  FormationFigures f;
  f.groups = n;
  BarrierServer barrier;
  auto lh = StartBenchLighthouse(o, "unchanged",
                                 {"--join-timeout-ms", "30000", "--heartbeat-timeout-ms", "30000"});
  auto conns = ConnectAll(loop, ParseEndpoint(lh.address), n + 1, 256, 30s);
  if (conns.size() != n + 1) {
    f.lighthouse.first_error = "connect failed";
    return f;
  }
  ConnPtr control = conns.back();
  conns.pop_back();
  Rounds rounds(loop, conns, control);
  const std::string job = "steady";
  std::vector<double> ms;
  size_t failures = 0;
  std::string first_error, reason;
  Status st = rounds.Register(job);
  if (st.ok()) st = rounds.Round(job, 0, nullptr).status();  // the first quorum forms
  if (!st.ok()) first_error = st.ToString();
  const size_t rounds_n = std::max<size_t>(3, static_cast<size_t>(500 * o.scale));
  for (uint32_t step = 1; st.ok() && step <= rounds_n; ++step) {
    auto t = rounds.Round(job, step, &reason);
    if (t.ok()) ms.push_back(*t);
    else if (++failures == 1) first_error = t.status().ToString();
    if (failures > 3) break;
  }
  f.lighthouse = Summarize(ms, failures, first_error);
  f.lighthouse.reason = reason;
  conns.push_back(control);
  CloseAll(loop, conns);
  f.barrier = BarrierFigures(loop, barrier, n, rounds_n);
  lh.process->Signal(SIGTERM);
  lh.process->Wait(10s);
  return f;
}

LatencyStats RunEchoRtt(const BarrierServer& server, size_t rounds) {
  // A barrier of one is an echo: write four bytes, read one back, blocking.
  asio::io_context ioc;
  tcp::socket s(ioc);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), server.port()));
  s.set_option(tcp::no_delay(true));
  std::vector<double> ms;
  const uint32_t one = 1;
  char byte = 0;
  for (size_t i = 0; i < rounds; ++i) {
    auto t0 = SteadyClock::now();
    asio::write(s, asio::buffer(&one, 4));
    asio::read(s, asio::buffer(&byte, 1));
    ms.push_back(Ms(SteadyClock::now() - t0).count());
  }
  return Summarize(ms, 0, "");
}

LatencyStats RunFsync(const std::string& dir, size_t rounds, bool append) {
  // In place: a preallocated file overwritten, so that fdatasync flushes data only. Append: the
  // file grows, so fdatasync also commits the size (a journal commit on ext4), as a log does.
  std::string path = dir + "/fsync-probe";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Summarize({}, 1, "cannot open " + path);
  const std::string record(100, 'x');
  size_t failures = 0;
  if (!append) {
    failures = ::posix_fallocate(fd, 0, static_cast<off_t>(record.size() * rounds)) == 0 &&
                       ::fsync(fd) == 0
                   ? 0
                   : 1;
  }
  std::vector<double> ms;
  for (size_t i = 0; i < rounds && failures == 0; ++i) {
    auto t0 = SteadyClock::now();
    const off_t at = static_cast<off_t>(i * record.size());
    bool ok = ::pwrite(fd, record.data(), record.size(), at) ==
                  static_cast<ssize_t>(record.size()) &&
              ::fdatasync(fd) == 0;
    if (ok) ms.push_back(Ms(SteadyClock::now() - t0).count());
    else ++failures;
  }
  ::close(fd);
  ::unlink(path.c_str());
  return Summarize(ms, failures, failures ? "fallocate, pwrite or fdatasync failed" : "");
}

}  // namespace lk::bench
