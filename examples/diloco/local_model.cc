#include "examples/diloco/local_model.h"

#include <torch/torch.h>

#include "common/log.h"

#include <cmath>
#include <cstring>

namespace lk::diloco {

namespace {

namespace nn = torch::nn;

// Causal multi-head self-attention.
class AttentionImpl : public nn::Module {
 public:
  AttentionImpl(int64_t width, int64_t heads, int64_t seq_len) : heads_(heads) {
    qkv_ = register_module("qkv", nn::Linear(width, 3 * width));
    proj_ = register_module("proj", nn::Linear(width, width));
    // A buffer, not a parameter: it is not trained and not part of the flat vector.
    mask_ = register_buffer("mask", torch::triu(torch::ones({seq_len, seq_len}), 1).to(torch::kBool));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), d = c / heads_;
    auto parts = qkv_->forward(x).chunk(3, -1);
    auto split = [&](const torch::Tensor& y) { return y.view({b, t, heads_, d}).transpose(1, 2); };
    torch::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(d)));
    att = att.masked_fill(mask_.slice(0, 0, t).slice(1, 0, t), -INFINITY).softmax(-1);
    return proj_->forward(torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, c}));
  }

 private:
  int64_t heads_;
  nn::Linear qkv_{nullptr}, proj_{nullptr};
  torch::Tensor mask_;
};
TORCH_MODULE(Attention);

class BlockImpl : public nn::Module {
 public:
  BlockImpl(int64_t width, int64_t heads, int64_t seq_len) {
    ln1_ = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({width})));
    attn_ = register_module("attn", Attention(width, heads, seq_len));
    ln2_ = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({width})));
    fc_ = register_module("fc", nn::Linear(width, 4 * width));
    out_ = register_module("out", nn::Linear(4 * width, width));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn_->forward(ln1_->forward(x));
    return x + out_->forward(torch::gelu(fc_->forward(ln2_->forward(x))));
  }

 private:
  nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  Attention attn_{nullptr};
  nn::Linear fc_{nullptr}, out_{nullptr};
};
TORCH_MODULE(Block);

class GptImpl : public nn::Module {
 public:
  GptImpl(int64_t vocab, const ModelOptions& o) {
    tok_ = register_module("tok", nn::Embedding(vocab, o.width));
    pos_ = register_module("pos", nn::Embedding(o.seq_len, o.width));
    blocks_ = register_module("blocks", nn::Sequential());
    for (uint32_t i = 0; i < o.layers; ++i) blocks_->push_back(Block(o.width, o.heads, o.seq_len));
    ln_ = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({int64_t{o.width}})));
    head_ = register_module("head", nn::Linear(o.width, vocab));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    torch::Tensor x = tok_->forward(idx) + pos_->forward(torch::arange(idx.size(1)));
    return head_->forward(ln_->forward(blocks_->forward(x)));
  }

 private:
  nn::Embedding tok_{nullptr}, pos_{nullptr};
  nn::Sequential blocks_{nullptr};
  nn::LayerNorm ln_{nullptr};
  nn::Linear head_{nullptr};
};
TORCH_MODULE(Gpt);

class TorchLocalModel final : public LocalModel {
 public:
  TorchLocalModel(const ModelOptions& o, uint64_t init_seed, const Encoded& data)
      : options_(o), data_(data) {
    torch::manual_seed(init_seed);
    model_ = Gpt(static_cast<int64_t>(data.vocab.size()), o);
    for (const auto& item : model_->named_parameters()) {
      param_specs_.push_back(TensorSpec{item.key(), numel_, item.value().sizes().vec()});
      params_.push_back(item.value());
      numel_ += static_cast<size_t>(item.value().numel());
    }
    size_t at = 0;
    for (const TensorSpec& p : param_specs_) {
      for (const char* kind : {"exp_avg/", "exp_avg_sq/"}) {
        optimizer_specs_.push_back(TensorSpec{kind + p.name, at, p.shape});
        at += p.numel();
      }
      optimizer_specs_.push_back(TensorSpec{"step/" + p.name, at, {}});
      at += 1;
    }
    optimizer_numel_ = at;
    ResetOptimizer();
  }

  size_t numel() const override { return sharded_ ? shard_numel_ : numel_; }

  void Flatten(std::span<float> out) const override {
    LK_CHECK(out.size() == numel()) << "flatten into " << out.size() << " of " << numel();
    size_t at = 0;
    for (const auto& p : Held()) {
      std::memcpy(out.data() + at, p.data_ptr<float>(), p.numel() * sizeof(float));
      at += static_cast<size_t>(p.numel());
    }
  }

  void Load(std::span<const float> flat) override {
    LK_CHECK(flat.size() == numel()) << "load " << flat.size() << " of " << numel();
    torch::NoGradGuard no_grad;
    size_t at = 0;
    for (auto& p : Held()) {
      std::memcpy(p.data_ptr<float>(), flat.data() + at, p.numel() * sizeof(float));
      at += static_cast<size_t>(p.numel());
    }
  }

  void Shard(uint32_t rank, uint32_t size, GroupSum sum) override {
    torch::NoGradGuard no_grad;
    sum_ = std::move(sum);
    rank_ = rank;
    shard_.clear();
    rows_.clear();
    shard_numel_ = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const RowRange r = ShardRows(param_specs_[i], size, rank);
      rows_.push_back(r);
      torch::Tensor s = params_[i].narrow(0, r.begin, r.end - r.begin).clone();
      s.set_requires_grad(true);
      shard_numel_ += static_cast<size_t>(s.numel());
      shard_.push_back(s);
    }
    sharded_ = true;
    Free();
    ResetOptimizer();
  }

  Status GatherWhole(std::vector<float>* out) override {
    out->resize(numel_);
    if (!sharded_) {
      Flatten(*out);
      return Status::Ok();
    }
    LK_RETURN_IF_ERROR(Gather());
    std::memcpy(out->data(), whole_.data_ptr<float>(), numel_ * sizeof(float));
    Free();
    return Status::Ok();
  }

  std::vector<TensorSpec> ParamSpecs() const override { return param_specs_; }
  std::vector<TensorSpec> OptimizerSpecs() const override { return optimizer_specs_; }

  // The step count of each parameter's state is a scalar: in the rows of a sharded model's
  // state it is rank 0's (ShardRows of a scalar), and the others hold none.
  bool HoldsScalars() const { return !sharded_ || rank_ == 0; }
  size_t OptimizerNumel() const {
    if (!sharded_) return optimizer_numel_;
    return 2 * shard_numel_ + (HoldsScalars() ? params_.size() : 0);
  }

  void ExportOptimizer(std::span<float> out) const override {
    LK_CHECK(out.size() == OptimizerNumel()) << "export into " << out.size();
    size_t at = 0;
    const size_t scalar = HoldsScalars() ? 1 : 0;
    for (const auto& p : Held()) {
      const size_t n = static_cast<size_t>(p.numel());
      auto it = optimizer_->state().find(Key(p));
      if (it == optimizer_->state().end()) {
        std::fill_n(out.begin() + at, 2 * n + scalar, 0.0f);
      } else {
        const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        std::memcpy(out.data() + at, st.exp_avg().contiguous().data_ptr<float>(), n * sizeof(float));
        std::memcpy(out.data() + at + n, st.exp_avg_sq().contiguous().data_ptr<float>(),
                    n * sizeof(float));
        if (scalar != 0) out[at + 2 * n] = static_cast<float>(st.step());
      }
      at += 2 * n + scalar;
    }
  }

  void ImportOptimizer(std::span<const float> in) override {
    LK_CHECK(in.size() == OptimizerNumel()) << "import from " << in.size();
    ResetOptimizer();
    const size_t scalar = HoldsScalars() ? 1 : 0;
    // A sharded group's trainers take the step counts from rank 0 (the others hold none): one
    // in-group sum, which every trainer of the group runs here, after the same restore.
    std::vector<float> steps(params_.size(), 0.0f);
    size_t at = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const size_t n = static_cast<size_t>(Held()[i].numel());
      if (scalar != 0) steps[i] = in[at + 2 * n];
      at += 2 * n + scalar;
    }
    if (sharded_) {
      if (Status st = sum_(steps); !st.ok()) {
        // The group is going down (its next collective fails too); the optimizer starts afresh.
        LK_LOG_WARN("optimizer_steps_not_shared error={}", Q(st.ToString()));
        return;
      }
    }
    at = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const torch::Tensor& p = Held()[i];
      const size_t n = static_cast<size_t>(p.numel());
      const auto step = static_cast<int64_t>(steps[i]);
      if (step > 0) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        auto blob = [&](size_t off) {
          return torch::from_blob(const_cast<float*>(in.data() + off), p.sizes(), torch::kFloat32)
              .clone();
        };
        st->step(step);
        st->exp_avg(blob(at));
        st->exp_avg_sq(blob(at + n));
        optimizer_->state()[Key(p)] = std::move(st);
      }
      at += 2 * n + scalar;
    }
  }

  void ResetOptimizer() override {
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        Held(), torch::optim::AdamWOptions(options_.inner_lr).weight_decay(options_.weight_decay));
  }

  Result<float> InnerStep(SplitMix& rng, const GroupAverage& average) override {
    if (sharded_) LK_RETURN_IF_ERROR(Gather());
    optimizer_->zero_grad();
    torch::Tensor loss = BatchLoss(rng);
    last_batch_hash_ = 0xcbf29ce484222325ULL;
    for (int64_t token : batch_x_) {
      last_batch_hash_ = (last_batch_hash_ ^ static_cast<uint64_t>(token)) * 0x100000001b3ULL;
    }
    loss.backward();
    // Gradients and the loss in one buffer: one collective per inner step.
    grads_.resize(numel_ + 2);
    size_t at = 0;
    for (const auto& p : params_) {
      std::memcpy(grads_.data() + at, p.grad().contiguous().data_ptr<float>(),
                  p.numel() * sizeof(float));
      at += static_cast<size_t>(p.numel());
    }
    grads_[numel_] = loss.item<float>();
    grads_[numel_ + 1] = 0.0f;
    LK_RETURN_IF_ERROR(average(grads_));
    at = 0;
    for (auto& p : params_) {
      p.mutable_grad().copy_(torch::from_blob(grads_.data() + at, p.sizes(), torch::kFloat32));
      at += static_cast<size_t>(p.numel());
    }
    torch::nn::utils::clip_grad_norm_(params_, options_.grad_clip_norm);
    if (sharded_) {
      // This trainer's rows of the group's clipped average gradient (a reduce-scatter by hand).
      for (size_t i = 0; i < params_.size(); ++i) {
        const RowRange& r = rows_[i];
        shard_[i].mutable_grad() = params_[i].grad().narrow(0, r.begin, r.end - r.begin).clone();
      }
      Free();
    }
    optimizer_->step();
    return grads_[numel_];
  }

  uint64_t LastBatchHash() const override { return last_batch_hash_; }

  float Eval(SplitMix& rng, uint32_t batches) override {
    torch::NoGradGuard no_grad;
    if (sharded_ && batches > 0 && !Gather().ok()) return NAN;  // the group is going down
    double sum = 0;
    for (uint32_t i = 0; i < batches; ++i) sum += BatchLoss(rng).item<float>();
    if (sharded_) Free();
    return batches == 0 ? 0.0f : static_cast<float>(sum / batches);
  }

 private:
  // The tensors this trainer keeps between steps and AdamW steps: the parameters, or when
  // sharded its rows of them.
  const std::vector<torch::Tensor>& Held() const { return sharded_ ? shard_ : params_; }

  // The whole weights into the model's parameters (views into whole_), from every trainer's
  // rows: each places its own into zeros, and the group's sum is exact (x + 0 == x).
  Status Gather() {
    torch::NoGradGuard no_grad;
    whole_ = torch::zeros({static_cast<int64_t>(numel_)}, torch::kFloat32);
    float* w = whole_.data_ptr<float>();
    for (size_t i = 0; i < params_.size(); ++i) {
      const TensorSpec& spec = param_specs_[i];
      const size_t row = spec.numel() / static_cast<size_t>(spec.shape[0]);
      std::memcpy(w + spec.offset + static_cast<size_t>(rows_[i].begin) * row,
                  shard_[i].data_ptr<float>(), shard_[i].numel() * sizeof(float));
    }
    LK_RETURN_IF_ERROR(sum_(std::span<float>(w, numel_)));
    for (size_t i = 0; i < params_.size(); ++i) {
      const TensorSpec& spec = param_specs_[i];
      params_[i].set_data(whole_.narrow(0, static_cast<int64_t>(spec.offset),
                                        static_cast<int64_t>(spec.numel()))
                              .view(spec.shape));
    }
    return Status::Ok();
  }

  // Drops the whole weights and gradients again: between steps a sharded trainer holds its
  // rows only.
  void Free() {
    for (auto& p : params_) {
      p.set_data(torch::empty({0}, torch::kFloat32));
      p.mutable_grad() = torch::Tensor();
    }
    whole_ = torch::Tensor();
  }

  // Cross-entropy of the model on one batch of `batch` samples of `seq_len` characters drawn
  // from `rng` (next-character targets).
  torch::Tensor BatchLoss(SplitMix& rng) {
    const int64_t b = options_.batch, t = options_.seq_len;
    const size_t n = data_.tokens.size();
    LK_CHECK(n > static_cast<size_t>(t) + 1) << "corpus shorter than one sample";
    // Members, not locals: from_blob does not copy, and the backward pass reads the inputs and
    // targets after this function returned.
    std::vector<int64_t>& x = batch_x_;
    std::vector<int64_t>& y = batch_y_;
    x.resize(b * t);
    y.resize(b * t);
    for (int64_t i = 0; i < b; ++i) {
      size_t start = rng.Below(n - t - 1);
      std::copy_n(data_.tokens.begin() + start, t, x.begin() + i * t);
      std::copy_n(data_.tokens.begin() + start + 1, t, y.begin() + i * t);
    }
    torch::Tensor xs = torch::from_blob(x.data(), {b, t}, torch::kInt64);
    torch::Tensor ys = torch::from_blob(y.data(), {b * t}, torch::kInt64);
    torch::Tensor logits = model_->forward(xs);
    return torch::cross_entropy_loss(logits.view({b * t, logits.size(-1)}), ys);
  }

  // libtorch keys an optimizer's per-parameter state by the tensor's implementation address.
  static std::string Key(const torch::Tensor& p) {
    return c10::guts::to_string(p.unsafeGetTensorImpl());
  }

  ModelOptions options_;
  const Encoded& data_;
  std::vector<TensorSpec> param_specs_, optimizer_specs_;
  size_t optimizer_numel_ = 0;
  Gpt model_{nullptr};
  std::vector<torch::Tensor> params_;
  size_t numel_ = 0;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<float> grads_;
  std::vector<int64_t> batch_x_, batch_y_;
  uint64_t last_batch_hash_ = 0;
  // Sharded (Shard): this trainer's rows of every parameter, which rows, their elements, the
  // group's sum, and the whole weights while gathered.
  bool sharded_ = false;
  uint32_t rank_ = 0;
  std::vector<torch::Tensor> shard_;
  std::vector<RowRange> rows_;
  size_t shard_numel_ = 0;
  GroupSum sum_;
  torch::Tensor whole_;
};

}  // namespace

Status ModelOptions::Validate() const {
  if (width == 0 || layers == 0 || heads == 0 || seq_len < 2 || batch == 0) {
    return InvalidArgument("model sizes must be positive (seq_len at least 2)");
  }
  if (width % heads != 0) return InvalidArgument("--model-width {} is not a multiple of --heads {}", width, heads);
  if (!(inner_lr > 0) || weight_decay < 0 || !(grad_clip_norm > 0)) {
    return InvalidArgument("inner_lr and grad_clip_norm must be positive, weight_decay not negative");
  }
  return Status::Ok();
}

std::unique_ptr<LocalModel> LocalModel::Create(const ModelOptions& options, uint64_t init_seed,
                                               const Encoded& data) {
  return std::make_unique<TorchLocalModel>(options, init_seed, data);
}

}  // namespace lk::diloco
