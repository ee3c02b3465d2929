#include "checkpoint/shard_server.h"

#include <sys/mman.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "checkpoint/format.h"
#include "checkpoint/manifest_proto.h"
#include "checkpoint/store.h"

namespace lk::ckpt {
namespace {

constexpr char kRootSelf[] = "_";
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

http::Response Text(int status, std::string body) {
  http::Response r;
  r.status = status;
  r.content_type = "text/plain";
  r.body = std::move(body);
  return r;
}

bool PlainName(std::string_view s) {
  return !s.empty() && s[0] != '.' && s.find('/') == std::string_view::npos;
}

}  // namespace

// Idle response buffers. A buffer is handed out as a shared_ptr whose deleter gives it back,
// so it returns here when the http server has written the response and dropped it.
struct ShardServer::BufferPool {
  std::mutex mu;
  std::vector<std::unique_ptr<std::string>> idle;
  uint64_t idle_bytes = 0;
  uint64_t idle_bytes_max = 0;

  static std::shared_ptr<std::string> Take(const std::shared_ptr<BufferPool>& pool, size_t n) {
    std::unique_ptr<std::string> s;
    {
      std::lock_guard lock(pool->mu);
      // Reads are mostly of one size (the planner's read_bytes_max): a buffer of exactly that
      // size is reused without touching a byte; another one is resized (fills only growth).
      auto it = std::find_if(pool->idle.begin(), pool->idle.end(),
                             [n](const auto& b) { return b->size() == n; });
      if (it == pool->idle.end() && !pool->idle.empty()) it = pool->idle.end() - 1;
      if (it != pool->idle.end()) {
        s = std::move(*it);
        pool->idle.erase(it);
        pool->idle_bytes -= s->capacity();
      }
    }
    if (!s) {
      s = std::make_unique<std::string>();
      s->reserve(n);
      // Before the first touch: a new buffer is then faulted in 2 MiB at a time, not 4 KiB.
      auto begin = reinterpret_cast<uintptr_t>(s->data());
      uintptr_t aligned = (begin + kHugePage - 1) & ~(kHugePage - 1);
      uintptr_t end = (begin + n) & ~(kHugePage - 1);
      if (end > aligned) ::madvise(reinterpret_cast<void*>(aligned), end - aligned, MADV_HUGEPAGE);
    }
    s->resize(n);
    return std::shared_ptr<std::string>(s.release(), [pool](std::string* b) {
      std::unique_ptr<std::string> owned(b);
      std::lock_guard lock(pool->mu);
      if (pool->idle_bytes + owned->capacity() > pool->idle_bytes_max) return;
      pool->idle_bytes += owned->capacity();
      pool->idle.push_back(std::move(owned));
    });
  }
};

ShardServer::ShardServer(ShardServerOptions options)
    : options_(std::move(options)),
      env_(options_.env ? options_.env : Env::Default()),
      pool_(std::make_shared<BufferPool>()) {
  pool_->idle_bytes_max = options_.idle_buffer_bytes_max;
  for (uint32_t i = 0; i < options_.read_threads; ++i) {
    readers_.emplace_back([this] { ReadLoop(); });
  }
}

ShardServer::~ShardServer() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : readers_) t.join();
}

void ShardServer::ReadLoop() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;  // stopping, and every request handed over is answered
      job = std::move(work_.front());
      work_.pop_front();
    }
    job();
  }
}

http::Handler ShardServer::AsHandler() {
  return [this](http::Request&& req, http::Responder respond) { Handle(std::move(req), std::move(respond)); };
}

void ShardServer::Handle(http::Request&& req, http::Responder respond) {
  ++requests_;
  if (readers_.empty()) return respond(Serve(req));
  {
    std::lock_guard lock(mu_);
    work_.push_back(
        [this, req = std::move(req), respond = std::move(respond)] { respond(Serve(req)); });
  }
  cv_.notify_one();
}

http::Response ShardServer::Serve(const http::Request& req) {
  std::string_view path = req.path;
  if (path.substr(0, options_.prefix.size()) != options_.prefix) return Text(404, "not found\n");
  std::string_view rest = path.substr(options_.prefix.size());
  if (req.method != "GET") return Text(405, "only GET\n");
  if (rest == "/checkpoints") return ListCheckpoints();
  constexpr std::string_view kFiles = "/files/";
  if (rest.substr(0, kFiles.size()) == kFiles) return ServeFile(req, rest.substr(kFiles.size()));
  return Text(404, "not found\n");
}

http::Response ShardServer::ListCheckpoints() {
  pb::ServedCheckpoints out;
  // Every complete checkpoint of the root, newest first: a recovery plan may name an older step.
  auto add_root = [&](const std::string& root_name, const std::string& dir) {
    auto refs = ListCommitted(env_, dir);
    if (!refs.ok()) return;
    for (const auto& ref : *refs) {
      auto m = LoadManifest(env_, ref.dir);
      if (!m.ok() || !CheckFiles(env_, ref.dir, *m).ok()) continue;
      auto* c = out.add_checkpoints();
      c->set_root(root_name);
      c->set_dir(ref.name);
      ToProto(*m, c->mutable_manifest());
    }
  };
  auto names = env_->ListDir(options_.base_dir);
  if (!names.ok()) return Text(503, names.status().ToString() + "\n");
  add_root(kRootSelf, options_.base_dir);
  for (const auto& n : *names) {
    if (!PlainName(n) || ParseStepDirName(n) >= 0) continue;
    std::string dir = JoinPath(options_.base_dir, n);
    if (env_->IsDir(dir)) add_root(n, dir);
  }
  http::Response r;
  r.content_type = "application/x-protobuf";
  out.SerializeToString(&r.body);
  return r;
}

http::Response ShardServer::ServeFile(const http::Request& req, std::string_view rest) {
  // ROOT/DIR/FILE, each a plain name, DIR a committed step directory.
  auto s1 = rest.find('/');
  auto s2 = s1 == std::string_view::npos ? s1 : rest.find('/', s1 + 1);
  if (s2 == std::string_view::npos) return Text(404, "want ROOT/DIR/FILE\n");
  std::string root(rest.substr(0, s1)), dir(rest.substr(s1 + 1, s2 - s1 - 1)),
      file(rest.substr(s2 + 1));
  if (!PlainName(root) || ParseStepDirName(dir) < 0 || !PlainName(file)) {
    return Text(404, "not a served file\n");
  }
  std::string base = root == kRootSelf ? options_.base_dir : JoinPath(options_.base_dir, root);
  std::string path = JoinPath(JoinPath(base, dir), file);
  auto f = env_->NewRandomAccessFile(path);
  if (!f.ok()) return Text(f.status().code() == Code::kNotFound ? 404 : 503, f.status().ToString() + "\n");
  uint64_t size = (*f)->size(), begin = 0, end = size;
  bool ranged = !req.range.empty();
  if (Status st = ranged ? ParseRange(req.range, size, &begin, &end) : Status::Ok(); !st.ok()) {
    http::Response r = Text(416, fmt::format("range not satisfiable: {}\n", st.message()));
    r.headers.emplace_back("Content-Range", fmt::format("bytes */{}", size));
    return r;
  }
  if (end - begin > options_.range_bytes_max) {
    return Text(413, fmt::format("ask for at most {} bytes per request\n", options_.range_bytes_max));
  }
  http::Response r;
  r.status = ranged ? 206 : 200;
  r.content_type = "application/octet-stream";
  if (options_.sendfile && req.file_body_ok && (*f)->fd() >= 0) {
    // The kernel sends the file's pages itself: no read into a buffer and, on loopback, no copy
    // on this side at all. The response owns the open file until the write ends; a file
    // replaced or removed meanwhile keeps its pages (live state is never rewritten in place).
    std::shared_ptr<const RandomAccessFile> file(std::move(*f));
    r.body_file = http::FileBody{file, file->fd(), begin, end - begin};
  } else {
    auto body = BufferPool::Take(pool_, end - begin);
    Status st = (*f)->Read(begin, end - begin, reinterpret_cast<uint8_t*>(body->data()));
    if (!st.ok()) return Text(503, st.ToString() + "\n");
    r.body_tail = std::move(body);
  }
  if (ranged) r.headers.emplace_back("Content-Range", fmt::format("bytes {}-{}/{}", begin, end - 1, size));
  bytes_served_ += end - begin;
  return r;
}

}  // namespace lk::ckpt
