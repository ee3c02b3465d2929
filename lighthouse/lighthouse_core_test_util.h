// Test helper for the lighthouse core tests: one job driven through the public inputs by a manual
// clock, keeping the effects of the last input.
// Thread-safety: none (tests only).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <lightkeeper/clock.h>
#include "lighthouse/lighthouse_core.h"

namespace lk::lighthouse::testing {

struct Harness {
  explicit Harness(CoreOptions o = {}) : options(o), core(o) {}

  Status Join(const std::string& g, uint32_t step, const std::string& inc = "i1",
              uint32_t node = 0, uint32_t nodes = 1, bool has_state = true, bool shrink = false) {
    fx = {};
    JoinInput in{job, g, inc, node, nodes, step, shrink, has_state, "addr-" + g};
    return core.OnJoin(in, clock.Now(), &fx);
  }
  Result<HeartbeatResult> Beat(const std::string& g, uint32_t step = 0,
                               const std::string& inc = "i1", uint32_t node = 0,
                               uint32_t nodes = 1, uint32_t generation = 0) {
    fx = {};
    HeartbeatInput in{job, g, inc, node, nodes, step, "train", "addr-" + g, generation};
    return core.OnHeartbeat(in, clock.Now(), &fx);
  }
  Result<bool> Commit(const std::string& g, uint32_t quorum_id, uint32_t step, bool ok = true,
                      const std::string& hash = "", const std::string& inc = "i1") {
    fx = {};
    return core.OnCommit(CommitInput{job, g, inc, 0, quorum_id, step, ok, hash}, clock.Now(),
                         &fx);
  }
  Status Leave(const std::string& g, const std::string& inc = "i1", uint32_t generation = 0) {
    fx = {};
    return core.OnLeave(job, g, inc, "preempted", clock.Now(), &fx, generation);
  }
  void Tick() {
    fx = {};
    core.Tick(clock.Now(), &fx);
  }
  const QuorumAnswer* Answer(const std::string& g, uint32_t node = 0) const {
    for (const auto& [key, a] : fx.answers) {
      if (key.group_id == g && key.node_rank == node) return &a;
    }
    return nullptr;
  }
  const Status* Rejection(const std::string& g) const {
    for (const auto& [key, st] : fx.rejections) {
      if (key.group_id == g) return &st;
    }
    return nullptr;
  }
  bool HasEvent(const std::string& prefix) const {
    return std::any_of(fx.events.begin(), fx.events.end(),
                       [&](const std::string& e) { return e.rfind(prefix, 0) == 0; });
  }
  const GroupView* Group(const std::string& g) {
    views = core.View(clock.Now());
    for (const JobView& j : views) {
      for (const GroupView& v : j.groups) {
        if (j.job == job && v.group_id == g) return &v;
      }
    }
    return nullptr;
  }
  // Forms quorum 1 of `groups` at step 0 (all join at once).
  void Form(const std::vector<std::string>& groups, uint32_t step = 0) {
    for (const std::string& g : groups) REQUIRE(Beat(g, step).ok());
    for (const std::string& g : groups) REQUIRE(Join(g, step).ok());
    REQUIRE(fx.answers.size() == groups.size());
  }

  std::string job = "j";
  CoreOptions options;
  ManualClock clock;
  LighthouseCore core;
  Effects fx;
  std::vector<JobView> views;
};

// A printable snapshot of everything View shows, to prove an input changed nothing.
inline std::string Snapshot(const LighthouseCore& core, TimePoint now) {
  std::string out;
  for (const JobView& j : core.View(now)) {
    out += j.job + " q" + std::to_string(j.quorum_id) + " c" + std::to_string(j.committed_step) +
           " " + j.last_decision + "\n";
    for (const GroupView& g : j.groups) {
      out += g.group_id + "/" + g.incarnation + " g" + std::to_string(g.generation) + " " +
             g.state + " s" + std::to_string(g.step) +
             (g.participant ? " p" : "") + (g.healthy ? " h" : "") + " " + g.reason + "\n";
    }
  }
  out += "checkpoints";
  for (const JobView& j : core.View(now)) {
    for (const CheckpointData& c : j.checkpoints) out += " " + std::to_string(c.step) + c.location;
  }
  return out + (core.NextDeadline() ? std::to_string(core.NextDeadline()->time_since_epoch().count())
                                    : "none");
}

}  // namespace lk::lighthouse::testing
