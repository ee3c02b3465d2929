// Table-driven tests of the pure quorum decision (rules 1-5) and the recovery plan (rule 7).
#include "lighthouse/quorum.h"

#include <doctest/doctest.h>

#include <deque>
#include <string>
#include <vector>

namespace lk::lighthouse {
namespace {

const TimePoint kT0 = TimePoint{} + std::chrono::hours(1);

enum class S {
  kAsk,      // one agent, heard at kT0 + at, asked at kT0 + at
  kIdle,     // heartbeats only
  kDead,     // asked, but its last heartbeat is 10 s old
  kShrink,   // asked with shrink_only
  kPartial,  // two agents, only node 0 asked
  kLeft,
  kDrain,
  kEvict,
  kReborn,  // asked with incarnation i2 (the previous quorum knew i1)
};

struct G {
  const char* id;
  S s;
  int64_t at_ms = 0;
};

GroupStatus Build(const G& spec) {
  GroupStatus g;
  g.group_id = spec.id;
  g.incarnation = spec.s == S::kReborn ? "i2" : "i1";
  g.agents.resize(spec.s == S::kPartial ? 2 : 1);
  const TimePoint at = kT0 + Millis(spec.at_ms);
  for (size_t r = 0; r < g.agents.size(); ++r) {
    AgentStatus& a = g.agents[r];
    a.seen = true;
    a.last_seen = spec.s == S::kDead ? kT0 - Millis(10'000) : at;
    bool asks = spec.s != S::kIdle && !(spec.s == S::kPartial && r == 1);
    if (asks) {
      a.asked = a.waiting = true;
      a.ask_step = 7;
      a.ask_shrink_only = spec.s == S::kShrink;
      ++g.asked;
      g.first_ask = spec.s == S::kDead ? a.last_seen : at;
    }
  }
  if (spec.s == S::kLeft) g.mode = GroupMode::kLeft;
  if (spec.s == S::kDrain) g.mode = GroupMode::kDraining;
  if (spec.s == S::kEvict) g.mode = GroupMode::kEvicted;
  return g;
}

struct Row {
  const char* name;
  std::vector<G> groups;
  std::vector<const char*> previous;  // members of the last quorum, incarnation i1
  uint32_t min_replicas;
  int64_t now_ms;
  const char* members;  // "" when waiting
  const char* reason;
};

std::string Ids(const std::vector<const GroupStatus*>& members) {
  std::string out;
  for (const GroupStatus* g : members) {
    if (!out.empty()) out += ",";
    out += g->group_id;
    if (g->incarnation != "i1") out += "/" + g->incarnation;
  }
  return out;
}

// `storage` keeps the groups alive as long as the decision's pointers.
QuorumDecision Decide(const Row& row, CoreOptions options, std::deque<GroupStatus>& storage) {
  options.min_replicas = row.min_replicas;
  std::vector<const GroupStatus*> groups;
  for (const G& g : row.groups) groups.push_back(&storage.emplace_back(Build(g)));
  std::vector<MemberData> previous;
  for (const char* id : row.previous) {
    MemberData m;
    m.group_id = id;
    m.incarnation = "i1";
    previous.push_back(m);
  }
  return ComputeQuorum({previous, groups}, options, kT0 + Millis(row.now_ms));
}

TEST_CASE("ComputeQuorum: rules 1-5 - each decision with its reason") {
  using enum S;
  CoreOptions options;  // join_timeout 2000 ms, heartbeat_timeout 3000 ms
  const std::vector<Row> rows = {
      {"first quorum once every healthy group asked",
       {{"a", kAsk}, {"b", kAsk}},
       {},
       1,
       10,
       "a,b",
       "all 2 healthy groups asked"},
      {"rule 5 waits for the join timeout",
       {{"a", kAsk}, {"b", kAsk}, {"c", kIdle}},
       {},
       1,
       800,
       "",
       "wait: 2 of 3 healthy groups asked, join_timeout in 1200ms"},
      {"rule 5 issues when join_timeout passed",
       {{"a", kAsk}, {"b", kAsk}, {"c", kIdle}},
       {},
       1,
       2000,
       "a,b",
       "join_timeout: 2 of 3 healthy groups asked within 2000ms"},
      {"min_replicas holds on rule 5",
       {{"a", kAsk}, {"b", kAsk}},
       {},
       3,
       10,
       "",
       "wait: min_replicas=3 but 2 candidates"},
      {"a majority of healthy groups is needed",
       {{"a", kAsk}, {"b", kIdle}, {"c", kIdle}},
       {},
       1,
       2500,
       "",
       "wait: 1 of 3 healthy groups asked, a majority needs 2"},
      {"rule 4 fast path",
       {{"a", kAsk}, {"b", kAsk}, {"c", kAsk}},
       {"a", "b", "c"},
       1,
       10,
       "a,b,c",
       "fast_path: all 3 previous members rejoined"},
      {"fast path takes joiners that asked, not idle ones",
       {{"a", kAsk}, {"b", kAsk}, {"c", kAsk}, {"d", kIdle}},
       {"a", "b"},
       1,
       10,
       "a,b,c",
       "fast_path: all 2 previous members rejoined, 1 joiner came in"},
      {"fast path does not wait for idle joiners",
       {{"a", kAsk}, {"b", kAsk}, {"c", kIdle}},
       {"a", "b"},
       1,
       10,
       "a,b",
       "fast_path: all 2 previous members rejoined"},
      {"fast path still needs min_replicas",
       {{"a", kAsk}},
       {"a"},
       2,
       10,
       "",
       "wait: min_replicas=2 but 1 candidate"},
      {"rule 3 shrink_only holds joiners back",
       {{"a", kShrink}, {"b", kAsk}, {"c", kAsk}},
       {"a", "b"},
       1,
       10,
       "a,b",
       "fast_path: all 2 previous members rejoined; shrink_only: 1 joiner held back"},
      {"shrink_only without a previous quorum holds everyone",
       {{"a", kShrink}, {"b", kAsk}},
       {},
       1,
       10,
       "",
       "wait: shrink_only holds back all 2 joiners"},
      {"rule 1: a member without heartbeats is not healthy",
       {{"a", kAsk}, {"b", kAsk}, {"c", kDead}},
       {"a", "b", "c"},
       1,
       10,
       "a,b",
       "all 2 healthy groups asked"},
      {"rule 1: a new incarnation is not the previous member",
       {{"a", kAsk}, {"b", kReborn}},
       {"a", "b"},
       1,
       10,
       "a,b/i2",
       "all 2 healthy groups asked"},
      {"multi-node group is a participant only when every agent asked",
       {{"a", kAsk}, {"b", kPartial}},
       {},
       1,
       2500,
       "",
       "wait: 1 of 2 healthy groups asked, a majority needs 2"},
      {"left, draining and evicted groups are not healthy",
       {{"a", kAsk}, {"b", kLeft}, {"c", kDrain}, {"d", kEvict}},
       {},
       1,
       10,
       "a",
       "all 1 healthy group asked"},
      {"joiners cannot outvote a live quorum",
       {{"a", kIdle}, {"b", kAsk}, {"c", kAsk}, {"d", kAsk}},
       {"a"},
       1,
       2500,
       "",
       "wait: 0 of 1 live previous members asked, joiners wait for the quorum's next step"},
      {"the join clock starts at the first previous member's ask",
       {{"a", kAsk, 1000}, {"b", kAsk, 1000}, {"c", kIdle, 1000}, {"d", kAsk, 500}},
       {"a", "b", "c"},
       1,
       2500,
       "",
       "wait: 3 of 4 healthy groups asked, join_timeout in 500ms"},
      {"... and the quorum forms join_timeout after it",
       {{"a", kAsk, 1000}, {"b", kAsk, 1000}, {"c", kIdle, 1000}, {"d", kAsk, 500}},
       {"a", "b", "c"},
       1,
       3000,
       "a,b,d",
       "join_timeout: 3 of 4 healthy groups asked within 2000ms"},
      {"no participants",
       {{"a", kIdle}},
       {},
       1,
       10,
       "",
       "wait: no healthy participants among 1 healthy group"},
      {"a dead group's old ask does not count",
       {{"a", kAsk}, {"b", kDead}},
       {},
       1,
       10,
       "a",
       "all 1 healthy group asked"},
  };
  for (const Row& row : rows) {
    const std::string name = row.name;
    CAPTURE(name);
    std::deque<GroupStatus> storage;
    QuorumDecision d = Decide(row, options, storage);
    CHECK(d.reason == std::string(row.reason));
    CHECK(d.issue == (std::string(row.members) != ""));
    if (d.issue) CHECK(Ids(d.members) == std::string(row.members));
    if (d.issue) CHECK(!d.wake_at.has_value());
  }
}

TEST_CASE("ComputeQuorum: waiting on join_timeout names the exact wake time") {
  Row row{"", {{"a", S::kAsk, 300}, {"b", S::kIdle}}, {}, 1, 800, "", ""};
  std::deque<GroupStatus> storage;
  QuorumDecision d = Decide(row, CoreOptions{}, storage);
  // One of two healthy groups is not a majority: no wake time, only an input can change this.
  CHECK(!d.issue);
  CHECK(!d.wake_at.has_value());
  row.groups = {{"a", S::kAsk, 300}, {"b", S::kAsk, 500}, {"c", S::kIdle}};
  d = Decide(row, CoreOptions{}, storage);
  REQUIRE(d.wake_at.has_value());
  CHECK(*d.wake_at == kT0 + Millis(2300));
  CHECK(d.held_back == 0);
}

TEST_CASE("ComputeQuorum: a heartbeat exactly heartbeat_timeout old is expired") {
  GroupStatus g = Build({"a", S::kAsk, 0});
  CoreOptions options;
  CHECK(IsHealthy(g, options, kT0 + Millis(2999)));
  CHECK(!IsHealthy(g, options, kT0 + Millis(3000)));
  CHECK(AliveUntil(g, options.heartbeat_timeout) == kT0 + Millis(3000));
  g.agents.emplace_back();  // an agent never heard
  CHECK(!AliveUntil(g, options.heartbeat_timeout).has_value());
}

struct PlanRow {
  const char* name;
  std::vector<uint32_t> steps;
  std::vector<bool> has_state;
  std::vector<bool> diverged;
  bool checkpoint;
  const char* heal;                            // one char per rank: h heals, - does not
  std::vector<std::vector<uint32_t>> sources;  // per rank
  uint32_t max_step;
  bool initial;
  std::vector<bool> partial = {};  // per rank; empty: none
};

TEST_CASE("PlanRecovery: rule 7 heal flags - striped donors - checkpoint - initial weights") {
  CheckpointData ckpt;
  ckpt.job = "j";
  ckpt.step = 40;
  ckpt.location = "/ckpt/40";
  const std::vector<PlanRow> rows = {
      {"a member behind heals from the up-to-date ones",
       {10, 10, 8},
       {1, 1, 1},
       {},
       false,
       "--h",
       {{}, {}, {0, 1}},
       10,
       false},
      {"donors rotate per healer",
       {10, 5, 5, 10, 5},
       {1, 1, 1, 1, 1},
       {},
       false,
       "-hh-h",
       {{}, {0, 3}, {3, 0}, {}, {0, 3}},
       10,
       false},
      {"a fresh incarnation without state heals",
       {10, 10},
       {1, 0},
       {},
       false,
       "-h",
       {{}, {0}},
       10,
       false},
      {"a diverged member heals and is no donor",
       {10, 10, 10},
       {1, 1, 1},
       {0, 1, 0},
       false,
       "-h-",
       {{}, {0, 2}, {}},
       10,
       false},
      {"no live state: every member restores the newest checkpoint",
       {0, 0},
       {0, 0},
       {},
       true,
       "hh",
       {{}, {}},
       40,
       false},
      {"a checkpoint ahead of every live member is restored (its holders are gone)",
       {10, 8},
       {1, 1},
       {},
       true,
       "hh",
       {{}, {}},
       40,
       false},
      {"first start: rank 0's initial weights",
       {0, 0, 0},
       {0, 0, 0},
       {},
       false,
       "-hh",
       {{}, {0}, {0}},
       0,
       true},
      // The lighthouse's simulation, seed 20736: rank 0 (fresh, step 0) was the source and
      // answered without a heal beside max_step 1, and its commits were refused for good.
      {"no live state and no checkpoint: a diverged member's trained state, not rank 0's",
       {0, 1, 0},
       {0, 1, 0},
       {0, 1, 0},
       false,
       "h-h",
       {{1}, {}, {1}},
       1,
       false},
      // The agents' simulation, seed 3576: one node of a group healed to step 6 while the
      // other's answer was lost, and every member that held step 6 died. As the source the
      // partial group gave each slot whatever that slot held (shards of steps 6 and 0), and the
      // outer step never completed. The whole fresh member is the source; step 6 is lost.
      {"no live state: a partial member (its shards of two steps) is no donor beside a whole one",
       {6, 0},
       {0, 0},
       {},
       false,
       "h-",
       {{1}, {}},
       0,
       true,
       {1, 0}},
      {"every member partial (the core evicts them before it plans): the furthest",
       {6, 3},
       {0, 0},
       {},
       false,
       "-h",
       {{}, {0}},
       6,
       true,
       {1, 1}},
  };
  for (const PlanRow& row : rows) {
    const std::string name = row.name;
    CAPTURE(name);
    std::vector<MemberData> members;
    for (size_t i = 0; i < row.steps.size(); ++i) {
      MemberData m;
      m.group_id = std::string(1, static_cast<char>('a' + i));
      m.incarnation = "i1";
      m.step = row.steps[i];
      m.has_state = row.has_state[i];
      m.partial = i < row.partial.size() && row.partial[i];
      members.push_back(m);
    }
    std::optional<CheckpointData> newest;
    if (row.checkpoint) newest = ckpt;
    RecoveryPlan plan = PlanRecovery(members, row.diverged, newest);
    CHECK(plan.max_step == row.max_step);
    CHECK(plan.initial == row.initial);
    CHECK(plan.restore.has_value() == (row.checkpoint && row.heal == std::string(2, 'h')));
    for (uint32_t rank = 0; rank < members.size(); ++rank) {
      CAPTURE(rank);
      QuorumAnswer a = AnswerFor(plan, 9, rank, "r");
      CHECK(a.heal == (row.heal[rank] == 'h'));
      CHECK(a.source_ranks == row.sources[rank]);
      CHECK(a.replica_rank == rank);
      CHECK(a.quorum_id == 9);
      CHECK(a.members.size() == members.size());
      CHECK(a.restore_checkpoint.has_value() == plan.restore.has_value());
    }
    // After a restart the plan is rebuilt from the persisted heal flags alone.
    RecoveryPlan again = PlanFromIssued(plan.members, newest);
    CHECK(again.max_step == plan.max_step);
    CHECK(again.initial == plan.initial);
    CHECK(again.restore.has_value() == plan.restore.has_value());
  }
}

}  // namespace
}  // namespace lk::lighthouse
