#include "python/src/native_manager.h"

#include <cstdlib>

#include "common/log.h"

namespace lk::python {

namespace {

// Puts a fixed prefix before every key of the agent's KV, so that the communicators of one
// trainer never read each other's addresses under one quorum_id.
class PrefixStore final : public comm::RendezvousStore {
 public:
  PrefixStore(comm::RendezvousStore* inner, std::string prefix)
      : inner_(inner), prefix_(std::move(prefix)) {}
  Status Put(uint32_t quorum_id, const std::string& key, const std::string& value) override {
    return inner_->Put(quorum_id, prefix_ + key, value);
  }
  Result<std::string> Get(uint32_t quorum_id, const std::string& key, Millis timeout) override {
    return inner_->Get(quorum_id, prefix_ + key, timeout);
  }

 private:
  comm::RendezvousStore* inner_;
  std::string prefix_;
};

}  // namespace

Status ManagerOptions::Validate() const {
  if (group_size == 0) return InvalidArgument("group_size must be at least 1");
  if (group_rank >= group_size) {
    return InvalidArgument("group_rank {} is not below group_size {}", group_rank, group_size);
  }
  if (init_timeout.count() <= 0 || op_timeout.count() <= 0) {
    return InvalidArgument("timeouts must be positive");
  }
  return Status::Ok();
}

NativeManager::NativeManager(ManagerOptions options)
    : options_(std::move(options)), sink_(std::make_shared<Sink>()) {}

Result<std::unique_ptr<NativeManager>> NativeManager::Create(ManagerOptions options) {
  if (options.socket.empty()) {
    const char* env = std::getenv("LK_AGENT_SOCKET");
    if (env == nullptr || *env == '\0') {
      return InvalidArgument("no socket given and LK_AGENT_SOCKET is not set: start the "
                             "replica_agent first");
    }
    options.socket = env;
  }
  LK_RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<NativeManager> m(new NativeManager(std::move(options)));
  LK_ASSIGN_OR_RETURN(m->session_, client::Session::Connect(m->options_.socket,
                                                            m->options_.group_rank,
                                                            m->options_.group_size));
  m->kv_ = std::make_unique<client::SessionKvStore>(m->options_.socket);
  m->session_->OnNotice([sink = m->sink_](const client::Notice& n) {
    std::lock_guard lock(sink->mu);
    if (n.lost) sink->record.lost_quorum_id = std::max(sink->record.lost_quorum_id, n.quorum_id);
    if (n.drain) {
      sink->record.drain = true;
      sink->record.checkpoint_now = sink->record.checkpoint_now || n.checkpoint_now;
    }
    sink->record.reason = n.reason;
    for (auto& [backend, comm] : sink->comms) {
      if (n.drain) {
        comm->Abort("drain: " + n.reason);
      } else if (n.lost) {
        comm->AbortQuorum(n.quorum_id, "quorum lost: " + n.reason);
      }
    }
  });
  return m;
}

NativeManager::~NativeManager() {
  // The notice thread may still run the callback: it must stop reaching the communicators
  // before they are destroyed below.
  std::lock_guard lock(sink_->mu);
  sink_->comms.clear();
}

Result<client::PollResult> NativeManager::Poll(uint32_t step, Millis timeout) {
  LK_ASSIGN_OR_RETURN(client::PollResult r, session_->Poll(step, timeout));
  quorum_ = r;
  polled_ = true;
  return r;
}

Status NativeManager::Commit(uint32_t step, bool ok, const std::string& state_hash) {
  return session_->Commit(step, ok, state_hash);
}

Status NativeManager::Finish() { return session_->Finish(); }

Status NativeManager::SetPeerWait(bool waiting) { return session_->SetPeerWait(waiting); }

Status NativeManager::RegisterCheckpoint(uint32_t step, const std::string& location,
                                         const std::string& manifest_digest) {
  return session_->RegisterCheckpoint(step, location, manifest_digest);
}

Status NativeManager::KvPut(uint32_t quorum_id, const std::string& key, const std::string& value) {
  return kv_->Put(quorum_id, key, value);
}

Result<std::string> NativeManager::KvGet(uint32_t quorum_id, const std::string& key,
                                         Millis timeout) {
  return kv_->Get(quorum_id, key, timeout);
}

Result<comm::CommManager*> NativeManager::CommFor(comm::Backend backend, int device) {
  auto it = comms_.find(backend);
  if (it != comms_.end()) {
    if (backend == comm::Backend::kNccl && comm_device_[backend] != device) {
      return InvalidArgument("this Manager's NCCL communicator is on cuda:{}, not cuda:{}",
                             comm_device_[backend], device);
    }
    return it->second.get();
  }
  if (!comm::BackendBuilt(backend)) {
    return InvalidArgument("this build has no {} communicator", comm::BackendName(backend));
  }
  comm::CommOptions co;
  co.slot = options_.group_rank;
  co.bind_host = options_.bind_host;
  co.init_timeout = options_.init_timeout;
  co.op_timeout = options_.op_timeout;
  co.device_index = std::max(device, 0);
  auto store = std::make_unique<PrefixStore>(
      kv_.get(), fmt::format("py/{}/", comm::BackendName(backend)));
  LK_ASSIGN_OR_RETURN(std::unique_ptr<comm::CommManager> c,
                      comm::CommManager::Create(backend, store.get(), co));
  comm::CommManager* raw = c.get();
  stores_[backend] = std::move(store);
  comms_[backend] = std::move(c);
  comm_device_[backend] = device;
  std::lock_guard lock(sink_->mu);
  sink_->comms[backend] = raw;
  return raw;
}

Status NativeManager::AllReduce(uintptr_t data, size_t count, comm::DType dtype, comm::ReduceOp op,
                                int device) {
  if (!polled_) return Status(Code::kInvalidArgument, "allreduce before the first poll");
  if (quorum_.drain) return Status(Code::kAborted, "the group is draining");
  const comm::Backend backend = device < 0 ? comm::Backend::kGloo : comm::Backend::kNccl;
  LK_ASSIGN_OR_RETURN(comm::CommManager * c, CommFor(backend, device));
  if (c->quorum_id() != quorum_.quorum_id) {
    LK_RETURN_IF_ERROR(
        c->Reconfigure(quorum_.quorum_id, quorum_.replica_rank, quorum_.replica_world_size)
            .WithContext(fmt::format("{} communicator for quorum {}", comm::BackendName(backend),
                                     quorum_.quorum_id)));
  }
  // A notice that arrived between the poll and the rebuild named this quorum; the abort it did
  // then reached the communicator of an older one.
  if (notices().lost_quorum_id >= quorum_.quorum_id) {
    c->AbortQuorum(quorum_.quorum_id, "quorum lost before the allreduce");
  }
  if (count == 0) return Status::Ok();
  return c->AllReduce(reinterpret_cast<void*>(data), count, dtype, op);
}

void NativeManager::Abort(const std::string& reason) {
  std::lock_guard lock(sink_->mu);
  for (auto& [backend, comm] : sink_->comms) comm->Abort(reason);
}

NoticeRecord NativeManager::notices() const {
  std::lock_guard lock(sink_->mu);
  return sink_->record;
}

}  // namespace lk::python
