#include "lighthouse/memory_state_store.h"

#include <map>
#include <mutex>
#include <tuple>

namespace lk::lighthouse {
namespace {

template <class Map>
std::vector<typename Map::mapped_type> Values(const Map& m) {
  std::vector<typename Map::mapped_type> out;
  out.reserve(m.size());
  for (const auto& [k, v] : m) out.push_back(v);
  return out;
}

// Records are kept by the same keys as the RocksDB layout (job; job and group; job and step;
// job, quorum_id and key), so loads come back in the same order within a job.
class MemoryStateStore final : public StateStore {
 public:
  Status Apply(const std::vector<JobRecordData>& jobs,
               const std::vector<CheckpointData>& checkpoints,
               const std::vector<std::string>& forget_jobs,
               const std::vector<GroupRecordData>& groups,
               const std::vector<std::pair<std::string, std::string>>& drop_groups,
               bool /*sync*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    // As in the RocksDB batch: deletes of forgotten jobs first, then the puts.
    for (const auto& job : forget_jobs) {
      jobs_.erase(job);
      EraseJob(&groups_, job);
      EraseJob(&checkpoints_, job);
      EraseJob(&kv_, job);
    }
    for (const auto& j : jobs) jobs_[j.job] = j;
    for (const auto& g : groups) groups_[{g.job, g.group_id}] = g;
    for (const auto& key : drop_groups) groups_.erase(key);
    for (const auto& c : checkpoints) checkpoints_[{c.job, c.step}] = c;
    return Status::Ok();
  }

  Result<std::vector<JobRecordData>> LoadJobs() override {
    std::lock_guard<std::mutex> lock(mu_);
    return Values(jobs_);
  }
  Result<std::vector<GroupRecordData>> LoadGroups() override {
    std::lock_guard<std::mutex> lock(mu_);
    return Values(groups_);
  }
  Result<std::vector<CheckpointData>> LoadCheckpoints() override {
    std::lock_guard<std::mutex> lock(mu_);
    return Values(checkpoints_);
  }

  Status PutKv(const KvEntry& entry) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[{entry.job, entry.quorum_id, entry.key}] = entry;
    return Status::Ok();
  }
  Result<std::vector<KvEntry>> LoadKv() override {
    std::lock_guard<std::mutex> lock(mu_);
    return Values(kv_);
  }
  Status DeleteKvBelow(const std::string& job, uint32_t keep_from) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_.erase(kv_.lower_bound({job, 0, ""}), kv_.lower_bound({job, keep_from, ""}));
    return Status::Ok();
  }
  Status DeleteCheckpoint(const std::string& job, uint32_t step) override {
    std::lock_guard<std::mutex> lock(mu_);
    checkpoints_.erase({job, step});
    return Status::Ok();
  }

 private:
  // Erases every entry whose key's first part is `job`.
  template <class Map>
  static void EraseJob(Map* m, const std::string& job) {
    for (auto it = m->begin(); it != m->end();) {
      if (std::get<0>(it->first) == job) it = m->erase(it);
      else ++it;
    }
  }

  std::mutex mu_;
  std::map<std::string, JobRecordData> jobs_;
  std::map<std::pair<std::string, std::string>, GroupRecordData> groups_;
  std::map<std::pair<std::string, uint32_t>, CheckpointData> checkpoints_;
  std::map<std::tuple<std::string, uint32_t, std::string>, KvEntry> kv_;
};

}  // namespace

std::unique_ptr<StateStore> NewMemoryStateStore() { return std::make_unique<MemoryStateStore>(); }

}  // namespace lk::lighthouse
