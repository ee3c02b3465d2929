// Durable lighthouse state: every job's last quorum, committed step and quorum_id, the registry
// of durable checkpoints, and the rendezvous KV. One interface; RocksDB behind it in production.
// Thread-safety: the RocksDB store is safe from any thread; the service uses it from one strand.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <lightkeeper/status.h>
#include "lighthouse/lighthouse_core.h"

namespace lk::lighthouse {

struct KvEntry {
  std::string job;
  uint32_t quorum_id = 0;
  std::string key;
  std::string value;
};

class StateStore {
 public:
  virtual ~StateStore() = default;
  // Writes all of it as one atomic batch. With `sync` the call returns only after the batch is
  // on disk (fsync of the write-ahead log); without it, it survives a process kill but not a
  // machine crash.
  // `groups` are written, `drop_groups` (job, group_id) deleted, in the same batch.
  virtual Status Apply(const std::vector<JobRecordData>& jobs,
                       const std::vector<CheckpointData>& checkpoints,
                       const std::vector<std::string>& forget_jobs,
                       const std::vector<GroupRecordData>& groups,
                       const std::vector<std::pair<std::string, std::string>>& drop_groups,
                       bool sync) = 0;
  virtual Result<std::vector<JobRecordData>> LoadJobs() = 0;
  virtual Result<std::vector<GroupRecordData>> LoadGroups() = 0;
  virtual Result<std::vector<CheckpointData>> LoadCheckpoints() = 0;

  // Rendezvous values are cheap to lose only in a machine crash (members re-put them), so they
  // are written without sync.
  virtual Status PutKv(const KvEntry& entry) = 0;
  virtual Result<std::vector<KvEntry>> LoadKv() = 0;
  // Deletes every KV entry of `job` with a quorum_id below `keep_from`.
  virtual Status DeleteKvBelow(const std::string& job, uint32_t keep_from) = 0;
  virtual Status DeleteCheckpoint(const std::string& job, uint32_t step) = 0;
};

Result<std::unique_ptr<StateStore>> OpenRocksDbStore(const std::string& dir);

}  // namespace lk::lighthouse
