// What the two chaos tests (plain processes: chaos_test.cc; Slurm jobs: slurm_chaos_test.cc)
// share: reading the trainers' --log JSON lines, watching the lighthouse's /status, and the
// checks of issue 6 on both. Test-only; include after doctest.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <boost/json.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/http/client.h"

namespace lk::e2e {

struct LogLine {
  uint32_t step = 0, quorum_id = 0, world = 0, group_rank = 0;
  double loss = 0;
  std::optional<double> eval_loss;  // with --eval-batches
  std::string hash;
  bool healed = false;
  std::string global_hash;  // the whole model's hash, the same in every layout
};

// A fresh random seed, or LK_CHAOS_SEED's; printed (and attached to the test's messages) so that
// a failing run can be replayed.
inline uint32_t ChaosSeed(const std::string& name) {
  uint32_t seed = static_cast<uint32_t>(std::random_device{}());
  if (const char* s = std::getenv("LK_CHAOS_SEED")) seed = static_cast<uint32_t>(std::stoul(s));
  fmt::print("{} seed {} (replay: LK_CHAOS_SEED={})\n", name, seed, seed);
  std::fflush(stdout);
  MESSAGE(name << " seed " << seed);
  return seed;
}

// A killed process may leave a torn last line: lines that do not parse are skipped.
inline std::vector<LogLine> ReadLog(const std::string& path) {
  std::vector<LogLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::system::error_code ec;
    boost::json::value v = boost::json::parse(line, ec);
    if (ec || !v.is_object()) continue;
    const boost::json::object& o = v.as_object();
    auto num = [&](const char* k) { return static_cast<uint32_t>(o.at(k).to_number<int64_t>()); };
    LogLine l{num("step"), num("quorum_id"), num("replica_world_size"), num("group_rank"),
              o.at("loss").to_number<double>(), std::nullopt,
              std::string(o.at("param_hash").as_string()), o.at("healed").as_bool(), ""};
    if (const auto* e = o.if_contains("eval_loss")) l.eval_loss = e->to_number<double>();
    if (const auto* g = o.if_contains("global_hash")) l.global_hash = g->as_string();
    out.push_back(std::move(l));
  }
  return out;
}

// GET http://ADDRESS/status with a bound; empty when the lighthouse does not answer.
inline std::string GetStatus(const std::string& address) {
  auto client = http::Client::Create("http://" + address);
  if (!client.ok()) return "";
  auto r = (*client)->Do("GET", "/status", "", "", Millis(1000));
  if (!r.ok() || r->status != 200) return "";
  return std::move(r->body);
}

// Polls /status every 100 ms and keeps what the checks need: the job's committed step over time
// and the membership each quorum_id named.
class StatusWatch {
 public:
  StatusWatch(std::string address, std::string job)
      : address_(std::move(address)), job_(std::move(job)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~StatusWatch() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint32_t committed() const { return committed_.load(); }
  std::vector<std::string> violations() const {
    std::lock_guard<std::mutex> l(mu_);
    return violations_;
  }
  std::map<uint32_t, std::string> quorums() const {
    std::lock_guard<std::mutex> l(mu_);
    return quorums_;
  }
  size_t polls() const { return polls_.load(); }

 private:
  void Loop() {
    while (!stop_) {
      std::string body = GetStatus(address_);
      if (!body.empty()) Record(body);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  void Record(const std::string& body) {
    boost::system::error_code ec;
    boost::json::value v = boost::json::parse(body, ec);
    if (ec) return;
    for (const auto& j : v.at("jobs").as_array()) {
      const auto& job = j.as_object();
      if (job.at("job").as_string() != job_) continue;
      uint32_t step = static_cast<uint32_t>(job.at("committed_step").to_number<int64_t>());
      uint32_t qid = static_cast<uint32_t>(job.at("quorum_id").to_number<int64_t>());
      std::set<std::string> members;
      for (const auto& m : job.at("members").as_array()) {
        members.insert(fmt::format("{}/{}", std::string(m.at("group_id").as_string()),
                                   std::string(m.at("incarnation").as_string())));
      }
      std::string names = fmt::format("{}", fmt::join(members, ","));
      std::lock_guard<std::mutex> l(mu_);
      ++polls_;
      if (step < committed_) {
        violations_.push_back(fmt::format("committed_step went back {} -> {}", committed_.load(),
                                          step));
      }
      committed_ = std::max(committed_.load(), step);
      if (qid == 0) continue;
      auto [it, fresh] = quorums_.emplace(qid, names);
      if (!fresh && it->second != names) {
        violations_.push_back(fmt::format("quorum {} named [{}] and [{}]", qid, it->second, names));
      }
    }
  }

  std::string address_, job_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> committed_{0};
  std::atomic<size_t> polls_{0};
  mutable std::mutex mu_;
  std::vector<std::string> violations_;
  std::map<uint32_t, std::string> quorums_;
};

// One trainer log of a run, and whether that trainer must have reached the last step (it was
// neither killed nor made to leave).
struct TrainerLog {
  std::string path;
  bool must_finish = false;
};

struct LogSummary {
  size_t lines = 0;
  size_t healed_lines = 0;
};

// The checks of issue 6 on the trainers' logs: per trainer, steps increase and quorum_id never
// decreases; across all trainers one param_hash per (step, shard), one world size per
// quorum_id, one eval_loss per step (the same weights on the same batches), and every step up to
// `steps` committed with every shard logged.
inline LogSummary CheckLogs(const std::vector<TrainerLog>& logs, uint32_t steps,
                            uint32_t group_size) {
  LogSummary sum;
  std::map<std::pair<uint32_t, uint32_t>, std::set<std::string>> hashes;
  std::map<uint32_t, std::set<uint32_t>> worlds;
  std::map<uint32_t, std::set<double>> evals;
  for (const TrainerLog& t : logs) {
    std::vector<LogLine> log = ReadLog(t.path);
    INFO("log " << t.path);
    for (size_t i = 0; i < log.size(); ++i) {
      ++sum.lines;
      sum.healed_lines += log[i].healed ? 1 : 0;
      hashes[{log[i].step, log[i].group_rank}].insert(log[i].hash);
      worlds[log[i].quorum_id].insert(log[i].world);
      if (log[i].eval_loss) evals[log[i].step].insert(*log[i].eval_loss);
      if (i > 0) {
        CHECK(log[i].step > log[i - 1].step);
        CHECK(log[i].quorum_id >= log[i - 1].quorum_id);
      }
    }
    if (t.must_finish) {
      REQUIRE_FALSE(log.empty());
      CHECK(log.back().step == steps);
    }
  }
  for (const auto& [key, hs] : hashes) {
    INFO("step " << key.first << " shard " << key.second);
    CHECK(hs.size() == 1);
  }
  for (const auto& [qid, ws] : worlds) {
    INFO("quorum " << qid);
    CHECK(ws.size() == 1);
  }
  for (const auto& [step, es] : evals) {
    INFO("eval_loss of step " << step);
    CHECK(es.size() == 1);
  }
  CHECK(hashes.size() == steps * group_size);  // every step committed, each shard logged
  return sum;
}

// The loss of the final model: eval_loss at step `steps` (the global weights on fixed batches;
// the same in every member, CheckLogs checks that). Also the mean inner loss of that step (the
// groups' own training batches), for the printout.
struct FinalLosses {
  double eval = 0;
  double inner = 0;
};
inline FinalLosses FinalLoss(const std::vector<TrainerLog>& logs, uint32_t steps) {
  FinalLosses f;
  int n = 0, e = 0;
  for (const TrainerLog& t : logs) {
    for (const LogLine& l : ReadLog(t.path)) {
      if (l.step != steps) continue;
      f.inner += l.loss;
      ++n;
      if (l.eval_loss) {
        f.eval += *l.eval_loss;
        ++e;
      }
    }
  }
  REQUIRE(n > 0);
  REQUIRE_MESSAGE(e > 0, "no eval_loss at the last step: run the trainers with --eval-batches");
  f.inner /= n;
  f.eval /= e;
  return f;
}

}  // namespace lk::e2e
