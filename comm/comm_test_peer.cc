// comm_test_peer: one trainer slot's CommManager in its own process, driven by line commands on
// stdin; each command answers one line on stdout ("ok ..." or "err CODE message"). Tests and
// benchmarks start several of these on loopback, kill them and watch the survivors.
//
//   reconfigure QUORUM_ID RANK WORLD          rendezvous and build the communicator
//   allreduce f32|bf16 sum|avg COUNT ROUNDS   fill with known values, allreduce, verify each round
//   bench COUNT ROUNDS [f32|bf16 [sum|avg]]   allreduces without verification (f32 sum default)
//   encoded none|bf16|int8|int4 sum|avg COUNT ROUNDS
//                                             AllReduceEncoded of the same inputs; each round is
//                                             checked bit for bit against the reference computed
//                                             here from every member's inputs; answers the
//                                             result's FNV-1a hash
//   abort_when_blocked                        call Abort from another thread once the next
//                                             command is blocked in a wait (its thread asleep in
//                                             a system call), so that the notice reaches a
//                                             collective or rendezvous that waits, not one that
//                                             is still starting
//   exit
//
// Inputs are f(rank, i) = rank + 1 + (i % 5) / 4: exact in bfloat16, and every sum of up to 64
// of them is exact in float32, so Gloo's result must equal the expected value bit for bit.
// Logs go to stderr; "bench_round_done round=1" says every member is inside the bench. Thread-
// safety: single-threaded apart from the abort_when_blocked watcher.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "common/log.h"
#include "comm/compress.h"
#include "comm/comm.h"
#include "comm/encoded.h"
#include "comm/reduce.h"
#include "comm/rendezvous_store.h"
#include "tests/support/thread_state.h"
#include "tests/support/wait.h"

#ifdef LK_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

namespace lk::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;

float Input(uint32_t rank, size_t i) { return static_cast<float>(rank + 1) + (i % 5) * 0.25f; }

float Expected(uint32_t world, size_t i, ReduceOp op) {
  float sum = 0;
  for (uint32_t r = 0; r < world; ++r) sum += Input(r, i);
  return op == ReduceOp::kAvg ? sum / static_cast<float>(world) : sum;
}

void Answer(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::string Err(const Status& st) {
  return fmt::format("err {} {}", CodeName(st.code()), st.message());
}

// Host staging for the NCCL backend, whose AllReduce takes device memory.
class Buffer {
 public:
  Buffer(Backend backend, size_t bytes) : backend_(backend), host_(bytes) {
#ifdef LK_HAVE_NCCL
    if (backend_ == Backend::kNccl) LK_CHECK(cudaMalloc(&device_, bytes) == cudaSuccess);
#endif
  }
  ~Buffer() {
#ifdef LK_HAVE_NCCL
    if (device_ != nullptr) cudaFree(device_);
#endif
  }
  char* host() { return host_.data(); }
  void* Upload() {
#ifdef LK_HAVE_NCCL
    if (backend_ == Backend::kNccl) {
      LK_CHECK(cudaMemcpy(device_, host_.data(), host_.size(), cudaMemcpyHostToDevice) ==
               cudaSuccess);
      return device_;
    }
#endif
    return host_.data();
  }
  void Download() {
#ifdef LK_HAVE_NCCL
    if (backend_ == Backend::kNccl) {
      LK_CHECK(cudaMemcpy(host_.data(), device_, host_.size(), cudaMemcpyDeviceToHost) ==
               cudaSuccess);
    }
#endif
  }

 private:
  Backend backend_;
  std::vector<char> host_;
  void* device_ = nullptr;
};

struct Peer {
  CommManager* comm = nullptr;
  Backend backend = Backend::kGloo;
  uint32_t rank = 0;
  uint32_t world = 1;
  std::vector<std::thread> timers;
  // The command thread (Peer lives on it), the number of commands it started, and the number of
  // the one it runs now (0 between commands): what abort_when_blocked watches.
  const pid_t command_tid = test::CurrentTid();
  uint64_t commands = 0;
  std::atomic<uint64_t> running{0};

  std::string AllReduce(DType dtype, ReduceOp op, size_t count, int rounds) {
    Buffer buf(backend, count * DTypeBytes(dtype));
    auto start = SteadyClock::now();
    for (int round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < count; ++i) {
        if (dtype == DType::kFloat32) {
          reinterpret_cast<float*>(buf.host())[i] = Input(rank, i);
        } else {
          reinterpret_cast<uint16_t*>(buf.host())[i] = FloatToBf16(Input(rank, i));
        }
      }
      Status st = comm->AllReduce(buf.Upload(), count, dtype, op);
      if (!st.ok()) {
        return fmt::format("{} ms={}", Err(st), ToMillis(SteadyClock::now() - start));
      }
      buf.Download();
      for (size_t i = 0; i < count; ++i) {
        float want = Expected(world, i, op);
        float got = reinterpret_cast<float*>(buf.host())[i];
        if (dtype == DType::kBFloat16) {
          want = Bf16ToFloat(FloatToBf16(want));
          got = Bf16ToFloat(reinterpret_cast<uint16_t*>(buf.host())[i]);
        }
        // NCCL sums bf16 natively and averages by a reciprocal: allow its rounding.
        float tolerance = backend == Backend::kNccl ? std::abs(want) / 64 : 0.0f;
        if (std::abs(got - want) > tolerance) {
          return fmt::format("err Mismatch round={} index={} got={} want={}", round, i, got, want);
        }
      }
    }
    return fmt::format("ok allreduce ms={}", ToMillis(SteadyClock::now() - start));
  }

  std::string Bench(size_t count, int rounds, DType dtype, ReduceOp op) {
    Buffer buf(backend, count * DTypeBytes(dtype));
    void* data = buf.Upload();
    auto start = SteadyClock::now();
    for (int round = 0; round < rounds; ++round) {
      Status st = comm->AllReduce(data, count, dtype, op);
      if (!st.ok()) return Err(st);
      // The first round needed every member: a test that kills one mid-bench waits for this.
      if (round == 0) LK_LOG_INFO("bench_round_done round=1 rounds={}", rounds);
    }
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(SteadyClock::now() - start);
    return fmt::format("ok bench us={}", us.count());
  }

  // What every member must hold after the encoded allreduce of the members' Input values: per
  // owner's chunk, the decoded contributions summed in rank order, encoded once, decoded.
  std::vector<float> EncodedReference(const ChunkCodec& codec, size_t count, ReduceOp op) const {
    std::vector<float> out(count);
    for (size_t c = 0; c < world; ++c) {
      Chunk ch = EncodedChunk(count, codec.block_elems(), world, c);
      std::vector<std::vector<uint8_t>> enc(world);
      std::vector<const uint8_t*> ptrs;
      for (uint32_t r = 0; r < world; ++r) {
        std::vector<float> in(ch.size);
        for (size_t i = 0; i < ch.size; ++i) in[i] = Input(r, ch.begin + i);
        enc[r].resize(codec.EncodedBytes(ch.size));
        codec.Encode(in.data(), ch.size, enc[r].data());
        ptrs.push_back(enc[r].data());
      }
      std::vector<float> sum(ch.size), scratch(ch.size);
      ReduceEncoded(codec, ptrs, ch.size, op, sum.data(), scratch.data());
      std::vector<uint8_t> bytes(codec.EncodedBytes(ch.size));
      codec.Encode(sum.data(), ch.size, bytes.data());
      codec.Decode(bytes.data(), ch.size, out.data() + ch.begin);
    }
    return out;
  }

  std::string Encoded(const std::string& codec_name, ReduceOp op, size_t count, int rounds) {
    comm::Codec oc;
    if (!comm::ParseCodec(codec_name, &oc)) return "err InvalidArgument codec";
    comm::BlockCodec codec(oc);
    const std::vector<float> want = EncodedReference(codec, count, op);
    std::vector<float> data(count);
    auto start = SteadyClock::now();
    for (int round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < count; ++i) data[i] = Input(rank, i);
      Status st = comm->AllReduceEncoded(data, codec, op);
      if (!st.ok()) return fmt::format("{} ms={}", Err(st), ToMillis(SteadyClock::now() - start));
      if (std::memcmp(data.data(), want.data(), count * sizeof(float)) != 0) {
        return fmt::format("err Mismatch round={}", round);
      }
    }
    uint64_t hash = 1469598103934665603ull;
    const auto* bytes = reinterpret_cast<const uint8_t*>(data.data());
    for (size_t i = 0; i < count * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    return fmt::format("ok encoded hash={:016x} ms={}", hash, ToMillis(SteadyClock::now() - start));
  }

  std::string Handle(const std::string& line) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "reconfigure") {
      uint32_t q = 0;
      in >> q >> rank >> world;
      auto start = SteadyClock::now();
      Status st = comm->Reconfigure(q, rank, world);
      auto ms = ToMillis(SteadyClock::now() - start);
      return st.ok() ? fmt::format("ok reconfigure ms={}", ms)
                     : fmt::format("{} ms={}", Err(st), ms);
    }
    if (cmd == "allreduce") {
      std::string dtype, op;
      size_t count = 0;
      int rounds = 1;
      in >> dtype >> op >> count >> rounds;
      return AllReduce(dtype == "bf16" ? DType::kBFloat16 : DType::kFloat32,
                       op == "avg" ? ReduceOp::kAvg : ReduceOp::kSum, count, rounds);
    }
    if (cmd == "bench") {
      size_t count = 0;
      int rounds = 1;
      std::string dtype = "f32", op = "sum";
      in >> count >> rounds >> dtype >> op;
      return Bench(count, rounds, dtype == "bf16" ? DType::kBFloat16 : DType::kFloat32,
                   op == "avg" ? ReduceOp::kAvg : ReduceOp::kSum);
    }
    if (cmd == "encoded") {
      std::string codec, op;
      size_t count = 0;
      int rounds = 1;
      in >> codec >> op >> count >> rounds;
      return Encoded(codec, op == "avg" ? ReduceOp::kAvg : ReduceOp::kSum, count, rounds);
    }
    if (cmd == "abort_when_blocked") {
      timers.emplace_back([this, mine = commands] {
        // Between commands the thread is asleep too (reading stdin): only a wait that lasts
        // inside one later command counts. One that never blocks gets the notice at the bound.
        test::WaitUntil(
            [&] {
              const uint64_t r = running.load();
              return r > mine && test::ThreadAsleep(::getpid(), command_tid) && running == r;
            },
            std::chrono::seconds(20), "the next command blocked in a wait");
        comm->Abort("test notice");
      });
      return "ok";
    }
    return "err InvalidArgument unknown command " + cmd;
  }
};

int Main(int argc, char** argv) {
  std::string backend_name = "gloo", store_spec, job = "j", bind = "127.0.0.1";
  uint32_t slot = 0, init_timeout_ms = 30'000, op_timeout_ms = 60'000;
  uint32_t device = 0, segment_kib = 1024;
  Flags flags("comm_test_peer", "One trainer slot's communicator driven by stdin commands.");
  flags.Add("backend", &backend_name, "gloo, nccl or gateway");
  flags.Add("store", &store_spec, "http://HOST:PORT (lighthouse KV) or file:DIR");
  flags.Add("job", &job, "job name for the lighthouse KV");
  flags.Add("slot", &slot, "cross-group slot");
  flags.Add("bind", &bind, "Gloo bind host");
  flags.Add("init-timeout-ms", &init_timeout_ms, "communicator init deadline");
  flags.Add("op-timeout-ms", &op_timeout_ms, "allreduce deadline");
  flags.Add("device", &device, "CUDA device (nccl)");
  flags.Add("segment-kib", &segment_kib, "Gloo ring segment size, KiB");
  bool full_mesh = false;
  flags.Add("full-mesh", &full_mesh, "connect every pair (the encoded allreduce of 4+ members)");
  uint32_t inflight_kib = static_cast<uint32_t>(CommOptions().inflight_bytes / 1024);
  flags.Add("inflight-kib", &inflight_kib, "Gloo reduce-scatter receives posted ahead, KiB");
  std::string gateway, gateway_token_file;
  flags.Add("gateway", &gateway, "the site's lk_gateway URL (backend gateway)");
  flags.Add("gateway-token-file", &gateway_token_file, "the job's token for the gateway");
  if (Status st = flags.Parse(argc, argv); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 2;
  }
  Backend backend;
  if (!ParseBackend(backend_name, &backend)) {
    std::fprintf(stderr, "unknown backend %s\n", backend_name.c_str());
    return 2;
  }
  SetLogPrefix(fmt::format("role=comm_test_peer pid={}", getpid()));
  auto store = OpenRendezvousStore(store_spec, job, "");
  if (!store.ok()) {
    Answer(Err(store.status()));
    return 1;
  }
  CommOptions options;
  options.slot = slot;
  options.bind_host = bind;
  options.init_timeout = Millis(init_timeout_ms);
  options.op_timeout = Millis(op_timeout_ms);
  options.device_index = static_cast<int>(device);
  options.segment_bytes = size_t{segment_kib} * 1024;
  options.inflight_bytes = size_t{inflight_kib} * 1024;
  options.full_mesh = full_mesh;
  options.gateway_url = gateway;
  options.job = job;
  if (!gateway_token_file.empty()) {
    std::ifstream in(gateway_token_file);
    std::getline(in, options.gateway_token);
  }
  auto comm = CommManager::Create(backend, store->get(), options);
  if (!comm.ok()) {
    Answer(Err(comm.status()));
    return 1;
  }
  Answer("ok ready");
  Peer peer;
  peer.comm = comm->get();
  peer.backend = backend;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "exit") break;
    peer.running = ++peer.commands;
    std::string answer = peer.Handle(line);
    peer.running = 0;
    Answer(answer);
  }
  for (auto& t : peer.timers) t.join();
  return 0;
}

}  // namespace
}  // namespace lk::comm

int main(int argc, char** argv) { return lk::comm::Main(argc, argv); }
