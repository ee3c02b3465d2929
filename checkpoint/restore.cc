#include "checkpoint/restore.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "checkpoint/format.h"
#include "checkpoint/store.h"
#include "common/log.h"

namespace lk::ckpt {
namespace {

class Fetch {
 public:
  Fetch(const Manifest& m, const RestorePlan& plan, const std::vector<Source*>& sources,
        const FetchOptions& options, RestoredState* out)
      : m_(m), plan_(plan), sources_(sources), options_(options), out_(out),
        alive_(sources.size(), true), stats_(sources.size()) {
    for (size_t i = 0; i < sources.size(); ++i) stats_[i].name = sources[i]->name();
    for (size_t i = 0; i < plan.reads.size(); ++i) queue_.push_back(i);
  }

  Status Run() {
    std::vector<std::thread> workers;
    for (size_t s = 0; s < sources_.size(); ++s) {
      for (uint32_t k = 0; k < std::max<uint32_t>(1, options_.streams_per_source); ++k) {
        workers.emplace_back([this, s] { Work(s); });
      }
    }
    Status result;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return done_ == plan_.reads.size() || Stuck(&result); });
      abort_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers) t.join();
    return done_ == plan_.reads.size() ? Status::Ok() : result;
  }

  std::vector<SourceReport> stats() const { return stats_; }

 private:
  // True (with the reason) when some queued read has no live source left to serve it.
  bool Stuck(Status* why) {
    for (size_t idx : queue_) {
      const std::string& file = m_.files[plan_.reads[idx].file].name;
      bool any = false;
      for (size_t s = 0; s < sources_.size() && !any; ++s) any = alive_[s] && sources_[s]->Has(file);
      if (any) continue;
      std::string reasons;
      for (const auto& st : stats_) {
        if (st.dropped) reasons += fmt::format("; {} dropped: {}", st.name, st.reason);
      }
      *why = Error(last_error_code_, "no live source holds {}{}", file, reasons);
      return true;
    }
    return false;
  }

  // Takes the first queued read that source `s` can serve, or returns false when the worker
  // should stop.
  bool Take(size_t s, size_t* idx) {
    std::unique_lock lock(mu_);
    while (true) {
      if (abort_ || !alive_[s] || done_ == plan_.reads.size()) return false;
      for (auto it = queue_.begin(); it != queue_.end(); ++it) {
        if (sources_[s]->Has(m_.files[plan_.reads[*it].file].name)) {
          *idx = *it;
          queue_.erase(it);
          return true;
        }
      }
      cv_.wait(lock);
    }
  }

  // Checks the read's chunks in order as their bytes land: each piece is hashed right after the
  // socket put it in dst, while it is still in cache, instead of reading 16 MiB back from memory
  // once the whole read is in.
  class ChunkChecker {
   public:
    ChunkChecker(const ReadOp& r, const uint8_t* dst, Xxh3Stream* hash)
        : r_(r), dst_(dst), hash_(hash) {
      hash_->Reset();
    }
    void Landed(uint64_t landed) {
      if (landed < landed_) {
        // The source started over (a retry on a fresh connection rewrites dst from the start):
        // every chunk is hashed again from the new bytes.
        next_ = 0;
        fed_ = 0;
        bad_ = nullptr;
        hash_->Reset();
      }
      landed_ = landed;
      while (next_ < r_.checks.size() && !bad_) {
        const ChunkCheck& c = r_.checks[next_];
        uint64_t from = c.offset + fed_, end = c.offset + c.length, to = std::min(landed, end);
        if (to > from) {
          hash_->Update(dst_ + from, to - from);
          fed_ += to - from;
        }
        if (to < end) return;
        if (hash_->Digest() != c.xxh3) {
          bad_ = &c;
          return;
        }
        ++next_;
        fed_ = 0;
        hash_->Reset();
      }
    }
    // The first chunk that failed, or nullptr when every chunk landed and matched.
    const ChunkCheck* Finish() {
      Landed(r_.length);
      return bad_;
    }

   private:
    const ReadOp& r_;
    const uint8_t* dst_;
    Xxh3Stream* hash_;
    uint64_t landed_ = 0;
    size_t next_ = 0;   // the chunk being hashed
    uint64_t fed_ = 0;  // its bytes hashed so far
    const ChunkCheck* bad_ = nullptr;
  };

  Status DoRead(size_t s, const ReadOp& r, Buffer* scratch, Xxh3Stream* hash) {
    const std::string& file = m_.files[r.file].name;
    bool direct = r.copies.size() == 1 && r.copies[0].src_offset == 0 && r.copies[0].length == r.length;
    uint8_t* dst;
    if (direct) {
      dst = out_->tensors[r.copies[0].tensor].data.data() + r.copies[0].dst_offset;
    } else {
      if (scratch->size() < r.length) *scratch = Buffer(r.length);
      dst = scratch->data();
    }
    ChunkChecker checker(r, dst, hash);
    LK_RETURN_IF_ERROR(
        sources_[s]->Read(file, r.offset, r.length, dst, [&](uint64_t n) { checker.Landed(n); }));
    if (const ChunkCheck* c = checker.Finish()) {
      return Error(Code::kDataLoss, "{}: {} bytes {}..{}: chunk checksum mismatch",
                   sources_[s]->name(), file, r.offset + c->offset,
                   r.offset + c->offset + c->length);
    }
    if (!direct) {
      for (const auto& c : r.copies) {
        std::memcpy(out_->tensors[c.tensor].data.data() + c.dst_offset, dst + c.src_offset, c.length);
      }
    }
    return Status::Ok();
  }

  void Work(size_t s) {
    Buffer scratch;
    Xxh3Stream hash;
    size_t idx;
    while (Take(s, &idx)) {
      const ReadOp& r = plan_.reads[idx];
      Status st = DoRead(s, r, &scratch, &hash);
      {
        std::lock_guard lock(mu_);
        if (st.ok()) {
          ++done_;
          stats_[s].bytes += r.length;
          ++stats_[s].reads;
        } else {
          queue_.push_front(idx);
          if (alive_[s]) {
            alive_[s] = false;
            stats_[s].dropped = true;
            stats_[s].reason = st.ToString();
            last_error_code_ = st.code();
            LK_LOG_WARN("restore_source_dropped source={} error={}", stats_[s].name, Q(st.ToString()));
          }
        }
      }
      cv_.notify_all();
      if (!st.ok()) return;
      if (options_.on_read_done) options_.on_read_done(s, r.length);
    }
  }

  const Manifest& m_;
  const RestorePlan& plan_;
  const std::vector<Source*>& sources_;
  const FetchOptions& options_;
  RestoredState* out_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<size_t> queue_;
  size_t done_ = 0;
  bool abort_ = false;
  std::vector<bool> alive_;
  std::vector<SourceReport> stats_;
  Code last_error_code_ = Code::kUnavailable;
};

}  // namespace

Result<RestoredState> ExecutePlan(const Manifest& m, const RestorePlan& plan,
                                  const std::vector<Source*>& sources, const FetchOptions& options,
                                  FetchReport* report) {
  auto start = std::chrono::steady_clock::now();
  RestoredState out;
  out.step = plan.step;
  out.ranks = plan.layout.ranks;
  out.rank = plan.layout.rank;
  out.metadata = m.metadata;
  for (const auto& t : plan.tensors) {
    uint8_t* dst = options.into ? options.into(t) : nullptr;
    // Huge pages: a fresh buffer is filled once, by the fetch.
    out.tensors.push_back(RestoredTensor{
        t.name, t.dtype, t.shape, t.rows,
        dst != nullptr ? Buffer::Borrow(dst, t.bytes) : Buffer(t.bytes, /*huge_pages=*/true)});
  }
  if (sources.empty() && !plan.reads.empty()) return InvalidArgument("restore with no source");
  Fetch fetch(m, plan, sources, options, &out);
  Status st = fetch.Run();
  if (report != nullptr) {
    report->sources = fetch.stats();
    report->bytes = plan.read_bytes();
    report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  LK_RETURN_IF_ERROR(st);
  return out;
}

Result<RestoredState> RestoreFromDir(const std::string& dir, const RestoreOptions& options,
                                     FetchReport* report) {
  Env* env = options.env ? options.env : Env::Default();
  LK_ASSIGN_OR_RETURN(Manifest m, LoadManifest(env, dir));
  LK_RETURN_IF_ERROR(CheckFiles(env, dir, m));
  LK_ASSIGN_OR_RETURN(RestorePlan plan, PlanRestore(m, options.layout, options.plan));
  FileSource source(env, dir, m);
  if (options.drop_cache) LK_RETURN_IF_ERROR(source.DropCaches());
  if (report != nullptr) report->dir = dir;
  return ExecutePlan(m, plan, {&source}, options.fetch, report);
}

Result<RestoredState> RestoreLatest(const std::string& root, const RestoreOptions& options,
                                    FetchReport* report) {
  Env* env = options.env ? options.env : Env::Default();
  LK_ASSIGN_OR_RETURN(auto refs, ListCommitted(env, root));
  std::vector<std::string> skipped;
  for (const auto& r : refs) {
    auto state = RestoreFromDir(r.dir, options, report);
    if (state.ok()) {
      if (report != nullptr) report->skipped = skipped;
      return state;
    }
    // A bad argument (layout) fails the same way everywhere: do not mask it as damage.
    if (state.status().code() == Code::kInvalidArgument) return state.status();
    LK_LOG_WARN("restore_skipped_checkpoint dir={} error={}", r.dir, Q(state.status().ToString()));
    skipped.push_back(state.status().ToString());
  }
  if (report != nullptr) report->skipped = skipped;
  std::string why;
  for (const auto& s : skipped) why += "; " + s;
  return Error(Code::kNotFound, "no complete checkpoint in {}{}", root, why);
}

}  // namespace lk::ckpt
