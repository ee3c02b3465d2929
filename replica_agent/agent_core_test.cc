// Table tests of the agent's core (agent_core.h), driven by a manual clock: one row (at least)
// for every behaviour an agent commit fixed, each named after what it keeps, with the effects
// (answers, asks, board, notices, leave, exit code) and the log lines checked.
#include "replica_agent/agent_core.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>

namespace lk::agent {
namespace {

using K = Effect::Kind;

Quorum Q1(uint32_t id, uint32_t max_step = 0, bool heal = false) {
  Quorum q;
  q.quorum_id = id;
  q.replica_rank = 0;
  q.replica_world_size = 2;
  q.max_step = max_step;
  q.heal = heal;
  q.reason = "all 2 healthy groups asked";
  if (heal) q.heal_sources = {"http://donor:1"};
  return q;
}

struct Harness {
  explicit Harness(uint32_t local = 1, bool board = false, CoreOptions o = {})
      : core(Options(o, board), TimePoint{}), local(local) {}
  static CoreOptions Options(CoreOptions o, bool board) {
    o.group_id = "g";
    o.incarnation = "i1";
    o.board = board;
    return o;
  }

  AgentCore core;
  uint32_t local;
  Effects fx;
  TimePoint now{};

  void Hello() {
    for (uint32_t r = 0; r < local; ++r) REQUIRE(core.OnHello(r, local, 100 + int(r), &fx).ok());
  }
  void Poll(uint32_t rank, uint32_t step, bool resumed = false,
            std::optional<BoardTicket> ready = std::nullopt, uint32_t consumed = 0) {
    PollInput in;
    in.group_rank = rank;
    in.group_size = local;
    in.step = step;
    in.pid = 100 + int(rank);
    in.resumed = resumed;
    in.board_ready = ready;
    in.board_consumed = consumed;
    core.OnPoll(in, now, &fx);
  }
  void PollAll(uint32_t step) {
    for (uint32_t r = 0; r < local; ++r) Poll(r, step);
  }
  void AskOk(uint32_t step, const Quorum& q) {
    AskResult a;
    a.serial = core.state().ask.serial;
    a.step = step;
    a.quorum = q;
    core.OnAskResult(a, &fx);
  }
  void AskFails(uint32_t step, Status st) {
    AskResult a;
    a.serial = core.state().ask.serial;
    a.step = step;
    a.status = std::move(st);
    core.OnAskResult(a, &fx);
  }
  Status CommitAll(uint32_t step, std::string hash = "h") {
    for (uint32_t r = 0; r < local; ++r) {
      CommitInput c;
      c.group_rank = r;
      c.step = step;
      c.state_hash = hash;
      auto st = core.OnCommit(c, &fx);
      if (!st.ok()) return st.status();
    }
    return Status::Ok();
  }
  void Beat(bool round_pending = false) {
    HeartbeatAnswer h;
    h.round_pending = round_pending;
    core.OnHeartbeat(h, &fx);
  }
  void Lost(uint32_t qid, bool self = false, bool evicted = false) {
    LossInput l;
    l.quorum_id = qid;
    l.names_this_group = self;
    l.evicted = evicted;
    l.who = "other:left";
    core.OnQuorumLost(l, &fx);
  }
  // Through the first quorum: hello, polls of step 0, the ask, its answer.
  void Start(uint32_t qid = 1) {
    Hello();
    PollAll(0);
    AskOk(0, Q1(qid));
    fx.clear();
  }

  std::vector<Effect> Of(K k) const {
    std::vector<Effect> out;
    for (const auto& e : fx) {
      if (e.kind == k) out.push_back(e);
    }
    return out;
  }
  size_t Count(K k) const { return Of(k).size(); }
  bool Logged(std::string_view prefix) const {
    for (const auto& e : fx) {
      if (e.kind == K::kLog && e.text.rfind(prefix, 0) == 0) return true;
    }
    return false;
  }
  size_t LogCount(std::string_view prefix) const {
    size_t n = 0;
    for (const auto& e : fx) n += e.kind == K::kLog && e.text.rfind(prefix, 0) == 0;
    return n;
  }
  // The position of the first effect of `k` (fx.size() when none).
  size_t At(K k) const {
    for (size_t i = 0; i < fx.size(); ++i) {
      if (fx[i].kind == k) return i;
    }
    return fx.size();
  }
  Ask::Kind ask() const { return core.state().ask.kind; }
};

TEST_CASE("names on the wire stay") {
  CHECK(PhaseName(Phase::kStarting) == "starting");
  CHECK(PhaseName(Phase::kQuorum) == "quorum");
  CHECK(PhaseName(Phase::kTraining) == "training");
  CHECK(PhaseName(Phase::kDraining) == "draining");
  CHECK(PhaseName(Phase::kPeerWait) == "peer_wait");
  CHECK(NoticeReasonName(NoticeReason::kQuorumLost) == "quorum_lost");
  CHECK(NoticeReasonName(NoticeReason::kAgentExiting) == "agent_exiting");
  CHECK(LeaveReasonName(LeaveReason::kNoTrainers) == "no_trainers");
}

TEST_CASE("first poll: the barrier of the node's trainers, then one fresh ask, answered once") {
  Harness h(2);
  h.Hello();
  h.Poll(0, 0);
  CHECK(h.Count(K::kAsk) == 0);  // one trainer of two at the boundary
  h.Poll(1, 0);
  auto asks = h.Of(K::kAsk);
  REQUIRE(asks.size() == 1);
  CHECK(asks[0].step == 0);
  CHECK(asks[0].fresh);  // no state in this life, step 0
  CHECK(asks[0].group_size == 2);
  CHECK(asks[0].ask_kind == Effect::AskKind::kForTrainers);
  CHECK(h.core.state().phase == Phase::kQuorum);
  h.fx.clear();
  h.AskOk(0, Q1(7, 0, /*heal=*/true));
  auto answers = h.Of(K::kAnswerPoll);
  REQUIRE(answers.size() == 2);
  CHECK(answers[0].answer.quorum_id == 7);
  CHECK(answers[0].answer.reconfigure);
  CHECK(answers[0].answer.heal);
  CHECK(answers[0].answer.heal_sources == std::vector<std::string>{"http://donor:1"});
  CHECK(h.Logged("quorum quorum_id=7 "));
  CHECK(h.core.state().phase == Phase::kTraining);
  CHECK(h.core.state().had_state);  // a heal gives the node state
}

TEST_CASE("mixed group sizes are asked for only when every local trainer averages across sizes") {
  Harness h(2);
  h.Hello();
  PollInput in;
  in.group_size = 2;
  in.mixed_group_sizes = true;
  in.group_rank = 0;
  h.core.OnPoll(in, h.now, &h.fx);
  in.group_rank = 1;
  in.mixed_group_sizes = false;
  h.core.OnPoll(in, h.now, &h.fx);
  REQUIRE(h.Count(K::kAsk) == 1);
  CHECK(!h.Of(K::kAsk)[0].mixed_group_sizes);
}

TEST_CASE("registration refusals") {
  struct Row {
    uint32_t rank, size;
    const char* what;
  };
  Row rows[] = {{0, 0, "group_size must be at least 1"},
                {2, 2, "group_rank 2 is not below group_size 2"},
                {0, 3, "group_size 3 is not a multiple of the group's 2 nodes"}};
  for (const Row& r : rows) {
    CoreOptions o;
    o.nodes = 2;
    Harness h(1, false, o);
    Status st = h.core.OnHello(r.rank, r.size, 1, &h.fx);
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK(st.message() == r.what);
  }
  Harness h(1);
  REQUIRE(h.core.OnHello(0, 1, 1, &h.fx).ok());
  CHECK(h.core.OnHello(0, 2, 1, &h.fx).message() ==
        "group_size 2 differs from the 1 other trainers gave");
  CHECK(h.core.OnHello(1, 1, 1, &h.fx).code() == Code::kInvalidArgument);
}

TEST_CASE(
    "ask ahead: after the node commits, fetched, put on the board, and the poll needs no ask") {
  Harness h(1, /*board=*/true);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  // The commit first, then the ask ahead (which the shell holds until the commit is delivered).
  REQUIRE(h.At(K::kQueueCommit) < h.At(K::kAsk));
  CHECK(h.Of(K::kAsk)[0].ask_kind == Effect::AskKind::kAhead);
  CHECK(!h.core.AskMayGo(/*commit_pending=*/true));
  CHECK(h.core.AskMayGo(/*commit_pending=*/false));
  CHECK(h.core.state().phase == Phase::kTraining);  // an ask ahead is no quorum phase
  h.fx.clear();
  h.AskOk(1, Q1(1, 1));
  CHECK(h.ask() == Ask::Kind::kFetched);
  auto pub = h.Of(K::kPublishBoard);
  REQUIRE(pub.size() == 1);  // unchanged quorum, no heal: the board carries it
  CHECK(pub[0].board_answer.step == 1);
  CHECK(pub[0].board_answer.quorum_id == 1);
  CHECK(h.core.WatchTarget() == 1u);
  h.fx.clear();
  // The trainer takes it from the board: the take makes it the trainers' quorum.
  BoardLook look;
  look.taken = BoardTicket{1, 1};
  h.core.OnBoardLook(look, &h.fx);
  CHECK(h.ask() == Ask::Kind::kIdle);
  CHECK(h.core.state().board.handed == BoardTicket{1, 1});
  CHECK(h.core.state().trainers.at(0).polled_step == 1u);
}

TEST_CASE("ask ahead is off with --ask-ahead=false, and during a drain") {
  CoreOptions o;
  o.ask_ahead = false;
  Harness h(1, false, o);
  h.Start();
  REQUIRE(h.CommitAll(1).ok());
  CHECK(h.Count(K::kAsk) == 0);
  h.PollAll(1);
  REQUIRE(h.Count(K::kAsk) == 1);
  CHECK(h.Of(K::kAsk)[0].ask_kind == Effect::AskKind::kForTrainers);
  Harness d(1);
  d.Start();
  d.core.OnDrain(LeaveReason::kSignal, "cancelled", false, &d.fx);
  REQUIRE(d.CommitAll(1).ok());  // the trainer's last commit still goes to the lighthouse
  CHECK(d.Count(K::kQueueCommit) == 1);
  CHECK(d.Count(K::kAsk) == 0);
}

TEST_CASE(
    "a changed quorum fetched ahead goes over the socket: no board answer, the poll gets it") {
  Harness h(1, true);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.AskOk(1, Q1(2, 1));
  CHECK(h.Count(K::kPublishBoard) == 0);
  h.fx.clear();
  h.PollAll(1);
  CHECK(h.Count(K::kAsk) == 0);
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].answer.quorum_id == 2);
  CHECK(a[0].answer.reconfigure);
}

TEST_CASE("a poll while the ask for its step is on its way takes that ask's answer") {
  Harness h(1);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  const uint64_t serial = h.core.state().ask.serial;
  h.fx.clear();
  h.PollAll(1);
  // No second ask: the one ahead now answers the trainers, and may go before the commit is in.
  REQUIRE(h.Count(K::kAsk) == 1);
  CHECK(h.Of(K::kAsk)[0].id == serial);
  CHECK(h.Of(K::kAsk)[0].ask_kind == Effect::AskKind::kForTrainers);
  CHECK(h.core.AskMayGo(/*commit_pending=*/true));
  CHECK(h.ask() == Ask::Kind::kForTrainers);
  CHECK(h.core.state().phase == Phase::kQuorum);
  h.AskOk(1, Q1(1, 1));
  CHECK(h.Count(K::kAnswerPoll) == 1);
}

TEST_CASE("an answer for a step nobody polls any more is dropped") {
  Harness h(1);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  REQUIRE(h.CommitAll(2).ok());  // the ask for 1 is superseded by the ask for 2
  h.fx.clear();
  h.AskOk(1, Q1(1, 1));
  CHECK(h.ask() == Ask::Kind::kAhead);
  CHECK(h.core.state().ask.step == 2);
}

TEST_CASE("a resumed poll is answered again only while its quorum is still the node's (da582a2)") {
  struct Row {
    const char* name;
    int change;  // 0: nothing, 1: its quorum lost, 2: another quorum since, 3: a drain
    bool resent;
  };
  Row rows[] = {{"unchanged", 0, true}, {"quorum lost", 1, false}, {"draining", 3, false}};
  for (const Row& r : rows) {
    CAPTURE(r.name);
    Harness h(1);
    h.Start(1);
    if (r.change == 1) h.Lost(1);
    if (r.change == 3) h.core.OnDrain(LeaveReason::kSignal, "cancelled", false, &h.fx);
    h.fx.clear();
    h.Poll(0, 0, /*resumed=*/true);
    auto a = h.Of(K::kAnswerPoll);
    CHECK(h.Logged("poll_answer_resent") == r.resent);
    if (r.resent) {
      REQUIRE(a.size() == 1);
      CHECK(a[0].incoming);
      CHECK(a[0].answer.quorum_id == 1);
      CHECK(h.Count(K::kAsk) == 0);
    } else if (r.change == 3) {
      REQUIRE(a.size() == 1);
      CHECK(a[0].answer.drain);
    } else {
      CHECK(a.empty());
      CHECK(h.Count(K::kAsk) == 1);  // a new round is what it needs
    }
  }
}

TEST_CASE(
    "a second poll of a rank supersedes its waiting one; steps below its commit are refused") {
  Harness h(2);
  h.Hello();
  h.Poll(0, 0);
  h.Poll(0, 0);
  auto refused = h.Of(K::kRefusePoll);
  REQUIRE(refused.size() == 1);
  CHECK(!refused[0].incoming);
  CHECK(refused[0].status.reason() == Reason::kRequestSuperseded);
  h.fx.clear();
  h.Poll(1, 3);
  refused = h.Of(K::kRefusePoll);
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].incoming);
  CHECK(refused[0].status.reason() == Reason::kStepDisagreement);
  h.Poll(1, 0);
  h.AskOk(0, Q1(1));
  REQUIRE(h.CommitAll(1).ok());
  h.fx.clear();
  h.Poll(0, 0);
  refused = h.Of(K::kRefusePoll);
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].status.reason() == Reason::kWrongStep);
}

TEST_CASE("lighthouse_unreachable continuing: once per outage, whatever failed first (e61d4cb)") {
  Harness h(1);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());  // ask ahead for 1
  h.AskFails(1, Status(Code::kUnavailable, "down"));
  CHECK(h.Count(K::kAnswerPoll) == 0);  // an ask ahead has no trainer waiting: it retries
  CHECK(h.LogCount("lighthouse_unreachable continuing") == 0);
  h.PollAll(1);
  h.AskFails(1, Status(Code::kUnavailable, "down"));
  CHECK(h.LogCount("lighthouse_unreachable continuing quorum_id=1") == 1);
  CHECK(h.ask() == Ask::Kind::kContinued);
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].answer.quorum_id == 1);  // on with the quorum it has
  CHECK(!a[0].answer.reconfigure);
  // The next boundary, still away: answered again, not logged again.
  REQUIRE(h.CommitAll(2).ok());
  h.PollAll(2);
  h.AskFails(2, Status(Code::kUnavailable, "down"));
  CHECK(h.LogCount("lighthouse_unreachable continuing") == 1);
  CHECK(h.Count(K::kAnswerPoll) == 2);
  // The lighthouse answers; the next outage says it again.
  REQUIRE(h.CommitAll(3).ok());
  h.AskOk(3, Q1(1, 3));
  h.PollAll(3);
  REQUIRE(h.CommitAll(4).ok());
  h.AskFails(4, Status(Code::kUnavailable, "down"));
  h.PollAll(4);
  h.AskFails(4, Status(Code::kUnavailable, "down"));
  CHECK(h.LogCount("lighthouse_unreachable continuing") == 2);
}

TEST_CASE("no continuing on a lost quorum, during a drain, or without any quorum") {
  Harness h(1);
  h.Start(1);
  h.Lost(1);
  h.PollAll(0);
  h.fx.clear();
  h.AskFails(0, Status(Code::kUnavailable, "down"));
  CHECK(h.Count(K::kAnswerPoll) == 0);
  CHECK(h.ask() == Ask::Kind::kForTrainers);  // retried
  Harness fresh(1);
  fresh.Hello();
  fresh.PollAll(0);
  fresh.AskFails(0, Status(Code::kUnavailable, "down"));
  CHECK(fresh.Count(K::kAnswerPoll) == 0);
}

TEST_CASE("no continuing on a quorum superseded by a newer one that was lost") {
  Harness h(1, true);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.AskOk(1, Q1(2, 1));  // fetched ahead
  h.Lost(2);
  h.PollAll(1);
  h.fx.clear();
  h.AskFails(1, Status(Code::kUnavailable, "connection reset"));
  CHECK(h.Count(K::kAnswerPoll) == 0);
  CHECK_FALSE(h.Logged("lighthouse_unreachable continuing"));
  CHECK(h.ask() == Ask::Kind::kForTrainers);  // retried
}

TEST_CASE("an ask names the quorum the trainers were last handed") {
  Harness h(1, true);
  Harness fresh(1);
  fresh.Hello();
  fresh.PollAll(0);
  REQUIRE(fresh.Count(K::kAsk) == 1);
  CHECK(fresh.Of(K::kAsk)[0].quorum_id == 0);
  h.Start(3);
  h.fx.clear();
  REQUIRE(h.CommitAll(1).ok());
  REQUIRE(h.Count(K::kAsk) == 1);  // ahead, for step 1
  CHECK(h.Of(K::kAsk)[0].quorum_id == 3);
}

TEST_CASE(
    "a continued group asks for its step after all when a heartbeat says round_pending (443c136)") {
  Harness h(1);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.PollAll(1);
  h.AskFails(1, Status(Code::kUnavailable, "down"));
  REQUIRE(h.ask() == Ask::Kind::kContinued);
  h.fx.clear();
  h.Beat(false);  // the lighthouse is back, no round: the continuation stands (bac41d5)
  CHECK(h.fx.empty());
  CHECK(!h.core.state().lost_quorums.count(1));
  h.Beat(true);
  CHECK(h.Logged("ask_behind step=1 quorum_id=1 reason=round_pending"));
  auto asks = h.Of(K::kAsk);
  REQUIRE(asks.size() == 1);
  CHECK(asks[0].ask_kind == Effect::AskKind::kBehind);
  CHECK(asks[0].step == 1);
  SUBCASE("answered on the trainers' quorum: nothing changes for them") {
    h.fx.clear();
    h.AskOk(1, Q1(1, 1));
    CHECK(h.ask() == Ask::Kind::kIdle);
    CHECK(h.Count(K::kAnswerPoll) == 0);
    CHECK(!h.core.state().lost_quorums.count(1));
  }
  SUBCASE(
      "answered on another quorum: theirs is over, and their poll of the step gets the new one") {
    h.core.OnNoticeWait(9, 1, &h.fx);
    h.fx.clear();
    h.AskOk(1, Q1(2, 1));
    CHECK(h.core.state().lost_quorums.count(1));
    auto n = h.Of(K::kAnswerNotice);
    REQUIRE(n.size() == 1);
    CHECK(n[0].notice.lost);
    CHECK(n[0].notice.reason == "quorum_lost");
    CHECK(h.ask() == Ask::Kind::kFetched);
    h.fx.clear();
    h.PollAll(1);
    auto a = h.Of(K::kAnswerPoll);
    REQUIRE(a.size() == 1);
    CHECK(a[0].answer.quorum_id == 2);
  }
  SUBCASE("a newer ask cancels the behind call") {
    h.fx.clear();
    REQUIRE(h.CommitAll(2).ok());
    CHECK(h.At(K::kCancelBehindAsk) < h.At(K::kAsk));
    CHECK(h.ask() == Ask::Kind::kAhead);
  }
  SUBCASE("the trainers come back to its step: its answer is theirs") {
    h.PollAll(1);
    CHECK(h.ask() == Ask::Kind::kForTrainers);
    h.fx.clear();
    h.AskOk(1, Q1(1, 1));
    CHECK(h.Count(K::kAnswerPoll) == 1);
  }
}

TEST_CASE("a commit ends the continuation: no behind ask at the next round_pending") {
  CoreOptions o;
  o.ask_ahead = false;
  Harness h(1, false, o);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.PollAll(1);
  h.AskFails(1, Status(Code::kUnavailable, "down"));
  REQUIRE(h.CommitAll(2).ok());
  CHECK(h.ask() == Ask::Kind::kIdle);
  h.fx.clear();
  h.Beat(true);
  CHECK(h.Count(K::kAsk) == 0);
}

// Found by the agents' simulation (tests/sim/agent_sim.cc): without asks ahead, a behind ask
// for step 1 stayed out after the trainers committed step 2 on their quorum; the lighthouse then
// formed a quorum at step 1 with this group in it, and its other members waited in that step
// for good while this group asked for step 2.
TEST_CASE("a behind ask is withdrawn once the trainers commit past its step") {
  CoreOptions o;
  o.ask_ahead = false;
  Harness h(1, false, o);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.PollAll(1);
  h.AskFails(1, Status(Code::kUnavailable, "down"));
  REQUIRE(h.ask() == Ask::Kind::kContinued);
  h.Beat(true);
  REQUIRE(h.ask() == Ask::Kind::kBehind);
  h.fx.clear();
  REQUIRE(h.CommitAll(2).ok());
  CHECK(h.Count(K::kCancelBehindAsk) == 1);
  CHECK(h.Logged("ask_behind_withdrawn step=1 committed_step=2"));
  CHECK(h.ask() == Ask::Kind::kIdle);
  CHECK(!h.core.PendingAsk(false));
}

// Found by the agents' simulation: node 1's answer was cut by its deadline as the quorum formed,
// node 0's trainers healed on theirs to step 10, the quorum was lost, and node 1 asked again
// with its trainers' step 9, refused STEP_DISAGREEMENT for good.
TEST_CASE("a node refused for an earlier step than its peer node's asks without state") {
  Harness h(1);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.PollAll(1);
  REQUIRE(h.ask() == Ask::Kind::kForTrainers);
  h.fx.clear();
  h.AskFails(1, Refuse(Code::kConflict, Reason::kStepDisagreement,
                       "agents of group g disagree on the step: node 1 asked with step 2, node 0 "
                       "with step 1"));
  CHECK(h.Logged("step_disagreement step=1 action=ask_without_state"));
  CHECK(h.Count(K::kExit) == 0);
  CHECK(h.Count(K::kLeave) == 0);
  auto again = h.core.PendingAsk(false);
  REQUIRE(again);
  CHECK(again->fresh);  // without state: the lighthouse heals the group as a whole
  CHECK(again->step == 1);
  h.fx.clear();
  h.AskOk(1, Q1(2, 2, /*heal=*/true));
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].answer.heal);
  CHECK(!h.core.state().without_state);
}

// Found by the agents' simulation: of a node's two trainers, one healed to step 3 on the
// answer; the other's poll timed out as the answer was on the way, the quorum was lost, and its
// resumed poll of step 0 went to a new round: the node's trainers polled steps 3 and 0 for good.
TEST_CASE("a resumed poll gets the heal its peers took even after the quorum was lost") {
  Harness h(2);
  h.Hello();
  h.PollAll(0);
  h.AskOk(0, Q1(4, 3, /*heal=*/true));
  REQUIRE(h.Count(K::kAnswerPoll) == 2);
  h.Lost(4);
  h.fx.clear();
  h.Poll(1, 0, /*resumed=*/true);
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].answer.heal);
  CHECK(a[0].answer.max_step == 3);
  CHECK(a[0].answer.quorum_id == 4);
  CHECK(h.Logged("poll_answer_resent group_rank=1 step=0 quorum_id=4"));
}

TEST_CASE("the board's withdraw against a take: a take that came first stands for the node") {
  SUBCASE("the take seen before the withdraw") {
    Harness h(1, true);
    h.Start(1);
    REQUIRE(h.CommitAll(1).ok());
    h.AskOk(1, Q1(1, 1));
    REQUIRE(h.Count(K::kPublishBoard) == 1);
    BoardLook look;
    look.taken = BoardTicket{5, 1};
    h.core.OnBoardLook(look, &h.fx);
    h.fx.clear();
    h.Lost(1);
    CHECK(h.Count(K::kWithdrawBoard) == 0);  // nothing is up any more
    CHECK(h.Count(K::kAsk) == 0);            // the trainers have the step's answer; they poll again
  }
  SUBCASE("the take raced the withdraw: the shell's next look brings it") {
    Harness h(1, true);
    h.Start(1);
    REQUIRE(h.CommitAll(1).ok());
    h.AskOk(1, Q1(1, 1));
    h.core.OnNoticeWait(3, 1, &h.fx);
    h.fx.clear();
    h.Lost(1);
    auto w = h.Of(K::kWithdrawBoard);
    REQUIRE(w.size() == 1);
    CHECK(w[0].step == 1);
    CHECK(w[0].quorum_id == 1);
    CHECK(h.ask() == Ask::Kind::kAhead);  // assumed withdrawn: fetch another
    h.fx.clear();
    BoardLook look;
    look.taken = BoardTicket{5, 1};
    h.core.OnBoardLook(look, &h.fx);
    CHECK(h.core.state().quorum->quorum_id == 1);  // the taken answer is the trainers'
    CHECK(h.ask() == Ask::Kind::kIdle);            // and the ask ahead for its step is moot
    CHECK(h.core.state().trainers.at(0).polled_step == 1u);
    // Their step on it fails (its notice says lost) and they poll the step again: a new round.
    h.Poll(0, 1, false, std::nullopt, /*consumed=*/5);
    CHECK(h.Count(K::kAsk) == 1);
  }
  SUBCASE("the withdraw came first: the next look forgets the answer") {
    Harness h(1, true);
    h.Start(1);
    REQUIRE(h.CommitAll(1).ok());
    h.AskOk(1, Q1(1, 1));
    h.Lost(1);
    h.core.OnBoardLook(BoardLook{}, &h.fx);
    CHECK(!h.core.state().board.published);
    CHECK(h.ask() == Ask::Kind::kAhead);
  }
}

TEST_CASE("a socket poll takes the board's answer for its step, once per trainer") {
  Harness h(2, true);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.AskOk(1, Q1(1, 1));
  REQUIRE(h.Count(K::kPublishBoard) == 1);
  h.fx.clear();
  // Rank 0 polls over the socket while the answer is up: it is taken for it.
  h.Poll(0, 1, false, BoardTicket{4, 1}, 0);
  CHECK(h.At(K::kTakeFor) < h.At(K::kAnswerPoll));
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].incoming);
  CHECK(a[0].answer.quorum_id == 1);
  REQUIRE(h.Count(K::kSetConsumed) == 1);
  CHECK(h.Of(K::kSetConsumed)[0].gen == 4);
  // Rank 1 read it off the board already (consumed 4): its socket poll is a retry, a new round.
  h.fx.clear();
  h.Poll(1, 1, false, std::nullopt, 4);
  CHECK(h.Count(K::kAnswerPoll) == 0);
}

TEST_CASE("no board answer while a trainer waits on the socket: the barrier answers it there") {
  Harness h(2, true);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.Poll(0, 1);  // over the socket, before the ask ahead came back
  h.AskOk(1, Q1(1, 1));
  CHECK(h.Count(K::kPublishBoard) == 0);
  h.fx.clear();
  h.Poll(1, 1);
  CHECK(h.Count(K::kAsk) == 0);
  CHECK(h.Count(K::kAnswerPoll) == 2);
}

TEST_CASE("ask ahead withdrawn and fetched again when its quorum is lost before the poll") {
  Harness h(1, true);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.AskOk(1, Q1(1, 1));
  h.fx.clear();
  h.Lost(1);
  CHECK(h.Logged("quorum_lost quorum_id=1"));
  REQUIRE(h.At(K::kWithdrawBoard) < h.At(K::kAsk));
  CHECK(h.Of(K::kAsk)[0].ask_kind == Effect::AskKind::kAhead);
  CHECK(h.Of(K::kAsk)[0].step == 1);
  SUBCASE("its own leave names it: no new ask") {
    Harness g(1, true);
    g.Start(1);
    REQUIRE(g.CommitAll(1).ok());
    g.AskOk(1, Q1(1, 1));
    g.fx.clear();
    g.Lost(1, /*self=*/true);
    CHECK(g.Count(K::kAsk) == 0);
  }
}

TEST_CASE("a loss of a quorum older than the one fetched ahead is no loss for the trainers") {
  Harness h(1);
  h.Start(1);
  REQUIRE(h.CommitAll(1).ok());
  h.AskOk(1, Q1(2, 1));
  h.core.OnNoticeWait(1, 1, &h.fx);
  h.fx.clear();
  h.Lost(1);
  CHECK(h.fx.empty());
  CHECK(!h.core.state().lost_quorums.count(1));
}

TEST_CASE("notices: a lost quorum, a newer quorum, a drain, the timeout") {
  Harness h(1);
  h.Start(1);
  h.core.OnNoticeWait(1, 1, &h.fx);
  h.core.OnNoticeWait(2, 1, &h.fx);
  CHECK(h.Count(K::kAnswerNotice) == 0);
  h.core.OnNoticeTimeout(2, &h.fx);
  auto n = h.Of(K::kAnswerNotice);
  REQUIRE(n.size() == 1);
  CHECK(n[0].id == 2);
  CHECK(!n[0].notice.lost);
  CHECK(n[0].notice.reason.empty());
  h.fx.clear();
  h.core.OnNoticeTimeout(2, &h.fx);  // answered already
  CHECK(h.fx.empty());
  h.core.OnNoticeWait(3, 0, &h.fx);  // a quorum older than the node's: lost
  REQUIRE(h.Count(K::kAnswerNotice) == 1);
  CHECK(h.Of(K::kAnswerNotice)[0].notice.why == NoticeReason::kQuorumLost);
  h.fx.clear();
  h.core.OnDrain(LeaveReason::kSignal, "preempted", true, &h.fx);
  n = h.Of(K::kAnswerNotice);
  REQUIRE(n.size() == 1);
  CHECK(n[0].notice.drain);
  CHECK(n[0].notice.checkpoint_now);
  CHECK(n[0].notice.reason == "preempted");
}

TEST_CASE(
    "drain without a checkpoint: polls answered, leave at once, then the trainers, then exit 0") {
  Harness h(1, true);
  h.Start(1);
  h.PollAll(1);  // waits (asks)
  h.fx.clear();
  h.core.OnDrain(LeaveReason::kSignal, "cancelled", false, &h.fx);
  CHECK(h.Logged("drain reason=cancelled checkpoint=false trainers=1"));
  CHECK(h.At(K::kCloseBoard) < h.At(K::kAnswerPoll));
  CHECK(h.At(K::kAnswerPoll) < h.At(K::kLeave));
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].answer.drain);
  CHECK(a[0].answer.reason == "cancelled");
  CHECK(h.Of(K::kLeave)[0].text == "cancelled");
  CHECK(h.Count(K::kWaitTrainers) == 0);
  CHECK(h.core.ReportedPhase() == Phase::kDraining);
  h.fx.clear();
  h.core.OnLeaveDone(&h.fx);
  CHECK(h.Count(K::kWaitTrainers) == 1);
  h.fx.clear();
  h.core.OnTrainersGone(true, &h.fx);
  REQUIRE(h.Count(K::kExit) == 1);
  CHECK(h.Of(K::kExit)[0].code == 0);
  // A second drain is no drain.
  h.fx.clear();
  h.core.OnDrain(LeaveReason::kDrained, "drained", false, &h.fx);
  CHECK(h.fx.empty());
}

TEST_CASE("drain with a checkpoint: the trainers save and exit first, then the leave, then exit") {
  for (bool all_exited : {true, false}) {
    CAPTURE(all_exited);
    Harness h(1);
    h.Start(1);
    h.core.OnDrain(LeaveReason::kSignal, "preempted", true, &h.fx);
    CHECK(h.Count(K::kLeave) == 0);
    CHECK(h.Count(K::kWaitTrainers) == 1);
    h.fx.clear();
    h.PollAll(1);  // a poll during the drain says drain and checkpoint_now
    REQUIRE(h.Count(K::kAnswerPoll) == 1);
    CHECK(h.Of(K::kAnswerPoll)[0].answer.checkpoint_now);
    h.fx.clear();
    h.core.OnTrainersGone(all_exited, &h.fx);
    CHECK(h.Logged("checkpoint_not_confirmed reason=drain_timeout") == !all_exited);
    auto leave = h.Of(K::kLeave);
    REQUIRE(leave.size() == 1);
    CHECK(leave[0].checkpoint);
    CHECK(leave[0].text == "preempted");
    h.fx.clear();
    h.core.OnLeaveDone(&h.fx);
    REQUIRE(h.Count(K::kExit) == 1);
    CHECK(h.Of(K::kExit)[0].code == 0);
  }
}

TEST_CASE("a trainer that dies during a drain is part of it; outside one, the group fails") {
  struct Row {
    const char* name;
    int before;  // 0: nothing, 1: drain, 2: signal arrived, 3: goodbye
    bool crash;
  };
  Row rows[] = {{"running", 0, true},
                {"draining", 1, false},
                {"signalled", 2, false},
                {"said goodbye", 3, false}};
  for (const Row& r : rows) {
    CAPTURE(r.name);
    Harness h(2);
    h.Start(1);
    if (r.before == 1) h.core.OnDrain(LeaveReason::kDrained, "drained", false, &h.fx);
    if (r.before == 2) h.core.OnSignalArrived();
    if (r.before == 3) REQUIRE(h.core.OnGoodbye(0, &h.fx).ok());
    h.fx.clear();
    h.core.OnTrainerExited(0, 100, &h.fx);
    CHECK(h.Logged(fmt::format("trainer_exited group_rank=0 pid=100 during_drain={}", !r.crash)));
    CHECK(h.Logged("group_failed reason=trainer_crashed") == r.crash);
    CHECK((h.Count(K::kSignalTrainers) == 1) == r.crash);
    if (r.crash) {
      CHECK(h.Of(K::kLeave)[0].text == "trainer_crashed");
      h.core.OnLeaveDone(&h.fx);
      h.core.OnTrainersGone(true, &h.fx);
      CHECK(h.Of(K::kExit).back().code == 3);
    }
    CHECK(h.core.state().trainers.at(0).exited);
  }
}

TEST_CASE("every local trainer said goodbye: the group leaves as finished and exits 0") {
  Harness h(2);
  h.Start(1);
  REQUIRE(h.core.OnGoodbye(0, &h.fx).ok());
  CHECK(h.Count(K::kLeave) == 0);
  REQUIRE(h.core.OnGoodbye(1, &h.fx).ok());
  REQUIRE(h.Count(K::kLeave) == 1);
  CHECK(h.Of(K::kLeave)[0].text == "finished");
  CHECK(h.core.OnGoodbye(5, &h.fx).message() == "group_rank 5 never said hello");
}

TEST_CASE("another node of the group left it finished: this node finishes and exits 0") {
  // Via a heartbeat's refusal, or the refusal of an ask its trainers made at the final step.
  for (int via : {0, 1}) {
    CAPTURE(via);
    Harness h(1);
    h.Start(1);
    h.PollAll(1);
    h.fx.clear();
    const Status finished = Refuse(Code::kConflict, Reason::kGroupFinished,
                                   "incarnation i1 of group g left (finished)");
    if (via == 0) {
      HeartbeatAnswer hb;
      hb.ok = false;
      hb.error = finished;
      h.core.OnHeartbeat(hb, &h.fx);
    } else {
      h.AskFails(1, finished);
    }
    CHECK(h.Logged("group_finished_by_peer"));
    CHECK_FALSE(h.Logged("group_failed"));
    CHECK(h.Count(K::kSignalTrainers) == 0);  // its trainers end on their own
    REQUIRE(h.Count(K::kLeave) == 1);
    CHECK(h.Of(K::kLeave)[0].text == "finished");
    // A second refusal (the heartbeat after the ask's) changes nothing; it is only logged.
    HeartbeatAnswer again;
    again.ok = false;
    again.error = finished;
    h.fx.clear();
    h.core.OnHeartbeat(again, &h.fx);
    REQUIRE(h.fx.size() == 1);
    CHECK(h.Logged("group_left_during_drain"));
    h.core.OnLeaveDone(&h.fx);
    h.core.OnTrainerExited(0, 100, &h.fx);
    CHECK(h.Logged("trainer_exited group_rank=0 pid=100 during_drain=true"));
    h.core.OnTrainersGone(true, &h.fx);
    REQUIRE(h.Count(K::kExit) == 1);
    CHECK(h.Of(K::kExit)[0].code == 0);
  }
}

TEST_CASE("a GROUP_LEFT heard while draining is the drain's own leave: no failure, exit 0") {
  // A heartbeat or ask that crossed the node's own leave (the Python chaos test's reference run,
  // where SIGTERM's drain ended in exit 3), or, in a drain with a save, another node's leave.
  struct Row {
    const char* name;
    bool checkpoint;
    bool via_ask;
    Reason reason;
  };
  const Row rows[] = {{"leave, heartbeat answer", false, false, Reason::kGroupLeft},
                      {"leave, ask answer", false, true, Reason::kGroupLeft},
                      {"save, another node left", true, false, Reason::kGroupLeft},
                      {"save, another node finished", true, false, Reason::kGroupFinished},
                      {"left, then forgotten", false, false, Reason::kStaleIncarnation},
                      {"replaced while saving", true, true, Reason::kIncarnationReplaced}};
  for (const Row& r : rows) {
    CAPTURE(r.name);
    Harness h(1);
    h.Start(1);
    h.PollAll(1);
    h.core.OnDrain(LeaveReason::kSignal, r.checkpoint ? "preempted" : "cancelled", r.checkpoint,
                   &h.fx);
    h.fx.clear();
    const Status left = Refuse(Code::kConflict, r.reason, "incarnation i1 of group g left");
    for (int i = 0; i < 2; ++i) {
      if (r.via_ask) {
        h.AskFails(1, left);
      } else {
        HeartbeatAnswer hb;
        hb.ok = false;
        hb.error = left;
        h.core.OnHeartbeat(hb, &h.fx);
      }
    }
    CHECK_FALSE(h.Logged("group_failed"));
    CHECK_FALSE(h.Logged("group_finished_by_peer"));
    CHECK(h.Count(K::kSignalTrainers) == 0);
    CHECK(h.core.state().exit_code == -1);
    // Logged once, however many answers say it.
    CHECK(h.LogCount("group_left_during_drain") == 1);
  }
  // Outside a drain the same refusal still ends the life: another node left the group.
  Harness h(1);
  h.Start(1);
  HeartbeatAnswer hb;
  hb.ok = false;
  hb.error = Refuse(Code::kConflict, Reason::kGroupLeft, "incarnation i1 of group g left");
  h.core.OnHeartbeat(hb, &h.fx);
  CHECK(h.Logged("group_failed"));
  CHECK(h.core.state().exit_code == 3);
}

TEST_CASE("a zombie incarnation: a replaced life fails (heartbeat conflict, ask refusal)") {
  struct Row {
    const char* name;
    int via;  // 0: heartbeat 409, 1: ask STALE_INCARNATION, 2: ask INCARNATION_REPLACED
  };
  Row rows[] = {{"heartbeat", 0}, {"stale", 1}, {"replaced", 2}};
  for (const Row& r : rows) {
    CAPTURE(r.name);
    Harness h(1);
    h.Start(1);
    h.PollAll(1);
    h.fx.clear();
    if (r.via == 0) {
      HeartbeatAnswer hb;
      hb.ok = false;
      hb.error = Status(Code::kConflict, "newer life i2");
      h.core.OnHeartbeat(hb, &h.fx);
    } else {
      h.AskFails(1, Refuse(Code::kConflict,
                           r.via == 1 ? Reason::kStaleIncarnation : Reason::kIncarnationReplaced,
                           "newer life i2"));
    }
    CHECK(h.Logged("group_failed reason=\"replaced: newer life i2\""));
    CHECK(h.Count(K::kSignalTrainers) == 1);
    auto a = h.Of(K::kAnswerPoll);
    REQUIRE(a.size() == 1);
    CHECK(a[0].answer.drain);
    CHECK(h.core.state().exit_code == 3);
  }
  // A heartbeat that only failed to arrive is no replacement.
  Harness h(1);
  h.Start(1);
  HeartbeatAnswer hb;
  hb.ok = false;
  hb.error = Status(Code::kUnavailable, "down");
  h.core.OnHeartbeat(hb, &h.fx);
  CHECK(h.fx.empty());
}

TEST_CASE("evicted: by a heartbeat's notice, an ask's refusal or the watch, the group fails") {
  for (int via : {0, 1, 2}) {
    CAPTURE(via);
    Harness h(1, true);
    h.Start(1);
    REQUIRE(h.CommitAll(1).ok());
    h.AskOk(1, Q1(1, 1));
    h.fx.clear();
    if (via == 0) {
      HeartbeatAnswer hb;
      hb.names_this_group = true;
      h.core.OnHeartbeat(hb, &h.fx);
    } else if (via == 1) {
      h.PollAll(2);
      h.AskFails(2, Refuse(Code::kConflict, Reason::kGroupEvicted, "stalled"));
    } else {
      h.Lost(1, true, true);
      CHECK(h.At(K::kWithdrawBoard) < h.At(K::kLeave));
      CHECK(h.Count(K::kAsk) == 0);  // an ask would readmit a group whose trainers stalled
    }
    CHECK(h.Logged("group_failed reason=evicted"));
    CHECK(h.Of(K::kLeave)[0].text == "evicted");
    CHECK(h.core.state().exit_code == 3);
  }
}

TEST_CASE(
    "a lapsed heartbeat is no eviction: the group stays, its step aborts, it rejoins healed") {
  Harness h(1);
  h.Start(1);
  h.core.OnNoticeWait(7, 1, &h.fx);  // the trainer's step on quorum 1 listens for its loss
  REQUIRE(h.CommitAll(1).ok());
  h.PollAll(1);  // at the next boundary before the ask ahead was answered
  h.fx.clear();
  // The lighthouse did not hear the node for heartbeat_timeout: quorum 1 went on without it.
  // The ask cleared by the expiry comes back refused as unhealthy: not an outage to go on
  // through with the old quorum, an ask to retry.
  HeartbeatAnswer hb;
  hb.revived_from = "heartbeat_timeout node=0 age=1042ms";
  h.core.OnHeartbeat(hb, &h.fx);
  CHECK(h.LogCount("heartbeat_lapsed lighthouse_reason=\"heartbeat_timeout node=0 age=1042ms\" "
                   "action=rejoin") == 1);
  CHECK(h.Count(K::kLeave) == 0);
  CHECK(h.Count(K::kSignalTrainers) == 0);
  h.AskFails(1, Refuse(Code::kUnavailable, Reason::kGroupUnhealthy, "group g unhealthy"));
  CHECK(h.Count(K::kAnswerPoll) == 0);
  CHECK(h.LogCount("lighthouse_unreachable") == 0);
  CHECK(h.ask() == Ask::Kind::kForTrainers);
  // The watch says quorum 1 lost this group: the trainers' step on it aborts.
  h.Lost(1, /*self=*/true, /*evicted=*/false);
  auto n = h.Of(K::kAnswerNotice);
  REQUIRE(n.size() == 1);
  CHECK(n[0].notice.lost);
  // The retried ask joins the next quorum, healing from the peers that went on.
  h.AskOk(1, Q1(2, 2, /*heal=*/true));
  auto a = h.Of(K::kAnswerPoll);
  REQUIRE(a.size() == 1);
  CHECK(a[0].answer.quorum_id == 2);
  CHECK(a[0].answer.heal);
  CHECK(h.core.state().exit_code == -1);
  CHECK(!h.core.state().draining);
}

TEST_CASE("the lighthouse says drain: the group leaves as drained, exit 0") {
  Harness h(1);
  h.Start(1);
  HeartbeatAnswer hb;
  hb.drain = true;
  h.core.OnHeartbeat(hb, &h.fx);
  REQUIRE(h.Count(K::kLeave) == 1);
  CHECK(h.Of(K::kLeave)[0].text == "drained");
  CHECK(h.core.state().exit_code == -1);
}

TEST_CASE("a group of another size is refused for good: polls fail, leave, exit 2") {
  Harness h(1);
  h.Hello();
  h.PollAll(0);
  h.fx.clear();
  h.AskFails(0, Refuse(Code::kConflict, Reason::kGroupSizeMismatch,
                       "HTTP 409: group of 1 trainers, the quorum's have 2"));
  CHECK(h.Logged("quorum_refused code=GROUP_SIZE_MISMATCH"));
  auto refused = h.Of(K::kRefusePoll);
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].status.message() == "group of 1 trainers, the quorum's have 2");
  CHECK(h.Of(K::kLeave)[0].text == "group_size_mismatch");
  h.fx.clear();
  h.PollAll(0);
  REQUIRE(h.Count(K::kRefusePoll) == 1);
  CHECK(h.Of(K::kRefusePoll)[0].status.reason() == Reason::kGroupSizeMismatch);
  h.core.OnTrainerExited(0, 100, &h.fx);  // its trainer exits with the refusal: no crash
  CHECK(!h.Logged("group_failed"));
  h.core.OnLeaveDone(&h.fx);
  h.core.OnTrainersGone(true, &h.fx);
  CHECK(h.Of(K::kExit).back().code == 2);
}

TEST_CASE("a commit refused because the job finished: the group leaves as job_finished") {
  Harness h(1);
  h.Start(1);
  h.core.OnJobFinished(&h.fx);
  CHECK(h.Of(K::kLeave)[0].text == "job_finished");
}

TEST_CASE("commits: the node's commit once every local trainer committed; failures at once") {
  Harness h(2);
  h.Hello();
  CommitInput c;
  c.step = 1;
  CHECK(h.core.OnCommit(c, &h.fx).status().reason() == Reason::kQuorumNotIssued);
  c.group_rank = 5;
  CHECK(h.core.OnCommit(c, &h.fx).status().message() == "group_rank 5 has not polled yet");
  h.PollAll(0);
  h.AskOk(0, Q1(1));
  h.fx.clear();
  c.group_rank = 0;
  c.state_hash = "a";
  c.tokens = 10;
  REQUIRE(h.core.OnCommit(c, &h.fx).ok());
  CHECK(h.Count(K::kQueueCommit) == 0);
  c.group_rank = 1;
  c.state_hash = "b";
  c.tokens = 7;
  REQUIRE(h.core.OnCommit(c, &h.fx).ok());
  auto q = h.Of(K::kQueueCommit);
  REQUIRE(q.size() == 1);
  CHECK(q[0].step == 1);
  CHECK(q[0].quorum_id == 1);
  CHECK(q[0].hash_list);  // a hash per shard: the shell hashes the list
  CHECK(q[0].text == "a;b;");
  CHECK(q[0].tokens == 10);  // the largest stands for the node
  CHECK(h.core.state().committed_step == 1);
  CHECK(h.core.OnCommit(c, &h.fx).status().reason() == Reason::kWrongStep);
  // A failed step is reported at once; one on a quorum the node left is only logged.
  h.fx.clear();
  c.step = 2;
  c.failed = true;
  c.quorum_id = 1;
  auto r = h.core.OnCommit(c, &h.fx);
  REQUIRE(r.ok());
  CHECK(*r == 1u);
  REQUIRE(h.Count(K::kQueueCommit) == 1);
  CHECK(h.Of(K::kQueueCommit)[0].failed);
  CHECK(h.Logged("outer_step_failed group_rank=1 step=2 quorum_id=1"));
  h.fx.clear();
  c.quorum_id = 9;
  REQUIRE(h.core.OnCommit(c, &h.fx).ok());
  CHECK(h.Count(K::kQueueCommit) == 0);
  CHECK(h.Logged("outer_step_failed_stale group_rank=1 step=2 quorum_id=9 current=1"));
}

TEST_CASE("one hash from every trainer is the node's hash") {
  Harness h(2);
  h.Start(1);
  REQUIRE(h.CommitAll(1, "same").ok());
  auto q = h.Of(K::kQueueCommit);
  REQUIRE(q.size() == 1);
  CHECK(!q[0].hash_list);
  CHECK(q[0].text == "same");
}

TEST_CASE("board commits are applied once each, in the node's order") {
  Harness h(1, true);
  h.Start(1);
  BoardLook look;
  look.slots[0].commit_step = 1;
  look.slots[0].state_hash = "x";
  h.core.OnBoardLook(look, &h.fx);
  h.core.OnBoardLook(look, &h.fx);
  CHECK(h.Count(K::kQueueCommit) == 1);
  look.slots[0].commit_step = 1;
  look.slots[0].state_hash = std::string(200, 'x');  // seen already: not looked at again
  h.core.OnBoardLook(look, &h.fx);
  CHECK(!h.Logged("board_commit_refused"));
}

TEST_CASE("the reported phase is peer_wait while every local trainer waits on its peers") {
  Harness h(2, true);
  h.Start(1);
  CHECK(h.core.ReportedPhase() == Phase::kTraining);
  REQUIRE(h.core.OnPhase(0, true).ok());
  CHECK(h.core.ReportedPhase() == Phase::kTraining);
  BoardLook look;
  look.slots[1].peer_wait = true;  // said on the board
  h.core.OnBoardLook(look, &h.fx);
  CHECK(h.core.ReportedPhase() == Phase::kPeerWait);
  CHECK(h.core.OnPhase(4, true).code() == Code::kInvalidArgument);
}

TEST_CASE("no trainer said hello within the bound: leave with no_trainers, exit non-zero") {
  CoreOptions o;
  o.hello_timeout = Millis(60'000);
  SUBCASE("none came") {
    Harness h(1, false, o);
    h.core.OnTick(TimePoint{} + Millis(59'999), &h.fx);
    CHECK(h.fx.empty());
    h.core.OnTick(TimePoint{} + Millis(60'000), &h.fx);
    CHECK(h.Logged("no_trainers hello_timeout_ms=60000"));
    REQUIRE(h.Count(K::kLeave) == 1);
    CHECK(h.Of(K::kLeave)[0].text == "no_trainers");
    h.core.OnLeaveDone(&h.fx);
    h.core.OnTrainersGone(true, &h.fx);
    REQUIRE(h.Count(K::kExit) == 1);
    CHECK(h.Of(K::kExit)[0].code != 0);
    h.fx.clear();
    h.core.OnTick(TimePoint{} + Millis(120'000), &h.fx);  // once
    CHECK(h.fx.empty());
  }
  SUBCASE("one said hello") {
    Harness h(1, false, o);
    h.Hello();
    REQUIRE(h.Count(K::kWatchPid) == 1);  // its process is watched from its hello
    h.fx.clear();
    h.core.OnTick(TimePoint{} + Millis(600'000), &h.fx);
    CHECK(h.fx.empty());
  }
  SUBCASE("zero waits for ever") {
    o.hello_timeout = Millis(0);
    Harness h(1, false, o);
    h.core.OnTick(TimePoint{} + Millis(600'000'000), &h.fx);
    CHECK(h.fx.empty());
  }
}

TEST_CASE("the heal of a quorum is answered once; a deadline on the ask changes nothing") {
  Harness h(1);
  h.Hello();
  h.PollAll(0);
  h.fx.clear();
  h.AskFails(0, Status(Code::kDeadlineExceeded, "round open"));
  CHECK(h.fx.empty());
  CHECK(h.ask() == Ask::Kind::kForTrainers);
  h.AskOk(0, Q1(1, 0, true));
  CHECK(h.Of(K::kAnswerPoll)[0].answer.heal);
  h.fx.clear();
  // Its step failed before it committed: the same quorum again carries no second heal.
  h.PollAll(0);
  h.AskOk(0, Q1(1, 0, true));
  REQUIRE(h.Count(K::kAnswerPoll) == 1);
  CHECK(!h.Of(K::kAnswerPoll)[0].answer.heal);
  CHECK(!h.Of(K::kAnswerPoll)[0].answer.reconfigure);
}

}  // namespace
}  // namespace lk::agent
