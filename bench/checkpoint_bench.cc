// Checkpoint throughput: save and restore of a large state on one disk, and peer recovery from
// 1, 2 and 3 shard servers on loopback. bench/checkpoint_bench.sh runs it next to fio and iperf3
// in the same run and reports ratios. Output: one "name=value" line per figure (bytes/second).
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <sys/prctl.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <filesystem>
#include <functional>
#include <thread>

#include "checkpoint/format.h"
#include "checkpoint/live.h"
#include "checkpoint/restore.h"
#include "checkpoint/shard_server.h"
#include "checkpoint/writer.h"
#include "common/flags.h"
#include "common/http/server.h"
#include "common/log.h"

namespace lk::ckpt {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// `bytes` of state as F32 tensors of 32 MiB (rows of 4 KiB), filled so no two chunks are equal.
Snapshot MakeState(uint64_t bytes, int64_t step) {
  Snapshot s;
  s.step = step;
  constexpr uint64_t kTensorBytes = uint64_t{32} << 20;
  for (uint64_t at = 0, i = 0; at < bytes; at += kTensorBytes, ++i) {
    uint64_t n = std::min(kTensorBytes, bytes - at);
    Buffer b(n);
    auto* w = reinterpret_cast<uint64_t*>(b.data());
    for (uint64_t k = 0; k < n / 8; ++k) w[k] = (i << 40) ^ k ^ (static_cast<uint64_t>(step) << 56);
    s.Add(fmt::format("layer{:03}.weight", i), DType::kF32, {static_cast<int64_t>(n / 4096), 1024},
          ConstBytes::Own(std::move(b)));
  }
  return s;
}

// Shard servers as replica agents run them: each peer has its own io_context, run by
// `threads` threads (an agent uses one).
class Servers {
 public:
  Servers(const std::string& base, int count, uint32_t threads, uint32_t read_threads) {
    for (int i = 0; i < count; ++i) {
      auto p = std::make_unique<Peer>();
      ShardServerOptions so;
      so.base_dir = base;
      so.read_threads = read_threads;
      p->shards = std::make_unique<ShardServer>(so);
      http::ServerOptions o;
      o.write_timeout = Millis(120'000);
      o.single_thread = threads == 1;
      p->server = std::make_unique<http::Server>(p->ioc, o, p->shards->AsHandler());
      LK_CHECK(p->server->Listen("127.0.0.1:0").ok());
      urls_.push_back("http://" + p->server->LocalAddress());
      for (uint32_t t = 0; t < threads; ++t) {
        p->threads.emplace_back([ioc = &p->ioc] { ioc->run(); });
      }
      peers_.push_back(std::move(p));
    }
  }
  ~Servers() {
    for (auto& p : peers_) {
      boost::asio::post(p->ioc, [p = p.get()] {
        p->server->Stop();
        p->ioc.stop();
      });
      for (auto& t : p->threads) t.join();
    }
  }
  const std::vector<std::string>& urls() const { return urls_; }

 private:
  struct Peer {
    boost::asio::io_context ioc;
    std::unique_ptr<ShardServer> shards;
    std::unique_ptr<http::Server> server;
    std::vector<std::thread> threads;
  };
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::string> urls_;
};

// Stand-ins for a model's tensors, as a trainer holds them when it heals: allocated and touched
// once, then every restore writes into them (FetchOptions::into).
class ModelTensors {
 public:
  std::function<uint8_t*(const TargetTensor&)> Into() {
    return [this](const TargetTensor& t) -> uint8_t* {
      auto& b = tensors_[t.name];
      if (b.size() != t.bytes) {
        b = Buffer(t.bytes, /*huge_pages=*/true);
        std::memset(b.data(), 0, b.size());
      }
      return b.data();
    };
  }

 private:
  std::map<std::string, Buffer> tensors_;
};

void SaveAndRestore(const std::string& dir, const Snapshot& state, int64_t bytes,
                    uint32_t restore_streams) {
  WriterOptions w;
  w.root = dir + "/ckpt";
  w.keep = 1;
  auto t0 = std::chrono::steady_clock::now();
  auto saved = CheckpointWriter(w).Save(state);
  double save_s = Seconds(t0);
  LK_CHECK(saved.ok()) << saved.status().ToString();
  std::printf("save_bytes_per_s=%.0f\nsave_s=%.3f\n", bytes / save_s, save_s);

  // Cold cache every time. The first restore goes into fresh memory, as a process that has no
  // model yet; then three into the model's tensors (touched once before, as a trainer's are),
  // of which the median counts: the virtual disk's speed swings from one second to the next.
  ModelTensors model;
  auto restore = [&](bool into_model) {
    RestoreOptions ro;
    ro.drop_cache = true;
    if (restore_streams > 0) ro.fetch.streams_per_source = restore_streams;
    if (into_model) ro.fetch.into = model.Into();
    auto t0 = std::chrono::steady_clock::now();
    auto restored = RestoreLatest(w.root, ro);
    double seconds = Seconds(t0);
    LK_CHECK(restored.ok()) << restored.status().ToString();
    LK_CHECK(restored->bytes() == static_cast<uint64_t>(bytes));
    return seconds;
  };
  double fresh_s = restore(false);
  std::printf("restore_fresh_bytes_per_s=%.0f\n", bytes / fresh_s);
  std::vector<double> runs;
  for (int i = 0; i < 3; ++i) runs.push_back(restore(true));
  std::sort(runs.begin(), runs.end());
  std::printf("restore_bytes_per_s=%.0f\nrestore_s=%.3f\n", bytes / runs[1], runs[1]);
}

// CPU seconds (user + system) of the whole process so far: with the servers and the client in
// one process, CPU per byte shows where a change saves work even when the machine is loaded.
double CpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// The work any recovery of this state does without a network: pread the served shard from
// /dev/shm into memory and hash it, on one thread. iperf3 moves bytes between two cache-resident
// 128 KiB buffers; a recovery cannot avoid reading the state from memory, writing it to the
// destination and checksumming it, so this shows how much of its time those take. Measured into
// fresh memory (page faults and zeroing included) and again into the same, now touched, memory
// (as a restore into the model's existing tensors).
void LocalCopyFloor(const std::string& shm) {
  std::vector<std::string> shards;
  for (const auto& e : std::filesystem::recursive_directory_iterator(shm)) {
    if (e.path().extension() == ".safetensors") shards.push_back(e.path().string());
  }
  LK_CHECK(!shards.empty());
  std::sort(shards.begin(), shards.end());
  Env* env = Env::Default();
  auto f = env->NewRandomAccessFile(shards.back());  // the newest step
  LK_CHECK(f.ok()) << f.status().ToString();
  uint64_t size = (*f)->size();
  // Small pages: on one thread they cost less here (a 4 KiB page is zeroed and then filled while
  // in cache, a 2 MiB one is not); restore uses huge pages because its streams fault in parallel.
  Buffer dst(size);
  for (const char* key : {"local_copy_fresh", "local_copy"}) {
    auto t0 = std::chrono::steady_clock::now();
    double cpu0 = CpuSeconds();
    constexpr uint64_t kRead = uint64_t{16} << 20, kChunk = uint64_t{4} << 20;
    uint64_t sum = 0;
    for (uint64_t at = 0; at < size; at += kRead) {
      uint64_t n = std::min(kRead, size - at);
      LK_CHECK((*f)->Read(at, n, dst.data() + at).ok());
      for (uint64_t c = 0; c < n; c += kChunk)
        sum ^= Xxh3(dst.data() + at + c, std::min(kChunk, n - c));
    }
    double s = Seconds(t0), cpu = CpuSeconds() - cpu0;
    std::printf("%s_bytes_per_s=%.0f\n%s_cpu_s_per_gb=%.3f\n%s_sum=%llx\n", key, size / s, key,
                cpu / (size / 1e9), key, static_cast<unsigned long long>(sum));
  }
}

// Context for the figures into fresh memory: how fast this process can fill fresh pages the
// first time and again once they were freed. On this VM the first pass runs at a fraction of
// the second (the hypervisor backs guest memory again after it was given back), which any
// program pays for memory it touches first.
void MemoryTouch(uint64_t bytes) {
  for (const char* key : {"memory_first_touch", "memory_second_touch"}) {
    auto t0 = std::chrono::steady_clock::now();
    {
      Buffer b(bytes, /*huge_pages=*/true);
      std::memset(b.data(), 1, b.size());
    }
    std::printf("%s_bytes_per_s=%.0f\n", key, bytes / Seconds(t0));
  }
}

int Main(int argc, char** argv) {
  std::string dir = "/tmp/lk-ckpt-bench", shm = "/dev/shm/lk-ckpt-bench";
  int64_t bytes = int64_t{2} << 30;
  uint32_t streams = 4;
  Flags flags("checkpoint_bench", "Checkpoint save/restore and peer recovery throughput.");
  flags.Add("dir", &dir, "directory on the disk under test", "LK_BENCH_DIR");
  flags.Add("shm", &shm, "node-local directory the peers serve from", "LK_BENCH_SHM");
  flags.Add("bytes", &bytes, "state size", "LK_BENCH_BYTES");
  flags.Add("streams", &streams, "concurrent reads per peer recovery (split over its sources)",
            "LK_BENCH_STREAMS");
  uint32_t restore_streams = 0;
  flags.Add("restore_streams", &restore_streams,
            "concurrent reads of the disk restore (0: RestoreOptions' default)",
            "LK_BENCH_RESTORE_STREAMS");
  bool peers_only = false;
  flags.Add("peers_only", &peers_only, "skip save and restore (for profiling the peer path)",
            "LK_BENCH_PEERS_ONLY");
  // The replica agent runs its io_context, and so its shard server, on one thread.
  uint32_t server_threads = 1;
  flags.Add("server_threads", &server_threads, "io threads of each peer's shard server",
            "LK_BENCH_SERVER_THREADS");
  uint32_t read_threads = ShardServerOptions().read_threads;
  flags.Add("read_threads", &read_threads, "each shard server's reader threads (0: io thread)",
            "LK_BENCH_READ_THREADS");
  bool skip_peers = false;
  flags.Add("skip_peers", &skip_peers, "stop after save and restore", "LK_BENCH_SKIP_PEERS");
  bool huge_pages = true;
  flags.Add("huge_pages", &huge_pages,
            "let buffers use transparent huge pages (false: PR_SET_THP_DISABLE, for comparison)",
            "LK_BENCH_HUGE_PAGES");
  if (Status st = flags.Parse(argc, argv); !st.ok() || flags.help_requested()) {
    std::fprintf(stderr, "%s\n%s", st.ToString().c_str(), flags.Help().c_str());
    return 2;
  }
  if (!huge_pages) LK_CHECK(::prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0);
  SetLogLevel(LogLevel::kWarn);
  std::filesystem::remove_all(dir + "/ckpt");
  std::filesystem::remove_all(shm);
  std::printf("effective %s\n", flags.Effective().c_str());

  MemoryTouch(static_cast<uint64_t>(bytes));
  Snapshot state = MakeState(static_cast<uint64_t>(bytes), 1);
  if (!peers_only) SaveAndRestore(dir, state, bytes, restore_streams);
  if (skip_peers) {
    std::filesystem::remove_all(dir + "/ckpt");
    return 0;
  }

  // Peers serve live state from node-local memory, as agents do.
  LiveStatePublisher pub(LivePublisherOptions{shm, 2, kDefaultChunkBytes, nullptr});
  auto t0 = std::chrono::steady_clock::now();
  LK_CHECK(pub.Publish(state).ok());
  std::printf("publish_shm_bytes_per_s=%.0f\n", bytes / Seconds(t0));
  state = Snapshot();
  Servers servers(shm, 3, std::max<uint32_t>(1, server_threads), read_threads);
  ModelTensors model;
  auto recover = [&](size_t n, bool into_model) {
    std::vector<std::string> urls(servers.urls().begin(), servers.urls().begin() + n);
    PeerRecoveryOptions po;
    po.fetch.streams_per_source = std::max<uint32_t>(1, streams / static_cast<uint32_t>(n));
    if (into_model) po.fetch.into = model.Into();
    auto t0 = std::chrono::steady_clock::now();
    double cpu0 = CpuSeconds();
    auto got = RecoverFromPeers(urls, po);
    std::pair<double, double> seconds_cpu{Seconds(t0), CpuSeconds() - cpu0};
    LK_CHECK(got.ok()) << got.status().ToString();
    LK_CHECK(got->bytes() == static_cast<uint64_t>(bytes));
    return seconds_cpu;
  };
  // The first gigabytes a process touches after the machine sat idle cost up to twice the CPU on
  // this VM (the hypervisor backs guest pages on first touch: the kernel's page zeroing and the
  // copies into them run slower), whatever the source count or the order. That first recovery
  // (into fresh memory, 1 source) is reported on its own; every other figure is the median of
  // three after it, so that they compare the transfer, not the host's memory state.
  auto print = [&](const std::string& key, std::pair<double, double> seconds_cpu) {
    std::printf("%s_bytes_per_s=%.0f\n%s_cpu_s_per_gb=%.3f\n", key.c_str(),
                bytes / seconds_cpu.first, key.c_str(), seconds_cpu.second / (bytes / 1e9));
  };
  auto median = [&](size_t n, bool into_model) {
    std::vector<std::pair<double, double>> runs;
    for (int i = 0; i < 3; ++i) runs.push_back(recover(n, into_model));
    std::sort(runs.begin(), runs.end());
    return runs[1];
  };
  print("peer_cold", recover(1, false));
  LocalCopyFloor(shm);
  print("peer1_fresh", median(1, false));
  for (size_t n = 1; n <= 3; ++n) print(fmt::format("peer{}", n), median(n, true));
  std::filesystem::remove_all(dir + "/ckpt");
  std::filesystem::remove_all(shm);
  return 0;
}

}  // namespace
}  // namespace lk::ckpt

int main(int argc, char** argv) { return lk::ckpt::Main(argc, argv); }
