// Restore: runs a RestorePlan over any set of sources. Reads are striped over every source that
// holds the file (each source runs `streams_per_source` workers pulling from one queue, so a
// faster source takes more), every chunk's XXH3 is checked, and a source that fails or sends
// wrong bytes is dropped and its reads go to the others. Also the two entry points most callers
// want: restore from a checkpoint directory, and from the newest good checkpoint of a root.
// Thread-safety: the functions are safe from any thread; they start and join their own workers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/env.h"
#include "checkpoint/planner.h"
#include "checkpoint/source.h"
#include "checkpoint/types.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

struct FetchOptions {
  // Concurrent reads per source: enough to keep a disk queue or a TCP pipe full.
  uint32_t streams_per_source = 4;
  // Called after each verified read (from a worker thread): source index and bytes.
  std::function<void(size_t source, uint64_t bytes)> on_read_done;
  // Where a tensor's bytes go: memory of the caller's for exactly `t.bytes` (this rank's rows),
  // or nullptr for a fresh buffer. Filling memory the caller already has (the model's own
  // tensors, touched before) skips the page faults and zeroing that a fresh buffer costs, about
  // a fifth of a peer recovery's CPU, and the copy out of it afterwards. The memory must stay
  // valid while the RestoredState lives; after a failed restore it holds partial data.
  std::function<uint8_t*(const TargetTensor& t)> into;
};

struct SourceReport {
  std::string name;
  uint64_t bytes = 0;
  uint64_t reads = 0;
  bool dropped = false;
  std::string reason;  // why it was dropped
};

struct FetchReport {
  std::vector<SourceReport> sources;
  uint64_t bytes = 0;
  double seconds = 0;
  std::string dir;  // the checkpoint restored, for RestoreFromDir / RestoreLatest
  std::vector<std::string> skipped;  // newer checkpoints skipped as damaged, with the reason
};

Result<RestoredState> ExecutePlan(const Manifest& m, const RestorePlan& plan,
                                  const std::vector<Source*>& sources, const FetchOptions& options,
                                  FetchReport* report = nullptr);

struct RestoreOptions {
  TargetLayout layout;
  PlanOptions plan;
  // One read at a time per file source: with the kernel's sequential readahead that matched fio
  // on the disks measured (bench/checkpoint.md), while four interleaved streams ran at 0.7x of
  // it. A parallel filesystem (Lustre, GPFS) wants more: raise streams_per_source there.
  FetchOptions fetch = [] {
    FetchOptions f;
    f.streams_per_source = 1;
    return f;
  }();
  Env* env = nullptr;       // nullptr: Env::Default()
  bool drop_cache = false;  // evict the shards from the page cache first (benchmarks)
};

Result<RestoredState> RestoreFromDir(const std::string& dir, const RestoreOptions& options,
                                     FetchReport* report = nullptr);
// The newest committed checkpoint of `root` that restores cleanly; a damaged newer one is
// skipped (logged, and listed in report->skipped) and the previous one used.
Result<RestoredState> RestoreLatest(const std::string& root, const RestoreOptions& options,
                                    FetchReport* report = nullptr);

}  // namespace lk::ckpt
