#include "checkpoint/live.h"

#include <map>
#include <memory>

#include "common/log.h"

namespace lk::ckpt {

std::string LiveRankRoot(const std::string& base_dir, uint32_t rank) {
  return JoinPath(base_dir, fmt::format("rank-{:05}", rank));
}

Result<SaveResult> LiveStatePublisher::Publish(const Snapshot& snapshot) {
  WriterOptions w;
  w.root = LiveRankRoot(options_.base_dir, snapshot.rank);
  w.keep = options_.keep;
  w.chunk_bytes = options_.chunk_bytes;
  w.commit = WriterOptions::Commit::kRank;
  w.env = options_.env;
  return CheckpointWriter(w).Save(snapshot);
}

Result<RestoredState> RecoverFromPeers(const std::vector<std::string>& peer_urls,
                                       const PeerRecoveryOptions& options, FetchReport* report) {
  struct Held {
    std::string url;
    std::vector<ServedCheckpointInfo> served;
  };
  std::vector<Held> peers;
  std::vector<std::string> unreachable;
  int64_t step = options.step;
  for (const auto& url : peer_urls) {
    auto served = ListPeer(url, options.peer);
    if (!served.ok()) {
      LK_LOG_WARN("recovery_peer_unreachable peer={} error={}", url, Q(served.status().ToString()));
      unreachable.push_back(served.status().ToString());
      continue;
    }
    if (options.step < 0) {
      for (const auto& c : *served) step = std::max(step, c.manifest.step);
    }
    peers.push_back(Held{url, std::move(*served)});
  }
  if (step < 0) {
    std::string why;
    for (const auto& u : unreachable) why += "; " + u;
    return Error(Code::kUnavailable, "no peer serves a checkpoint{}", why);
  }
  std::vector<Manifest> parts;
  std::vector<std::unique_ptr<Source>> sources;
  for (const auto& p : peers) {
    std::map<std::string, std::string> files;
    for (const auto& c : p.served) {
      if (c.manifest.step != step) continue;
      parts.push_back(c.manifest);
      for (const auto& f : c.manifest.files) files[f.name] = c.root + "/" + c.dir;
    }
    if (!files.empty()) sources.push_back(std::make_unique<PeerSource>(p.url, std::move(files), options.peer));
  }
  if (parts.empty()) return Error(Code::kUnavailable, "no reachable peer serves step {}", step);
  auto merged = MergeManifests(parts);
  if (!merged.ok()) return merged.status().WithContext(fmt::format("step {} from peers", step));
  if (merged->partial) {
    std::string ranks;
    for (const auto& f : merged->files) ranks += fmt::format(" {}", f.rank);
    return Error(Code::kUnavailable, "peers serve only ranks{} of the {} of step {}", ranks,
                 merged->ranks, step);
  }
  LK_ASSIGN_OR_RETURN(RestorePlan plan, PlanRestore(*merged, options.layout, options.plan));
  std::vector<Source*> raw;
  for (auto& s : sources) raw.push_back(s.get());
  return ExecutePlan(*merged, plan, raw, options.fetch, report);
}

}  // namespace lk::ckpt
