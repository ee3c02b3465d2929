#include "comm/comm.h"

#include <net/if.h>

#include "comm/backends.h"
#include "common/http/server.h"

namespace lk::comm {

std::string_view BackendName(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
    case Backend::kGateway:
      return "gateway";
  }
  return "unknown";
}

bool ParseBackend(std::string_view name, Backend* out) {
  if (name == "gloo") {
    *out = Backend::kGloo;
  } else if (name == "nccl") {
    *out = Backend::kNccl;
  } else if (name == "gateway") {
    *out = Backend::kGateway;
  } else {
    return false;
  }
  return true;
}

size_t DTypeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

bool BackendBuilt(Backend backend) {
#ifdef LK_HAVE_NCCL
  (void)backend;
  return true;
#else
  return backend != Backend::kNccl;
#endif
}

Result<std::string> ResolveBindHost(const std::string& bind_host) {
  if (bind_host.empty() || bind_host.size() >= IF_NAMESIZE ||
      ::if_nametoindex(bind_host.c_str()) == 0) {
    return bind_host;
  }
  return http::InterfaceIPv4(bind_host);
}

Status CommOptions::Validate() const {
  if (bind_host.empty()) return InvalidArgument("bind_host must not be empty");
  // The bind address is what peers are given: "every address" reaches none of them.
  if (bind_host == "0.0.0.0" || bind_host == "::" || bind_host == "[::]") {
    return InvalidArgument(
        "bind_host {} is every address of the host and cannot be given to peers: give this "
        "node's address on the network the other groups reach",
        bind_host);
  }
  if (init_timeout <= Millis(0)) return InvalidArgument("init_timeout must be positive");
  if (op_timeout <= Millis(0)) return InvalidArgument("op_timeout must be positive");
  if (device_index < 0) return InvalidArgument("device_index must be >= 0");
  if (segment_bytes < 4096) return InvalidArgument("segment_bytes must be at least 4096");
  if (inflight_bytes > (size_t{1} << 30)) return InvalidArgument("inflight_bytes must be at most 1 GiB");
  return Status::Ok();
}

Status CommManager::AllReduceEncoded(std::span<float>, const ChunkCodec&, ReduceOp,
                                     std::span<float>, std::span<float>) {
  return Error(Code::kUnavailable, "the {} backend has no encoded allreduce",
               BackendName(backend()));
}

Status CommManager::AllReduceRuns(std::span<float>, std::span<const ReduceRun>,
                                  const ChunkCodec*, std::span<float>, std::span<float>) {
  return Error(Code::kUnavailable, "the {} backend has no allreduce of runs",
               BackendName(backend()));
}

Result<std::unique_ptr<CommManager>> CommManager::Create(Backend backend, RendezvousStore* store,
                                                         CommOptions options) {
  if (store == nullptr) return InvalidArgument("CommManager needs a RendezvousStore");
  LK_RETURN_IF_ERROR(options.Validate());
  if (backend == Backend::kGloo) return CreateGlooCommManager(store, std::move(options));
  if (backend == Backend::kGateway) return CreateGatewayCommManager(store, std::move(options));
#ifdef LK_HAVE_NCCL
  return CreateNcclCommManager(store, std::move(options));
#else
  return Error(Code::kUnavailable, "this build has no NCCL (CUDA and NCCL were not found)");
#endif
}

Result<std::string> WaitForKey(RendezvousStore* store, uint32_t quorum_id, const std::string& key,
                               TimePoint deadline, const std::function<Status()>& interrupted,
                               Millis slice) {
  for (;;) {
    LK_RETURN_IF_ERROR(interrupted());
    auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    if (left <= Millis(0)) {
      return Error(Code::kDeadlineExceeded, "key {} of quorum {} not published before the deadline",
                   key, quorum_id);
    }
    auto r = store->Get(quorum_id, key, std::min(left, slice));
    if (r.ok() || r.status().code() != Code::kDeadlineExceeded) return r;
  }
}

}  // namespace lk::comm
