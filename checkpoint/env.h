// Env: every filesystem call the checkpoint shell makes, behind one interface (leveldb style), so
// tests can inject faults (a full disk on the Nth byte, a failing fsync or rename) and check that
// the previous checkpoint is untouched. PosixEnv is the real one; FaultEnv wraps any Env and is
// free when no fault is armed.
// Thread-safety: Env and FaultEnv are safe from any thread. A WritableFile is used by one thread;
// a RandomAccessFile may be read from many threads at once (pread).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <lightkeeper/status.h>

namespace lk::ckpt {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual Status Append(const void* data, uint64_t size) = 0;
  virtual Status Sync() = 0;  // fdatasync: the data (and size) are durable
  virtual Status Close() = 0;
  virtual const std::string& path() const = 0;
};

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Reads exactly `size` bytes at `offset`; a short file is kDataLoss naming the file.
  virtual Status Read(uint64_t offset, uint64_t size, uint8_t* dst) const = 0;
  virtual uint64_t size() const = 0;
  virtual const std::string& path() const = 0;
  // Drops the file's pages from the page cache (for benchmarks that mean to read the disk).
  virtual void DropCache() const {}
  // The open descriptor, for sendfile(2); -1 when the file is not a plain POSIX one (a test Env
  // that injects faults keeps every read going through Read).
  virtual int fd() const { return -1; }
};

class Env {
 public:
  virtual ~Env() = default;
  static Env* Default();

  // Creates or truncates.
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) = 0;
  // Fails with kConflict when the file exists: the commit lock between ranks of one group.
  virtual Result<std::unique_ptr<WritableFile>> NewExclusiveFile(const std::string& path) = 0;
  virtual Result<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(const std::string& path) = 0;
  virtual Status CreateDir(const std::string& path) = 0;  // with parents; fine when it exists
  // rename(2): replaces a file atomically; moving a directory onto a non-empty one fails.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  virtual Status SyncDir(const std::string& path) = 0;
  virtual Status RemoveFile(const std::string& path) = 0;
  virtual Status RemoveDirRecursive(const std::string& path) = 0;
  // Entry names (no "." or ".."), sorted.
  virtual Result<std::vector<std::string>> ListDir(const std::string& path) = 0;
  virtual bool Exists(const std::string& path) = 0;
  virtual bool IsDir(const std::string& path) = 0;
  virtual int64_t NowUnixMs() = 0;
};

// Reads a whole (small) file.
Result<std::string> ReadFileToString(Env* env, const std::string& path);
// Writes `path` so that a crash leaves either the old or the new content: a temp file beside it,
// fsync, rename, fsync of the directory.
Status WriteFileAtomic(Env* env, const std::string& path, std::string_view data);
std::string JoinPath(const std::string& dir, const std::string& name);
std::string DirName(const std::string& path);
// Creates `path` and its missing parents, and syncs the directory holding each one it created,
// so that the new directories survive a machine crash (CreateDir alone leaves their entries in
// the page cache).
Status CreateDirDurable(Env* env, const std::string& path);
// The Status for an errno of a call on `path` (ENOENT is kNotFound, ENOSPC kResourceExhausted...).
Status ErrnoStatus(int err, std::string_view what, const std::string& path);

// Wraps an Env and fails chosen operations on paths that contain `path_match`.
//
// Lost-writes mode (TrackUnsynced; as leveldb's fault-injection env): the env then records what
// a machine crash could take away and, at DropUnsynced, takes it away on the real disk:
//   - file data appended since the file's last Sync (the file is truncated to its synced size);
//   - directory entries (files and directories created, renames) made since the last SyncDir of
//     the directory that holds them: created entries are removed, renames are moved back (and a
//     file a rename replaced gets its old content back).
// Removals are taken as durable at once, the harsher choice for "the previous checkpoint
// survives". CrashAfter(n) chooses the crash point: the n-th mutating call from then on (create,
// append, sync, close, mkdir, rename, remove) and every one after it fail as if the machine had
// stopped, so the code under test sees an error and stops there. Syncs are recorded but not
// performed in this mode: durability is what the env simulates, and real fsyncs would only cost
// time. The base Env is used for everything else, so paths are real paths on a real disk.
class FaultEnv final : public Env {
 public:
  explicit FaultEnv(Env* base);
  ~FaultEnv() override;

  // After `bytes` more bytes are appended to matching files, appends fail with ENOSPC.
  void FailWritesAfter(uint64_t bytes, std::string path_match = "");
  void FailSyncs(std::string path_match);
  void FailRenames(std::string path_match);
  void Clear();
  uint64_t faults_hit() const { return faults_hit_.load(); }

  // Lost-writes mode; see above. Everything done before TrackUnsynced counts as durable.
  void TrackUnsynced();
  // The `ops`-th mutating call from now on fails, and all after it (0: the next one).
  void CrashAfter(uint64_t ops);
  // Mutating calls made since TrackUnsynced, and whether the chosen crash point was reached.
  uint64_t mutating_ops() const;
  bool crashed() const;
  // Reverts the disk to what was synced (see above) and leaves lost-writes mode; every file the
  // env handed out must be closed or destroyed first.
  Status DropUnsynced();

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override;
  Result<std::unique_ptr<WritableFile>> NewExclusiveFile(const std::string& path) override;
  Result<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(const std::string& path) override {
    return base_->NewRandomAccessFile(path);
  }
  Status CreateDir(const std::string& path) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status SyncDir(const std::string& path) override;
  Status RemoveFile(const std::string& path) override;
  Status RemoveDirRecursive(const std::string& path) override;
  Result<std::vector<std::string>> ListDir(const std::string& path) override {
    return base_->ListDir(path);
  }
  bool Exists(const std::string& path) override { return base_->Exists(path); }
  bool IsDir(const std::string& path) override { return base_->IsDir(path); }
  int64_t NowUnixMs() override { return base_->NowUnixMs(); }

  // Used by the wrapped files (`file` is the id the env gave the file, 0 when untracked).
  Status BeforeAppend(const std::string& path, uint64_t size);
  Status BeforeSync(const std::string& path);
  Status BeforeClose(const std::string& path);
  void Synced(uint64_t file, uint64_t bytes);

 private:
  struct Lost;  // the lost-writes state
  bool Matches(const std::string& match, const std::string& path) const;
  // Counts one mutating call in lost-writes mode; the error once the crash point is reached.
  Status CountOp(std::string_view what, const std::string& path);
  Result<std::unique_ptr<WritableFile>> Wrap(const std::string& path, bool existed,
                                             Result<std::unique_ptr<WritableFile>> file);

  Env* base_;
  mutable std::mutex mu_;
  bool write_armed_ = false;
  uint64_t write_bytes_left_ = 0;
  std::string write_match_;
  std::string sync_match_;
  std::string rename_match_;
  bool sync_armed_ = false;
  bool rename_armed_ = false;
  std::atomic<uint64_t> faults_hit_{0};
  std::unique_ptr<Lost> lost_;  // null unless in lost-writes mode
};

}  // namespace lk::ckpt
