// Live recovery: after each commit a trainer publishes its state (global weights, outer optimizer
// state) into a node-local directory (e.g. /dev/shm/lk-live/JOB), in the checkpoint format and by
// the same atomic commit, one root per rank (rank-00003/step-.../). The node's agent serves that
// directory with a ShardServer; a healing group's agents call RecoverFromPeers with the agents
// the lighthouse's plan names, which merges the ranks' partial manifests (replicas of one rank
// write identical shards, so any of them serves any chunk), plans for the healing layout and
// fetches striped over all of them.
// Thread-safety: LiveStatePublisher::Publish may be called from several threads (one per rank);
// RecoverFromPeers is safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/planner.h"
#include "checkpoint/restore.h"
#include "checkpoint/source.h"
#include "checkpoint/writer.h"

namespace lk::ckpt {

struct LivePublisherOptions {
  std::string base_dir;  // node-local, e.g. /dev/shm/lk-live/JOB
  // Two: a peer still fetching the previous step is not cut off by the next publish.
  uint32_t keep = 2;
  uint64_t chunk_bytes = kDefaultChunkBytes;
  Env* env = nullptr;
};

// base_dir/rank-00003
std::string LiveRankRoot(const std::string& base_dir, uint32_t rank);

class LiveStatePublisher {
 public:
  explicit LiveStatePublisher(LivePublisherOptions options) : options_(std::move(options)) {}
  // Writes this rank's state as a committed partial checkpoint of its step.
  Result<SaveResult> Publish(const Snapshot& snapshot);

 private:
  LivePublisherOptions options_;
};

struct PeerRecoveryOptions {
  PeerOptions peer;
  TargetLayout layout;
  int64_t step = -1;  // the step the plan names; -1: the newest any peer serves
  PlanOptions plan;
  FetchOptions fetch;
};

// Fetches this rank's state (layout) of `step` from the peers' shard servers. Peers that do not
// answer or hold another step are left out; reads are striped over the rest; a peer that fails
// mid-transfer or sends wrong bytes is dropped and its reads go to the others.
Result<RestoredState> RecoverFromPeers(const std::vector<std::string>& peer_urls,
                                       const PeerRecoveryOptions& options,
                                       FetchReport* report = nullptr);

}  // namespace lk::ckpt
