#include "examples/diloco/state_io.h"

#include <cstring>
#include <functional>
#include <filesystem>

#include "checkpoint/live.h"
#include "checkpoint/restore.h"
#include "checkpoint/writer.h"

namespace lk::diloco {

namespace {

constexpr const char* kGlobal = "global";
constexpr const char* kMomentum = "momentum";

class CheckpointStateIo final : public StateIo {
 public:
  explicit CheckpointStateIo(StateIoOptions o)
      : options_(std::move(o)),
        writer_(ckpt::WriterOptions{.root = options_.ckpt_dir, .keep = options_.keep}),
        live_(ckpt::LivePublisherOptions{.base_dir = options_.live_dir}) {}

  Status SaveDurable(const OuterState& state, uint32_t attempt) override {
    if (options_.ckpt_dir.empty()) return InvalidArgument("no --ckpt-dir to save into");
    auto r = writer_.Save(MakeSnapshot(state, std::to_string(attempt)));
    return r.ok() ? Status::Ok() : r.status().WithContext("durable checkpoint");
  }

  Status PublishLive(const OuterState& state) override {
    if (options_.live_dir.empty()) return Status::Ok();
    auto r = live_.Publish(MakeSnapshot(state, "0"));
    return r.ok() ? Status::Ok() : r.status().WithContext("publish live state");
  }

  Result<OuterState> FetchFromPeers(const std::vector<std::string>& peers, uint32_t step) override {
    if (peers.empty()) return Status(Code::kNotFound, "no heal sources");
    std::vector<std::string> urls;
    for (const auto& p : peers) urls.push_back(p.rfind("http", 0) == 0 ? p : "http://" + p);
    ckpt::PeerRecoveryOptions o;
    o.layout = Layout();
    o.step = step;
    o.peer.request_timeout = Millis(10'000);
    // The peers' agents ask for the job's token (LK_TOKEN_FILE) and, over https, verify
    // against LK_CA_FILE.
    LK_RETURN_IF_ERROR(http::ClientOptionsFromEnv(&o.peer.client));
    OuterState out;
    o.fetch.into = Into(&out);
    LK_ASSIGN_OR_RETURN(ckpt::RestoredState s, ckpt::RecoverFromPeers(urls, o));
    LK_RETURN_IF_ERROR(FromRestored(s, &out));
    return out;
  }

  Result<OuterState> Restore(const std::string& location) override {
    ckpt::RestoreOptions o;
    o.layout = Layout();
    OuterState out;
    o.fetch.into = Into(&out);
    // A step-* directory names one checkpoint; anything else is a root holding several.
    bool one = std::filesystem::path(location).filename().string().rfind("step-", 0) == 0;
    auto r = one ? ckpt::RestoreFromDir(location, o) : ckpt::RestoreLatest(location, o);
    if (!r.ok()) return r.status().WithContext("restore " + location);
    LK_RETURN_IF_ERROR(FromRestored(*r, &out));
    return out;
  }

 private:
  ckpt::TargetLayout Layout() const { return ckpt::TargetLayout{options_.ranks, options_.rank}; }

  ckpt::Snapshot MakeSnapshot(const OuterState& state, std::string attempt) const {
    ckpt::Snapshot s;
    s.step = state.step;
    s.rank = options_.rank;
    s.ranks = options_.ranks;
    s.attempt = std::move(attempt);
    s.metadata["step"] = std::to_string(state.step);
    s.metadata["kind"] = "diloco-outer-state";
    const std::vector<int64_t> shape{static_cast<int64_t>(options_.total)};
    s.Add(kGlobal, ckpt::DType::kF32, shape,
          ckpt::ConstBytes::Copy(state.global.data(), state.global.size() * sizeof(float)));
    s.Add(kMomentum, ckpt::DType::kF32, shape,
          ckpt::ConstBytes::Copy(state.momentum.data(), state.momentum.size() * sizeof(float)));
    return s;
  }

  // The restore writes the two vectors in place instead of into buffers of its own that would
  // then be copied: one pass over the state fewer.
  static std::function<uint8_t*(const ckpt::TargetTensor&)> Into(OuterState* out) {
    return [out](const ckpt::TargetTensor& t) -> uint8_t* {
      std::vector<float>* v = t.name == kGlobal ? &out->global : t.name == kMomentum ? &out->momentum : nullptr;
      if (v == nullptr || t.dtype != ckpt::DType::kF32 || t.bytes % sizeof(float) != 0) return nullptr;
      v->resize(t.bytes / sizeof(float));
      return reinterpret_cast<uint8_t*>(v->data());
    };
  }

  Status FromRestored(const ckpt::RestoredState& s, OuterState* out_ptr) const {
    OuterState& out = *out_ptr;
    out.step = static_cast<uint32_t>(s.step);
    for (auto [name, dst] : {std::pair{kGlobal, &out.global}, std::pair{kMomentum, &out.momentum}}) {
      const ckpt::RestoredTensor* t = s.Find(name);
      if (t == nullptr) return Status(Code::kDataLoss, fmt::format("checkpoint has no {}", name));
      if (t->dtype != ckpt::DType::kF32 || t->shape.size() != 1 ||
          t->shape[0] != static_cast<int64_t>(options_.total)) {
        return Status(Code::kDataLoss, fmt::format("{} has the wrong dtype or shape for a model "
                                                   "of {} parameters", name, options_.total));
      }
      if (t->data.data() == reinterpret_cast<const uint8_t*>(dst->data())) continue;  // in place
      dst->resize(t->data.size() / sizeof(float));
      std::memcpy(dst->data(), t->data.data(), dst->size() * sizeof(float));
    }
    return Status::Ok();
  }

  StateIoOptions options_;
  ckpt::CheckpointWriter writer_;
  ckpt::LiveStatePublisher live_;
};

}  // namespace

std::unique_ptr<StateIo> MakeCheckpointStateIo(StateIoOptions options) {
  return std::make_unique<CheckpointStateIo>(std::move(options));
}

}  // namespace lk::diloco
