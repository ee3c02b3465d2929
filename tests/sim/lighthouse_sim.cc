// Seeded deterministic simulation of the lighthouse core: many groups (1-3 nodes) in one or two
// jobs train DiLoCo-style (ask, train, commit) while the simulation crashes and restarts them
// (new incarnations), partitions them (their requests are dropped), makes them leave or stall,
// and restarts the lighthouse itself (a new core Loaded from the last persisted records only).
// After every event it checks: quorum_id never repeats with another membership and never goes
// backwards; answers only reach waiting agents and never precede their persisted record; no
// member of an issued quorum lacks a heartbeat within heartbeat_timeout; NextDeadline is never
// in the past after a Tick. After a calm period every group must have been answered, and when
// all groups leave no waiter may be left.
//
// LK_SIM_TRACE=1 prints the core's event lines as they happen (the seeds: simulation_test.cc).
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <queue>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "lighthouse/lighthouse_core.h"
#include "tests/sim/disk.h"
#include "tests/sim/sim.h"

namespace lk::sim {
namespace {

using namespace lk::lighthouse;  // NOLINT: the model speaks the core's terms throughout

using std::chrono::milliseconds;

enum class Ev { kBeat, kAsk, kDeadline, kTrainDone, kFault, kRestart, kEnd };

struct Event {
  TimePoint at;
  uint64_t seq;
  Ev kind;
  int group = -1;
  int node = 0;
  int gen = 0;
  uint64_t req = 0;
  bool operator>(const Event& o) const { return std::tie(at, seq) > std::tie(o.at, o.seq); }
};

struct SimAgent {
  bool waiting = false;  // a request is held by the (simulated) shell
  bool answered = false;
  uint64_t req = 0;
};

struct SimGroup {
  std::string job, id, inc;
  uint32_t nodes = 1;
  uint32_t trainers = 2;  // the group's size, sent with every ask
  bool mixed = false;     // its trainers average across sizes (mixed_group_sizes)
  int gen = 0;
  bool up = true;
  bool has_state = false;
  bool training = false;
  bool shrink_only = false;   // this round's asks (only during the chaos period)
  bool size_refused = false;  // its last answer was GROUP_SIZE_MISMATCH
  uint32_t step = 0;
  uint32_t quorum_id = 0;
  TimePoint partitioned_until{}, stalled_until{};
  TimePoint last_answer{};
  std::vector<SimAgent> agents;
};

class Sim {
 public:
  Sim(uint64_t seed, SimStats* stats) : seed_(seed), rng_(seed), stats_(stats) {
    options_.min_replicas = Rand(1, 2);
    options_.join_timeout = Millis(Rand(200, 1500));
    options_.heartbeat_timeout = Millis(Rand(1000, 3000));
    options_.progress_timeout = Rand(0, 1) ? Millis(Rand(6000, 12000)) : Millis(0);
    options_.answer_members_inline = Rand(0, 1);
    // Odd seeds collect left and silent groups quickly, so that collection meets restarts,
    // requeues and partitions (derived from the seed, not drawn: the draws stay as they were).
    if (seed % 2 == 1)
      options_.group_grace = Millis(2'000 + static_cast<int64_t>(seed % 7) * 1'000);
    core_ = std::make_unique<LighthouseCore>(options_);
    // Every job gets at least two groups, so that min_replicas (1 or 2) lets it form.
    const int groups = Rand(2, 7);
    const int jobs = groups >= 4 ? Rand(1, 2) : 1;
    for (int i = 0; i < groups; ++i) {
      SimGroup g;
      g.job = fmt::format("job{}", i % jobs);
      g.id = fmt::format("g{}", i);
      g.nodes = Rand(1, 3);
      // A quarter of the seeds has a group of another size, which no quorum may hold beside
      // the others (derived from the seed, not drawn: the draws stay as they were).
      // Only where g0's job has at least two other groups, so that either size can train.
      const int job0_groups = (groups + jobs - 1) / jobs;
      g.trainers = seed % 4 == 3 && i == 0 && job0_groups >= 3 ? 1 : 2;
      // Whose trainers mix, also from the seed: nobody, everybody, all but g0, or only g0.
      switch (seed % 16 / 4) {
        case 0:
          g.mixed = false;
          break;
        case 1:
          g.mixed = true;
          break;
        case 2:
          g.mixed = i != 0;
          break;
        default:
          g.mixed = i == 0;
          break;
      }
      groups_.push_back(g);
      Start(i, now_ + Millis(Rand(0, 500)));
    }
    for (TimePoint t = now_ + Millis(1000); t < chaos_end_; t += Millis(Rand(500, 3000))) {
      Push(t, Ev::kFault);
    }
    Push(end_, Ev::kEnd);
  }

  // Runs to the end; returns an empty string or the first broken invariant.
  std::string Run() {
    while (error_.empty() && !events_.empty()) {
      std::optional<TimePoint> deadline = core_->NextDeadline();
      if (deadline && *deadline <= events_.top().at) {
        // A deadline can lie behind `now` when the inputs since were errors or carried no time
        // (they apply no timeouts); the shell's timer then fires at once.
        now_ = std::max(now_, *deadline);
        Effects fx;
        core_->Tick(now_, &fx);
        Apply(fx);
        std::optional<TimePoint> next = core_->NextDeadline();
        Check(!next || *next > now_, "NextDeadline not after the Tick that applied it");
        continue;
      }
      Event e = events_.top();
      events_.pop();
      now_ = e.at;
      Handle(e);
      if (error_.empty() && Rand(0, 9) == 0) QuietTick();
    }
    return error_;
  }

 private:
  int Rand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  void Push(TimePoint at, Ev kind, int group = -1, int node = 0, uint64_t req = 0) {
    int gen = group >= 0 ? groups_[group].gen : 0;
    events_.push(Event{at, seq_++, kind, group, node, gen, req});
  }
  void Check(bool ok, const std::string& what) {
    if (!ok && error_.empty()) {
      error_ = fmt::format("{} (at +{}ms)", what, ToMillis(now_ - kStart));
    }
  }
  bool Reachable(const SimGroup& g) const { return g.up && now_ >= g.partitioned_until; }
  Millis Beat() const { return options_.heartbeat_timeout / 3; }

  void Start(int i, TimePoint at) {
    SimGroup& g = groups_[i];
    ++g.gen;
    g.inc = fmt::format("{}-{}", g.id, g.gen);
    g.up = true;
    g.has_state = false;
    g.training = false;
    g.step = 0;
    g.agents.assign(g.nodes, SimAgent{});
    for (uint32_t n = 0; n < g.nodes; ++n) {
      Push(at, Ev::kBeat, i, static_cast<int>(n));
      Push(at + Millis(Rand(0, 300)), Ev::kAsk, i, static_cast<int>(n));
    }
  }

  void Handle(const Event& e) {
    SimGroup* g = e.group >= 0 ? &groups_[e.group] : nullptr;
    bool current = g && e.gen == g->gen && g->up;
    switch (e.kind) {
      case Ev::kBeat:
        if (!current) return;
        if (Reachable(*g)) SendBeat(e.group, e.node);
        Push(now_ + Beat(), Ev::kBeat, e.group, e.node);
        return;
      case Ev::kAsk:
        if (current) SendAsk(e.group, e.node);
        return;
      case Ev::kDeadline: {
        AgentKey key{g->job, g->id, g->inc, static_cast<uint32_t>(e.node)};
        if (!current || !g->agents[e.node].waiting || g->agents[e.node].req != e.req) return;
        core_->OnJoinTimeout(key);  // the shell answers 504
        waiters_.erase(key);
        g->agents[e.node].waiting = false;
        Reask(e.group);
        return;
      }
      case Ev::kTrainDone:
        if (current) TrainDone(e.group);
        return;
      case Ev::kRestart:
        if (g->gen == e.gen && !g->up) Start(e.group, now_);
        return;
      case Ev::kFault:
        Fault();
        return;
      case Ev::kEnd:
        End();
        return;
    }
  }

  void SendBeat(int i, int node) {
    SimGroup& g = groups_[i];
    Effects fx;
    HeartbeatInput in{g.job,   g.id,   g.inc,   static_cast<uint32_t>(node),
                      g.nodes, g.step, "train", fmt::format("{}:{}", g.id, node)};
    auto r = core_->OnHeartbeat(in, now_, &fx);
    Check(r.ok(), "heartbeat of a current incarnation failed: " + r.status().ToString());
    if (r.ok()) contact_[{g.job, g.id, g.inc, static_cast<uint32_t>(node)}] = now_;
    Apply(fx);
  }

  void SendAsk(int i, int node) {
    SimGroup& g = groups_[i];
    SimAgent& a = g.agents[node];
    if (a.waiting || a.answered || g.training) return;
    if (!Reachable(g)) {
      Push(now_ + Millis(500), Ev::kAsk, i, node);  // connection refused: try again
      return;
    }
    AgentKey key{g.job, g.id, g.inc, static_cast<uint32_t>(node)};
    a.waiting = true;
    a.req = ++req_;
    waiters_[key] = a.req;
    Push(now_ + Millis(Rand(3000, 6000)), Ev::kDeadline, i, node, a.req);
    JoinInput in{g.job,      g.id,          g.inc,       static_cast<uint32_t>(node),      g.nodes,
                 g.step,     g.shrink_only, g.has_state, fmt::format("{}:{}", g.id, node), 0,
                 g.trainers, g.mixed};
    Effects fx;
    Status st = core_->OnJoin(in, now_, &fx);
    Check(st.ok(), "ask of a current incarnation failed: " + st.ToString());
    if (st.ok()) contact_[key] = now_;
    Apply(fx);
  }

  // Every agent of the group that is neither waiting nor answered asks (again) soon.
  void Reask(int i) {
    SimGroup& g = groups_[i];
    g.shrink_only = now_ < chaos_end_ && Rand(0, 9) == 0;
    for (SimAgent& a : g.agents) a.answered = false;
    for (uint32_t n = 0; n < g.nodes; ++n) {
      Push(now_ + Millis(Rand(50, 400)), Ev::kAsk, i, static_cast<int>(n));
    }
  }

  void TrainDone(int i) {
    SimGroup& g = groups_[i];
    if (now_ < g.stalled_until) {  // a stalled trainer: heartbeats go on, the step does not
      Push(g.stalled_until, Ev::kTrainDone, i);
      return;
    }
    g.training = false;
    if (Reachable(g)) {
      bool ok = Rand(0, 19) != 0;
      std::string hash = Rand(0, 29) == 0 ? "odd" : fmt::format("h{}", g.step + 1);
      Effects fx;
      auto r =
          core_->OnCommit({g.job, g.id, g.inc, 0, g.quorum_id, g.step + 1, ok, hash}, now_, &fx);
      if (r.ok()) contact_[{g.job, g.id, g.inc, 0}] = now_;
      if (!r.ok() && trace_) {
        fmt::print("+{:>6}ms sim: commit of {} step {} refused: {}\n", ToMillis(now_ - kStart),
                   g.inc, g.step + 1, r.status().ToString());
      }
      Apply(fx);
      if (r.ok() && ok) {
        ++g.step;
        if (Rand(0, 4) == 0) {
          Effects cfx;
          CheckpointData c{g.job, g.step, fmt::format("/ckpt/{}/{}", g.id, g.step), "d", g.id, 0};
          Check(core_->OnRegisterCheckpoint(c, &cfx).ok(), "checkpoint registration failed");
          Apply(cfx);
        }
      }
    }
    Reask(i);
  }

  void Fault() {
    const int i = Rand(0, static_cast<int>(groups_.size()) - 1);
    SimGroup& g = groups_[i];
    switch (Rand(0, 5)) {
      case 0:  // crash; Slurm requeues it later as a new incarnation
        if (!g.up) return;
        g.up = false;
        ++g.gen;
        Push(now_ + Millis(Rand(500, 8000)), Ev::kRestart, i);
        return;
      case 1: {  // graceful leave, then requeue
        if (!Reachable(g)) return;
        Effects fx;
        Status st = core_->OnLeave(g.job, g.id, g.inc, "preempted", now_, &fx);
        // A group the (restarted) lighthouse has not heard from yet is unknown to it, and so is
        // a new life of a group that has not heartbeated yet: its leave changes nothing.
        Check(st.ok() || st.code() == Code::kNotFound || st.reason() == Reason::kUnknownIncarnation,
              "leave failed: " + st.ToString());
        Apply(fx);
        g.up = false;
        ++g.gen;
        Push(now_ + Millis(Rand(500, 8000)), Ev::kRestart, i);
        return;
      }
      case 2:
        g.partitioned_until = now_ + Millis(Rand(500, 6000));
        return;
      case 3:
        g.stalled_until = now_ + Millis(Rand(2000, 15000));
        return;
      case 4:
        RestartLighthouse();
        return;
      default:  // a new incarnation appears while the old one still runs (restart race)
        if (!g.up) return;
        Start(i, now_);
        return;
    }
  }

  void RestartLighthouse() {
    ++stats_->restarts;
    Status st = disk_.Restart(options_, now_, &core_);
    Check(st.ok(), "Load failed: " + st.ToString());
    for (const auto& [job, r] : disk_.jobs) {
      for (const MemberData& m : r.members) {
        for (uint32_t n = 0; n < std::max<size_t>(1, m.addresses.size()); ++n) {
          contact_[{r.job, m.group_id, m.incarnation, n}] = now_;
        }
      }
    }
    waiters_.clear();  // connections drop: agents retry
    for (size_t i = 0; i < groups_.size(); ++i) {
      SimGroup& g = groups_[i];
      bool dropped = false;
      for (SimAgent& a : g.agents) {
        dropped = dropped || a.waiting;
        a.waiting = false;
      }
      if (g.up && dropped) Reask(static_cast<int>(i));
    }
  }

  // Tick before the next deadline must change nothing.
  void QuietTick() {
    std::optional<TimePoint> next = core_->NextDeadline();
    if (next && *next <= now_) return;
    Effects fx;
    core_->Tick(now_, &fx);
    Check(fx.events.empty() && fx.answers.empty() && fx.rejections.empty(),
          "Tick before NextDeadline changed something");
  }

  void Apply(const Effects& fx) {
    stats_->issued += fx.issued.size();
    stats_->answers += fx.answers.size();
    stats_->rejections += fx.rejections.size();
    for (const Effects::Issued& is : fx.issued) stats_->changed += is.changed;
    for (const std::string& e : fx.events) ++stats_->events[e.substr(0, e.find(' '))];
    if (trace_) {
      for (const std::string& e : fx.events) {
        fmt::print("+{:>6}ms {}\n", ToMillis(now_ - kStart), e);
      }
    }
    if (std::string broken = disk_.Write(fx); !broken.empty()) Check(false, broken);
    for (const Effects::Issued& is : fx.issued) CheckIssued(is);
    for (const auto& [key, answer] : fx.answers) CheckAnswer(key, answer);
    for (const auto& [key, status] : fx.rejections) {
      auto it = waiters_.find(key);
      Check(it != waiters_.end(), "rejection for an agent that is not waiting");
      waiters_.erase(key);
      for (size_t i = 0; i < groups_.size(); ++i) {
        SimGroup& g = groups_[i];
        if (g.id != key.group_id || g.job != key.job || g.inc != key.incarnation) continue;
        g.agents[key.node_rank].waiting = false;
        if (status.reason() == Reason::kGroupSizeMismatch) {
          bool job_mixes = true;
          for (const SimGroup& o : groups_) job_mixes = job_mixes && (o.job != g.job || o.mixed);
          Check(!job_mixes,
                fmt::format("{} refused for its size in a job whose groups all mix", g.id));
          // As the agent does: leave and exit (asking again would be refused again).
          if (!g.up) continue;
          g.up = false;
          g.size_refused = true;
          Effects left;
          (void)core_->OnLeave(g.job, g.id, g.inc, "group_size_mismatch", now_, &left);
          Apply(left);
          continue;
        }
        if (g.up) Reask(static_cast<int>(i));
      }
    }
  }

  void CheckIssued(const Effects::Issued& is) {
    auto rec = disk_.jobs.find(is.job);
    Check(rec != disk_.jobs.end() && rec->second.quorum_id == is.quorum_id,
          "issued quorum not persisted in the same effects");
    if (rec == disk_.jobs.end()) return;
    std::string members;
    for (const MemberData& m : rec->second.members) {
      members += m.group_id + "/" + m.incarnation + " ";
      for (uint32_t n = 0; n < std::max<size_t>(1, m.addresses.size()); ++n) {
        auto c = contact_.find({is.job, m.group_id, m.incarnation, n});
        Check(c != contact_.end() && now_ - c->second < options_.heartbeat_timeout,
              fmt::format("quorum {} member {} node {} without a recent heartbeat", is.quorum_id,
                          m.group_id, n));
      }
    }
    uint32_t& last = last_issued_[is.job];
    Check(is.quorum_id >= last,
          fmt::format("quorum_id went back: {} after {}", is.quorum_id, last));
    // Rule 6 both ways: a change (of members, or after a failed commit) takes an id never issued
    // before; no change keeps the id the job had.
    Check(is.changed || is.quorum_id == last,
          fmt::format("an unchanged quorum of {} moved from id {} to {}", is.job, last,
                      is.quorum_id));
    last = is.quorum_id;
    auto [it, fresh] = memberships_.try_emplace({is.job, is.quorum_id}, members);
    Check(it->second == members, fmt::format("quorum {} of {} issued with two memberships: [{}] "
                                             "and [{}]",
                                             is.quorum_id, is.job, it->second, members));
    Check(!is.changed || fresh,
          fmt::format("a changed quorum reused an id: {} of {}", is.quorum_id, is.job));
  }

  void CheckAnswer(const AgentKey& key, const QuorumAnswer& a) {
    Check(waiters_.erase(key) == 1, "answer for an agent that is not waiting");
    // A replaced life is never answered again, whatever restarts happened in between.
    if (auto g = disk_.groups.find({key.job, key.group_id}); g != disk_.groups.end()) {
      for (const auto& r : g->second.retired) {
        Check(
            r.incarnation != key.incarnation,
            fmt::format("retired incarnation {} of {} was answered", r.incarnation, key.group_id));
      }
      Check(g->second.incarnation == key.incarnation && g->second.generation == a.generation,
            "an answer for another life than the persisted current one");
    }
    auto rec = disk_.jobs.find(key.job);
    Check(rec != disk_.jobs.end() && rec->second.quorum_id >= a.quorum_id,
          "answer before its quorum was persisted");
    const auto& members = a.members_shared ? *a.members_shared : a.members;
    Check(a.replica_rank < members.size() && members[a.replica_rank].group_id == key.group_id,
          "answer with a wrong replica_rank");
    // One trainer count per quorum (GROUP_SIZE_MISMATCH keeps the others out), unless every
    // member averages across sizes; each member carries its group's size.
    std::set<uint32_t> sizes;
    bool all_mixed = true;
    for (const MemberData& m : members) {
      for (const SimGroup& g : groups_) {
        if (g.job != key.job || g.id != m.group_id) continue;
        sizes.insert(g.trainers);
        all_mixed = all_mixed && g.mixed;
        Check(m.group_size == g.trainers,
              fmt::format("member {} of quorum {} carries size {}, not {}", m.group_id, a.quorum_id,
                          m.group_size, g.trainers));
      }
    }
    Check(sizes.size() <= 1 || all_mixed,
          fmt::format("quorum {} of {} holds groups of {} sizes, not all of which mix", a.quorum_id,
                      key.job, sizes.size()));
    if (sizes.size() > 1) ++stats_->mixed_answers;
    for (uint32_t s : a.source_ranks) {
      Check(s < members.size() && !members[s].heal, "a healing member named as a donor");
    }
    for (size_t i = 0; i < groups_.size(); ++i) {
      SimGroup& g = groups_[i];
      if (g.id != key.group_id || g.job != key.job || g.inc != key.incarnation) continue;
      SimAgent& agent = g.agents[key.node_rank];
      agent.waiting = false;
      agent.answered = true;
      g.quorum_id = a.quorum_id;
      g.last_answer = now_;
      g.size_refused = false;
      if (a.heal) {
        g.step = a.max_step;
        g.has_state = true;
      } else if (a.initial) {
        g.has_state = true;
      }
      bool all = true;
      for (const SimAgent& x : g.agents) all = all && x.answered;
      if (all && g.up) {
        for (SimAgent& x : g.agents) x.answered = false;
        g.training = true;
        Push(now_ + Millis(Rand(300, 2500)), Ev::kTrainDone, static_cast<int>(i));
      }
    }
  }

  void End() {
    // After the calm period every running group must have been answered recently.
    for (const SimGroup& g : groups_) {
      // A group refused for its size is answered, with the refusal, by design.
      Check(!g.up || g.size_refused || g.last_answer > chaos_end_ + Millis(15'000),
            fmt::format("{} of {} not answered in the calm period", g.id, g.job));
    }
    for (SimGroup& g : groups_) {
      if (!g.up) continue;
      Effects fx;
      Check(core_->OnLeave(g.job, g.id, g.inc, "done", now_, &fx).ok(), "final leave failed");
      Apply(fx);
      g.up = false;
      ++g.gen;
    }
    Check(waiters_.empty(),
          fmt::format("{} waiters left after every group left (first: {} {} {})", waiters_.size(),
                      waiters_.empty() ? "" : waiters_.begin()->first.group_id,
                      waiters_.empty() ? "" : waiters_.begin()->first.incarnation,
                      waiters_.empty() ? 0 : waiters_.begin()->first.node_rank));
    while (!events_.empty()) events_.pop();
  }

  const TimePoint kStart = TimePoint{} + std::chrono::hours(1);
  uint64_t seed_;
  std::mt19937_64 rng_;
  SimStats* stats_;
  CoreOptions options_;
  std::unique_ptr<LighthouseCore> core_;
  TimePoint now_ = kStart;
  TimePoint chaos_end_ = kStart + Millis(30'000);
  TimePoint end_ = kStart + Millis(60'000);
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t seq_ = 0, req_ = 0;
  std::vector<SimGroup> groups_;
  std::map<AgentKey, uint64_t> waiters_;
  std::map<AgentKey, TimePoint> contact_;  // last accepted heartbeat/ask/commit (or Load)
  Disk disk_;
  std::map<std::string, uint32_t> last_issued_;
  std::map<std::pair<std::string, uint32_t>, std::string> memberships_;
  std::string error_;
  bool trace_ = std::getenv("LK_SIM_TRACE") != nullptr;
};

}  // namespace

std::string RunLighthouseSim(uint64_t seed, SimStats* stats) { return Sim(seed, stats).Run(); }

}  // namespace lk::sim
