// ShardServer: serves checkpoints over HTTP so that peers can restore from them with Range
// requests. It is an http::Handler, meant to be mounted by the replica agent under a prefix
// (default /v1/shards) next to its other routes; `checkpoint serve` runs it alone.
//
// It serves `base_dir` (a durable checkpoint root, or a node-local live-state directory such as
// /dev/shm/lk-live/JOB). A "root" is base_dir itself (named "_") when it holds step-*
// checkpoints, and each subdirectory that does (live state: one root per rank, rank-00003).
//   GET PREFIX/checkpoints                -> ServedCheckpoints (protobuf): every complete
//                                            checkpoint of every root, newest first, with manifests
//   GET PREFIX/files/ROOT/DIR/FILE        -> the file; with "Range: bytes=A-B" (one range,
//                                            "A-", "-N" allowed) 206 + Content-Range; a range
//                                            outside the file is 416 with "bytes */SIZE"
// Only committed step-* directories are reachable: no temp dirs, no "..", no other files.
//
// A file's bytes go out as the response's shared body tail (http::Response::body_tail), read
// with one pread into a pooled buffer: one copy in user space, none by the http server.
//
// Requests are answered on the server's own reader threads (`read_threads`), not on the
// calling io thread: the replica agent runs its io_context on one thread, and a 16 MiB pread
// there both held up its heartbeats and left that one thread doing the copy out of the page
// cache and the sending, which capped a recovery from one peer at what one core could do.
//
// Thread-safety: Handle may be called from several threads at once; the Responder is called
// from a reader thread (or the calling thread when read_threads is 0).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/env.h"
#include "checkpoint/range.h"
#include "common/http/http.h"

namespace lk::ckpt {

struct ShardServerOptions {
  std::string base_dir;
  std::string prefix = "/v1/shards";
  // Largest body one request may ask for (also a request without Range): bounds server memory.
  uint64_t range_bytes_max = uint64_t{256} << 20;
  // Send file ranges with sendfile(2) where the connection allows (plain TCP or Unix socket):
  // the kernel passes the page-cache (or /dev/shm) pages to the socket, so serving costs no
  // copy on this side. Off: ranges are read into the buffers below and written from them.
  bool sendfile = true;
  // Without sendfile, file bodies are read into buffers that are reused once their response is written, and up
  // to this many bytes of them are kept while idle. A fresh 16 MiB string per request cost a
  // page fault per 4 KiB and a memset before the read: more CPU than sending the bytes.
  uint64_t idle_buffer_bytes_max = uint64_t{64} << 20;
  // Threads that read files and answer; 0 answers on the calling thread.
  uint32_t read_threads = 2;
  Env* env = nullptr;  // nullptr: Env::Default()
};

class ShardServer {
 public:
  explicit ShardServer(ShardServerOptions options);
  // Answers the requests already handed over, then stops the reader threads.
  ~ShardServer();
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;
  void Handle(http::Request&& req, http::Responder respond);
  // A handler that forwards to this server; the server must outlive it.
  http::Handler AsHandler();
  uint64_t bytes_served() const { return bytes_served_.load(); }
  uint64_t requests() const { return requests_.load(); }

 private:
  http::Response Serve(const http::Request& req);
  http::Response ListCheckpoints();
  http::Response ServeFile(const http::Request& req, std::string_view rest);

  struct BufferPool;
  void ReadLoop();

  ShardServerOptions options_;
  Env* env_;
  // Shared with the buffers' deleters, which run when the http server is done with a response,
  // possibly after this ShardServer is gone.
  std::shared_ptr<BufferPool> pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> work_;
  bool stopping_ = false;
  std::vector<std::thread> readers_;
  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> requests_{0};
};

}  // namespace lk::ckpt
