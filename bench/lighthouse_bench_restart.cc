// Modes (4)-(6): simultaneous cold starts, restart to serving after kill -9 with 10,000 groups of
// state in RocksDB, and the lighthouse's memory per tracked group.
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <map>
#include <thread>

#include "bench/lighthouse_bench_modes.h"
#include "bench/lighthouse_bench_proto.h"
#include "common/http/client.h"

namespace lk::bench {

using namespace std::chrono_literals;
using Ms = std::chrono::duration<double, std::milli>;

namespace {

std::shared_ptr<const std::string> Shared(std::string s) {
  return std::make_shared<const std::string>(std::move(s));
}

// ---- (4) cold starts ----

struct ColdAgent {
  ConnPtr conn;
  std::shared_ptr<const std::string> heartbeat, join;
  HttpResult answer;
  bool finished = false;
};

// Starts one agent as replica_agent does at a cold start: connect, heartbeat, ask.
void StartAgent(Loop& loop, const tcp::endpoint& ep, ColdAgent* a, size_t* finished) {
  a->conn = std::make_shared<HttpConn>(loop.ioc());
  auto finish = [a, finished](HttpResult&& r) {
    a->answer = std::move(r);
    a->finished = true;
    ++*finished;
  };
  a->conn->Connect(ep, [a, finish](bool ok) {
    if (!ok) {
      HttpResult r;
      r.error = "connect failed";
      return finish(std::move(r));
    }
    a->conn->Send(a->heartbeat, [a, finish](HttpResult&& hb) {
      if (hb.status != 200) return finish(std::move(hb));
      a->conn->Send(a->join, finish, true);
    });
  });
}

}  // namespace

ColdStartFigures RunColdStarts(Loop& loop, const BenchOptions& o, size_t sets,
                               size_t groups_per_set, size_t sets_at_once) {
  ColdStartFigures f;
  f.sets = sets;
  f.groups_per_set = groups_per_set;
  f.bound_ms = 10'000;
  // min_replicas = the set's size: every set must come up whole, so a lost wake-up shows as a
  // join that never answers rather than as a smaller quorum.
  auto lh = StartBenchLighthouse(o, "coldstart",
                                 {"--min-replicas", std::to_string(groups_per_set)});
  auto ep = ParseEndpoint(lh.address);
  std::vector<double> ms;
  std::string first_error;
  for (size_t first = 0; first < sets; first += sets_at_once) {
    const size_t count = std::min(sets_at_once, sets - first);
    const size_t n = count * groups_per_set;
    std::vector<ColdAgent> agents(n);
    for (size_t i = 0; i < n; ++i) {
      std::string job = fmt::format("cold-{:04}", first + i / groups_per_set);
      std::string group = fmt::format("group-{:03}", i % groups_per_set);
      agents[i].heartbeat = Shared(RequestBytes("POST", "/v1/heartbeat",
                                                HeartbeatBody(job, group, 0), kProtoType));
      agents[i].join = Shared(RequestBytes("POST", "/v1/quorum", QuorumBody(job, group, 0),
                                           kProtoType));
    }
    size_t finished = 0;
    auto t0 = SteadyClock::now();
    for (auto& a : agents) StartAgent(loop, ep, &a, &finished);
    loop.RunUntil([&] { return finished == n; },
                  std::chrono::milliseconds(static_cast<int64_t>(f.bound_ms)));
    std::vector<bool> hung(n);
    for (size_t i = 0; i < n; ++i) {
      const auto& a = agents[i];
      ++f.joins;
      hung[i] = !a.finished;
      if (hung[i]) {
        ++f.hung;
      } else if (a.answer.status == 200) {
        ++f.answered;
        ms.push_back(Ms(a.answer.done - t0).count());
      } else {
        ++f.failed;
        if (first_error.empty()) {
          first_error = fmt::format("{} {} {}", a.answer.status, a.answer.error,
                                    a.answer.body.substr(0, 200));
        }
      }
    }
    // A set is consistent when all its groups got the same quorum of the whole set.
    for (size_t s = 0; s < count; ++s) {
      std::optional<uint32_t> qid;
      bool ok = true;
      for (size_t g = 0; g < groups_per_set && ok; ++g) {
        const auto& a = agents[s * groups_per_set + g];
        auto q = a.finished && a.answer.status == 200 ? ParseQuorum(a.answer.body) : std::nullopt;
        ok = q && q->members == groups_per_set && q->replica_rank == g &&
             (!qid || *qid == q->quorum_id);
        if (q) qid = q->quorum_id;
      }
      f.inconsistent_sets += ok ? 0 : 1;
    }
    for (auto& a : agents) a.conn->Close();
    loop.RunUntil([&] { return finished == n; }, 5s);
  }
  f.latency = Summarize(ms, f.failed, first_error);
  lh.process->Signal(SIGTERM);
  lh.process->Wait(10s);
  return f;
}

// ---- (5) restart to serving, (6) memory per group ----

namespace {

std::string JobName(size_t j) { return fmt::format("mem-{:03}", j); }

// Sends one request per connection for agents [first, first + conns.size()) and checks 200s.
Status Wave(Loop& loop, const std::vector<ConnPtr>& conns, size_t first, size_t groups_per_job,
            bool join, uint32_t step) {
  std::vector<std::shared_ptr<const std::string>> reqs;
  for (size_t c = 0; c < conns.size(); ++c) {
    size_t k = first + c;
    std::string job = JobName(k / groups_per_job);
    std::string group = fmt::format("group-{:05}", k % groups_per_job);
    reqs.push_back(Shared(join ? RequestBytes("POST", "/v1/quorum", QuorumBody(job, group, step),
                                              kProtoType)
                               : RequestBytes("POST", "/v1/heartbeat",
                                              HeartbeatBody(job, group, step), kProtoType)));
  }
  for (const auto& r : SendAll(loop, conns, reqs, 60s, true)) {
    if (r.status != 200) {
      return Error(Code::kInternal, "{}: {} {} {}", join ? "quorum" : "heartbeat", r.status,
                   r.error, r.body.substr(0, 200));
    }
    if (join) {
      auto q = ParseQuorum(r.body);
      if (!q || q->members != groups_per_job) return Error(Code::kInternal, "short quorum");
    }
  }
  return Status::Ok();
}

// RSS once the allocator has settled (the lighthouse is idle while this sleeps).
int64_t SettledRss(pid_t pid) {
  std::this_thread::sleep_for(300ms);
  return ProcessRssBytes(pid);
}

double LoadMsFromLog(const std::string& log) {
  auto pos = log.rfind("state_loaded");
  if (pos == std::string::npos) return -1;
  auto k = log.find("load_ms=", pos);
  return k == std::string::npos ? -1 : std::stod(log.substr(k + 8));
}

Status FillState(Loop& loop, const tcp::endpoint& ep, pid_t pid, size_t jobs,
                 size_t groups_per_job, RestartFigures* f) {
  const size_t groups = jobs * groups_per_job;
  // Waves of whole jobs over a fixed set of connections, so that connection buffers are in the
  // baseline and the deltas are group state only.
  const size_t width = std::max<size_t>(1, 1000 / groups_per_job) * groups_per_job;
  auto conns = ConnectAll(loop, ep, width, 256, 60s);
  if (conns.size() != width) return Error(Code::kInternal, "connected {} of {}", conns.size(), width);
  std::vector<std::shared_ptr<const std::string>> healthz(
      width, Shared(RequestBytes("GET", "/healthz", "", kProtoType)));
  for (int warm = 0; warm < 3; ++warm) SendAll(loop, conns, healthz, 30s);
  f->rss_base = SettledRss(pid);
  for (size_t first = 0; first < groups; first += width) {
    LK_RETURN_IF_ERROR(Wave(loop, conns, first, groups_per_job, false, 0));
  }
  f->rss_heartbeats = SettledRss(pid);
  for (size_t first = 0; first < groups; first += width) {
    LK_RETURN_IF_ERROR(Wave(loop, conns, first, groups_per_job, true, 0));
  }
  f->rss_quorums = SettledRss(pid);
  // The probe: a one-group job whose next quorum after the restart is the first one timed.
  std::vector<ConnPtr> one = {conns[0]};
  for (bool join : {false, true}) {
    auto r = SendAll(loop, one, {Shared(RequestBytes(
                                    "POST", join ? "/v1/quorum" : "/v1/heartbeat",
                                    join ? QuorumBody("probe", "group-00000", 0)
                                         : HeartbeatBody("probe", "group-00000", 0),
                                    kProtoType))}, 10s);
    if (r[0].status != 200) return Error(Code::kInternal, "probe: {} {}", r[0].status, r[0].error);
  }
  CloseAll(loop, conns);
  return Status::Ok();
}

}  // namespace

RestartFigures RunRestartAndMemory(Loop& loop, const BenchOptions& o, size_t jobs,
                                   size_t groups_per_job) {
  RestartFigures f;
  f.jobs = jobs;
  f.groups = jobs * groups_per_job;
  // Heartbeats are sent once: a long timeout keeps every group healthy (tracked) while the
  // state is built, as steady agents would.
  std::vector<std::string> flags = {"--heartbeat-timeout-ms", "120000", "--join-timeout-ms",
                                    "30000"};
  auto lh = StartBenchLighthouse(o, "restart", flags);
  auto ep = ParseEndpoint(lh.address);
  Status st = FillState(loop, ep, lh.process->pid(), jobs, groups_per_job, &f);
  if (!st.ok()) {
    f.error = st.ToString();
    return f;
  }
  f.bytes_per_group_tracked =
      static_cast<double>(f.rss_heartbeats - f.rss_base) / static_cast<double>(f.groups);
  f.bytes_per_group_quorum =
      static_cast<double>(f.rss_quorums - f.rss_base) / static_cast<double>(f.groups);

  lh.process->Signal(SIGKILL);
  lh.process->Wait(10s);
  std::vector<std::string> argv = {o.bin_dir + "/lighthouse", "--bind", lh.address, "--data-dir",
                                   lh.data_dir};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto t0 = SteadyClock::now();
  test::Process restarted(argv, lh.log_path);
  bool up = false;
  for (int i = 0; i < 10'000 && !up; ++i) {
    auto c = http::Client::Create("http://" + lh.address);
    if (c.ok()) {
      auto r = (*c)->Do("GET", "/healthz", "", "", Millis(200));
      up = r.ok() && r->status == 200;
    }
    if (!up) std::this_thread::sleep_for(1ms);
  }
  if (!up) {
    f.error = "no /healthz within 10 s of the restart";
    return f;
  }
  f.healthz_ms = Ms(SteadyClock::now() - t0).count();
  auto probe_conn = ConnectAll(loop, ep, 1, 1, 10s);
  if (probe_conn.size() != 1) {
    f.error = "cannot connect after the restart";
    return f;
  }
  auto probe = SendAll(loop, probe_conn,
                       {Shared(RequestBytes("POST", "/v1/quorum",
                                            QuorumBody("probe", "group-00000", 1), kProtoType))},
                       10s);
  CloseAll(loop, probe_conn);
  f.quorum_ms = Ms(probe[0].done - t0).count();
  // A whole job's members retrying at their next step: the fast path from the loaded quorum.
  auto conns = ConnectAll(loop, ep, groups_per_job, 256, 10s);
  st = conns.size() == groups_per_job ? Wave(loop, conns, 0, groups_per_job, true, 1)
                                      : Error(Code::kInternal, "reconnect failed");
  auto t_job = SteadyClock::now();
  CloseAll(loop, conns);
  f.job_quorum_ms = Ms(t_job - t0).count();
  f.rss_restarted = SettledRss(restarted.pid());
  f.load_ms = LoadMsFromLog(restarted.Log());
  f.ok = probe[0].status == 200 && st.ok();
  if (probe[0].status != 200) f.error = fmt::format("probe after restart: {}", probe[0].status);
  if (!st.ok()) f.error = st.ToString();
  restarted.Signal(SIGTERM);
  restarted.Wait(10s);
  return f;
}

}  // namespace lk::bench
