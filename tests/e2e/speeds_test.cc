// End-to-end tests of groups of different speeds and sizes on real processes (issue 15): a
// lighthouse, one replica_agent per group and its trainers, the tests' tiny model.
//  - Two groups with different --inner-steps (a C++ group of 4, a Python group of 8): every
//    commit carries the group's tokens (inner steps x batch x seq_len), the average is
//    token-weighted in every member, param_hash (per shard) and global_hash (whole weights)
//    agree across the groups at every step, and the lighthouse's /status and /metrics show
//    each group's tokens and its share of the step.
//  - Two groups of two trainers with time budgets (--outer-step-s), one group's inner steps
//    twice as long (--inner-step-min-ms): the trainers of each group stop after the same inner
//    step (their shards agree), and whatever count each group ran is the tokens it reported.
//  - A DiLoCo group of one trainer and a group of two plain-allreduce trainers (which cannot
//    average across sizes) in one job: the second is refused when it asks (GROUP_SIZE_MISMATCH)
//    with a clear message in the lighthouse's log, the agent's log and the trainers' stderr,
//    its agent exits 2, and nothing aborts inside Gloo; the first trains to the end. Groups of
//    different sizes that all run DiLoCo share quorums (mixed_sizes_test.cc).
// No test asserts a speed: the counts compared are the ones the logs report.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <boost/json.hpp>

#include <chrono>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tests/e2e/chaos_run.h"

namespace lk::e2e {
namespace {

using namespace std::chrono_literals;

// The fields of a --log line these tests look at.
struct TokenLine {
  uint32_t step = 0, group_rank = 0, inner_steps_run = 0;
  uint64_t tokens = 0, quorum_tokens = 0;
  bool weighted = false;
  std::string group_id, param_hash, global_hash;
};

std::vector<TokenLine> ReadTokenLog(const std::string& path) {
  std::vector<TokenLine> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    boost::system::error_code ec;
    boost::json::value v = boost::json::parse(line, ec);
    if (ec || !v.is_object()) continue;
    const boost::json::object& o = v.as_object();
    auto num = [&](const char* k) { return o.at(k).to_number<uint64_t>(); };
    TokenLine t;
    t.step = static_cast<uint32_t>(num("step"));
    t.group_rank = static_cast<uint32_t>(num("group_rank"));
    t.inner_steps_run = static_cast<uint32_t>(num("inner_steps_run"));
    t.tokens = num("tokens");
    t.quorum_tokens = num("quorum_tokens");
    t.weighted = o.at("weighted").as_bool();
    t.group_id = std::string(o.at("group_id").as_string());
    t.param_hash = std::string(o.at("param_hash").as_string());
    t.global_hash = std::string(o.at("global_hash").as_string());
    out.push_back(std::move(t));
  }
  return out;
}

constexpr uint64_t kTokensPerInnerStep = 8 * 32;  // chaos_run.h's --batch 8 --seq-len 32

// Checks every log line of every trainer: the tokens are the group's inner steps times the
// tokens of one (per trainer, summed over the group), the average was weighted, the quorum's
// total is the sum of the groups' at that step, and one global_hash per step across all.
// Returns the lines by (step, group).
std::map<std::pair<uint32_t, std::string>, TokenLine> CheckTokenLogs(const Run& run,
                                                                     uint32_t steps) {
  std::map<std::pair<uint32_t, std::string>, TokenLine> by_group;
  std::map<uint32_t, std::set<std::string>> global_hashes;
  std::map<uint32_t, std::set<uint64_t>> quorum_totals;
  for (const auto& life : run.lives) {
    const uint32_t size = run.SizeOf(life->group);
    for (const std::string& path : life->logs) {
      INFO("log " << path);
      std::vector<TokenLine> log = ReadTokenLog(path);
      REQUIRE_FALSE(log.empty());
      CHECK(log.back().step == steps);
      for (const TokenLine& t : log) {
        INFO("step " << t.step);
        CHECK(t.group_id == life->group);
        CHECK(t.weighted);
        CHECK(t.inner_steps_run > 0);
        CHECK(t.tokens == uint64_t{t.inner_steps_run} * kTokensPerInnerStep * size);
        CHECK(t.global_hash.size() == 16);
        global_hashes[t.step].insert(t.global_hash);
        quorum_totals[t.step].insert(t.quorum_tokens);
        auto [it, fresh] = by_group.emplace(std::make_pair(t.step, t.group_id), t);
        // The trainers of one group report one count (the library sums it over the group).
        if (!fresh) CHECK(it->second.tokens == t.tokens);
      }
    }
  }
  for (uint32_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
    CHECK(global_hashes[step].size() == 1);
    REQUIRE(quorum_totals[step].size() == 1);
    uint64_t sum = 0;
    for (const auto& [key, t] : by_group) {
      if (key.first == step) sum += t.tokens;
    }
    CHECK(*quorum_totals[step].begin() == sum);
  }
  return by_group;
}

// The job's groups in /status: group_id -> the group's JSON object.
std::map<std::string, boost::json::object> StatusGroups(const Run& run) {
  std::map<std::string, boost::json::object> out;
  std::string body = GetStatus(run.lh.address);
  REQUIRE_FALSE(body.empty());
  boost::json::value v = boost::json::parse(body);
  for (const auto& j : v.at("jobs").as_array()) {
    if (j.at("job").as_string() != run.options.job) continue;
    for (const auto& g : j.at("groups").as_array()) {
      out[std::string(g.at("group_id").as_string())] = g.as_object();
    }
  }
  return out;
}

// protobuf's JSON mapping writes 64-bit integers as strings.
uint64_t U64(const boost::json::object& o, const char* key) {
  const boost::json::value* v = o.if_contains(key);
  if (v == nullptr) return 0;
  if (v->is_string()) return std::stoull(std::string(v->as_string()));
  return v->to_number<uint64_t>();
}

std::string Metrics(const Run& run) {
  auto client = http::Client::Create(run.lh.url());
  REQUIRE(client.ok());
  auto r = (*client)->Do("GET", "/metrics", "", "", Millis(2000));
  REQUIRE(r.ok());
  REQUIRE(r->status == 200);
  return r->body;
}

TEST_CASE("speeds groups with different inner steps commit their tokens and agree at every step") {
  constexpr uint32_t kSteps = 6;
  RunOptions o;
  o.job = "speeds";
  o.steps = kSteps;
  o.group_size = 1;
  o.group_flags["g0"] = {"--inner-steps", "4"};
  o.group_flags["g1"] = {"--inner-steps", "8"};
  Run run("speeds", o);
  fmt::print("speeds logs in {}\n", run.dir);
  run.StartGroup("g0", TrainerKind::kCpp);
  run.StartGroup("g1", TrainerKind::kPython);
  run.WaitSurvivors(240s);

  auto lines = CheckTokenLogs(run, kSteps);
  for (uint32_t step = 1; step <= kSteps; ++step) {
    INFO("step " << step);
    CHECK(lines.at({step, "g0"}).tokens == 4 * kTokensPerInnerStep);
    CHECK(lines.at({step, "g1"}).tokens == 8 * kTokensPerInnerStep);
    CHECK(lines.at({step, "g0"}).quorum_tokens == 12 * kTokensPerInnerStep);
  }
  // The C++ and the Python group hold the same weights at every step (CheckLogs: per shard).
  CheckLogs(run.AllLogs(), kSteps, 1);

  // The lighthouse: each group's tokens of its last commit, its share of that step, its total.
  auto groups = StatusGroups(run);
  REQUIRE(groups.count("g0") == 1);
  REQUIRE(groups.count("g1") == 1);
  CHECK(U64(groups["g0"], "tokens") == 4 * kTokensPerInnerStep);
  CHECK(U64(groups["g1"], "tokens") == 8 * kTokensPerInnerStep);
  CHECK(U64(groups["g0"], "tokens_step") == kSteps);
  CHECK(U64(groups["g0"], "tokens_total") == kSteps * 4 * kTokensPerInnerStep);
  CHECK(U64(groups["g1"], "tokens_total") == kSteps * 8 * kTokensPerInnerStep);
  CHECK(groups["g0"].at("share").to_number<double>() == doctest::Approx(1.0 / 3));
  CHECK(groups["g1"].at("share").to_number<double>() == doctest::Approx(2.0 / 3));
  CHECK(U64(groups["g1"], "group_size") == 1);
  std::string m = Metrics(run);
  CHECK(m.find(fmt::format("lk_group_tokens_total{{job=\"speeds\",group=\"g0\"}} {}",
                           kSteps * 4 * kTokensPerInnerStep)) != std::string::npos);
  CHECK(m.find("lk_group_token_share{job=\"speeds\",group=\"g1\"} 0.666667") !=
        std::string::npos);
}

TEST_CASE("speeds time budgets: each group stops its trainers after the same inner step") {
  constexpr uint32_t kSteps = 5;
  RunOptions o;
  o.job = "budgets";
  o.steps = kSteps;
  o.group_size = 2;
  // The same budget; the slow group's inner steps take twice as long.
  o.group_flags["g0"] = {"--inner-steps", "1000", "--outer-step-s", "0.4", "--inner-step-min-ms",
                         "10"};
  o.group_flags["g1"] = {"--inner-steps", "1000", "--outer-step-s", "0.4", "--inner-step-min-ms",
                         "20"};
  Run run("budgets", o);
  fmt::print("budgets logs in {}\n", run.dir);
  run.StartGroup("g0", TrainerKind::kCpp);
  run.StartGroup("g1", TrainerKind::kPython);
  run.WaitSurvivors(240s);
  auto lines = CheckTokenLogs(run, kSteps);
  // Both trainers of a group ran the same inner steps (CheckTokenLogs: one count per group and
  // step), and their shards of the new weights agree across the groups.
  CheckLogs(run.AllLogs(), kSteps, 2);
  for (uint32_t step = 1; step <= kSteps; ++step) {
    INFO("step " << step);
    CHECK(lines.at({step, "g0"}).inner_steps_run < 1000);  // the budget ended them, not the cap
    CHECK(lines.at({step, "g1"}).inner_steps_run < 1000);
  }
}

TEST_CASE("speeds a group of another size that cannot average across sizes is refused, not aborted") {
  // The DiLoCo trainers average across group sizes; a trainer with a plain allreduce over
  // equal layouts (tests/test_trainer.cc) cannot, so a group of two of those beside a DiLoCo
  // group of one is what stays unsupported, and is refused when it asks.
  RunOptions o;
  o.job = "sizes";
  o.steps = 40;
  o.group_size = 1;
  o.lighthouse_flags = {"--min-replicas", "1", "--join-timeout-ms", "500",
                        "--heartbeat-timeout-ms", "2000"};
  o.group_flags["g0"] = {"--inner-steps", "4", "--inner-step-min-ms", "5"};
  Run run("sizes", o);
  fmt::print("sizes logs in {}\n", run.dir);
  Life* g0 = run.StartGroup("g0");
  REQUIRE(run.WaitFirstCommit(g0, 60s));
  const std::string socket = run.dir + "/g1.sock";
  test::Process agent({test::BinDir() + "/replica_agent", "--lighthouse", run.lh.url(), "--job",
                       o.job, "--group-id", "g1", "--socket", socket, "--serve", "127.0.0.1:0",
                       "--heartbeat-interval-ms", "100", "--quorum-timeout-ms", "5000"},
                      run.dir + "/agent-g1.log");
  REQUIRE_FALSE(agent.WaitForLog("agent_listening", 20s).empty());
  std::vector<std::unique_ptr<test::Process>> trainers;
  for (uint32_t r = 0; r < 2; ++r) {
    const std::string log = fmt::format("{}/trainer-g1-{}.jsonl", run.dir, r);
    trainers.push_back(std::make_unique<test::Process>(
        std::vector<std::string>{test::BinDir() + "/test_trainer", "--group-rank",
                                 std::to_string(r), "--group-size", "2", "--steps", "20",
                                 "--log", log},
        log + ".stderr", std::map<std::string, std::string>{{"LK_AGENT_SOCKET", socket}}));
  }
  // The group of two asks, the lighthouse keeps it out: its trainers fail their poll with
  // the reason, nothing aborts inside Gloo.
  for (auto& t : trainers) {
    auto code = t->Wait(60s);
    INFO("trainer stderr " << t->log_path());
    REQUIRE(code.has_value());
    CHECK(*code == 1);
    std::string err = t->Log();
    CHECK(err.find("group g1 has 2 trainers and cannot average across group sizes") !=
          std::string::npos);
    CHECK(err.find("terminate called") == std::string::npos);
    CHECK(err.find("EnforceNotMet") == std::string::npos);
  }
  auto agent_code = agent.Wait(30s);
  REQUIRE(agent_code.has_value());
  CHECK(*agent_code == 2);
  CHECK(agent.Log().find("quorum_refused code=GROUP_SIZE_MISMATCH") != std::string::npos);
  CHECK(run.lh.process->Log().find("group_refused job=sizes group=g1 ") != std::string::npos);
  CHECK(run.lh.process->Log().find("code=GROUP_SIZE_MISMATCH") != std::string::npos);
  // The group left with the refusal as its reason (while it waited, /status said "refused").
  auto groups = StatusGroups(run);
  REQUIRE(groups.count("g1") == 1);
  CHECK(std::string(groups["g1"].at("reason").as_string()) == "group_size_mismatch");
  // The group of one was never disturbed: it trains to the end and exits 0.
  for (auto& t : g0->trainers) {
    auto code = t->Wait(180s);
    INFO("trainer stderr " << t->log_path());
    REQUIRE(code.has_value());
    CHECK(*code == 0);
  }
  auto code = g0->agent->Wait(30s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  CHECK(ReadLog(g0->logs[0]).back().step == o.steps);
}

}  // namespace
}  // namespace lk::e2e
