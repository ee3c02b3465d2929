// The Gloo backend (the class and how a blocked collective ends: gloo_comm_impl.h):
// rendezvous and connect, the watchdog and the failure monitor, and the pipelined ring
// allreduce. The encoded allreduce is in gloo_encoded.cc.
#include <signal.h>

#include <algorithm>
#include <cstring>

#include "comm/backends.h"
#include "comm/gloo_comm_impl.h"
#include "comm/reduce.h"
#include "common/log.h"
#include "common/sigpipe.h"

namespace lk::comm {
namespace {

std::string AddressKey(uint32_t slot, uint32_t rank) {
  return fmt::format("gloo/slot{}/rank{}", slot, rank);
}

// The value a member publishes: for each neighbour, its rank and the address of the pair that
// waits for it. Layout: repeated {u32 peer_rank, u32 length, bytes}.
std::string EncodeAddresses(const std::vector<std::pair<uint32_t, std::vector<char>>>& pairs) {
  std::string out;
  for (const auto& [peer, bytes] : pairs) {
    uint32_t header[2] = {peer, static_cast<uint32_t>(bytes.size())};
    out.append(reinterpret_cast<const char*>(header), sizeof(header));
    out.append(bytes.data(), bytes.size());
  }
  return out;
}

Result<std::vector<char>> FindAddress(const std::string& value, uint32_t for_rank) {
  size_t pos = 0;
  while (pos + 8 <= value.size()) {
    uint32_t header[2];
    std::memcpy(header, value.data() + pos, sizeof(header));
    pos += sizeof(header);
    if (header[1] > value.size() - pos) break;
    if (header[0] == for_rank) {
      return std::vector<char>(value.begin() + pos, value.begin() + pos + header[1]);
    }
    pos += header[1];
  }
  return Error(Code::kDataLoss, "no address for rank {} in the rendezvous value", for_rank);
}

}  // namespace

namespace gloo_backend {

void GlooCommManager::OnFailedLocked() {
  armed_ = false;
  for (GlooBuffer* b : inflight_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
  if (sentinel_) sentinel_->abortWaitRecv();
  if (ctx_) {
    for (uint32_t i = 0; i < world_; ++i) {
      if (i == rank_) continue;
      auto& pair = ctx_->getPair(static_cast<int>(i));
      // Abort runs on the caller's thread (a notice callback): nothing may escape from it.
      try {
        if (pair) pair->close();
      } catch (const std::exception& e) {
        LK_LOG_WARN("comm_close_failed backend=gloo peer={} error={}", i, Q(e.what()));
      }
    }
  }
  cv_.notify_all();
}

void GlooCommManager::WatchdogLoop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    if (!armed_) {
      cv_.wait(lock);
    } else if (SteadyClock::now() >= deadline_) {
      armed_ = false;
      FailLocked(Error(Code::kDeadlineExceeded, "{} did not finish within {} ms", deadline_what_,
                       deadline_ms_));
    } else {
      cv_.wait_until(lock, deadline_);
    }
  }
}

Status GlooCommManager::Reconfigure(uint32_t quorum_id, uint32_t replica_rank,
                                    uint32_t world_size) {
  if (world_size == 0 || replica_rank >= world_size) {
    return InvalidArgument("replica_rank {} out of world_size {}", replica_rank, world_size);
  }
  ScopedSigpipeBlock no_sigpipe;  // Gloo writes on this thread (and on the monitor it starts)
  auto start = SteadyClock::now();
  std::shared_ptr<GlooContext> old;
  {
    std::lock_guard lock(mu_);
    if (auto answer = BeginLocked(quorum_id)) return *answer;
    old = std::move(ctx_);
    rank_ = replica_rank;
    world_ = world_size;
    op_seq_ = 0;
    ++generation_;
    ArmLocked(options_.init_timeout, "communicator init");
  }
  StopMonitor();
  old.reset();  // its pairs are closed; this frees their sockets

  Status st;
  if (world_size > 1) {
    try {
      auto ctx =
          device_->createContext(static_cast<int>(replica_rank), static_cast<int>(world_size));
      ctx->setTimeout(options_.init_timeout);
      st = Connect(std::move(ctx), quorum_id, replica_rank, world_size,
                   start + options_.init_timeout);
    } catch (const std::exception& e) {
      st = Error(Code::kUnavailable, "gloo: {}", e.what());
    }
  }
  std::lock_guard lock(mu_);
  armed_ = false;
  if (!st.ok()) FailLocked(st);
  if (phase_ == Phase::kFailed) return status_;
  phase_ = Phase::kReady;
  LK_LOG_INFO("comm_ready backend=gloo slot={} quorum_id={} rank={} world={} init_ms={}",
              options_.slot, quorum_id, replica_rank, world_size,
              ToMillis(SteadyClock::now() - start));
  return Status::Ok();
}

Status GlooCommManager::Connect(std::shared_ptr<GlooContext> ctx, uint32_t quorum_id, uint32_t rank,
                                uint32_t world, TimePoint deadline) {
  // The ring only talks to its two neighbours, so only those pairs exist, unless the encoded
  // allreduce (all-to-all) needs every pair.
  std::set<uint32_t> peers = {(rank + world - 1) % world, (rank + 1) % world};
  if (options_.full_mesh) {
    for (uint32_t p = 0; p < world; ++p) {
      if (p != rank) peers.insert(p);
    }
  }
  std::vector<std::pair<uint32_t, std::vector<char>>> mine;
  {
    std::lock_guard lock(mu_);
    if (phase_ == Phase::kFailed) return status_;
    ctx_ = ctx;  // from here on Abort and the watchdog can close its pairs
    for (uint32_t p : peers) {
      auto& pair = ctx->createPair(static_cast<int>(p));
      mine.emplace_back(p, pair->address().bytes());
    }
  }
  LK_RETURN_IF_ERROR(
      store_->Put(quorum_id, AddressKey(options_.slot, rank), EncodeAddresses(mine)));
  // Ascending peer order on every member is consistent with one global order of the edges,
  // so the blocking connects cannot wait on each other in a cycle.
  for (uint32_t p : peers) {
    LK_ASSIGN_OR_RETURN(std::string value,
                        WaitForKey(store_, quorum_id, AddressKey(options_.slot, p), deadline,
                                   [this] { return Interrupted(); }));
    LK_ASSIGN_OR_RETURN(std::vector<char> address, FindAddress(value, rank));
    LK_RETURN_IF_ERROR(Interrupted());
    ctx->getPair(static_cast<int>(p))->connect(address);
  }
  std::lock_guard lock(mu_);
  if (phase_ == Phase::kFailed) return status_;
  StartMonitorLocked(peers);
  return Status::Ok();
}

void GlooCommManager::StartMonitorLocked(const std::set<uint32_t>& peers) {
  constexpr uint64_t kSentinelSlot = ~uint64_t{0};
  sentinel_ = ctx_->createUnboundBuffer(&sentinel_bytes_, sizeof(sentinel_bytes_));
  for (uint32_t p : peers) {
    sentinel_->recv(static_cast<int>(p), kSentinelSlot, 0, sizeof(sentinel_bytes_));
  }
  monitor_ = std::thread([this, buf = sentinel_.get(), generation = generation_] {
    Status failure;
    try {
      // False: woken by FailLocked, the communicator is already failed or replaced.
      if (!buf->waitRecv(nullptr, kForever)) return;
      failure = Error(Code::kInternal, "a peer sent on the failure-detection slot");
    } catch (const std::exception& e) {
      failure = Error(Code::kAborted, "peer failure: {}", e.what());
    }
    std::lock_guard lock(mu_);
    if (generation == generation_) FailLocked(failure);
  });
}

void GlooCommManager::StopMonitor() {
  if (monitor_.joinable()) monitor_.join();
  std::lock_guard lock(mu_);
  sentinel_.reset();
}

Status GlooCommManager::UsableLocked() const {
  if (phase_ == Phase::kNone) {
    return Error(Code::kUnavailable, "no communicator: call Reconfigure first");
  }
  if (phase_ == Phase::kFailed) return status_;
  return Status::Ok();
}

GlooCommManager::OpStart GlooCommManager::StartLocked(size_t count, const char* what) {
  OpStart op{ctx_, rank_, world_};
  if (op.world > 1 && count > 0) ArmLocked(options_.op_timeout, what);
  return op;
}

Status GlooCommManager::EndOp(const Status& st) {
  std::lock_guard lock(mu_);
  armed_ = false;
  if (!st.ok()) FailLocked(st);
  if (phase_ == Phase::kFailed) return status_;
  return Status::Ok();
}

Status GlooCommManager::AllReduce(void* data, size_t count, DType dtype, ReduceOp reduce) {
  ScopedSigpipeBlock no_sigpipe;  // Gloo writes on this thread
  OpStart op;
  {
    std::lock_guard lock(mu_);
    LK_RETURN_IF_ERROR(UsableLocked());
    op = StartLocked(count, "allreduce");
  }
  const size_t rank = op.rank, world = op.world;
  float* values = static_cast<float*>(data);
  if (dtype == DType::kBFloat16) {
    // The ring fills the float32 accumulator itself, segment by segment, as it adds into it.
    widened_.resize(count);
    values = widened_.data();
  }
  if (world > 1 && count > 0) {
    // The ring itself divides and narrows each chunk where it is finished (see Ring).
    Status st;
    try {
      st = Ring(*op.ctx, data, values, count, dtype, reduce, rank, world);
    } catch (const std::exception& e) {
      st = Error(Code::kAborted, "peer failure: {}", e.what());
    }
    return EndOp(st);
  }
  if (dtype == DType::kBFloat16) WidenBf16(static_cast<const uint16_t*>(data), values, count);
  if (reduce == ReduceOp::kAvg) Divide(values, count, static_cast<float>(world));
  if (dtype == DType::kBFloat16) NarrowToBf16(values, static_cast<uint16_t*>(data), count);
  return Status::Ok();
}

Status GlooCommManager::WaitRecv(GlooBuffer& buf) {
  // The watchdog aborts the wait at the op deadline; Gloo's own timeout is only a backstop.
  if (!buf.waitRecv(nullptr, options_.op_timeout + Millis(5'000))) {
    return Error(Code::kAborted, "recv aborted");
  }
  return Status::Ok();
}

Status GlooCommManager::WaitSend(GlooBuffer& buf) {
  if (!buf.waitSend(nullptr, options_.op_timeout + Millis(5'000))) {
    return Error(Code::kAborted, "send aborted");
  }
  return Status::Ok();
}

// Ring allreduce: world-1 reduce-scatter steps, then world-1 allgather steps, each moving one
// chunk to the right neighbour and one from the left, in segments.
//
// The steps are pipelined segment by segment rather than run one after the other: what a member
// receives at step s is what it sends at step s+1 (RingRecvChunk/RingSendChunk), so segment k is
// forwarded the moment it has arrived and been reduced, while the later segments of step s are
// still on the wire. A step barrier would drain both directions of every link twice per step
// (wait for the last send, then a recv-ready round trip before the next step's data may flow);
// with 2 members the reduce-scatter and the allgather thus become one continuous exchange.
//
// Each chunk is finished where its reduction ends (the last reduce-scatter step): divided for
// an average and, for bfloat16, rounded into the caller's buffer right after its last addition,
// while the segment is still in cache, instead of in two more passes over the whole buffer. The
// allgather then copies finished values only, so every member holds the same bits, and they are
// the bits of "sum in float32, divide, round once" as before.
//
// For bfloat16 the float32 accumulator is not filled up front: each segment is set to the
// member's own widened input plus what arrived the one time the ring adds into it.
//
// bfloat16 travels as bfloat16 wherever that is exact: the first reduce-scatter step sends the
// members' own inputs (widening is exact) and the allgather sends rounded results; only the
// partial sums in between need float32. With 2 members every byte on the wire is bfloat16.
//
// Buffers and ordering:
//  - Reduce-scatter segments arrive in a staging ring (inflight_bytes of segments, at least four),
//  each
//    slot posted again as soon as its segment is reduced: memory stays bounded whatever the
//    size, and the segment the kernel has just written is still in cache when it is added.
//  - Allgather segments go straight into the caller's buffer; their receives are all posted up
//    front. That is safe: segment k of a chunk can only come back in the allgather after this
//    member's reduce-scatter send of the same segment has been read by the right neighbour,
//    i.e. after the kernel has copied it out.
//  - Each step has its own Gloo slot. Gloo sends a message once both the send and the peer's
//    recv are posted; both sides post in step-then-segment order, so every buffer's receives
//    complete in that order and the n-th completed wait is the n-th posted receive.
Status GlooCommManager::Ring(GlooContext& ctx, void* user, float* acc, size_t count, DType dtype,
                             ReduceOp op, size_t rank, size_t world) {
  const size_t staging_segments =
      std::max<size_t>(4, options_.inflight_bytes / std::max<size_t>(1, options_.segment_bytes));
  const bool bf16 = dtype == DType::kBFloat16;
  const size_t seg = std::max<size_t>(1, options_.segment_bytes / sizeof(float));
  const size_t steps = RingSteps(world);
  const size_t last_reduce = world - 2;
  auto segments = [seg](size_t n) { return (n + seg - 1) / seg; };
  auto seg_len = [seg](size_t n, size_t k) { return std::min(seg, n - k * seg); };
  auto in_chunk = [&](size_t step) {
    return RingChunk(count, world, RingRecvChunk(rank, world, step));
  };
  // Whether step s carries bfloat16 (the caller's buffer) or float32 (the accumulator).
  auto wire16 = [&](size_t step) { return bf16 && (step == 0 || !RingStepReduces(world, step)); };
  auto wire_bytes = [&](size_t step) { return wire16(step) ? sizeof(uint16_t) : sizeof(float); };
  const size_t depth =
      std::max<size_t>(1, std::min(staging_segments, segments(RingChunk(count, world, 0).size)));
  if (scratch_.size() < depth * seg) scratch_.resize(depth * seg);
  const int left = static_cast<int>((rank + world - 1) % world);
  const int right = static_cast<int>((rank + 1) % world);
  auto ubuf = ctx.createUnboundBuffer(user, count * DTypeBytes(dtype));
  std::unique_ptr<GlooBuffer> abuf_owned;
  if (bf16) abuf_owned = ctx.createUnboundBuffer(acc, count * sizeof(float));
  GlooBuffer* abuf = bf16 ? abuf_owned.get() : ubuf.get();
  auto sbuf = ctx.createUnboundBuffer(scratch_.data(), depth * seg * sizeof(float));
  {
    std::lock_guard lock(mu_);
    if (phase_ == Phase::kFailed) return status_;
    inflight_ = {ubuf.get(), sbuf.get()};
    if (bf16) inflight_.push_back(abuf);
  }
  InflightGuard unregister{this};  // after the buffers: see InflightGuard

  const uint64_t slot_base = (++op_seq_) * 2 * world;
  // The next reduce-scatter segment to post a staging receive for, and how many were posted.
  size_t post_step = 0, post_seg = 0, staged_posted = 0;
  auto post_staged = [&] {
    while (RingStepReduces(world, post_step) && post_seg >= segments(in_chunk(post_step).size)) {
      ++post_step;
      post_seg = 0;
    }
    if (!RingStepReduces(world, post_step)) return;
    const size_t n = seg_len(in_chunk(post_step).size, post_seg);
    sbuf->recv(left, slot_base + post_step, (staged_posted % depth) * seg * sizeof(float),
               n * wire_bytes(post_step));
    ++post_seg;
    ++staged_posted;
  };
  for (size_t i = 0; i < depth; ++i) post_staged();
  for (size_t step = world - 1; step < steps; ++step) {
    Chunk in = in_chunk(step);
    for (size_t k = 0; k < segments(in.size); ++k) {
      ubuf->recv(left, slot_base + step, (in.begin + k * seg) * DTypeBytes(dtype),
                 seg_len(in.size, k) * DTypeBytes(dtype));
    }
  }
  size_t user_sends = 0, acc_sends = 0;
  auto send = [&](size_t step, const Chunk& out, size_t k) {
    const size_t bytes = wire_bytes(step);
    GlooBuffer* from = wire16(step) ? ubuf.get() : abuf;
    from->send(right, slot_base + step, (out.begin + k * seg) * bytes,
               seg_len(out.size, k) * bytes);
    ++(from == ubuf.get() ? user_sends : acc_sends);
  };
  Chunk first = RingChunk(count, world, RingSendChunk(rank, world, 0));
  for (size_t k = 0; k < segments(first.size); ++k) send(0, first, k);

  const float divisor = static_cast<float>(world);
  size_t staged_done = 0;
  for (size_t step = 0; step < steps; ++step) {
    Chunk in = in_chunk(step);
    for (size_t k = 0; k < segments(in.size); ++k) {
      const size_t begin = in.begin + k * seg;
      const size_t n = seg_len(in.size, k);
      if (RingStepReduces(world, step)) {
        LK_RETURN_IF_ERROR(WaitRecv(*sbuf));
        const float* staged = scratch_.data() + (staged_done % depth) * seg;
        if (!bf16) {
          AddInto(acc + begin, staged, n);
        } else {
          // Each chunk is reduced into once per member, so this is the first time this
          // segment of the accumulator is written: it is set to this member's own input plus
          // what arrived, without a widening pass over the whole buffer beforehand.
          const uint16_t* mine = static_cast<const uint16_t*>(user) + begin;
          if (wire16(step)) {
            SumBf16(mine, reinterpret_cast<const uint16_t*>(staged), acc + begin, n);
          } else {
            SumBf16Float(mine, staged, acc + begin, n);
          }
        }
        ++staged_done;
        post_staged();              // the slot just read is free again
        if (step == last_reduce) {  // this segment is final: finish it here, once
          if (op == ReduceOp::kAvg) Divide(acc + begin, n, divisor);
          if (bf16) NarrowToBf16(acc + begin, static_cast<uint16_t*>(user) + begin, n);
        }
      } else {
        LK_RETURN_IF_ERROR(WaitRecv(*ubuf));
      }
      if (step + 1 < steps) send(step + 1, in, k);
    }
  }
  for (size_t i = 0; i < user_sends; ++i) LK_RETURN_IF_ERROR(WaitSend(*ubuf));
  for (size_t i = 0; i < acc_sends; ++i) LK_RETURN_IF_ERROR(WaitSend(*abuf));
  return Status::Ok();
}

}  // namespace gloo_backend

Result<std::unique_ptr<CommManager>> CreateGlooCommManager(RendezvousStore* store,
                                                           CommOptions options) {
  // Gloo writes with writev(2), which raises SIGPIPE when a peer reset the connection: its
  // device loop thread, started here, inherits a mask with SIGPIPE blocked (see sigpipe.h).
  ScopedSigpipeBlock no_sigpipe;
  std::shared_ptr<gloo::transport::Device> device;
  LK_ASSIGN_OR_RETURN(std::string host, ResolveBindHost(options.bind_host));
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return Error(Code::kUnavailable, "gloo device on {}: {}", options.bind_host, e.what());
  }
  return std::unique_ptr<CommManager>(std::make_unique<gloo_backend::GlooCommManager>(
      store, std::move(options), std::move(device)));
}

}  // namespace lk::comm
