// What the lighthouse's shell keeps in its store, as both simulations hold it: the last record
// of each job and group and the registered checkpoints, written from each input's effects. A
// restart loads a new core from these alone.
#pragma once

#include <fmt/format.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lighthouse/lighthouse_core.h"

namespace lk::sim {

struct Disk {
  std::map<std::string, lighthouse::JobRecordData> jobs;
  std::map<std::tuple<std::string, uint32_t, std::string>, lighthouse::CheckpointData> ckpts;
  std::map<std::pair<std::string, std::string>, lighthouse::GroupRecordData> groups;

  // Writes the records of `fx`. Returns the first rule they break, or "": a job's persisted
  // quorum id and a group's generation only go up, across restarts too.
  std::string Write(const lighthouse::Effects& fx) {
    std::string error;
    for (const lighthouse::JobRecordData& r : fx.persist_jobs) {
      auto it = jobs.find(r.job);
      if (it != jobs.end() && it->second.quorum_id > r.quorum_id && error.empty()) {
        error = fmt::format("persisted quorum_id of {} went back", r.job);
      }
      jobs[r.job] = r;
    }
    for (const lighthouse::CheckpointData& c : fx.persist_checkpoints) {
      ckpts[{c.job, c.step, c.location}] = c;
    }
    for (const lighthouse::GroupRecordData& g : fx.persist_groups) {
      auto [it, fresh] = groups.try_emplace({g.job, g.group_id}, g);
      if (!fresh && it->second.generation > g.generation && error.empty()) {
        error = fmt::format("generation of {} in {} went back", g.group_id, g.job);
      }
      it->second = g;
    }
    for (const auto& key : fx.drop_groups) groups.erase(key);
    for (const lighthouse::CheckpointData& c : fx.drop_checkpoints) {
      ckpts.erase({c.job, c.step, c.location});
    }
    return error;
  }

  // Whether the group's persisted record lists `incarnation` as a replaced life.
  bool Retired(const std::string& job, const std::string& group,
               const std::string& incarnation) const {
    auto it = groups.find({job, group});
    if (it == groups.end()) return false;
    for (const auto& r : it->second.retired) {
      if (r.incarnation == incarnation) return true;
    }
    return false;
  }

  // A restarted lighthouse: a new core that loaded the records at `now`.
  Status Restart(const lighthouse::CoreOptions& options, TimePoint now,
                 std::unique_ptr<lighthouse::LighthouseCore>* core) const {
    *core = std::make_unique<lighthouse::LighthouseCore>(options);
    std::vector<lighthouse::JobRecordData> j;
    for (const auto& [name, r] : jobs) j.push_back(r);
    std::vector<lighthouse::CheckpointData> c;
    for (const auto& [key, r] : ckpts) c.push_back(r);
    std::vector<lighthouse::GroupRecordData> g;
    for (const auto& [key, r] : groups) g.push_back(r);
    return (*core)->Load(std::move(j), std::move(c), now, std::move(g));
  }
};

}  // namespace lk::sim
