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
  // Peers of other groups may hold the state in other layouts (groups of different sizes):
  // parts of one layout (rank count and chunk size) merge, parts of two never do. The first
  // layout, in peer order, whose parts cover every rank is the one fetched.
  struct Layout {
    uint32_t ranks = 0;
    uint64_t chunk_bytes = 0;
    std::vector<Manifest> parts;
    std::vector<std::unique_ptr<Source>> sources;
  };
  std::vector<Layout> layouts;
  for (const auto& p : peers) {
    std::map<size_t, std::map<std::string, std::string>> files;  // layout index -> its files
    for (const auto& c : p.served) {
      if (c.manifest.step != step) continue;
      size_t li = 0;
      while (li < layouts.size() && (layouts[li].ranks != c.manifest.ranks ||
                                     layouts[li].chunk_bytes != c.manifest.chunk_bytes)) {
        ++li;
      }
      if (li == layouts.size()) {
        layouts.emplace_back();
        layouts.back().ranks = c.manifest.ranks;
        layouts.back().chunk_bytes = c.manifest.chunk_bytes;
      }
      layouts[li].parts.push_back(c.manifest);
      for (const auto& f : c.manifest.files) files[li][f.name] = c.root + "/" + c.dir;
    }
    for (auto& [li, f] : files) {
      layouts[li].sources.push_back(std::make_unique<PeerSource>(p.url, std::move(f), options.peer));
    }
  }
  if (layouts.empty()) return Error(Code::kUnavailable, "no reachable peer serves step {}", step);
  Status first_error;
  for (Layout& l : layouts) {
    auto merged = MergeManifests(l.parts);
    Status st = merged.status();
    if (st.ok() && merged->partial) {
      std::string ranks;
      for (const auto& f : merged->files) ranks += fmt::format(" {}", f.rank);
      st = Error(Code::kUnavailable, "peers serve only ranks{} of the {} of step {}", ranks,
                 merged->ranks, step);
    }
    if (!st.ok()) {
      if (first_error.ok()) first_error = st.WithContext(fmt::format("step {} from peers", step));
      continue;
    }
    LK_ASSIGN_OR_RETURN(RestorePlan plan, PlanRestore(*merged, options.layout, options.plan));
    std::vector<Source*> raw;
    for (auto& s : l.sources) raw.push_back(s.get());
    return ExecutePlan(*merged, plan, raw, options.fetch, report);
  }
  return first_error;
}

}  // namespace lk::ckpt
