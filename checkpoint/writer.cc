#include "checkpoint/writer.h"

#include <algorithm>
#include <set>

#include "checkpoint/format.h"
#include "checkpoint/store.h"
#include "common/log.h"

namespace lk::ckpt {
namespace {

constexpr char kLockFile[] = "COMMIT.lock";
constexpr std::string_view kReceiptSuffix = ".receipt";

std::string TmpDirName(int64_t step, const std::string& attempt) {
  return fmt::format(".tmp-{}-{}", StepDirName(step), attempt);
}

// The step of a ".tmp-step-000000000042-ATTEMPT" name, or -1.
int64_t ParseTmpDirStep(std::string_view name) {
  if (name.substr(0, 5) != ".tmp-" || name.size() < 5 + 17) return -1;
  return ParseStepDirName(name.substr(5, 17));
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

Status WriterOptions::Validate() const {
  if (root.empty()) return InvalidArgument("checkpoint root is empty");
  if (chunk_bytes == 0) return InvalidArgument("chunk_bytes is 0");
  if (write_bytes_max < chunk_bytes) return InvalidArgument("write_bytes_max below chunk_bytes");
  return Status::Ok();
}

Status ValidateSnapshot(const Snapshot& s) {
  if (s.ranks == 0 || s.rank >= s.ranks) return InvalidArgument("rank {} of {} ranks", s.rank, s.ranks);
  if (s.step < 0) return InvalidArgument("negative step {}", s.step);
  if (s.attempt.empty() || s.attempt.find('/') != std::string::npos) {
    return InvalidArgument("attempt '{}' is not a plain name", s.attempt);
  }
  std::set<std::string_view> names;
  for (const auto& t : s.tensors) {
    if (t.name.empty() || !names.insert(t.name).second) {
      return InvalidArgument("tensor name '{}' is empty or repeated", t.name);
    }
    if (t.name.rfind("__", 0) == 0) return InvalidArgument("tensor name '{}' is reserved", t.name);
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgument("tensor '{}' has a negative dimension", t.name);
    }
    if (t.rows.begin < 0 || t.rows.end > RowsOf(t.shape) || t.rows.empty()) {
      return InvalidArgument("tensor '{}': rows [{},{}) outside its {} rows", t.name, t.rows.begin,
                             t.rows.end, RowsOf(t.shape));
    }
    uint64_t want = static_cast<uint64_t>(t.rows.rows()) * RowBytes(t.dtype, t.shape);
    if (t.data.size != want || (want > 0 && t.data.data == nullptr)) {
      return InvalidArgument("tensor '{}': {} bytes given, its rows need {}", t.name, t.data.size, want);
    }
  }
  return Status::Ok();
}

CheckpointWriter::CheckpointWriter(WriterOptions options)
    : options_(std::move(options)), env_(options_.env ? options_.env : Env::Default()) {}

Result<Manifest> CheckpointWriter::WriteShard(const Snapshot& s, const std::string& tmp) {
  std::vector<const SnapshotTensor*> ts;
  for (const auto& t : s.tensors) ts.push_back(&t);
  std::sort(ts.begin(), ts.end(), [](auto* a, auto* b) { return a->name < b->name; });
  ShardHeader h;
  // Only deterministic fields: replicas of one rank's state must produce identical shards, so
  // that a healing group may fetch any chunk from any of them.
  h.metadata = s.metadata;
  h.metadata["lk.step"] = std::to_string(s.step);
  h.metadata["lk.rank"] = std::to_string(s.rank);
  h.metadata["lk.ranks"] = std::to_string(s.ranks);
  uint64_t at = 0;
  for (const auto* t : ts) {
    std::vector<int64_t> local = t->shape;
    if (!local.empty()) local[0] = t->rows.rows();
    h.entries.push_back(ShardEntry{t->name, t->dtype, local, t->shape, t->rows, at, at + t->data.size});
    at += t->data.size;
  }
  std::string head = EncodeShardHeader(&h);
  std::string name = ShardFileName(s.rank, s.ranks);
  std::string path = JoinPath(tmp, name);

  Manifest own;
  own.step = s.step;
  own.ranks = s.ranks;
  own.created_unix_ms = env_->NowUnixMs();
  own.chunk_bytes = options_.chunk_bytes;
  own.metadata = s.metadata;
  own.partial = true;
  own.files.push_back(ShardFileInfo{name, s.rank, head.size() + at, head.size(),
                                    Xxh3(head.data(), head.size())});
  LK_ASSIGN_OR_RETURN(auto f, env_->NewWritableFile(path));
  LK_RETURN_IF_ERROR(f->Append(head.data(), head.size()));
  uint64_t piece_max = options_.write_bytes_max / options_.chunk_bytes * options_.chunk_bytes;
  for (size_t i = 0; i < ts.size(); ++i) {
    const SnapshotTensor& t = *ts[i];
    SliceInfo slice{0, t.rows, head.size() + h.entries[i].begin, t.data.size, {}};
    slice.chunk_xxh3.reserve(ChunkCount(t.data.size, options_.chunk_bytes));
    for (uint64_t pos = 0; pos < t.data.size; pos += piece_max) {
      uint64_t n = std::min(piece_max, t.data.size - pos);
      auto hashes = ChunkHashes(t.data.data + pos, n, options_.chunk_bytes);
      slice.chunk_xxh3.insert(slice.chunk_xxh3.end(), hashes.begin(), hashes.end());
      LK_RETURN_IF_ERROR(f->Append(t.data.data + pos, n));
    }
    own.tensors.push_back(TensorInfo{t.name, t.dtype, t.shape, {std::move(slice)}});
  }
  LK_RETURN_IF_ERROR(f->Sync());
  LK_RETURN_IF_ERROR(f->Close());
  return own;
}

Result<SaveResult> CheckpointWriter::Save(const Snapshot& s) {
  LK_RETURN_IF_ERROR(options_.Validate());
  LK_RETURN_IF_ERROR(ValidateSnapshot(s));
  // Durable: a root created by this save must not vanish with its first checkpoint in a crash.
  LK_RETURN_IF_ERROR(CreateDirDurable(env_, options_.root));
  std::string final_dir = JoinPath(options_.root, StepDirName(s.step));
  if (env_->Exists(final_dir)) {
    return Error(Code::kConflict, "{} exists: a committed checkpoint is never overwritten", final_dir);
  }
  std::string tmp = JoinPath(options_.root, TmpDirName(s.step, s.attempt));
  LK_RETURN_IF_ERROR(env_->CreateDir(tmp));
  LK_ASSIGN_OR_RETURN(Manifest own, WriteShard(s, tmp));
  SaveResult r;
  r.bytes = own.files[0].size_bytes;
  if (options_.commit == WriterOptions::Commit::kRank) {
    LK_RETURN_IF_ERROR(Commit(own, tmp, final_dir));
    r.committed = true;
  } else {
    std::string receipt = JoinPath(tmp, fmt::format("rank-{:05}{}", s.rank, kReceiptSuffix));
    Status wrote = WriteFileAtomic(env_, receipt, EncodeManifestFile(own));
    // Once this receipt is visible the last rank may commit and rename the directory under
    // our feet (the directory sync that ends WriteFileAtomic then finds it gone): the
    // checkpoint is then committed, by another rank.
    if (!wrote.ok() && env_->Exists(final_dir)) return r;
    LK_RETURN_IF_ERROR(wrote);
    LK_ASSIGN_OR_RETURN(r.committed, TryCommit(s, tmp, own));
    if (!r.committed) return r;
  }
  r.dir = final_dir;
  Status st = ApplyRetention(s.step);
  if (!st.ok()) LK_LOG_WARN("checkpoint_retention_failed root={} error={}", options_.root, Q(st.ToString()));
  return r;
}

Result<bool> CheckpointWriter::TryCommit(const Snapshot& s, const std::string& tmp,
                                         const Manifest& own) {
  std::string final_dir = JoinPath(options_.root, StepDirName(s.step));
  auto names = env_->ListDir(tmp);
  // Another rank saw every receipt first and has committed (renamed the directory): done.
  if (!names.ok() && env_->Exists(final_dir)) return false;
  LK_RETURN_IF_ERROR(names.status());
  std::vector<std::string> receipts;
  for (auto& n : *names) {
    if (EndsWith(n, kReceiptSuffix)) receipts.push_back(n);
  }
  if (receipts.size() < s.ranks) return false;
  auto lock = env_->NewExclusiveFile(JoinPath(tmp, kLockFile));
  if (!lock.ok()) {
    if (lock.status().code() == Code::kConflict) return false;  // another rank commits
    if (env_->Exists(final_dir)) return false;                  // another rank committed
    return lock.status();
  }
  LK_RETURN_IF_ERROR((*lock)->Close());
  std::vector<Manifest> parts;
  for (const auto& n : receipts) {
    std::string path = JoinPath(tmp, n);
    LK_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(env_, path));
    LK_ASSIGN_OR_RETURN(Manifest part, DecodeManifestFile(bytes, path));
    if (part.ranks != s.ranks || part.step != s.step) {
      return Error(Code::kConflict, "{}: receipt of step {} with {} ranks in a save of step {} with {}",
                   path, part.step, part.ranks, s.step, s.ranks);
    }
    parts.push_back(std::move(part));
  }
  auto merged = MergeManifests(parts);
  if (!merged.ok()) return merged.status().WithContext("merge receipts in " + tmp);
  if (merged->partial) {
    return Error(Code::kInvalidArgument, "{}: the ranks' shards do not cover every tensor", tmp);
  }
  merged->created_unix_ms = std::max(merged->created_unix_ms, own.created_unix_ms);
  for (const auto& n : receipts) {
    LK_RETURN_IF_ERROR(env_->RemoveFile(JoinPath(tmp, n)));
  }
  // The lock stays until the directory is renamed: removed earlier, a rank that had counted
  // every receipt just before could take it and commit a second time. It goes along with the
  // rename and is removed from the committed directory after (readers ignore files the
  // manifest does not name, so a crash in between leaves a valid checkpoint).
  LK_RETURN_IF_ERROR(Commit(*merged, tmp, final_dir));
  if (Status st = env_->RemoveFile(JoinPath(final_dir, kLockFile)); !st.ok()) {
    LK_LOG_WARN("checkpoint_lock_left dir={} error={}", final_dir, Q(st.ToString()));
  }
  return true;
}

Status CheckpointWriter::Commit(const Manifest& m, const std::string& tmp, const std::string& final_dir) {
  std::string manifest_path = JoinPath(tmp, kManifestFile);
  {
    std::string bytes = EncodeManifestFile(m);
    LK_ASSIGN_OR_RETURN(auto f, env_->NewWritableFile(manifest_path));
    LK_RETURN_IF_ERROR(f->Append(bytes.data(), bytes.size()));
    LK_RETURN_IF_ERROR(f->Sync());
    LK_RETURN_IF_ERROR(f->Close());
  }
  LK_RETURN_IF_ERROR(env_->SyncDir(tmp));
  if (env_->Exists(final_dir)) {
    return Error(Code::kConflict, "{} exists: a committed checkpoint is never overwritten", final_dir);
  }
  LK_RETURN_IF_ERROR(env_->Rename(tmp, final_dir));
  LK_RETURN_IF_ERROR(env_->SyncDir(options_.root));
  std::string name = StepDirName(m.step);
  LK_RETURN_IF_ERROR(WriteFileAtomic(env_, JoinPath(options_.root, kLatestFile), name + "\n"));
  LK_LOG_INFO("checkpoint_committed dir={} step={} ranks={} files={} bytes={}", final_dir, m.step,
              m.ranks, m.files.size(), m.data_bytes());
  return Status::Ok();
}

Status CheckpointWriter::ApplyRetention(int64_t newest_step) {
  const std::string& root = options_.root;
  LK_ASSIGN_OR_RETURN(auto names, env_->ListDir(root));
  std::vector<std::string> doomed;
  for (const auto& n : names) {
    int64_t tmp_step = ParseTmpDirStep(n);
    // A temp directory of an older or equal step is a crashed or superseded attempt.
    if (tmp_step >= 0 && tmp_step <= newest_step) doomed.push_back(n);
    if (n.rfind(".trash-", 0) == 0) doomed.push_back(n);
  }
  if (options_.keep > 0) {
    LK_ASSIGN_OR_RETURN(auto refs, ListCommitted(env_, root));
    uint32_t valid = 0;
    for (const auto& r : refs) {
      if (valid >= options_.keep) {
        doomed.push_back(r.name);
        continue;
      }
      auto m = LoadManifest(env_, r.dir);
      // Damaged checkpoints newer than the kept ones are left for people to look at.
      if (m.ok() && CheckFiles(env_, r.dir, *m).ok()) ++valid;
    }
  }
  for (const auto& n : doomed) {
    std::string path = JoinPath(root, n);
    // Rename first, so a checkpoint half deleted by a crash never looks like one.
    if (n.rfind(".trash-", 0) != 0) {
      std::string trash = JoinPath(root, ".trash-" + n);
      LK_RETURN_IF_ERROR(env_->Rename(path, trash));
      path = trash;
    }
    LK_RETURN_IF_ERROR(env_->RemoveDirRecursive(path));
  }
  return Status::Ok();
}

AsyncCheckpointWriter::AsyncCheckpointWriter(AsyncWriterOptions options)
    : options_(std::move(options)), writer_(options_.writer), thread_([this] { Run(); }) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Status AsyncCheckpointWriter::Save(Snapshot snapshot) {
  LK_RETURN_IF_ERROR(ValidateSnapshot(snapshot));
  uint64_t bytes = snapshot.bytes();
  std::unique_lock lock(mu_);
  if (!error_.ok()) return error_.WithContext("an earlier save failed");
  cv_.wait(lock, [&] {
    return bytes_in_flight_ == 0 || bytes_in_flight_ + bytes <= options_.bytes_in_flight_max;
  });
  bytes_in_flight_ += bytes;
  queue_.push_back(std::move(snapshot));
  cv_.notify_all();
  return Status::Ok();
}

Status AsyncCheckpointWriter::Wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  Status st = error_;
  error_ = Status::Ok();
  return st;
}

uint64_t AsyncCheckpointWriter::bytes_in_flight() const {
  std::lock_guard lock(mu_);
  return bytes_in_flight_;
}

int64_t AsyncCheckpointWriter::last_committed_step() const {
  std::lock_guard lock(mu_);
  return last_committed_step_;
}

void AsyncCheckpointWriter::Run() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued is written
    Snapshot s = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    uint64_t bytes = s.bytes();
    int64_t step = s.step;
    auto r = writer_.Save(s);
    s = Snapshot();  // release the trainer's buffers before admitting more
    if (!r.ok()) LK_LOG_ERROR("checkpoint_save_failed error={}", Q(r.status().ToString()));
    lock.lock();
    busy_ = false;
    bytes_in_flight_ -= bytes;
    if (!r.ok() && error_.ok()) error_ = r.status();
    if (r.ok() && r->committed) last_committed_step_ = std::max(last_committed_step_, step);
    cv_.notify_all();
  }
}

}  // namespace lk::ckpt
