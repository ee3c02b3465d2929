// The NCCL backend on raw device buffers. Built only when CUDA and NCCL are found.
//
// Never a hang: the communicator is non-blocking (config.blocking = 0), so init and every
// collective return at once and this file polls them (ncclCommGetAsyncError, cudaStreamQuery)
// under a deadline, checking the abort flag between polls. On a failure, a notice (Abort) or a
// deadline, the polling thread calls ncclCommAbort, which also stops kernels in flight.
// Only the trainer thread calls NCCL: Abort from another thread sets the flag and the trainer's
// poll (or its next call) aborts the communicator, so NCCL never sees two threads on one comm.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/backends.h"
#include "common/log.h"

namespace lk::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;

std::string IdKey(uint32_t slot) { return fmt::format("nccl/slot{}/id", slot); }

Status CudaError(cudaError_t e, std::string_view what) {
  return Error(Code::kUnavailable, "{}: {}", what, cudaGetErrorString(e));
}

Status NcclError(ncclResult_t r, std::string_view what) {
  // A remote or system error means a peer went away: the collective was cut short.
  Code code = (r == ncclRemoteError || r == ncclSystemError) ? Code::kAborted : Code::kInternal;
  return Error(code, "{}: {}", what, ncclGetErrorString(r));
}

class NcclCommManager final : public CommManager, private CommLifecycle {
 public:
  NcclCommManager(RendezvousStore* store, CommOptions options, cudaStream_t stream)
      : CommLifecycle("nccl", options.slot),
        store_(store),
        options_(std::move(options)),
        stream_(stream) {}

  ~NcclCommManager() override {
    DropComm();
    cudaStreamDestroy(stream_);
  }

  Status Reconfigure(uint32_t quorum_id, uint32_t replica_rank, uint32_t world_size) override;
  Status AllReduce(void* data, size_t count, DType dtype, ReduceOp op) override;

  void Abort(const std::string& reason) override { AbortAll(reason); }
  void AbortQuorum(uint32_t quorum_id, const std::string& reason) override {
    AbortUpTo(quorum_id, reason);
  }
  void Close(const std::string& reason) override { CloseAll(reason); }
  uint32_t quorum_id() const override { return quorum_id_.load(); }
  Backend backend() const override { return Backend::kNccl; }

 private:
  // Trainer thread only: aborts and frees the NCCL communicator, if any.
  void DropComm() {
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }
  // Polls the communicator until its pending work is done (init or enqueue), the deadline
  // passes or Abort is called.
  Status PollAsync(TimePoint deadline, std::string_view what);

  RendezvousStore* const store_;
  const CommOptions options_;
  cudaStream_t stream_;
  ncclComm_t comm_ = nullptr;  // trainer thread only
};

Status NcclCommManager::PollAsync(TimePoint deadline, std::string_view what) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return NcclError(r, what);
    if (state == ncclSuccess) return Status::Ok();
    if (state != ncclInProgress) return NcclError(state, what);
    if (failed_.load()) return Interrupted();
    if (SteadyClock::now() >= deadline) {
      return Error(Code::kDeadlineExceeded, "{} did not finish in time", what);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

Status NcclCommManager::Reconfigure(uint32_t quorum_id, uint32_t replica_rank,
                                    uint32_t world_size) {
  if (world_size == 0 || replica_rank >= world_size) {
    return InvalidArgument("replica_rank {} out of world_size {}", replica_rank, world_size);
  }
  auto start = SteadyClock::now();
  TimePoint deadline = start + options_.init_timeout;
  {
    std::lock_guard lock(mu_);
    if (auto answer = BeginLocked(quorum_id)) return *answer;
  }
  DropComm();

  if (cudaError_t e = cudaSetDevice(options_.device_index); e != cudaSuccess) {
    return Fail(CudaError(e, "cudaSetDevice"));
  }
  ncclUniqueId id;
  if (replica_rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return Fail(NcclError(r, "ncclGetUniqueId"));
    }
    Status st = store_->Put(quorum_id, IdKey(options_.slot),
                            std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    if (!st.ok()) return Fail(st);
  } else {
    auto value = WaitForKey(store_, quorum_id, IdKey(options_.slot), deadline,
                            [this] { return Interrupted(); });
    if (!value.ok()) return Fail(value.status());
    if (value->size() != sizeof(id)) {
      return Fail(
          Error(Code::kDataLoss, "NCCL id of {} bytes, want {}", value->size(), sizeof(id)));
    }
    std::memcpy(&id, value->data(), sizeof(id));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&comm_, static_cast<int>(world_size), id,
                                          static_cast<int>(replica_rank), &config);
  Status st = (r == ncclSuccess || r == ncclInProgress) ? Status::Ok()
                                                        : NcclError(r, "ncclCommInitRankConfig");
  if (st.ok() && comm_ != nullptr) st = PollAsync(deadline, "NCCL communicator init");
  if (st.ok() && comm_ == nullptr) st = Error(Code::kInternal, "NCCL returned no communicator");
  if (!st.ok()) {
    DropComm();
    return Fail(st);
  }
  std::lock_guard lock(mu_);
  if (phase_ == Phase::kFailed) {
    DropComm();
    return status_;
  }
  phase_ = Phase::kReady;
  LK_LOG_INFO("comm_ready backend=nccl slot={} quorum_id={} rank={} world={} init_ms={}",
              options_.slot, quorum_id, replica_rank, world_size,
              ToMillis(SteadyClock::now() - start));
  return Status::Ok();
}

Status NcclCommManager::AllReduce(void* data, size_t count, DType dtype, ReduceOp op) {
  Status failed;
  {
    std::lock_guard lock(mu_);
    if (phase_ == Phase::kNone) {
      return Error(Code::kUnavailable, "no communicator: call Reconfigure first");
    }
    if (phase_ == Phase::kFailed) failed = status_;
  }
  if (!failed.ok()) {
    DropComm();
    return failed;
  }
  TimePoint deadline = SteadyClock::now() + options_.op_timeout;
  ncclDataType_t type = dtype == DType::kFloat32 ? ncclFloat32 : ncclBfloat16;
  ncclRedOp_t red = op == ReduceOp::kSum ? ncclSum : ncclAvg;
  ncclResult_t r = ncclAllReduce(data, data, count, type, red, comm_, stream_);
  Status st =
      (r == ncclSuccess || r == ncclInProgress) ? Status::Ok() : NcclError(r, "ncclAllReduce");
  // A non-blocking communicator may still be enqueueing the kernel.
  if (st.ok() && r == ncclInProgress) st = PollAsync(deadline, "allreduce enqueue");
  while (st.ok()) {
    cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      st = CudaError(e, "allreduce stream");
      break;
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      st = NcclError(async, "allreduce");
    } else if (failed_.load()) {
      st = Interrupted();
    } else if (SteadyClock::now() >= deadline) {
      st = Error(Code::kDeadlineExceeded, "allreduce did not finish within {} ms",
                 options_.op_timeout.count());
    } else {
      std::this_thread::yield();
    }
  }
  if (!st.ok()) {
    st = Fail(st);
    DropComm();  // ncclCommAbort also stops the kernel still in flight
  }
  return st;
}

}  // namespace

Result<std::unique_ptr<CommManager>> CreateNcclCommManager(RendezvousStore* store,
                                                           CommOptions options) {
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    return CudaError(e, "cudaGetDeviceCount");
  }
  if (options.device_index >= devices) {
    return Error(Code::kUnavailable, "CUDA device {} of {}", options.device_index, devices);
  }
  if (cudaError_t e = cudaSetDevice(options.device_index); e != cudaSuccess) {
    return CudaError(e, "cudaSetDevice");
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaError(e, "cudaStreamCreate");
  }
  return std::unique_ptr<CommManager>(
      std::make_unique<NcclCommManager>(store, std::move(options), stream));
}

}  // namespace lk::comm
