#include "diloco/state_io.h"

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "checkpoint/live.h"
#include "checkpoint/restore.h"
#include "checkpoint/writer.h"
#include "common/http/client.h"

namespace lk::diloco {

std::string MomentumName(const std::string& param) { return "outer_momentum/" + param; }
std::string InnerName(const std::string& inner) { return "inner/" + inner; }
std::string ExtraStateName(uint32_t rank) {
  return fmt::format("{}rank-{:05d}", kExtraStatePrefix, rank);
}

namespace {

// Where one checkpoint tensor's rows go in this trainer's buffers.
struct Slot {
  const TensorSpec* spec = nullptr;
  std::vector<float>* dst = nullptr;
  const ShardPiece* piece = nullptr;  // null: no rows on this rank
};

class CheckpointStateIo final : public StateIo {
 public:
  explicit CheckpointStateIo(StateIoOptions o)
      : options_(std::move(o)),
        layout_(MakeShardLayout(options_.params, options_.ranks, options_.rank)),
        inner_layout_(options_.inner_rows.empty()
                          ? MakeShardLayout(options_.inner_state, options_.ranks, options_.rank)
                          : MakeShardLayout(options_.inner_state, options_.inner_rows)),
        writer_(ckpt::WriterOptions{.root = options_.ckpt_dir, .keep = options_.keep}),
        live_(ckpt::LivePublisherOptions{.base_dir = options_.live_dir}) {}

  Status SaveDurable(const OuterState& state, std::span<const float> inner,
                     std::span<const uint8_t> extra, uint32_t attempt) override {
    if (options_.ckpt_dir.empty()) return InvalidArgument("no checkpoint directory to save into");
    ckpt::Snapshot s = MakeSnapshot(state, inner, std::to_string(attempt));
    if (!extra.empty()) {
      // Whole, by this rank: the planner hands it to the same rank only (ExtraRows), so it is
      // kept out of the even split that every other tensor follows.
      const auto len = static_cast<int64_t>(extra.size());
      s.tensors.push_back(ckpt::SnapshotTensor{ExtraStateName(options_.rank), ckpt::DType::kU8,
                                               {len}, ckpt::RowRange{0, len},
                                               ckpt::ConstBytes::Copy(extra.data(), extra.size())});
    }
    auto r = writer_.Save(s);
    return r.ok() ? Status::Ok() : r.status().WithContext("durable checkpoint");
  }

  Status PublishLive(const OuterState& state) override {
    if (options_.live_dir.empty()) return Status::Ok();
    auto r = live_.Publish(MakeSnapshot(state, {}, "0"));
    return r.ok() ? Status::Ok() : r.status().WithContext("publish live state");
  }

  Result<std::optional<RestoredExtra>> RestoreOwnExtra() override {
    if (options_.ckpt_dir.empty() || !std::filesystem::exists(options_.ckpt_dir)) {
      return std::optional<RestoredExtra>();
    }
    ckpt::RestoreOptions o;
    o.layout = Layout();
    // This rank's extra tensor whole, and nothing else: the weights come from elsewhere.
    o.plan.target_rows = ExtraRows(true, /*extra_only=*/true);
    auto r = ckpt::RestoreLatest(options_.ckpt_dir, o);
    if (!r.ok()) {
      if (r.status().code() == Code::kNotFound) return std::optional<RestoredExtra>();
      return r.status().WithContext("extra state from " + options_.ckpt_dir);
    }
    RestoredOuter got;
    TakeExtra(*r, &got);
    if (!got.extra) return std::optional<RestoredExtra>();
    return std::optional<RestoredExtra>(
        RestoredExtra{static_cast<uint32_t>(r->step), std::move(*got.extra)});
  }

  Result<OuterState> FetchFromPeers(const std::vector<std::string>& peers, uint32_t step) override {
    if (peers.empty()) return Status(Code::kNotFound, "no heal sources");
    std::vector<std::string> urls;
    for (const auto& p : peers) urls.push_back(p.rfind("http", 0) == 0 ? p : "http://" + p);
    ckpt::PeerRecoveryOptions o;
    o.layout = Layout();
    o.step = step;
    o.peer.request_timeout = Millis(10'000);
    // Live state holds no extra state; should a peer serve a checkpoint that does, it stays
    // there: the joiner's own data position is the joiner's.
    o.plan.target_rows = ExtraRows(false);
    // The peers' agents ask for the job's token (LK_TOKEN_FILE) and, over https, verify
    // against LK_CA_FILE.
    LK_RETURN_IF_ERROR(http::ClientOptionsFromEnv(&o.peer.client));
    RestoredOuter out;
    auto slots = Slots(&out);
    o.fetch.into = Into(&slots);
    LK_ASSIGN_OR_RETURN(ckpt::RestoredState s, ckpt::RecoverFromPeers(urls, o));
    LK_RETURN_IF_ERROR(FromRestored(s, slots, &out));
    return std::move(out.state);
  }

  Result<RestoredOuter> Restore(const std::string& location) override {
    ckpt::RestoreOptions o;
    o.layout = Layout();
    o.plan.target_rows = ExtraRows(true);
    RestoredOuter out;
    auto slots = Slots(&out);
    o.fetch.into = Into(&slots);
    // A step-* directory names one checkpoint; anything else is a root holding several.
    bool one = std::filesystem::path(location).filename().string().rfind("step-", 0) == 0;
    auto r = one ? ckpt::RestoreFromDir(location, o) : ckpt::RestoreLatest(location, o);
    if (!r.ok()) return r.status().WithContext("restore " + location);
    LK_RETURN_IF_ERROR(FromRestored(*r, slots, &out));
    return out;
  }

 private:
  ckpt::TargetLayout Layout() const { return ckpt::TargetLayout{options_.ranks, options_.rank}; }

  static std::vector<int64_t> Shape(const TensorSpec& s) { return s.shape; }

  // The planner's rows for the extra state: this rank's tensor whole (with `take`), every other
  // rank's not at all; the inner state's rows by its rule (InnerRows); the even split for
  // everything else, or nothing with `extra_only`.
  std::function<std::optional<ckpt::RowRange>(const ckpt::TensorInfo&, ckpt::RowRange)>
  ExtraRows(bool take, bool extra_only = false) const {
    return [this, take, extra_only, mine = ExtraStateName(options_.rank)](
               const ckpt::TensorInfo& t, ckpt::RowRange even) -> std::optional<ckpt::RowRange> {
      if (t.name.rfind(kExtraStatePrefix, 0) != 0) {
        if (extra_only) return std::nullopt;
        if (std::optional<ckpt::RowRange> r = InnerRows(t.name)) return r;
        return std::optional<ckpt::RowRange>(even);
      }
      if (!take || t.name != mine) return std::nullopt;
      return ckpt::RowRange{0, ckpt::RowsOf(t.shape)};
    };
  }

  // The rows of inner-state tensor `name` this rank holds when they are given (none otherwise,
  // or for any other name).
  std::optional<ckpt::RowRange> InnerRows(const std::string& name) const {
    if (options_.inner_rows.empty()) return std::nullopt;
    for (size_t i = 0; i < options_.inner_state.size(); ++i) {
      if (InnerName(options_.inner_state[i].name) != name) continue;
      const RowRange r = options_.inner_rows[i];
      return ckpt::RowRange{r.begin, r.end};
    }
    return std::nullopt;
  }

  // Adds rows [piece] of a tensor whose shard buffer is `owner` (shared by every tensor of the
  // snapshot, so the snapshot holds one copy of the state, not one per tensor).
  static void AddTensor(ckpt::Snapshot* s, std::string name, const TensorSpec& spec,
                        const ShardPiece* piece, const std::shared_ptr<std::vector<float>>& owner,
                        size_t base) {
    if (piece == nullptr) return;  // no rows on this rank: the writer stores none either
    ckpt::ConstBytes b{reinterpret_cast<const uint8_t*>(owner->data() + base + piece->shard_offset),
                       piece->count * sizeof(float), owner};
    // The piece's own rows: the even split's for the outer state, the caller's rule's for the
    // inner state (the writer would otherwise assume the even split).
    s->tensors.push_back(ckpt::SnapshotTensor{std::move(name), ckpt::DType::kF32, Shape(spec),
                                              ckpt::RowRange{piece->row_begin, piece->row_end},
                                              std::move(b)});
  }

  ckpt::Snapshot MakeSnapshot(const OuterState& state, std::span<const float> inner,
                              std::string attempt) const {
    ckpt::Snapshot s;
    s.step = state.step;
    s.rank = options_.rank;
    s.ranks = options_.ranks;
    s.attempt = std::move(attempt);
    s.metadata["step"] = std::to_string(state.step);
    s.metadata["kind"] = "diloco-outer-state";
    s.metadata["inner_state"] = inner.empty() ? "false" : "true";
    // One copy of everything, lent to the writer slice by slice.
    auto all = std::make_shared<std::vector<float>>();
    all->reserve(state.global.size() + state.momentum.size() + inner.size());
    all->insert(all->end(), state.global.begin(), state.global.end());
    all->insert(all->end(), state.momentum.begin(), state.momentum.end());
    all->insert(all->end(), inner.begin(), inner.end());
    const size_t n = state.global.size();
    for (const TensorSpec& spec : options_.params) {
      const ShardPiece* p = layout_.PieceOf(&spec - options_.params.data());
      AddTensor(&s, spec.name, spec, p, all, 0);
      AddTensor(&s, MomentumName(spec.name), spec, p, all, n);
    }
    if (!inner.empty()) {
      for (const TensorSpec& spec : options_.inner_state) {
        const ShardPiece* p = inner_layout_.PieceOf(&spec - options_.inner_state.data());
        AddTensor(&s, InnerName(spec.name), spec, p, all, 2 * n);
      }
    }
    return s;
  }

  // Sizes the buffers of `out` and maps every tensor name to its place in them.
  std::map<std::string, Slot> Slots(RestoredOuter* out) const {
    out->state.global.assign(layout_.shard_numel, 0.0f);
    out->state.momentum.assign(layout_.shard_numel, 0.0f);
    out->inner.emplace(inner_layout_.shard_numel, 0.0f);
    std::map<std::string, Slot> slots;
    for (size_t i = 0; i < options_.params.size(); ++i) {
      const TensorSpec& spec = options_.params[i];
      slots[spec.name] = Slot{&spec, &out->state.global, layout_.PieceOf(i)};
      slots[MomentumName(spec.name)] = Slot{&spec, &out->state.momentum, layout_.PieceOf(i)};
    }
    for (size_t i = 0; i < options_.inner_state.size(); ++i) {
      const TensorSpec& spec = options_.inner_state[i];
      slots[InnerName(spec.name)] = Slot{&spec, &*out->inner, inner_layout_.PieceOf(i)};
    }
    return slots;
  }

  // The restore writes each tensor's rows in place instead of into buffers of its own that
  // would then be copied: one pass over the state fewer.
  static std::function<uint8_t*(const ckpt::TargetTensor&)> Into(
      std::map<std::string, Slot>* slots) {
    return [slots](const ckpt::TargetTensor& t) -> uint8_t* {
      auto it = slots->find(t.name);
      if (it == slots->end() || it->second.piece == nullptr || t.dtype != ckpt::DType::kF32 ||
          t.bytes != it->second.piece->count * sizeof(float)) {
        return nullptr;
      }
      return reinterpret_cast<uint8_t*>(it->second.dst->data() + it->second.piece->shard_offset);
    };
  }

  static Status CheckAndCopy(const ckpt::RestoredTensor& t, const Slot& slot) {
    const TensorSpec& spec = *slot.spec;
    if (t.dtype != ckpt::DType::kF32 || t.shape != spec.shape) {
      return Status(Code::kDataLoss,
                    fmt::format("tensor '{}' in the checkpoint has another dtype or shape than "
                                "the model's",
                                t.name));
    }
    if (slot.piece == nullptr) return Status::Ok();  // a scalar of rank 0, or no rows here
    if (t.rows.begin != slot.piece->row_begin || t.rows.end != slot.piece->row_end ||
        t.data.size() != slot.piece->count * sizeof(float)) {
      return Status(Code::kDataLoss, fmt::format("tensor '{}' restored the wrong rows", t.name));
    }
    float* dst = slot.dst->data() + slot.piece->shard_offset;
    if (t.data.data() != reinterpret_cast<const uint8_t*>(dst)) {
      std::memcpy(dst, t.data.data(), t.data.size());
    }
    return Status::Ok();
  }

  Status FromRestored(const ckpt::RestoredState& s, const std::map<std::string, Slot>& slots,
                      RestoredOuter* out) const {
    out->state.step = static_cast<uint32_t>(s.step);
    for (const TensorSpec& spec : options_.params) {
      for (const std::string& name : {spec.name, MomentumName(spec.name)}) {
        const ckpt::RestoredTensor* t = s.Find(name);
        if (t == nullptr)
          return Status(Code::kDataLoss, fmt::format("checkpoint has no '{}'", name));
        LK_RETURN_IF_ERROR(CheckAndCopy(*t, slots.at(name)));
      }
    }
    TakeExtra(s, out);
    for (const TensorSpec& spec : options_.inner_state) {
      const std::string name = InnerName(spec.name);
      const ckpt::RestoredTensor* t = s.Find(name);
      Status st = t == nullptr
                      ? Status(Code::kNotFound, fmt::format("checkpoint has no '{}'", name))
                      : CheckAndCopy(*t, slots.at(name));
      if (!st.ok()) {
        out->inner.reset();
        out->inner_missing = st.message();
        return Status::Ok();
      }
    }
    if (options_.inner_state.empty()) {
      out->inner.reset();
      out->inner_missing = "no inner state is kept";
    }
    return Status::Ok();
  }

  void TakeExtra(const ckpt::RestoredState& s, RestoredOuter* out) const {
    out->extra.reset();
    const ckpt::RestoredTensor* t = s.Find(ExtraStateName(options_.rank));
    if (t == nullptr || t->dtype != ckpt::DType::kU8 || t->shape.size() != 1) return;
    out->extra.emplace(t->data.data(), t->data.data() + t->data.size());
  }

  StateIoOptions options_;
  ShardLayout layout_;
  ShardLayout inner_layout_;
  ckpt::CheckpointWriter writer_;
  ckpt::LiveStatePublisher live_;
};

}  // namespace

std::unique_ptr<StateIo> MakeCheckpointStateIo(StateIoOptions options) {
  return std::make_unique<CheckpointStateIo>(std::move(options));
}

}  // namespace lk::diloco
