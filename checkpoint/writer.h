// The checkpoint writer: each rank writes its own shard; the save becomes visible only by an
// atomic commit, so a crash at any instant leaves the previous checkpoint intact and found.
//
// Commit protocol (WriterOptions::commit == kGroup), for the ranks of one group sharing ROOT
// (the same node-local directory, or a shared filesystem seen by several nodes):
//   1. every rank writes ROOT/.tmp-step-S-ATTEMPT/shard-R-of-N.safetensors and fsyncs it;
//   2. it writes its receipt (a partial manifest of its slices) beside it, atomically by rename,
//      and fsyncs the directory;
//   3. it lists the receipts; the rank that sees all N takes COMMIT.lock with O_EXCL (the last
//      rank to finish, or one of several finishing together), merges the receipts into MANIFEST
//      (fsync), renames the temp directory to ROOT/step-S, fsyncs ROOT, and moves LATEST by
//      rename; then it applies retention.
// O_CREAT|O_EXCL and rename are atomic on local filesystems and on NFSv3+/Lustre/GPFS, which is
// all the protocol needs from a shared filesystem. Ranks on nodes that share no filesystem
// cannot make one durable checkpoint together; each can publish its own state (kRank).
//
// kRank: the rank commits alone; its manifest is partial (only its slices). Live state uses this:
// every rank publishes into its own node-local root, and a healing group merges the partial
// manifests that peers serve.
//
// Retention keeps the newest `keep` valid committed checkpoints; temp directories never count,
// and those of steps at or below the newest commit are removed (stale attempts).
//
// Thread-safety: CheckpointWriter::Save may be called from several threads for different ranks;
// AsyncCheckpointWriter is safe from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "checkpoint/env.h"
#include "checkpoint/manifest.h"
#include "checkpoint/types.h"
#include <lightkeeper/status.h>

namespace lk::ckpt {

struct WriterOptions {
  std::string root;  // the directory holding step-* checkpoints; created when missing
  // Newest valid checkpoints kept; older ones are deleted after each commit. 0 keeps all.
  uint32_t keep = 3;
  // Checksum granularity: a corrupt byte costs at most one chunk re-read from another source.
  uint64_t chunk_bytes = kDefaultChunkBytes;
  enum class Commit { kGroup, kRank };
  Commit commit = Commit::kGroup;
  // Bytes handed to one write(2); big enough for full disk speed.
  uint64_t write_bytes_max = uint64_t{64} << 20;
  Env* env = nullptr;  // nullptr: Env::Default()
  Status Validate() const;
};

struct SaveResult {
  bool committed = false;  // whether this call committed the checkpoint
  std::string dir;         // the committed directory, when committed
  uint64_t bytes = 0;      // shard bytes this rank wrote
};

class CheckpointWriter {
 public:
  explicit CheckpointWriter(WriterOptions options);
  // Writes this rank's shard and, when it completes the group (or commit == kRank), commits.
  // On any error nothing visible changes: the temp directory stays until a later commit's
  // retention removes it, and the error names the file.
  Result<SaveResult> Save(const Snapshot& snapshot);
  const WriterOptions& options() const { return options_; }

 private:
  Result<Manifest> WriteShard(const Snapshot& s, const std::string& tmp);
  Result<bool> TryCommit(const Snapshot& s, const std::string& tmp, const Manifest& own);
  Status Commit(const Manifest& m, const std::string& tmp, const std::string& final_dir);
  Status ApplyRetention(int64_t newest_step);

  WriterOptions options_;
  Env* env_;
};

// Checks a snapshot before anything is written: ranks, unique names, sizes against shapes.
Status ValidateSnapshot(const Snapshot& s);

struct AsyncWriterOptions {
  WriterOptions writer;
  // Snapshot bytes held at once (queued plus being written). Save blocks while a new snapshot
  // would exceed it, unless nothing is held (one snapshot larger than the bound still goes).
  uint64_t bytes_in_flight_max = uint64_t{8} << 30;
};

// The trainer hands over a snapshot and continues; one background thread writes snapshots in
// order. Errors are kept and returned by Wait() (and logged).
class AsyncCheckpointWriter {
 public:
  explicit AsyncCheckpointWriter(AsyncWriterOptions options);
  ~AsyncCheckpointWriter();  // waits for queued saves
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Queues the snapshot; blocks only for the memory bound. Fails once an earlier save failed
  // and the error was not yet collected by Wait().
  Status Save(Snapshot snapshot);
  // Waits until every queued snapshot is written; returns the first error since the last Wait.
  Status Wait();
  uint64_t bytes_in_flight() const;
  int64_t last_committed_step() const;

 private:
  void Run();

  AsyncWriterOptions options_;
  CheckpointWriter writer_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Snapshot> queue_;
  uint64_t bytes_in_flight_ = 0;
  bool busy_ = false;
  bool stopping_ = false;
  Status error_;
  int64_t last_committed_step_ = -1;
  std::thread thread_;
};

}  // namespace lk::ckpt
