#include "checkpoint/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

namespace lk::ckpt {

Status ErrnoStatus(int err, std::string_view what, const std::string& path) {
  Code code = Code::kInternal;
  switch (err) {
    case ENOENT: code = Code::kNotFound; break;
    case ENOSPC:
    case EDQUOT: code = Code::kResourceExhausted; break;
    case EEXIST:
    case ENOTEMPTY: code = Code::kConflict; break;
    case EACCES:
    case EPERM: code = Code::kPermissionDenied; break;
    case EIO: code = Code::kDataLoss; break;
    default: break;
  }
  return Error(code, "{} {}: {}", what, path, std::strerror(err));
}

namespace {

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  Status Append(const void* data, uint64_t size) override {
    auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      // Linux writes at most ~2 GiB per call; loop on short writes.
      ssize_t n = ::write(fd_, p, std::min<uint64_t>(size, uint64_t{1} << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "write", path_);
      }
      p += n;
      size -= static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }
  Status Sync() override {
    if (::fdatasync(fd_) != 0) return ErrnoStatus(errno, "fsync", path_);
    return Status::Ok();
  }
  Status Close() override {
    int fd = fd_;
    fd_ = -1;
    if (fd >= 0 && ::close(fd) != 0) return ErrnoStatus(errno, "close", path_);
    return Status::Ok();
  }
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
  int fd_;
};

class PosixRandomAccessFile final : public RandomAccessFile {
 public:
  PosixRandomAccessFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixRandomAccessFile() override { ::close(fd_); }
  Status Read(uint64_t offset, uint64_t size, uint8_t* dst) const override {
    while (size > 0) {
      ssize_t n = ::pread(fd_, dst, std::min<uint64_t>(size, uint64_t{1} << 30),
                          static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "read", path_);
      }
      if (n == 0) return Error(Code::kDataLoss, "read {}: file ends at {}", path_, offset);
      dst += n;
      offset += static_cast<uint64_t>(n);
      size -= static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }
  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }
  void DropCache() const override { ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED); }
  int fd() const override { return fd_; }

 private:
  std::string path_;
  int fd_;
  uint64_t size_;
};

class PosixEnv final : public Env {
 public:
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    return Open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC);
  }
  Result<std::unique_ptr<WritableFile>> NewExclusiveFile(const std::string& path) override {
    return Open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC);
  }
  Result<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "stat", path);
    }
    // Sequential hint: the kernel reads ahead further, which large restores want.
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    return std::unique_ptr<RandomAccessFile>(
        std::make_unique<PosixRandomAccessFile>(path, fd, static_cast<uint64_t>(st.st_size)));
  }
  Status CreateDir(const std::string& path) override {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) return ErrnoStatus(ec.value(), "mkdir", path);
    return Status::Ok();
  }
  Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoStatus(errno, "rename to " + to + " from", from);
    return Status::Ok();
  }
  Status SyncDir(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open dir", path);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus(err, "fsync dir", path);
    return Status::Ok();
  }
  Status RemoveFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, "unlink", path);
    return Status::Ok();
  }
  Status RemoveDirRecursive(const std::string& path) override {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) return ErrnoStatus(ec.value(), "remove", path);
    return Status::Ok();
  }
  Result<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return ErrnoStatus(errno, "list", path);
    std::vector<std::string> names;
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(std::move(n));
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    return names;
  }
  bool Exists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }
  bool IsDir(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }
  int64_t NowUnixMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

 private:
  Result<std::unique_ptr<WritableFile>> Open(const std::string& path, int flags) {
    int fd = ::open(path.c_str(), flags, 0644);
    if (fd < 0) return ErrnoStatus(errno, "create", path);
    return std::unique_ptr<WritableFile>(std::make_unique<PosixWritableFile>(path, fd));
  }
};

}  // namespace

Env* Env::Default() {
  static PosixEnv env;
  return &env;
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string DirName(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Result<std::string> ReadFileToString(Env* env, const std::string& path) {
  LK_ASSIGN_OR_RETURN(auto f, env->NewRandomAccessFile(path));
  std::string out(f->size(), '\0');
  LK_RETURN_IF_ERROR(f->Read(0, out.size(), reinterpret_cast<uint8_t*>(out.data())));
  return out;
}

Status WriteFileAtomic(Env* env, const std::string& path, std::string_view data) {
  std::string tmp = path + ".tmp";
  LK_ASSIGN_OR_RETURN(auto f, env->NewWritableFile(tmp));
  LK_RETURN_IF_ERROR(f->Append(data.data(), data.size()));
  LK_RETURN_IF_ERROR(f->Sync());
  LK_RETURN_IF_ERROR(f->Close());
  LK_RETURN_IF_ERROR(env->Rename(tmp, path));
  return env->SyncDir(DirName(path));
}

Status CreateDirDurable(Env* env, const std::string& path) {
  // The missing ancestors, outermost first: each one's entry lives in its parent, which must be
  // synced after it is created (the parent of the outermost one existed already).
  std::vector<std::string> missing;
  for (std::string p = path; !p.empty() && p != "/" && p != "." && !env->Exists(p); p = DirName(p)) {
    missing.push_back(p);
  }
  LK_RETURN_IF_ERROR(env->CreateDir(path));
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    LK_RETURN_IF_ERROR(env->SyncDir(DirName(*it)));
  }
  return Status::Ok();
}

}  // namespace lk::ckpt
