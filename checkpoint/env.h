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

#include "common/status.h"

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

// Wraps an Env and fails chosen operations on paths that contain `path_match`.
class FaultEnv final : public Env {
 public:
  explicit FaultEnv(Env* base) : base_(base) {}

  // After `bytes` more bytes are appended to matching files, appends fail with ENOSPC.
  void FailWritesAfter(uint64_t bytes, std::string path_match = "");
  void FailSyncs(std::string path_match);
  void FailRenames(std::string path_match);
  void Clear();
  uint64_t faults_hit() const { return faults_hit_.load(); }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override;
  Result<std::unique_ptr<WritableFile>> NewExclusiveFile(const std::string& path) override;
  Result<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(const std::string& path) override {
    return base_->NewRandomAccessFile(path);
  }
  Status CreateDir(const std::string& path) override { return base_->CreateDir(path); }
  Status Rename(const std::string& from, const std::string& to) override;
  Status SyncDir(const std::string& path) override { return base_->SyncDir(path); }
  Status RemoveFile(const std::string& path) override { return base_->RemoveFile(path); }
  Status RemoveDirRecursive(const std::string& path) override {
    return base_->RemoveDirRecursive(path);
  }
  Result<std::vector<std::string>> ListDir(const std::string& path) override {
    return base_->ListDir(path);
  }
  bool Exists(const std::string& path) override { return base_->Exists(path); }
  bool IsDir(const std::string& path) override { return base_->IsDir(path); }
  int64_t NowUnixMs() override { return base_->NowUnixMs(); }

  // Used by the wrapped files.
  Status BeforeAppend(const std::string& path, uint64_t size);
  Status BeforeSync(const std::string& path);

 private:
  bool Matches(const std::string& match, const std::string& path) const;

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
};

}  // namespace lk::ckpt
