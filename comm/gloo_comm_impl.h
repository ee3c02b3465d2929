// The Gloo backend's communicator (internal to comm/; it pulls in Gloo): the
// class shared by gloo_comm.cc (rendezvous, the ring allreduce, failure handling) and
// gloo_encoded.cc (the encoded allreduce). The backend is a ring allreduce written on Gloo's
// TCP transport (pairs and unbound buffers), so that these files own every wait and can cut
// it short.
//
// How a blocked collective ends at once:
//  - Abort() (any thread) calls abortWaitRecv/abortWaitSend on the unbound buffers in flight,
//    which wakes the waiting trainer thread, and closes every pair with SO_LINGER 0, so the
//    kernel resets the connections and the peers' own waits fail at once too.
//  - A peer that dies (kill -9, socket closed) makes the kernel close its sockets; Gloo's device
//    loop reads EOF/RST but only fails the waits posted on that very pair, while the trainer
//    thread may be waiting on the other neighbour. So every communicator keeps a sentinel
//    receive posted on each of its pairs (a slot no one sends on) and a monitor thread waiting
//    on it: the failure of any pair wakes the monitor, which fails the whole communicator and
//    closes its pairs, so the failure travels around the ring one hop per member, each hop as
//    fast as the kernel delivers a reset.
//  - A watchdog thread fails the communicator the same way when the init or op deadline passes,
//    so no Gloo-internal wait is ever the last line of defence.
// Thread-safety: see comm.h.
#pragma once

#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "comm/backends.h"
#include "comm/comm.h"
#include "common/log.h"

namespace lk::comm::gloo_backend {

using SteadyClock = std::chrono::steady_clock;
using GlooContext = gloo::transport::Context;
using GlooBuffer = gloo::transport::UnboundBuffer;

// The monitor's wait: far above any training run, and small enough that Gloo's deadline
// arithmetic cannot overflow.
inline constexpr auto kForever = std::chrono::hours(24 * 365);

// Gloo slots of the encoded allreduce: a space of their own (AllReduce numbers its slots from
// 2 * world per collective), so that a member running the other kind of collective waits for
// the op deadline instead of receiving a message of the wrong shape.
inline constexpr uint64_t kEncodedSlots = uint64_t{1} << 62;
// ... and the allreduce of runs another.
inline constexpr uint64_t kRunSlots = kEncodedSlots | (uint64_t{1} << 61);

class GlooCommManager final : public CommManager, private CommLifecycle {
 public:
  GlooCommManager(RendezvousStore* store, CommOptions options,
                  std::shared_ptr<gloo::transport::Device> device)
      : CommLifecycle("gloo", options.slot),
        store_(store),
        options_(std::move(options)),
        device_(std::move(device)) {
    watchdog_ = std::thread([this] { WatchdogLoop(); });
  }

  ~GlooCommManager() override {
    {
      std::lock_guard lock(mu_);
      FailLocked(Error(Code::kAborted, "communicator shut down"), LogLevel::kDebug);
      stop_ = true;
      cv_.notify_all();
    }
    watchdog_.join();
    StopMonitor();
    ctx_.reset();
    device_.reset();
  }

  Status Reconfigure(uint32_t quorum_id, uint32_t replica_rank, uint32_t world_size) override;
  Status AllReduce(void* data, size_t count, DType dtype, ReduceOp op) override;
  Status AllReduceEncoded(std::span<float> data, const ChunkCodec& codec, ReduceOp op,
                          std::span<float> sent, std::span<float> result_feedback) override;
  Status AllReduceRuns(std::span<float> data, std::span<const ReduceRun> runs,
                       const ChunkCodec* codec, std::span<float> sent,
                       std::span<float> result_feedback) override;

  void Abort(const std::string& reason) override { AbortAll(reason); }
  void AbortQuorum(uint32_t quorum_id, const std::string& reason) override {
    AbortUpTo(quorum_id, reason);
  }
  void Close(const std::string& reason) override { CloseAll(reason); }
  uint32_t quorum_id() const override { return quorum_id_.load(); }
  Backend backend() const override { return Backend::kGloo; }

 private:
  // Posts the sentinel receives and starts the monitor of the communicator just connected.
  void StartMonitorLocked(const std::set<uint32_t>& peers);
  // Stops the monitor of the previous communicator (it was woken by FailLocked) and frees it.
  void StopMonitor();
  Status Connect(std::shared_ptr<GlooContext> ctx, uint32_t quorum_id, uint32_t rank,
                 uint32_t world, TimePoint deadline);
  // `user` is the caller's buffer; `acc` the float32 accumulator (the same memory for float32,
  // the widened copy for bfloat16).
  Status Ring(GlooContext& ctx, void* user, float* acc, size_t count, DType dtype, ReduceOp op,
              size_t rank, size_t world);
  // The encoded allreduce's two all-to-all phases (ctx is null for a member alone).
  Status Exchange(GlooContext* ctx, std::span<float> data, const ChunkCodec& codec, ReduceOp op,
                  std::span<float> sent, std::span<float> result_feedback, size_t rank,
                  size_t world);
  // The allreduce of runs' two phases (ctx is null for a member alone).
  Status ExchangeRuns(GlooContext* ctx, std::span<float> data, std::span<const ReduceRun> runs,
                      const ChunkCodec* codec, std::span<float> sent,
                      std::span<float> result_feedback, size_t rank, size_t world);
  // The start of a collective, under mu_: UsableLocked refuses without a communicator (or with
  // the failure a failed one keeps); StartLocked takes the communicator and arms the op deadline
  // when the collective moves bytes (more than one member, a non-empty buffer). EndOp ends an
  // armed collective: it disarms, keeps the first failure, and answers with it.
  struct OpStart {
    std::shared_ptr<GlooContext> ctx;
    size_t rank = 0;
    size_t world = 0;
  };
  Status UsableLocked() const;
  // The encoded collectives' own checks: the error-feedback spans are empty or as long as the
  // data, and more than three members exchange all-to-all only over the full mesh (under mu_).
  static Status CheckFeedbackSpans(size_t n, std::span<float> sent,
                                   std::span<float> result_feedback) {
    if (!sent.empty() && sent.size() != n) {
      return InvalidArgument("sent has {} elements, data {}", sent.size(), n);
    }
    if (!result_feedback.empty() && result_feedback.size() != n) {
      return InvalidArgument("result_feedback has {} elements, data {}", result_feedback.size(), n);
    }
    return Status::Ok();
  }
  Status FullMeshLocked(const char* what) const {
    if (world_ > 3 && !options_.full_mesh) {
      return InvalidArgument("the {} of {} members needs CommOptions::full_mesh", what, world_);
    }
    return Status::Ok();
  }
  OpStart StartLocked(size_t count, const char* what);
  Status EndOp(const Status& st);
  Status WaitRecv(GlooBuffer& buf);
  Status WaitSend(GlooBuffer& buf);
  // Clears inflight_ when a collective ends. Declared after the collective's buffers, so that
  // it runs first: Abort must never touch a freed buffer.
  struct InflightGuard {
    GlooCommManager* self;
    ~InflightGuard() {
      std::lock_guard lock(self->mu_);
      self->inflight_.clear();
    }
  };
  // A failure wakes every wait in flight and resets every connection.
  void OnFailedLocked() override;
  std::string FailDetailLocked() const override {
    return fmt::format(" rank={} world={}", rank_, world_);
  }
  void ArmLocked(Millis timeout, const char* what) {
    deadline_ = SteadyClock::now() + timeout;
    deadline_what_ = what;
    deadline_ms_ = timeout.count();
    armed_ = true;
    cv_.notify_all();
  }
  void WatchdogLoop();

  RendezvousStore* const store_;
  const CommOptions options_;
  std::shared_ptr<gloo::transport::Device> device_;  // one TCP event loop for all quorums
  std::thread watchdog_;

  // Trainer-thread state (Reconfigure and AllReduce are not called concurrently).
  uint64_t op_seq_ = 0;  // numbers collectives within a quorum so that every one has own slots
  std::vector<float> scratch_;  // the reduce-scatter staging ring (see Ring)
  std::vector<float> widened_;
  // The encoded allreduce: this member's encoded chunks, the contributions to its own chunk, the
  // encoded result of every chunk, and the float32 sum of its chunk.
  std::vector<uint8_t> enc_send_, enc_stage_, enc_result_;
  std::vector<float> enc_sum_, enc_scratch_;
  // The allreduce of runs: its four message areas, this member's own encodings, one result.
  std::vector<uint8_t> runs_send_, runs_stage_, runs_out_, runs_in_, runs_own_, runs_result_;
  std::vector<float> runs_sum_, runs_scratch_;

  // Guarded by mu_ (CommLifecycle's), with the lifecycle.
  std::condition_variable cv_;
  std::shared_ptr<GlooContext> ctx_;
  uint32_t rank_ = 0;
  uint32_t world_ = 0;
  std::vector<GlooBuffer*> inflight_;     // buffers a collective waits on right now
  uint64_t generation_ = 0;               // one per Reconfigure, so a late monitor fails nothing
  std::unique_ptr<GlooBuffer> sentinel_;  // freed only after monitor_ is joined
  uint64_t sentinel_bytes_ = 0;
  std::thread monitor_;
  bool armed_ = false;
  TimePoint deadline_;
  const char* deadline_what_ = "";
  int64_t deadline_ms_ = 0;
  bool stop_ = false;
};

}  // namespace lk::comm::gloo_backend
