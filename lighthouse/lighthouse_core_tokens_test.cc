// Tests of the lighthouse core for groups of different speeds and sizes: each group's tokens
// per committed step (its contribution, shown and persisted), the refusal of a group whose
// trainer count differs from the quorum's (GROUP_SIZE_MISMATCH), and quorums of several sizes
// when every group averages across sizes, through the public inputs.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_test_util.h"
#include "lighthouse/quorum.h"

namespace lk::lighthouse {
namespace {

using testing::Harness;

Status JoinSized(Harness& h, const std::string& g, uint32_t step, uint32_t group_size,
                 const std::string& inc = "i1", bool mixed = false) {
  h.fx = {};
  JoinInput in{h.job, g, inc, 0, 1, step, false, true, "addr-" + g, 0, group_size, mixed};
  return h.core.OnJoin(in, h.clock.Now(), &h.fx);
}

// A group whose trainers average across sizes (the DiLoCo library's asks).
Status JoinMixed(Harness& h, const std::string& g, uint32_t step, uint32_t group_size) {
  return JoinSized(h, g, step, group_size, "i1", true);
}

// "a:1,b:2": each member of a's answer with its size.
std::string Sizes(const QuorumAnswer* a) {
  std::string out;
  for (const MemberData& m : *a->members_shared) {
    if (!out.empty()) out += ",";
    out += m.group_id + ":" + std::to_string(m.group_size);
  }
  return out;
}

Result<bool> CommitTokens(Harness& h, const std::string& g, uint32_t quorum_id, uint32_t step,
                          uint64_t tokens, uint32_t node = 0) {
  h.fx = {};
  return h.core.OnCommit(CommitInput{h.job, g, "i1", node, quorum_id, step, true, "", tokens},
                         h.clock.Now(), &h.fx);
}

TEST_CASE("tokens: each group's commit carries its tokens - status shows them and the step's share") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(CommitTokens(h, "a", 1, 1, 3000).ok());
  CHECK(h.HasEvent("commit job=j quorum_id=1 group=a incarnation=i1 node=0 step=1 ok=true "
                   "committed_step=1 tokens=3000"));
  REQUIRE(h.fx.persist_jobs.size() == 1);
  REQUIRE(h.fx.persist_jobs[0].tokens.size() == 1);
  CHECK(h.fx.persist_jobs[0].tokens[0] == GroupTokensData{"a", 1, 3000, 3000});
  REQUIRE(CommitTokens(h, "b", 1, 1, 1000).ok());
  const GroupView* a = h.Group("a");
  REQUIRE(a != nullptr);
  CHECK(a->tokens == 3000);
  CHECK(a->tokens_step == 1);
  CHECK(a->tokens_total == 3000);
  CHECK(a->share == doctest::Approx(0.75));
  const GroupView* b = h.Group("b");
  CHECK(b->tokens == 1000);
  CHECK(b->share == doctest::Approx(0.25));

  // The next step: a quorum again, other counts; totals add up, shares follow the new step.
  REQUIRE(h.Join("a", 1).ok());
  REQUIRE(h.Join("b", 1).ok());
  REQUIRE(h.fx.answers.size() == 2);
  REQUIRE(CommitTokens(h, "a", 1, 2, 500).ok());
  a = h.Group("a");
  CHECK(a->tokens == 500);
  CHECK(a->tokens_step == 2);
  CHECK(a->tokens_total == 3500);
  CHECK(a->share == doctest::Approx(1.0));  // b has not committed step 2 yet
  REQUIRE(CommitTokens(h, "b", 1, 2, 1500).ok());
  CHECK(h.Group("a")->share == doctest::Approx(0.25));
  CHECK(h.Group("b")->share == doctest::Approx(0.75));
  CHECK(h.Group("b")->tokens_total == 2500);
}

TEST_CASE("tokens: a group's nodes report one count per step, a failed step counts none") {
  Harness h;
  for (uint32_t node = 0; node < 2; ++node) {
    REQUIRE(h.Beat("a", 0, "i1", node, 2).ok());
  }
  for (uint32_t node = 0; node < 2; ++node) {
    h.fx = {};
    JoinInput in{h.job, "a", "i1", node, 2, 0, false, true, "addr", 0, 4};
    REQUIRE(h.core.OnJoin(in, h.clock.Now(), &h.fx).ok());
  }
  REQUIRE(h.fx.answers.size() == 2);
  REQUIRE(CommitTokens(h, "a", 1, 1, 800, 0).ok());
  REQUIRE(CommitTokens(h, "a", 1, 1, 800, 1).ok());
  CHECK(h.Group("a")->tokens_total == 800);
  h.fx = {};
  REQUIRE(h.core.OnCommit(CommitInput{h.job, "a", "i1", 0, 1, 2, false, "", 900}, h.clock.Now(),
                          &h.fx)
              .ok());
  CHECK(h.Group("a")->tokens_total == 800);
  CHECK(h.Group("a")->tokens_step == 1);
  CHECK(h.Group("a")->group_size == 4);
}

TEST_CASE("tokens: the counters survive a restart (Load of the persisted job record)") {
  Harness h;
  h.Form({"a", "b"});
  REQUIRE(CommitTokens(h, "a", 1, 1, 64).ok());
  REQUIRE(CommitTokens(h, "b", 1, 1, 192).ok());
  JobRecordData rec = h.fx.persist_jobs.at(0);
  LighthouseCore restarted(h.options);
  REQUIRE(restarted.Load({rec}, {}, h.clock.Now()).ok());
  std::vector<JobView> views = restarted.View(h.clock.Now());
  REQUIRE(views.size() == 1);
  // Loaded members are groups again; their contribution is back with them.
  bool saw_b = false;
  for (const GroupView& g : views[0].groups) {
    if (g.group_id != "b") continue;
    saw_b = true;
    CHECK(g.tokens == 192);
    CHECK(g.tokens_total == 192);
    CHECK(g.share == doctest::Approx(0.75));
  }
  CHECK(saw_b);
  // A repeated group in a record is corrupt state, refused.
  rec.tokens.push_back(rec.tokens.front());
  LighthouseCore broken(h.options);
  CHECK(broken.Load({rec}, {}, h.clock.Now()).code() == Code::kDataLoss);
}

TEST_CASE("group size: a group of another size is refused when the quorum forms, with a reason") {
  Harness h;
  REQUIRE(h.Beat("a").ok());
  REQUIRE(h.Beat("b").ok());
  REQUIRE(JoinSized(h, "a", 0, 1).ok());
  CHECK(h.fx.answers.empty());  // b is healthy and has not asked: a waits for it
  REQUIRE(JoinSized(h, "b", 0, 2).ok());
  // A tie between one group of 1 and one of 2: the first by group_id sets the size.
  const Status* refused = h.Rejection("b");
  REQUIRE(refused != nullptr);
  CHECK(refused->code() == Code::kConflict);
  CHECK(refused->reason() == Reason::kGroupSizeMismatch);
  CHECK(refused->message() ==
        "group b has 2 trainers but the quorum's groups have 1: groups of different sizes share "
        "a quorum only when all of them average across sizes (the DiLoCo library does); start "
        "it with --group-size 1");
  CHECK(h.HasEvent("group_refused job=j group=b incarnation=i1 group_size=2 quorum_group_size=1 "
                   "code=GROUP_SIZE_MISMATCH"));
  // The refused group holds up nothing: a goes ahead alone.
  const QuorumAnswer* a = h.Answer("a");
  REQUIRE(a != nullptr);
  CHECK(a->members_shared->size() == 1);
  const GroupView* b = h.Group("b");
  CHECK(b->state == "refused");
  CHECK(b->reason == refused->message());
  CHECK(b->group_size == 2);
}

TEST_CASE("group size: a running quorum keeps its size - a joiner of another is refused") {
  Harness h;
  // Two groups of 2 train; a group of 1 (first by group_id) comes to join them.
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Beat("c").ok());
  REQUIRE(JoinSized(h, "b", 0, 2).ok());
  REQUIRE(JoinSized(h, "c", 0, 2).ok());
  REQUIRE(h.fx.answers.size() == 2);
  REQUIRE(h.Beat("a", 0).ok());
  // The live quorum's size stands even before its members ask again.
  REQUIRE(JoinSized(h, "a", 0, 1).ok());
  REQUIRE(h.Rejection("a") != nullptr);
  CHECK(h.Rejection("a")->reason() == Reason::kGroupSizeMismatch);
  CHECK(h.Group("a")->state == "refused");
  REQUIRE(JoinSized(h, "b", 1, 2).ok());
  REQUIRE(JoinSized(h, "c", 1, 2).ok());
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("a") == nullptr);
  // Asking again is judged afresh (and refused again while the quorum's size stands).
  REQUIRE(JoinSized(h, "a", 0, 1).ok());
  CHECK(h.Group("a")->state == "refused");
  REQUIRE(h.Rejection("a") != nullptr);
  // An agent that sends no size (older agents) is never refused for it.
  REQUIRE(h.Beat("d", 0).ok());
  REQUIRE(JoinSized(h, "d", 0, 0).ok());
  CHECK(h.Rejection("d") == nullptr);
}

TEST_CASE("group size: the quorum's size is the previous members', else the most groups'") {
  GroupStatus a, b, c, d;
  a.group_id = "a", a.group_size = 1;
  b.group_id = "b", b.group_size = 2;
  c.group_id = "c", c.group_size = 2;
  d.group_id = "d", d.group_size = 0;
  std::vector<const GroupStatus*> all = {&a, &b, &c, &d};
  CHECK(QuorumGroupSize(all, {false, false, false, false}) == 2);  // most groups
  CHECK(QuorumGroupSize(all, {true, false, false, false}) == 1);   // the running quorum's
  using List = std::vector<const GroupStatus*>;
  CHECK(QuorumGroupSize(List{&a, &b}, {false, false}) == 1);  // a tie: the first group's
  CHECK(QuorumGroupSize(List{&b, &a}, {false, false}) == 2);
  CHECK(QuorumGroupSize(List{&d}, {false}) == 0);             // nobody said
  CHECK(QuorumGroupSize(List{&d, &c}, {true, false}) == 2);   // a previous member without one
  // A tie among the candidates goes to the size more healthy groups have.
  CHECK(QuorumGroupSize(List{&a, &b}, {false, false}, List{&a, &b, &c}) == 2);
}

TEST_CASE("group size: no refusal on a tie before a first quorum: the size turns with more asks") {
  CoreOptions o;
  o.min_replicas = 2;
  Harness h(o);
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(JoinSized(h, "a", 0, 1).ok());
  REQUIRE(JoinSized(h, "b", 0, 2).ok());
  CHECK(h.fx.rejections.empty());  // 1 against 1: nobody is refused yet, nothing issues
  CHECK(h.fx.answers.empty());
  REQUIRE(JoinSized(h, "c", 0, 2).ok());
  // Two groups of 2 make the size: they form the quorum, and a is refused.
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(h.Answer("b") != nullptr);
  CHECK(h.Answer("c") != nullptr);
  REQUIRE(h.Rejection("a") != nullptr);
  CHECK(h.Rejection("a")->reason() == Reason::kGroupSizeMismatch);
}

TEST_CASE("mixed sizes: groups that all average across sizes share one quorum - each member's size") {
  Harness h;
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(JoinMixed(h, "a", 0, 1).ok());
  REQUIRE(JoinMixed(h, "b", 0, 2).ok());
  REQUIRE(JoinMixed(h, "c", 0, 3).ok());
  CHECK(h.fx.rejections.empty());
  REQUIRE(h.fx.answers.size() == 3);
  CHECK(Sizes(h.Answer("a")) == "a:1,b:2,c:3");
  CHECK(h.Answer("c")->replica_rank == 2);
  CHECK(h.Group("b")->mixed_group_sizes);
  // The next step: a joiner of a fourth size comes in beside them.
  REQUIRE(h.Beat("d").ok());
  REQUIRE(JoinMixed(h, "d", 0, 4).ok());
  for (const char* g : {"a", "b", "c"}) REQUIRE(JoinMixed(h, g, 1, g[0] - 'a' + 1).ok());
  CHECK(h.fx.rejections.empty());
  REQUIRE(h.Answer("d") != nullptr);
  CHECK(Sizes(h.Answer("d")) == "a:1,b:2,c:3,d:4");
  // The sizes and the flag are persisted with the quorum: after a restart the first member
  // to ask sets no one-size rule for the others.
  JobRecordData rec = h.fx.persist_jobs.at(0);
  REQUIRE(rec.members.size() == 4);
  CHECK(rec.members[3].group_size == 4);
  CHECK(rec.members[3].mixed_group_sizes);
  Harness r(h.options);
  REQUIRE(r.core.Load({rec}, {}, h.clock.Now()).ok());
  for (const char* g : {"a", "b", "c", "d"}) {
    REQUIRE(JoinSized(r, g, 2, g[0] - 'a' + 1, "i1", true).ok());
    CHECK(r.fx.rejections.empty());
  }
  REQUIRE(r.Answer("a") != nullptr);
  CHECK(Sizes(r.Answer("a")) == "a:1,b:2,c:3,d:4");
}

TEST_CASE("mixed sizes: a group that cannot mix is refused by a quorum of several sizes, taken by one of its own size") {
  Harness h;
  for (const char* g : {"a", "b"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(JoinMixed(h, "a", 0, 1).ok());
  REQUIRE(JoinMixed(h, "b", 0, 2).ok());
  REQUIRE(h.fx.answers.size() == 2);
  REQUIRE(h.Beat("c").ok());
  REQUIRE(JoinSized(h, "c", 0, 2).ok());  // an older trainer: no mixed_group_sizes
  const Status* refused = h.Rejection("c");
  REQUIRE(refused != nullptr);
  CHECK(refused->reason() == Reason::kGroupSizeMismatch);
  CHECK(refused->message() ==
        "group c has 2 trainers and cannot average across group sizes, but the quorum's groups "
        "have other sizes (use the DiLoCo library, which sets mixed_group_sizes, in every "
        "group, or give every group the same --group-size)");
  CHECK(h.HasEvent("group_refused job=j group=c incarnation=i1 group_size=2 quorum_group_size=0 "
                   "code=GROUP_SIZE_MISMATCH"));

  // A quorum of mixing groups that all have one size takes a group of that size that cannot
  // mix; from then on the quorum keeps that size.
  Harness u;
  for (const char* g : {"a", "b"}) REQUIRE(u.Beat(g).ok());
  REQUIRE(JoinMixed(u, "a", 0, 2).ok());
  REQUIRE(JoinMixed(u, "b", 0, 2).ok());
  REQUIRE(u.fx.answers.size() == 2);
  REQUIRE(u.Beat("c").ok());
  REQUIRE(JoinSized(u, "c", 0, 2).ok());
  CHECK(u.Rejection("c") == nullptr);
  REQUIRE(JoinMixed(u, "a", 1, 2).ok());
  REQUIRE(JoinMixed(u, "b", 1, 2).ok());
  REQUIRE(u.Answer("c") != nullptr);
  CHECK(Sizes(u.Answer("c")) == "a:2,b:2,c:2");
  REQUIRE(u.Beat("d").ok());
  REQUIRE(JoinMixed(u, "d", 0, 3).ok());  // can mix, but c cannot: one size again
  REQUIRE(u.Rejection("d") != nullptr);
  CHECK(u.Rejection("d")->reason() == Reason::kGroupSizeMismatch);
}

TEST_CASE("mixed sizes: every agent of a group must mix - a first quorum with one that cannot has one size") {
  Harness h;
  for (const char* g : {"a", "b", "c"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(JoinMixed(h, "a", 0, 1).ok());
  REQUIRE(JoinMixed(h, "b", 0, 2).ok());
  REQUIRE(JoinSized(h, "c", 0, 2).ok());
  // Not all mix: the one-size rule, and the size most groups have.
  REQUIRE(h.fx.answers.size() == 2);
  CHECK(Sizes(h.Answer("b")) == "b:2,c:2");
  REQUIRE(h.Rejection("a") != nullptr);

  // Two nodes of one group: its asks mix only when both do.
  Harness two;
  REQUIRE(two.Beat("a").ok());
  REQUIRE(two.Beat("b", 0, "i1", 0, 2).ok());
  REQUIRE(two.Beat("b", 0, "i1", 1, 2).ok());
  REQUIRE(JoinMixed(two, "a", 0, 1).ok());
  two.fx = {};
  JoinInput in{two.job, "b", "i1", 0, 2, 0, false, true, "addr-b0", 0, 2, true};
  REQUIRE(two.core.OnJoin(in, two.clock.Now(), &two.fx).ok());
  CHECK(two.Group("b")->mixed_group_sizes == false);  // node 1 has not said so yet
  in.node_rank = 1;
  in.address = "addr-b1";
  REQUIRE(two.core.OnJoin(in, two.clock.Now(), &two.fx).ok());
  CHECK(two.Group("b")->mixed_group_sizes);
  CHECK(two.fx.rejections.empty());
  REQUIRE(two.Answer("a") != nullptr);
  CHECK(Sizes(two.Answer("a")) == "a:1,b:2");
}

TEST_CASE("mixed sizes: a member back from collection has said nothing - it neither mixes nor refuses, and refusals wait for it") {
  CoreOptions o;
  o.heartbeat_timeout = std::chrono::milliseconds(1000);
  o.group_grace = std::chrono::milliseconds(2000);
  Harness h(o);
  for (const char* g : {"a", "b"}) REQUIRE(h.Beat(g).ok());
  REQUIRE(JoinMixed(h, "a", 0, 2).ok());
  REQUIRE(JoinMixed(h, "b", 0, 1).ok());
  REQUIRE(h.fx.answers.size() == 2);
  // b goes silent past its grace period and is collected while a keeps beating.
  bool collected = false;
  for (int i = 0; i < 10 && !collected; ++i) {
    h.clock.Advance(std::chrono::milliseconds(500));
    REQUIRE(h.Beat("a").ok());
    collected = h.HasEvent("group_collected job=j group=b");
    h.Tick();
    collected = collected || h.HasEvent("group_collected job=j group=b");
  }
  REQUIRE(collected);
  // The same life of b comes back (still a member of quorum 1) but has not asked yet.
  REQUIRE(h.Beat("b").ok());
  REQUIRE(h.Beat("c").ok());
  REQUIRE(JoinMixed(h, "c", 0, 1).ok());  // a mixing group of another size than a's
  CHECK(h.Rejection("c") == nullptr);
  CHECK_FALSE(h.HasEvent("group_refused"));
  // A group that cannot mix, among mixing groups of other sizes, would be refused; while b may
  // still say it cannot mix (a one-size rule of its own), that is not final: d waits.
  REQUIRE(h.Beat("d").ok());
  REQUIRE(JoinSized(h, "d", 0, 3).ok());
  CHECK(h.Rejection("d") == nullptr);
  CHECK_FALSE(h.HasEvent("group_refused"));
  // Once b says it mixes, the rule is known and d is refused.
  REQUIRE(JoinMixed(h, "b", 0, 1).ok());
  REQUIRE(h.Rejection("d") != nullptr);
  CHECK(h.Rejection("d")->reason() == Reason::kGroupSizeMismatch);
  CHECK(h.Rejection("c") == nullptr);
}

}  // namespace
}  // namespace lk::lighthouse
