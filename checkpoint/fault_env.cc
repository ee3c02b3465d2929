// FaultEnv: armed failures (a full disk, a failing fsync or rename) and the lost-writes mode that
// simulates a machine crash by dropping everything not yet synced. See env.h.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <optional>

#include "checkpoint/env.h"

namespace lk::ckpt {
namespace {

bool Under(const std::string& path, const std::string& dir) {
  return path == dir || (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
                         path[dir.size()] == '/');
}

// `path` with the prefix `from` (a path or a directory above it) replaced by `to`.
void MovePath(std::string* path, const std::string& from, const std::string& to) {
  if (Under(*path, from)) *path = to + path->substr(from.size());
}

class FaultWritableFile final : public WritableFile {
 public:
  FaultWritableFile(FaultEnv* env, std::unique_ptr<WritableFile> base, uint64_t id)
      : env_(env), base_(std::move(base)), id_(id) {}
  Status Append(const void* data, uint64_t size) override {
    LK_RETURN_IF_ERROR(env_->BeforeAppend(base_->path(), size));
    LK_RETURN_IF_ERROR(base_->Append(data, size));
    written_ += size;
    return Status::Ok();
  }
  Status Sync() override {
    LK_RETURN_IF_ERROR(env_->BeforeSync(base_->path()));
    // In lost-writes mode the env only records the sync (id_ != 0); the data is durable from
    // now on as far as the simulated crash is concerned.
    if (id_ != 0) {
      env_->Synced(id_, written_);
      return Status::Ok();
    }
    return base_->Sync();
  }
  Status Close() override {
    LK_RETURN_IF_ERROR(env_->BeforeClose(base_->path()));
    return base_->Close();
  }
  const std::string& path() const override { return base_->path(); }

 private:
  FaultEnv* env_;
  std::unique_ptr<WritableFile> base_;
  uint64_t id_;  // the lost-writes id, 0 when not tracked
  uint64_t written_ = 0;
};

}  // namespace

// What a crash would take away, in the order it was done. Paths are kept current: a rename
// moves every recorded path below it, and undoing one moves them back.
struct FaultEnv::Lost {
  struct File {
    std::string path;
    uint64_t synced_bytes = 0;
  };
  // A directory entry not yet made durable by a sync of its directory.
  struct Entry {
    enum Kind { kFile, kDir, kRename } kind;
    std::string path;                     // the entry (a rename's new name)
    std::string from;                     // a rename's old name
    std::optional<std::string> replaced;  // the content of the file a rename replaced
    bool to_synced = false, from_synced = false;
  };

  std::map<uint64_t, File> files;  // by id: files opened for writing since tracking began
  std::vector<Entry> entries;
  uint64_t next_id = 1;
  uint64_t ops = 0;
  std::optional<uint64_t> crash_at;
  bool crashed = false;

  void Moved(const std::string& from, const std::string& to) {
    for (auto& [id, f] : files) MovePath(&f.path, from, to);
    for (auto& e : entries) {
      MovePath(&e.path, from, to);
      MovePath(&e.from, from, to);
    }
  }
  void Removed(const std::string& path) {
    std::erase_if(files, [&](const auto& kv) { return Under(kv.second.path, path); });
  }
  void DirSynced(const std::string& dir) {
    for (auto& e : entries) {
      if (DirName(e.path) == dir) e.to_synced = true;
      if (e.kind == Entry::kRename && DirName(e.from) == dir) e.from_synced = true;
    }
    std::erase_if(entries, [](const Entry& e) {
      return e.to_synced && (e.kind != Entry::kRename || e.from_synced);
    });
  }
};

FaultEnv::FaultEnv(Env* base) : base_(base) {}
FaultEnv::~FaultEnv() = default;

void FaultEnv::FailWritesAfter(uint64_t bytes, std::string path_match) {
  std::lock_guard lock(mu_);
  write_armed_ = true;
  write_bytes_left_ = bytes;
  write_match_ = std::move(path_match);
}

void FaultEnv::FailSyncs(std::string path_match) {
  std::lock_guard lock(mu_);
  sync_armed_ = true;
  sync_match_ = std::move(path_match);
}

void FaultEnv::FailRenames(std::string path_match) {
  std::lock_guard lock(mu_);
  rename_armed_ = true;
  rename_match_ = std::move(path_match);
}

void FaultEnv::Clear() {
  std::lock_guard lock(mu_);
  write_armed_ = sync_armed_ = rename_armed_ = false;
}

void FaultEnv::TrackUnsynced() {
  std::lock_guard lock(mu_);
  lost_ = std::make_unique<Lost>();
}

void FaultEnv::CrashAfter(uint64_t ops) {
  std::lock_guard lock(mu_);
  if (lost_) lost_->crash_at = lost_->ops + ops;
}

uint64_t FaultEnv::mutating_ops() const {
  std::lock_guard lock(mu_);
  return lost_ ? lost_->ops : 0;
}

bool FaultEnv::crashed() const {
  std::lock_guard lock(mu_);
  return lost_ && lost_->crashed;
}

bool FaultEnv::Matches(const std::string& match, const std::string& path) const {
  return match.empty() || path.find(match) != std::string::npos;
}

Status FaultEnv::CountOp(std::string_view what, const std::string& path) {
  if (!lost_) return Status::Ok();
  if (!lost_->crashed && lost_->crash_at && lost_->ops >= *lost_->crash_at) lost_->crashed = true;
  if (lost_->crashed) {
    ++faults_hit_;
    return Error(Code::kUnavailable, "{} {}: simulated machine crash", what, path);
  }
  ++lost_->ops;
  return Status::Ok();
}

Status FaultEnv::BeforeAppend(const std::string& path, uint64_t size) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("write", path));
  if (!write_armed_ || !Matches(write_match_, path)) return Status::Ok();
  if (size <= write_bytes_left_) {
    write_bytes_left_ -= size;
    return Status::Ok();
  }
  write_bytes_left_ = 0;
  ++faults_hit_;
  return ErrnoStatus(ENOSPC, "write", path);
}

Status FaultEnv::BeforeSync(const std::string& path) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("fsync", path));
  if (!sync_armed_ || !Matches(sync_match_, path)) return Status::Ok();
  ++faults_hit_;
  return ErrnoStatus(EIO, "fsync", path);
}

Status FaultEnv::BeforeClose(const std::string& path) {
  std::lock_guard lock(mu_);
  return CountOp("close", path);
}

void FaultEnv::Synced(uint64_t file, uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (!lost_) return;
  auto it = lost_->files.find(file);
  if (it != lost_->files.end()) it->second.synced_bytes = bytes;
}

Result<std::unique_ptr<WritableFile>> FaultEnv::Wrap(const std::string& path, bool existed,
                                                     Result<std::unique_ptr<WritableFile>> file) {
  if (!file.ok()) return file.status();
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (lost_) {
      // Truncated or new: nothing of this file is durable until its first sync. An older
      // record of the same path is of a file that is gone.
      lost_->Removed(path);
      id = lost_->next_id++;
      lost_->files[id] = Lost::File{path, 0};
      if (!existed) lost_->entries.push_back(Lost::Entry{Lost::Entry::kFile, path, "", {}});
    }
  }
  return std::unique_ptr<WritableFile>(
      std::make_unique<FaultWritableFile>(this, std::move(*file), id));
}

Result<std::unique_ptr<WritableFile>> FaultEnv::NewWritableFile(const std::string& path) {
  {
    std::lock_guard lock(mu_);
    LK_RETURN_IF_ERROR(CountOp("create", path));
  }
  bool existed = base_->Exists(path);
  return Wrap(path, existed, base_->NewWritableFile(path));
}

Result<std::unique_ptr<WritableFile>> FaultEnv::NewExclusiveFile(const std::string& path) {
  {
    std::lock_guard lock(mu_);
    LK_RETURN_IF_ERROR(CountOp("create", path));
  }
  return Wrap(path, false, base_->NewExclusiveFile(path));
}

Status FaultEnv::CreateDir(const std::string& path) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("mkdir", path));
  std::vector<std::string> missing;
  if (lost_) {
    for (std::string p = path; !p.empty() && p != "/" && p != "." && !base_->Exists(p);
         p = DirName(p)) {
      missing.push_back(p);
    }
  }
  LK_RETURN_IF_ERROR(base_->CreateDir(path));
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    lost_->entries.push_back(Lost::Entry{Lost::Entry::kDir, *it, "", {}});
  }
  return Status::Ok();
}

Status FaultEnv::Rename(const std::string& from, const std::string& to) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("rename", from));
  if (rename_armed_ && (Matches(rename_match_, from) || Matches(rename_match_, to))) {
    ++faults_hit_;
    return ErrnoStatus(EIO, "rename", from);
  }
  std::optional<std::string> replaced;
  if (lost_ && base_->Exists(to) && !base_->IsDir(to)) {
    auto old = ReadFileToString(base_, to);
    if (!old.ok()) return old.status().WithContext("fault env: save the file a rename replaces");
    replaced = std::move(*old);
  }
  LK_RETURN_IF_ERROR(base_->Rename(from, to));
  if (lost_) {
    lost_->Removed(to);  // the replaced file
    lost_->Moved(from, to);
    lost_->entries.push_back(Lost::Entry{Lost::Entry::kRename, to, from, std::move(replaced)});
  }
  return Status::Ok();
}

Status FaultEnv::SyncDir(const std::string& path) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("fsync dir", path));
  if (!lost_) return base_->SyncDir(path);
  // Recorded, not performed (see env.h); the directory must still exist, as fsync needs it.
  if (!base_->IsDir(path)) return ErrnoStatus(ENOENT, "open dir", path);
  lost_->DirSynced(path);
  return Status::Ok();
}

Status FaultEnv::RemoveFile(const std::string& path) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("unlink", path));
  LK_RETURN_IF_ERROR(base_->RemoveFile(path));
  if (lost_) lost_->Removed(path);
  return Status::Ok();
}

Status FaultEnv::RemoveDirRecursive(const std::string& path) {
  std::lock_guard lock(mu_);
  LK_RETURN_IF_ERROR(CountOp("remove", path));
  LK_RETURN_IF_ERROR(base_->RemoveDirRecursive(path));
  if (lost_) lost_->Removed(path);
  return Status::Ok();
}

Status FaultEnv::DropUnsynced() {
  std::unique_ptr<Lost> lost;
  {
    std::lock_guard lock(mu_);
    lost = std::move(lost_);
  }
  if (!lost) return Status::Ok();
  namespace fs = std::filesystem;
  std::error_code ec;
  // Data first, at the files' current paths; then the directory entries, newest first, so that
  // each undo finds the paths as they were right after it was done.
  for (const auto& [id, f] : lost->files) {
    if (!fs::is_regular_file(f.path, ec)) continue;
    if (fs::file_size(f.path, ec) > f.synced_bytes) {
      fs::resize_file(f.path, f.synced_bytes, ec);
      if (ec) return ErrnoStatus(ec.value(), "fault env: truncate", f.path);
    }
  }
  for (size_t i = lost->entries.size(); i-- > 0;) {
    Lost::Entry e = lost->entries[i];
    if (e.kind == Lost::Entry::kRename) {
      if (fs::exists(e.path, ec)) {
        fs::rename(e.path, e.from, ec);
        if (ec) return ErrnoStatus(ec.value(), "fault env: undo rename of", e.from);
      }
      if (e.replaced) {
        // Written in place, not through a temp file: that name may be one the undo restores.
        LK_ASSIGN_OR_RETURN(auto f, base_->NewWritableFile(e.path));
        LK_RETURN_IF_ERROR(f->Append(e.replaced->data(), e.replaced->size()));
        LK_RETURN_IF_ERROR(f->Close());
      }
      // Earlier entries below the new name are below the old one again.
      lost->entries.resize(i);
      lost->Moved(e.path, e.from);
      continue;
    }
    fs::remove_all(e.path, ec);
    if (ec) return ErrnoStatus(ec.value(), "fault env: remove unsynced", e.path);
  }
  return Status::Ok();
}

}  // namespace lk::ckpt
