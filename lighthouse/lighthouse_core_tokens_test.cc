// Tests of the lighthouse core for groups of different speeds and sizes: each group's tokens
// per committed step (its contribution, shown and persisted), and the refusal of a group whose
// trainer count differs from the quorum's (GROUP_SIZE_MISMATCH), through the public inputs.
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
                 const std::string& inc = "i1") {
  h.fx = {};
  JoinInput in{h.job, g, inc, 0, 1, step, false, true, "addr-" + g, 0, group_size};
  return h.core.OnJoin(in, h.clock.Now(), &h.fx);
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
        "group b has 2 trainers but the quorum's groups have 1: groups of different sizes cannot "
        "train one job yet (start it with --group-size 1)");
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

}  // namespace
}  // namespace lk::lighthouse
