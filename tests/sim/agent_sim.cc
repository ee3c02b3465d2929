// The agents' seeded simulation: groups of one or two nodes, each node the real agent core
// (replica_agent/agent_core.h) with one or two scripted trainers, against the real lighthouse
// core, with this file as the shell between them. Everything the real shell does by I/O happens
// here as events on one simulated clock: heartbeats, one ask in flight per node (retried with a
// backoff, cut by the lighthouse's deadline), the watch of the node's quorum, the outbox of
// commits and leaves (in order, retried while the lighthouse is away), leaves bounded in time,
// the trainers' exits after a SIGTERM or a drain. Answers from the lighthouse arrive after a
// random delay (so they reorder), and some are lost on the way (the node sees a broken
// connection). Faults: trainers crash or stall, groups are preempted (with or without a
// checkpoint drain), partitioned, restarted beside their running life (the launcher's race),
// started with trainers that never come; the lighthouse restarts from its persisted records and
// is away for a while. Lives that end are requeued by the launcher, as Slurm does.
//
// Invariants, checked as events happen:
// - every trainer's poll is answered (or its group leaves) within a bound once the faults stop;
// - no two trainers of one life hold different quorums for one step unless the lighthouse
//   already counts the older one lost (so that their notice is on its way);
// - no node reports a commit of a step one of its trainers did not commit;
// - no replaced life is answered a quorum, has a commit taken, or hands its trainers a quorum
//   after its core learned it was replaced;
// - the lighthouse's persisted quorum id never goes back and answers never precede it;
// - at the end every life's agents exit, and no ask is left waiting at the lighthouse.
#include <fmt/format.h>

#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "lighthouse/lighthouse_core.h"
#include "replica_agent/agent_core.h"
#include "tests/sim/disk.h"
#include "tests/sim/sim.h"

namespace lk::sim {
namespace {

namespace lh = lk::lighthouse;
namespace ag = lk::agent;

enum class Ev : uint8_t {
  kBeat,          // a node heartbeats
  kBeatArrive,    // the heartbeat reaches the lighthouse, and its answer the node
  kAskDeadline,   // the lighthouse's hold of an ask ran out (504)
  kAskReply,      // an ask's answer (or failure) reaches its node
  kAskRetry,      // the node's quorum loop backed off after a failure
  kOutbox,        // the node's outbox tries its oldest report
  kLoss,          // the watch says the node's quorum lost a member
  kTrainerStart,  // a trainer process starts: hello, then its first poll
  kAnswer,        // an answer (poll or notice) reaches a trainer
  kSyncDone,      // a trainer finished the outer step's collective on its quorum
  kPoll,          // a trainer polls (after its inner steps, or again after a failed step)
  kExit,          // a trainer process exits
  kTrainersGone,  // a drain's wait for the trainers ran out (drain_timeout)
  kLeaveBound,    // a leave's wait for the lighthouse ran out
  kTick,          // the agent core's timer (the hello bound)
  kFault,
  kRequeue,  // the launcher starts a new life of a group
  kEnd,      // trainers say goodbye at their next boundary
  kFinal,    // the run is over: check what is left
};

struct Event {
  TimePoint at;
  uint64_t seq;
  Ev kind;
  int life = -1;
  int node = 0;
  int trainer = 0;
  uint64_t tag = 0;  // the call, epoch or quorum the event is about
  bool operator>(const Event& o) const { return std::tie(at, seq) > std::tie(o.at, o.seq); }
};

enum class TrainerSt : uint8_t { kStarting, kPolling, kSyncing, kBarrier, kInner, kGone };

struct SimTrainer {
  uint32_t rank = 0;  // group rank
  int node = 0;
  int pid = 0;
  TrainerSt st = TrainerSt::kStarting;
  uint32_t step = 0;       // the step it polls, or trains from
  uint32_t quorum_id = 0;  // the quorum of the outer step it is in
  uint32_t committed = 0;
  bool ever_committed = false;
  uint64_t epoch = 0;   // bumped at every change: older events about it are moot
  uint64_t notice = 0;  // its notice wait (0: none)
  TimePoint poll_since{};
  bool never_starts = false;  // a mistyped flag: the process dies before its hello
  bool exit_pending = false;
  bool bad_exit = false;  // it dies (a crash, a SIGTERM), not a clean exit 0
  std::optional<ag::PollAnswer> poll_answer;
  std::optional<ag::NoticeAnswer> notice_answer;
};

struct Report {
  bool leave = false;
  ag::Effect commit;  // kQueueCommit
  std::string reason;
};

struct SimNode {
  std::unique_ptr<ag::AgentCore> core;
  bool exited = false;
  int code = -1;
  uint32_t generation = 0;
  // The quorum loop: one ask in flight.
  std::optional<ag::Effect> in_flight;
  uint64_t call = 0;  // the call id of the ask in flight (answers of older calls are moot)
  bool backing_off = false;
  int failures = 0;
  // The outbox.
  std::deque<Report> outbox;
  bool outbox_scheduled = false;
  int outbox_failures = 0;
  // The leave in flight: its report is in the outbox until delivered or the bound passes.
  bool leaving = false;
  bool waiting_trainers = false;
  std::set<uint32_t> loss_sent;  // quorums whose loss is on its way to the core
  bool replaced_seen = false;    // the core failed with reason replaced
  std::string failed;            // the core's first group_failed line
  bool heartbeating = true;
  bool feeding = false;  // an ask's result is being fed: the loop decides what comes next
};

struct Life {
  int group = 0;
  int gen = 0;
  std::string inc;
  std::vector<SimNode> nodes;
  std::vector<SimTrainer> trainers;
  bool over = false;
  bool no_trainers = false;  // its trainers never start
  bool step_killed = false;  // a trainer died: srun ends the trainers' step on every node
  // Set at the end of the run: the trainers stop at this step, as a training loop of a fixed
  // length does (every trainer of a group at the same step).
  std::optional<uint32_t> final_step;
};

struct SimGroup {
  std::string job = "job", id;
  uint32_t nodes = 1, per_node = 1;
  bool mixed = false;
  int gen = 0;
  int current = -1;  // life index
  bool finished = false;
  bool refused = false;  // left for good (group_size_mismatch)
  TimePoint partitioned_until{}, stalled_until{};
  TimePoint last_commit{};
  bool next_life_fails_start = false;
};

class AgentSim {
 public:
  AgentSim(uint64_t seed, SimStats* stats) : seed_(seed), rng_(seed), stats_(stats) {
    options_.min_replicas = Rand(1, 2);
    options_.join_timeout = Millis(Rand(200, 1500));
    options_.heartbeat_timeout = Millis(Rand(1000, 3000));
    options_.progress_timeout = Rand(0, 1) ? Millis(Rand(8000, 15000)) : Millis(0);
    options_.answer_members_inline = Rand(0, 1);
    if (seed % 2 == 1)
      options_.group_grace = Millis(3'000 + static_cast<int64_t>(seed % 5) * 1'000);
    quorum_timeout_ = Millis(Rand(2000, 5000));
    ask_ahead_ = Rand(0, 3) != 0;
    lh_ = std::make_unique<lh::LighthouseCore>(options_);
    const int groups = Rand(2, 4);
    for (int i = 0; i < groups; ++i) {
      SimGroup g;
      g.id = fmt::format("g{}", i);
      g.nodes = Rand(1, 2);
      g.per_node = Rand(1, 2);
      // Every group averages across sizes, or none does and all have one size.
      g.mixed = seed % 3 != 0;
      if (!g.mixed) g.per_node = g.nodes == 1 ? 2 : 1;
      groups_.push_back(g);
      StartLife(i, now_ + Millis(Rand(0, 500)));
    }
    for (TimePoint t = now_ + Millis(1500); t < chaos_end_; t += Millis(Rand(700, 3000))) {
      Push(t, Ev::kFault);
    }
    Push(end_, Ev::kEnd);
    Push(final_, Ev::kFinal);
  }

  std::string Run() {
    while (error_.empty() && !events_.empty()) {
      std::optional<TimePoint> deadline = lh_->NextDeadline();
      if (deadline && *deadline <= events_.top().at && LighthouseUp()) {
        now_ = std::max(now_, *deadline);
        lh::Effects fx;
        lh_->Tick(now_, &fx);
        ApplyLh(fx);
        Watches();
        continue;
      }
      Event e = events_.top();
      events_.pop();
      now_ = std::max(now_, e.at);
      Handle(e);
      if (error_.empty()) Watches();
      if (error_.empty()) CheckPollBound();
    }
    return error_;
  }

 private:
  // ---- plumbing ----
  int Rand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  Millis Delay() { return Millis(Rand(0, 40)); }
  bool Lost() { return Rand(0, 49) == 0; }
  void Push(TimePoint at, Ev kind, int life = -1, int node = 0, int trainer = 0, uint64_t tag = 0) {
    events_.push(Event{at, seq_++, kind, life, node, trainer, tag});
  }
  void Check(bool ok, const std::string& what) {
    if (!ok && error_.empty()) error_ = fmt::format("{} (at +{}ms)", what, ToMillis(now_ - kStart));
  }
  bool LighthouseUp() const { return now_ >= lh_down_until_; }
  bool Reachable(const Life& l) const {
    return LighthouseUp() && now_ >= groups_[l.group].partitioned_until;
  }
  Millis Beat() const { return options_.heartbeat_timeout / 3; }
  static std::string Address(const Life& l, int node) { return fmt::format("{}:n{}", l.inc, node); }
  lh::AgentKey Key(const Life& l, int node) const {
    return {groups_[l.group].job, groups_[l.group].id, l.inc, static_cast<uint32_t>(node)};
  }
  void Trace(const std::string& line) {
    if (trace_) fmt::print("+{:>6}ms {}\n", ToMillis(now_ - kStart), line);
  }

  // ---- lives ----
  void StartLife(int g, TimePoint at) {
    SimGroup& grp = groups_[g];
    ++grp.gen;
    ++stats_->lives;
    Life l;
    l.group = g;
    l.gen = grp.gen;
    l.inc = fmt::format("{}-{}", grp.id, grp.gen);
    // Faults end with the chaos period: a later life starts well.
    l.no_trainers = grp.next_life_fails_start && at < chaos_end_;
    grp.next_life_fails_start = false;
    for (uint32_t n = 0; n < grp.nodes; ++n) {
      SimNode node;
      ag::CoreOptions o;
      o.group_id = grp.id;
      o.incarnation = l.inc;
      o.node_rank = n;
      o.nodes = grp.nodes;
      o.ask_ahead = ask_ahead_;
      o.hello_timeout = Millis(8000);
      node.core = std::make_unique<ag::AgentCore>(o, at);
      l.nodes.push_back(std::move(node));
    }
    for (uint32_t r = 0; r < grp.nodes * grp.per_node; ++r) {
      SimTrainer t;
      t.rank = r;
      t.node = static_cast<int>(r / grp.per_node);
      t.pid = next_pid_++;
      t.never_starts = l.no_trainers;
      l.trainers.push_back(t);
    }
    lives_.push_back(std::move(l));
    const int li = static_cast<int>(lives_.size()) - 1;
    life_of_[lives_[li].inc] = li;
    grp.current = li;
    for (uint32_t n = 0; n < grp.nodes; ++n) {
      Push(at, Ev::kBeat, li, static_cast<int>(n));
      Push(at + Millis(8000), Ev::kTick, li, static_cast<int>(n));
    }
    for (size_t r = 0; r < lives_[li].trainers.size(); ++r) {
      Push(at + Millis(Rand(50, 800)), Ev::kTrainerStart, li, 0, static_cast<int>(r));
    }
  }

  bool Current(int li) const { return groups_[lives_[li].group].current == li; }

  void NodeExited(int li, int n, int code) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    if (node.exited) return;
    node.exited = true;
    node.code = code;
    Trace(fmt::format("agent_exit {} node={} code={}", l.inc, n, code));
    // A node that drained on purpose (Slurm's signal, its trainers done) exits 0: an answer
    // that crossed its own leave, or another node's leave, is no failure. Only a real end of
    // the life meanwhile (a newer life took over, an eviction) makes it one.
    const std::string& why = node.core->state().drain_reason;
    if (code != 0 && (why == "preempted" || why == "finished")) {
      Check(Retired(groups_[l.group], l.inc) ||
                node.failed.rfind("group_failed reason=evicted", 0) == 0,
            fmt::format("{} node {} drained ({}) but exited {}: {}", l.inc, n, why, code,
                        node.failed));
    }
    // Its trainers are its children: whatever still runs is killed with the job step.
    // (so that a node that exits non-zero takes the whole trainers' step down).
    bool killed = false;
    for (SimTrainer& t : l.trainers) {
      if (t.node == n && t.st != TrainerSt::kGone) {
        Gone(l, t);
        killed = true;
      }
    }
    if (killed && code != 0) KillStep(li);
    for (const SimNode& o : l.nodes) {
      if (!o.exited) return;
    }
    l.over = true;
    SimGroup& g = groups_[l.group];
    bool failed = false;
    for (const SimNode& o : l.nodes) failed |= o.code != 0;
    if (!Current(li)) return;  // a replaced life: its successor runs
    if (g.refused) return;
    // Slurm requeues a life that failed or was preempted; one that finished stays finished.
    const bool finished = now_ >= end_ && !failed;
    if (finished) {
      g.finished = true;
      return;
    }
    if (now_ < end_) Push(now_ + Millis(Rand(300, 4000)), Ev::kRequeue, li);
  }

  // ---- the event loop ----
  void Handle(const Event& e) {
    switch (e.kind) {
      case Ev::kBeat:
        return OnBeat(e.life, e.node);
      case Ev::kBeatArrive:
        return OnBeatArrive(e.life, e.node, static_cast<uint32_t>(e.tag));
      case Ev::kAskDeadline:
        return OnAskDeadline(e.life, e.node, e.tag);
      case Ev::kAskReply:
        return OnAskReply(e.life, e.node, e.tag);
      case Ev::kAskRetry: {
        SimNode& n = lives_[e.life].nodes[e.node];
        n.backing_off = false;
        return MaybeAsk(e.life, e.node);
      }
      case Ev::kOutbox:
        return OnOutbox(e.life, e.node);
      case Ev::kLoss:
        return OnLoss(e.life, e.node, static_cast<uint32_t>(e.tag));
      case Ev::kTrainerStart:
        return OnTrainerStart(e.life, e.trainer);
      case Ev::kAnswer:
        return OnTrainerAnswer(e.life, e.trainer, e.tag);
      case Ev::kSyncDone:
        return OnSyncDone(e.life, e.trainer, e.tag);
      case Ev::kPoll:
        return OnTrainerPoll(e.life, e.trainer, e.tag);
      case Ev::kExit:
        return OnTrainerExit(e.life, e.trainer);
      case Ev::kTrainersGone: {
        SimNode& n = lives_[e.life].nodes[e.node];
        if (!n.waiting_trainers || n.exited) return;
        n.waiting_trainers = false;
        ag::Effects fx;
        n.core->OnTrainersGone(e.tag == 1, &fx);
        return Apply(e.life, e.node, std::move(fx));
      }
      case Ev::kLeaveBound: {
        SimNode& n = lives_[e.life].nodes[e.node];
        if (!n.leaving || n.exited) return;
        n.leaving = false;
        ag::Effects fx;
        n.core->OnLeaveDone(&fx);
        return Apply(e.life, e.node, std::move(fx));
      }
      case Ev::kTick: {
        SimNode& n = lives_[e.life].nodes[e.node];
        if (n.exited) return;
        ag::Effects fx;
        n.core->OnTick(now_, &fx);
        return Apply(e.life, e.node, std::move(fx));
      }
      case Ev::kFault:
        return Fault();
      case Ev::kRequeue: {
        const Life& l = lives_[e.life];
        if (Current(e.life) && l.over) StartLife(l.group, now_);
        return;
      }
      case Ev::kEnd:
        // Every life trains one more step and stops there.
        for (Life& l : lives_) {
          uint32_t top = 0;
          for (const SimTrainer& t : l.trainers) top = std::max(top, t.step);
          l.final_step = top + 1;
        }
        return;
      case Ev::kFinal:
        return Final();
    }
  }

  // ---- the node's lighthouse calls ----
  void OnBeat(int li, int n) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    if (node.exited || !node.heartbeating) return;
    // After a drain the group has left: the shell's heartbeat loop ends.
    if (node.core->state().draining) {
      node.heartbeating = false;
      return;
    }
    Push(now_ + Beat(), Ev::kBeat, li, n);
    // On its way the node may start a drain and leave (its leave overtaking the heartbeat on
    // another connection): the answer then speaks of the node's own leave.
    Push(now_ + Millis(Rand(0, 20)), Ev::kBeatArrive, li, n, 0,
         node.core->state().committed_step);
  }

  void OnBeatArrive(int li, int n, uint32_t step) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    if (node.exited) return;
    ag::HeartbeatAnswer in;
    if (!Reachable(l)) {
      in.ok = false;
      in.error = Status(Code::kUnavailable, "connection refused");
    } else {
      const SimGroup& g = groups_[l.group];
      lh::HeartbeatInput hb{g.job,
                            g.id,
                            l.inc,
                            static_cast<uint32_t>(n),
                            g.nodes,
                            step,
                            std::string(ag::PhaseName(node.core->ReportedPhase())),
                            Address(l, n),
                            node.generation};
      lh::Effects fx;
      auto r = lh_->OnHeartbeat(hb, now_, &fx);
      ApplyLh(fx);
      if (!r.ok()) {
        in.ok = false;
        in.error = r.status();
      } else {
        if (r->generation != 0) node.generation = r->generation;
        for (const auto& notice : r->notices) {
          if (notice.group_id == g.id && notice.incarnation == l.inc &&
              notice.reason != "heartbeat_timeout") {
            in.names_this_group = true;
          }
        }
        in.revived_from = r->revived_from;
        in.drain = r->drain;
        // As the service computes it: an agent of the job waits in a round, or the quorum
        // lost a member.
        bool open = false;
        for (const auto& [key, call] : held_) open |= key.job == g.job;
        if (!open) {
          auto w = lh_->Watch(g.job, r->quorum_id);
          open = w.ok() && w->lost;
        }
        in.round_pending = open;
      }
      if (Lost()) {  // the answer never came back
        in = ag::HeartbeatAnswer{};
        in.ok = false;
        in.error = Status(Code::kUnavailable, "connection reset");
      }
    }
    ag::Effects fx;
    node.core->OnHeartbeat(in, &fx);
    Apply(li, n, std::move(fx));
  }

  bool CommitPending(const SimNode& node) const {
    for (const Report& r : node.outbox) {
      if (!r.leave) return true;
    }
    return false;
  }

  // The quorum loop: one ask at a time, the one the core says (AskMayGo).
  void MaybeAsk(int li, int n) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    if (node.exited || node.in_flight || node.backing_off || node.feeding) return;
    auto ask = node.core->PendingAsk(CommitPending(node));
    if (!ask) return;
    node.in_flight = *ask;
    const uint64_t call = ++calls_;
    node.call = call;
    Trace(fmt::format("ask {} node={} call={} step={} serial={}", l.inc, n, call, ask->step,
                      ask->id));
    if (!Reachable(l)) {
      replies_[call] = Reply{Status(Code::kUnavailable, "connection refused"), {}};
      Push(now_ + Delay(), Ev::kAskReply, li, n, 0, call);
      return;
    }
    const SimGroup& g = groups_[l.group];
    lh::JoinInput in{g.job,           g.id,
                     l.inc,           static_cast<uint32_t>(n),
                     g.nodes,         ask->step,
                     false,           !ask->fresh,
                     Address(l, n),   node.generation,
                     ask->group_size, ask->mixed_group_sizes,
                     ask->quorum_id};
    lh::Effects fx;
    const lh::AgentKey key = Key(l, n);
    // A newer ask of the same agent supersedes the one held (the service answers it 409).
    if (auto it = held_.find(key); it != held_.end()) held_.erase(it);
    Status st = lh_->OnJoin(in, now_, &fx);
    if (!st.ok()) {
      replies_[call] = Reply{st, {}};
      Push(now_ + Delay(), Ev::kAskReply, li, n, 0, call);
      ApplyLh(fx);
      return;
    }
    held_[key] = call;
    held_where_[call] = {li, n};
    Push(now_ + quorum_timeout_, Ev::kAskDeadline, li, n, 0, call);
    ApplyLh(fx);
  }

  void OnAskDeadline(int li, int n, uint64_t call) {
    const lh::AgentKey key = Key(lives_[li], n);
    auto it = held_.find(key);
    if (it == held_.end() || it->second != call) return;
    held_.erase(it);
    lh_->OnJoinTimeout(key);
    replies_[call] = Reply{Status(Code::kDeadlineExceeded, "quorum not formed in time"), {}};
    Push(now_ + Delay(), Ev::kAskReply, li, n, 0, call);
  }

  void OnAskReply(int li, int n, uint64_t call) {
    auto it = replies_.find(call);
    if (it == replies_.end()) return;
    Reply reply = std::move(it->second);
    replies_.erase(it);
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    Trace(fmt::format("ask_reply {} node={} call={} current_call={} status={}", l.inc, n, call,
                      node.call, reply.status.ToString()));
    if (node.exited || node.call != call || !node.in_flight) return;
    const ag::Effect ask = *node.in_flight;
    node.in_flight.reset();
    // A behind ask that was superseded was cancelled: the loop goes on without feeding it.
    if (ask.ask_kind == ag::Effect::AskKind::kBehind && node.core->state().ask.serial != ask.id) {
      return MaybeAsk(li, n);
    }
    ag::AskResult in;
    in.serial = ask.id;
    in.step = ask.step;
    in.kind = ask.ask_kind;
    in.status = reply.status;
    if (reply.status.ok()) {
      node.failures = 0;
      in.quorum = reply.quorum;
    } else if (reply.status.code() != Code::kDeadlineExceeded) {
      ++node.failures;
    }
    ag::Effects fx;
    node.core->OnAskResult(in, &fx);
    node.feeding = true;
    Apply(li, n, std::move(fx));
    node.feeding = false;
    if (node.exited) return;
    const ag::Ask& now = node.core->state().ask;
    if (reply.status.ok() || reply.status.code() == Code::kDeadlineExceeded || !now.asking() ||
        now.serial != ask.id) {
      return MaybeAsk(li, n);
    }
    node.backing_off = true;
    Push(now_ + Millis(std::min(100 << std::min(node.failures, 4), 1600)), Ev::kAskRetry, li, n);
  }

  ag::Quorum ToAgent(const lh::QuorumAnswer& a, uint32_t node_rank) const {
    ag::Quorum q;
    q.quorum_id = a.quorum_id;
    q.replica_rank = a.replica_rank;
    const auto& members = a.members_shared ? *a.members_shared : a.members;
    q.replica_world_size = static_cast<uint32_t>(members.size());
    q.max_step = a.max_step;
    q.heal = a.heal;
    q.initial = a.initial;
    q.restore_checkpoint = a.restore_checkpoint.has_value();
    q.reason = a.reason;
    q.diverged_step = a.diverged_step;
    for (uint32_t s : a.source_ranks) {
      if (s < members.size() && node_rank < members[s].addresses.size()) {
        q.heal_sources.push_back(members[s].addresses[node_rank]);
      }
    }
    return q;
  }

  // The watch: a node whose quorum the lighthouse counts lost hears of it (after a delay).
  void Watches() {
    for (size_t li = 0; li < lives_.size(); ++li) {
      Life& l = lives_[li];
      if (l.over || !Reachable(l)) continue;
      const SimGroup& g = groups_[l.group];
      for (size_t n = 0; n < l.nodes.size(); ++n) {
        SimNode& node = l.nodes[n];
        if (node.exited) continue;
        auto target = node.core->WatchTarget();
        if (!target || node.core->state().lost_quorums.count(*target) ||
            node.loss_sent.count(*target)) {
          continue;
        }
        auto w = lh_->Watch(g.job, *target);
        if (!w.ok() || !w->lost) continue;
        node.loss_sent.insert(*target);
        Trace(fmt::format("watch {} node={} quorum_id={} lost", l.inc, n, *target));
        losses_[{static_cast<int>(li), static_cast<int>(n), *target}] = w->notices;
        Push(now_ + Delay(), Ev::kLoss, static_cast<int>(li), static_cast<int>(n), 0, *target);
      }
    }
  }

  void OnLoss(int li, int n, uint32_t qid) {
    auto it = losses_.find({li, n, qid});
    if (it == losses_.end()) return;
    std::vector<lh::FailureNoticeData> notices = std::move(it->second);
    losses_.erase(it);
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    if (node.exited) return;
    ag::LossInput in;
    in.quorum_id = qid;
    for (const auto& notice : notices) {
      in.who += (in.who.empty() ? "" : ",") + notice.group_id + ":" + notice.reason;
      if (notice.group_id != groups_[l.group].id || notice.incarnation != l.inc) continue;
      in.names_this_group = true;
      in.evicted |= notice.reason == "progress_stalled";
    }
    ag::Effects fx;
    node.core->OnQuorumLost(in, &fx);
    Apply(li, n, std::move(fx));
  }

  // The outbox: reports in order, the oldest retried until the lighthouse takes or refuses it.
  void KickOutbox(int li, int n, Millis after = Millis(0)) {
    SimNode& node = lives_[li].nodes[n];
    if (node.outbox_scheduled || node.outbox.empty() || node.exited) return;
    node.outbox_scheduled = true;
    Push(now_ + after + Delay(), Ev::kOutbox, li, n);
  }

  void OnOutbox(int li, int n) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    node.outbox_scheduled = false;
    if (node.exited || node.outbox.empty()) return;
    if (!Reachable(l)) {
      ++node.outbox_failures;
      return KickOutbox(li, n, Millis(std::min(100 << std::min(node.outbox_failures, 4), 1600)));
    }
    node.outbox_failures = 0;
    Report r = std::move(node.outbox.front());
    node.outbox.pop_front();
    const SimGroup& g = groups_[l.group];
    lh::Effects fx;
    if (r.leave) {
      Status st = lh_->OnLeave(g.job, g.id, l.inc, r.reason, now_, &fx, node.generation);
      ApplyLh(fx);
      ++stats_->leaves;
      (void)st;  // refused (stale, unknown): the life is over either way
      if (node.leaving) {
        node.leaving = false;
        ag::Effects afx;
        node.core->OnLeaveDone(&afx);
        Apply(li, n, std::move(afx));
      }
    } else {
      const ag::Effect& c = r.commit;
      lh::CommitInput in{g.job,       g.id,   l.inc,     static_cast<uint32_t>(n),
                         c.quorum_id, c.step, !c.failed, c.hash_list ? std::string("list") : c.text,
                         c.tokens};
      auto res = lh_->OnCommit(in, now_, &fx);
      if (res.ok() && !c.failed) {
        ++stats_->commits;
        Check(!Retired(g, l.inc),
              fmt::format("commit of step {} taken from replaced life {}", c.step, l.inc));
        groups_[l.group].last_commit = now_;
      }
      ApplyLh(fx);
      if (!res.ok() && res.status().reason() == Reason::kJobFinished) {
        ag::Effects afx;
        node.core->OnJobFinished(&afx);
        Apply(li, n, std::move(afx));
      }
    }
    KickOutbox(li, n);
    MaybeAsk(li, n);  // an ask ahead waits for the commits
  }

  bool Retired(const SimGroup& g, const std::string& inc) const {
    return disk_.Retired(g.job, g.id, inc);
  }

  // ---- the lighthouse's effects ----
  void ApplyLh(const lh::Effects& fx) {
    stats_->issued += fx.issued.size();
    stats_->answers += fx.answers.size();
    stats_->rejections += fx.rejections.size();
    for (const auto& is : fx.issued) stats_->changed += is.changed;
    for (const std::string& e : fx.events) {
      ++stats_->events[e.substr(0, e.find(' '))];
      Trace(e);
    }
    if (std::string broken = disk_.Write(fx); !broken.empty()) Check(false, broken);
    for (const lh::JobRecordData& r : fx.persist_jobs) {
      std::set<std::string> incs;
      for (const lh::MemberData& m : r.members) incs.insert(m.incarnation);
      auto [known, fresh] = memberships_.try_emplace(r.quorum_id, incs);
      Check(fresh || known->second == incs,
            fmt::format("quorum {} persisted with two memberships", r.quorum_id));
    }
    for (const auto& [key, answer] : fx.answers) {
      auto rec = disk_.jobs.find(key.job);
      Check(rec != disk_.jobs.end() && rec->second.quorum_id >= answer.quorum_id,
            "answer before its quorum was persisted");
      auto it = held_.find(key);
      if (it == held_.end()) continue;  // the caller gave up (its deadline passed)
      const uint64_t call = it->second;
      auto where = held_where_.find(call);
      held_.erase(it);
      if (where == held_where_.end()) continue;
      const auto [li, n] = where->second;
      const SimGroup& g = groups_[lives_[li].group];
      Check(!Retired(g, key.incarnation),
            fmt::format("replaced life {} answered quorum {}", key.incarnation, answer.quorum_id));
      if (Lost()) {
        replies_[call] = Reply{Status(Code::kUnavailable, "connection reset"), {}};
      } else {
        replies_[call] = Reply{Status::Ok(), ToAgent(answer, key.node_rank)};
      }
      Push(now_ + Delay(), Ev::kAskReply, li, n, 0, call);
    }
    for (const auto& [key, status] : fx.rejections) {
      auto it = held_.find(key);
      if (it == held_.end()) continue;
      const uint64_t call = it->second;
      auto where = held_where_.find(call);
      held_.erase(it);
      if (where == held_where_.end()) continue;
      replies_[call] = Reply{status, {}};
      Push(now_ + Delay(), Ev::kAskReply, where->second.first, where->second.second, 0, call);
    }
  }

  // ---- the agent core's effects, applied as the shell does ----
  void Apply(int li, int n, ag::Effects fx) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[n];
    for (ag::Effect& e : fx) {
      switch (e.kind) {
        case ag::Effect::Kind::kLog:
          ++stats_->events["agent_" + e.text.substr(0, e.text.find(' '))];
          Trace(fmt::format("{} node={}: {}", l.inc, n, e.text));
          if (e.text.rfind("group_failed", 0) == 0) {
            if (node.failed.empty()) node.failed = e.text;
            if (e.text.find("replaced") != std::string::npos) node.replaced_seen = true;
          }
          break;
        case ag::Effect::Kind::kAnswerPoll:
        case ag::Effect::Kind::kRefusePoll: {
          SimTrainer* t = TrainerOf(l, e.rank);
          if (!t || t->st != TrainerSt::kPolling) break;
          if (e.kind == ag::Effect::Kind::kRefusePoll) {
            if (e.status.reason() == Reason::kRequestSuperseded) break;
            // Every group here has one size or all mix, and the trainers poll in step: no
            // refusal is right (a size refusal would turn a group away for nothing).
            Check(false, fmt::format("poll of {} rank {} refused: {}", l.inc, e.rank,
                                     e.status.ToString()));
            ExitSoon(li, *t, true);
            break;
          }
          Check(!node.replaced_seen || e.answer.drain,
                fmt::format("replaced life {} handed its trainers quorum {}", l.inc,
                            e.answer.quorum_id));
          t->poll_answer = e.answer;
          Push(now_ + Millis(Rand(0, 5)), Ev::kAnswer, li, 0, static_cast<int>(e.rank), t->epoch);
          break;
        }
        case ag::Effect::Kind::kAsk:
          break;  // MaybeAsk below
        case ag::Effect::Kind::kCancelBehindAsk:
          if (node.in_flight && node.in_flight->ask_kind == ag::Effect::AskKind::kBehind) {
            // The call is cancelled: the lighthouse drops the held ask, the loop goes on.
            const lh::AgentKey key = Key(l, n);
            if (auto it = held_.find(key); it != held_.end() && it->second == node.call) {
              held_.erase(it);
              lh_->OnJoinTimeout(key);
            }
            node.in_flight.reset();
            node.call = 0;
          }
          break;
        case ag::Effect::Kind::kQueueCommit: {
          if (!e.failed) {
            for (const SimTrainer& t : l.trainers) {
              if (t.node != n) continue;
              Check(t.ever_committed && t.committed >= e.step,
                    fmt::format("{} node {} reports step {} that rank {} did not commit ({})",
                                l.inc, n, e.step, t.rank, t.committed));
            }
          }
          Report r;
          r.commit = e;
          node.outbox.push_back(std::move(r));
          KickOutbox(li, n);
          break;
        }
        case ag::Effect::Kind::kPublishBoard:
        case ag::Effect::Kind::kWithdrawBoard:
        case ag::Effect::Kind::kTakeFor:
        case ag::Effect::Kind::kSetConsumed:
        case ag::Effect::Kind::kCloseBoard:
          break;  // no board in this model: trainers poll over the socket
        case ag::Effect::Kind::kAnswerNotice: {
          for (SimTrainer& t : l.trainers) {
            if (t.notice != e.id) continue;
            t.notice = 0;
            t.notice_answer = e.notice;
            Push(now_ + Millis(Rand(0, 5)), Ev::kAnswer, li, 0, static_cast<int>(t.rank),
                 t.epoch | kNoticeBit);
          }
          break;
        }
        case ag::Effect::Kind::kSignalTrainers:
          for (SimTrainer& t : l.trainers) {
            if (t.node == n && t.st != TrainerSt::kGone) ExitSoon(li, t, true);
          }
          break;
        case ag::Effect::Kind::kWatchPid:
          break;  // exits are fed by OnTrainerExit
        case ag::Effect::Kind::kLeave: {
          Report r;
          r.leave = true;
          r.reason = e.text;
          node.outbox.push_back(std::move(r));
          node.leaving = true;
          KickOutbox(li, n);
          Push(now_ + Millis(e.text == "finished" ? 10'000 : 3'000), Ev::kLeaveBound, li, n);
          break;
        }
        case ag::Effect::Kind::kWaitTrainers:
          // Up to drain_timeout; at once when they are all gone already.
          node.waiting_trainers = true;
          Push(NodeTrainersGone(l, n) ? now_ : now_ + Millis(5'000), Ev::kTrainersGone, li, n, 0,
               NodeTrainersGone(l, n) ? 1 : 0);
          break;
        case ag::Effect::Kind::kExit:
          NodeExited(li, n, e.code);
          return;
      }
    }
    MaybeAsk(li, n);
  }

  static constexpr uint64_t kNoticeBit = uint64_t{1} << 62;

  SimTrainer* TrainerOf(Life& l, uint32_t rank) {
    return rank < l.trainers.size() ? &l.trainers[rank] : nullptr;
  }
  bool NodeTrainersGone(const Life& l, int n) const {
    for (const SimTrainer& t : l.trainers) {
      if (t.node == n && t.st != TrainerSt::kGone) return false;
    }
    return true;
  }

  // ---- trainers ----
  void ExitSoon(int li, SimTrainer& t, bool bad = false) {
    if (t.st == TrainerSt::kGone) return;
    t.bad_exit |= bad;
    if (t.exit_pending) return;
    t.exit_pending = true;
    Push(now_ + Millis(Rand(0, 300)), Ev::kExit, li, 0, static_cast<int>(t.rank));
  }

  // The trainers of a life are one srun step with --kill-on-bad-exit (slurm/script.cc): one that
  // dies takes the others, on every node, with it; one still starting dies before its hello,
  // and its agent never hears of it (the hello bound ends that node). Left to start, such a
  // trainer polled alone on a node whose peer node had left: seed 145389364114.
  void KillStep(int li) {
    Life& l = lives_[li];
    if (l.step_killed) return;
    l.step_killed = true;
    for (SimTrainer& o : l.trainers) {
      if (o.st == TrainerSt::kStarting) {
        o.never_starts = true;
      } else if (o.st != TrainerSt::kGone) {
        ExitSoon(li, o, true);
      }
    }
  }

  void Gone(Life& l, SimTrainer& t) {
    t.st = TrainerSt::kGone;
    ++t.epoch;
    t.notice = 0;
    (void)l;
  }

  void OnTrainerExit(int li, int r) {
    Life& l = lives_[li];
    SimTrainer& t = l.trainers[r];
    if (t.st == TrainerSt::kGone) return;
    Gone(l, t);
    if (t.bad_exit) KillStep(li);
    SimNode& node = l.nodes[t.node];
    if (node.exited) return;
    ag::Effects fx;
    node.core->OnTrainerExited(t.rank, t.pid, &fx);
    Apply(li, t.node, std::move(fx));
    if (!node.exited && node.waiting_trainers && NodeTrainersGone(l, t.node)) {
      node.waiting_trainers = false;
      ag::Effects gfx;
      node.core->OnTrainersGone(true, &gfx);
      Apply(li, t.node, std::move(gfx));
    }
  }

  void OnTrainerStart(int li, int r) {
    Life& l = lives_[li];
    SimTrainer& t = l.trainers[r];
    if (t.st != TrainerSt::kStarting || l.nodes[t.node].exited) return;
    if (t.never_starts) {
      t.st = TrainerSt::kGone;  // died before its hello: the agent never hears of it
      return;
    }
    SimNode& node = l.nodes[t.node];
    const SimGroup& g = groups_[l.group];
    ag::Effects fx;
    Status st = node.core->OnHello(t.rank, g.nodes * g.per_node, t.pid, &fx);
    Apply(li, t.node, std::move(fx));
    if (!st.ok()) {
      Check(node.core->state().draining, "hello refused: " + st.ToString());
      ExitSoon(li, t, true);
      return;
    }
    Poll(li, t);
  }

  void Poll(int li, SimTrainer& t, bool resumed = false) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[t.node];
    if (node.exited || t.st == TrainerSt::kGone) return;
    const SimGroup& g = groups_[l.group];
    if (l.final_step && t.step >= *l.final_step) {
      // The run is over for this trainer: goodbye, then exit 0.
      ag::Effects fx;
      (void)node.core->OnGoodbye(t.rank, &fx);
      t.st = TrainerSt::kInner;  // not polling any more
      ++t.epoch;
      Apply(li, t.node, std::move(fx));
      ExitSoon(li, t);
      return;
    }
    t.st = TrainerSt::kPolling;
    ++t.epoch;
    t.poll_since = now_;
    Trace(
        fmt::format("trainer {} rank={} poll step={} resumed={}", l.inc, t.rank, t.step, resumed));
    ++stats_->polls;
    ag::PollInput in;
    in.group_rank = t.rank;
    in.group_size = g.nodes * g.per_node;
    in.step = t.step;
    in.pid = t.pid;
    in.mixed_group_sizes = g.mixed;
    in.resumed = resumed;
    ag::Effects fx;
    node.core->OnPoll(in, now_, &fx);
    Apply(li, t.node, std::move(fx));
  }

  void OnTrainerPoll(int li, int r, uint64_t epoch) {
    SimTrainer& t = lives_[li].trainers[r];
    if (t.epoch != epoch || t.st == TrainerSt::kGone) return;
    Poll(li, t);
  }

  void OnTrainerAnswer(int li, int r, uint64_t tag) {
    Life& l = lives_[li];
    SimTrainer& t = l.trainers[r];
    const bool notice = (tag & kNoticeBit) != 0;
    if (t.st == TrainerSt::kGone || t.epoch != (tag & ~kNoticeBit)) return;
    SimNode& node = l.nodes[t.node];
    if (notice) {
      if (!t.notice_answer) return;
      ag::NoticeAnswer a = *t.notice_answer;
      t.notice_answer.reset();
      if (a.drain) return ExitSoon(li, t);
      if (!a.lost || a.quorum_id != t.quorum_id ||
          (t.st != TrainerSt::kSyncing && t.st != TrainerSt::kBarrier)) {
        return;
      }
      // The quorum of its outer step lost a member: the step fails, and the trainer asks for
      // the same step again.
      return FailStep(li, t);
    }
    if (t.st != TrainerSt::kPolling || !t.poll_answer) return;
    ag::PollAnswer a = *t.poll_answer;
    t.poll_answer.reset();
    if (!a.drain && Rand(0, 29) == 0) {
      // Its poll timed out on its side as the answer was on the way: it polls again, resumed.
      return Poll(li, t, true);
    }
    ++stats_->trainer_answers;
    Trace(fmt::format(
        "trainer {} rank={} step={} answer quorum_id={} heal={} max_step={} drain={} "
        "reconfigure={}",
        l.inc, t.rank, t.step, a.quorum_id, a.heal, a.max_step, a.drain, a.reconfigure));
    if (a.drain) {
      t.st = TrainerSt::kInner;
      ++t.epoch;
      return ExitSoon(li, t);
    }
    if (a.heal) t.step = a.max_step;  // the state comes from the donors (or a checkpoint)
    t.st = TrainerSt::kSyncing;
    t.quorum_id = a.quorum_id;
    ++t.epoch;
    // Two trainers of one life on different quorums for one step: only while the older is lost.
    for (const SimTrainer& o : l.trainers) {
      if (&o == &t || o.step != t.step || o.quorum_id == t.quorum_id) continue;
      if (o.st != TrainerSt::kSyncing && o.st != TrainerSt::kBarrier) continue;
      const uint32_t older = std::min(o.quorum_id, t.quorum_id);
      auto w = lh_->Watch(groups_[l.group].job, older);
      Check(!w.ok() || w->lost,
            fmt::format("{} ranks {} and {} hold quorums {} and {} for step {}, neither lost",
                        l.inc, o.rank, t.rank, o.quorum_id, t.quorum_id, t.step));
    }
    t.notice = ++notices_;
    ag::Effects fx;
    node.core->OnNoticeWait(t.notice, t.quorum_id, &fx);
    Apply(li, t.node, std::move(fx));
    if (t.st != TrainerSt::kSyncing) return;
    Push(now_ + Millis(Rand(5, 80)), Ev::kSyncDone, li, 0, r, t.epoch);
  }

  // The outer step's collective: it completes when every trainer of every member of the
  // quorum (the lives it names) reached it on the same quorum and step, as the cross-group
  // average needs them all; one that never comes holds the others until their notice of the
  // loss aborts it.
  void OnSyncDone(int li, int r, uint64_t epoch) {
    Life& l = lives_[li];
    SimTrainer& t = l.trainers[r];
    if (t.epoch != epoch || t.st != TrainerSt::kSyncing) return;
    t.st = TrainerSt::kBarrier;
    const uint32_t qid = t.quorum_id, step = t.step;
    auto members = memberships_.find(qid);
    Check(members != memberships_.end(), fmt::format("quorum {} handed out unknown", qid));
    if (members == memberships_.end()) return;
    std::vector<int> in;
    for (const std::string& inc : members->second) {
      auto it = life_of_.find(inc);
      if (it == life_of_.end()) return;
      for (const SimTrainer& o : lives_[it->second].trainers) {
        if (o.st != TrainerSt::kBarrier || o.step != step || o.quorum_id != qid) return;
      }
      in.push_back(it->second);
    }
    const bool fails = Rand(0, 19) == 0;
    for (int m : in) {
      for (SimTrainer& o : lives_[m].trainers) {
        if (fails) {
          FailStep(m, o);
        } else {
          Commit(m, o);
        }
      }
    }
  }

  void FailStep(int li, SimTrainer& t) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[t.node];
    if (t.notice != 0) {
      ag::Effects nfx;
      node.core->OnNoticeTimeout(t.notice, &nfx);  // the trainer stops waiting
      t.notice = 0;
      Apply(li, t.node, std::move(nfx));
    }
    Trace(fmt::format("trainer {} rank={} step={} failed quorum_id={}", l.inc, t.rank, t.step,
                      t.quorum_id));
    ag::CommitInput c;
    c.group_rank = t.rank;
    c.step = t.step + 1;
    c.quorum_id = t.quorum_id;
    c.failed = true;
    ag::Effects fx;
    (void)node.core->OnCommit(c, &fx);
    t.st = TrainerSt::kInner;
    ++t.epoch;
    Apply(li, t.node, std::move(fx));
    Push(now_ + Millis(Rand(10, 200)), Ev::kPoll, li, 0, static_cast<int>(t.rank), t.epoch);
  }

  void Commit(int li, SimTrainer& t) {
    Life& l = lives_[li];
    SimNode& node = l.nodes[t.node];
    if (t.notice != 0) {
      ag::Effects nfx;
      node.core->OnNoticeTimeout(t.notice, &nfx);
      t.notice = 0;
      Apply(li, t.node, std::move(nfx));
    }
    if (node.exited) return;
    t.committed = t.step + 1;
    t.ever_committed = true;
    Trace(fmt::format("trainer {} rank={} commit step={} quorum_id={}", l.inc, t.rank, t.step + 1,
                      t.quorum_id));
    ag::CommitInput c;
    c.group_rank = t.rank;
    c.step = t.step + 1;
    c.quorum_id = t.quorum_id;
    c.state_hash = fmt::format("h{}", t.step + 1);
    c.tokens = 1000;
    ag::Effects fx;
    auto res = node.core->OnCommit(c, &fx);
    t.step += 1;
    t.st = TrainerSt::kInner;
    ++t.epoch;
    Apply(li, t.node, std::move(fx));
    if (!res.ok()) {
      Check(node.core->state().draining || node.exited,
            fmt::format("{} rank {} commit of step {} refused: {}", l.inc, t.rank, t.step,
                        res.status().ToString()));
    }
    // Inner steps; a stalled host makes them slow.
    TimePoint next = now_ + Millis(Rand(200, 1500));
    next = std::max(next, groups_[l.group].stalled_until);
    Push(next, Ev::kPoll, li, 0, static_cast<int>(t.rank), t.epoch);
  }

  // ---- faults ----
  void Fault() {
    const int g = Rand(0, static_cast<int>(groups_.size()) - 1);
    SimGroup& grp = groups_[g];
    const int li = grp.current;
    Life& l = lives_[li];
    switch (Rand(0, 7)) {
      case 0: {  // a trainer crashes
        std::vector<int> live;
        for (const SimTrainer& t : l.trainers) {
          if (t.st != TrainerSt::kGone && t.st != TrainerSt::kStarting)
            live.push_back(static_cast<int>(t.rank));
        }
        if (live.empty()) return;
        Trace(fmt::format("fault trainer_crash {}", l.inc));
        ExitSoon(li, l.trainers[live[Rand(0, static_cast<int>(live.size()) - 1)]], true);
        return;
      }
      case 1: {  // preempted: Slurm's signal; half the time with a checkpoint drain
        if (l.over) return;
        const bool checkpoint = Rand(0, 1) == 0;
        Trace(fmt::format("fault preempt {} checkpoint={}", l.inc, checkpoint));
        for (size_t n = 0; n < l.nodes.size(); ++n) {
          SimNode& node = l.nodes[n];
          if (node.exited) continue;
          node.core->OnSignalArrived();
          ag::Effects fx;
          node.core->OnDrain(ag::LeaveReason::kSignal, "preempted", checkpoint, &fx);
          Apply(li, static_cast<int>(n), std::move(fx));
          for (SimTrainer& t : l.trainers) {
            if (t.node == static_cast<int>(n)) ExitSoon(li, t);  // the signal reaches them too
          }
        }
        return;
      }
      case 2:
        grp.partitioned_until = std::min(now_ + Millis(Rand(500, 6000)), chaos_end_);
        Trace(fmt::format("fault partition {}", grp.id));
        return;
      case 3:
        grp.stalled_until = std::min(now_ + Millis(Rand(2000, 15000)), chaos_end_);
        Trace(fmt::format("fault stall {}", grp.id));
        return;
      case 4:
        return RestartLighthouse();
      case 5:  // the launcher's race: a new life starts while the old one still runs
        if (l.over) return;
        Trace(fmt::format("fault restart_race {}", grp.id));
        StartLife(g, now_);
        return;
      case 6:  // the group's next life has trainers that fail at start
        grp.next_life_fails_start = true;
        return;
      default:
        return;
    }
  }

  void RestartLighthouse() {
    ++stats_->restarts;
    Trace("fault lighthouse_restart");
    lh_down_until_ = now_ + Millis(Rand(0, 3000));
    Status st = disk_.Restart(options_, lh_down_until_, &lh_);
    Check(st.ok(), "Load failed: " + st.ToString());
    // Held asks lose their connection.
    for (const auto& [key, call] : held_) {
      auto where = held_where_.find(call);
      if (where == held_where_.end()) continue;
      replies_[call] = Reply{Status(Code::kUnavailable, "connection reset"), {}};
      Push(now_ + Delay(), Ev::kAskReply, where->second.first, where->second.second, 0, call);
    }
    held_.clear();
    if (LighthouseUp()) return;
    // Its timers restart when it is back: nothing reaches it before.
  }

  // ---- invariants over time ----
  void CheckPollBound() {
    if (now_ < chaos_end_ + Millis(20'000) || now_ >= end_) return;
    const Millis bound =
        quorum_timeout_ + options_.join_timeout + 2 * options_.heartbeat_timeout + Millis(12'000);
    for (const Life& l : lives_) {
      if (l.over) continue;
      for (const SimTrainer& t : l.trainers) {
        if (t.st != TrainerSt::kPolling) continue;
        Check(now_ - t.poll_since <= bound,
              fmt::format("{} rank {} polled step {} {} ms ago and has no answer", l.inc, t.rank,
                          t.step, ToMillis(now_ - t.poll_since)));
      }
    }
  }

  void Final() {
    for (const Life& l : lives_) {
      for (size_t n = 0; n < l.nodes.size(); ++n) {
        Check(l.nodes[n].exited, fmt::format("{} node {} still runs at the end", l.inc, n));
      }
    }
    Check(held_.empty(), fmt::format("{} asks still held at the lighthouse", held_.size()));
    while (!events_.empty()) events_.pop();
  }

  struct Reply {
    Status status;
    ag::Quorum quorum;
  };

  const TimePoint kStart = TimePoint{} + std::chrono::hours(1);
  uint64_t seed_;
  std::mt19937_64 rng_;
  SimStats* stats_;
  lh::CoreOptions options_;
  Millis quorum_timeout_{3000};
  bool ask_ahead_ = true;
  std::unique_ptr<lh::LighthouseCore> lh_;
  TimePoint now_ = kStart;
  TimePoint lh_down_until_ = kStart;
  TimePoint chaos_end_ = kStart + Millis(30'000);
  TimePoint end_ = kStart + Millis(75'000);
  TimePoint final_ = kStart + Millis(100'000);
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t seq_ = 0, calls_ = 0, notices_ = 0;
  int next_pid_ = 1000;
  std::vector<SimGroup> groups_;
  std::deque<Life> lives_;
  std::map<lh::AgentKey, uint64_t> held_;               // asks the lighthouse holds
  std::map<uint64_t, std::pair<int, int>> held_where_;  // call -> (life, node)
  std::map<uint64_t, Reply> replies_;                   // answers on their way
  std::map<std::tuple<int, int, uint32_t>, std::vector<lh::FailureNoticeData>> losses_;
  Disk disk_;
  std::map<uint32_t, std::set<std::string>> memberships_;  // quorum id -> member incarnations
  std::map<std::string, int> life_of_;                     // incarnation -> life
  std::string error_;
  bool trace_ = std::getenv("LK_SIM_TRACE") != nullptr;
};

}  // namespace

std::string RunAgentSim(uint64_t seed, SimStats* stats) { return AgentSim(seed, stats).Run(); }

}  // namespace lk::sim
