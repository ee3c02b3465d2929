// The replica's local model: a small GPT-style character model on LibTorch with its inner AdamW
// optimizer. Torch stays inside local_model.cc; the trainer sees flat float vectors only, which
// is also the form the outer step, the collectives and the checkpoints work on.
// Thread-safety: one thread (the trainer's). Torch runs with one intra-op thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include <lightkeeper/status.h>
#include <lightkeeper/diloco.h>
#include "examples/diloco/corpus.h"

namespace lk::diloco {

struct ModelOptions {
  uint32_t width = 64;    // embedding width; a multiple of heads
  uint32_t layers = 2;    // transformer blocks
  uint32_t heads = 4;     // attention heads per block
  uint32_t seq_len = 64;  // characters of context per sample
  uint32_t batch = 16;    // samples per inner step per trainer
  double inner_lr = 3e-3;       // AdamW learning rate (constant: the runs are short)
  double weight_decay = 0.01;   // AdamW decoupled weight decay
  double grad_clip_norm = 1.0;  // global gradient-norm clip after the group average
  Status Validate() const;
};

// Averages a float buffer over the trainers of this group in place (identity for one trainer).
using GroupAverage = std::function<Status(std::span<float>)>;
// Sums a float buffer over the trainers of this group in place.
using GroupSum = std::function<Status(std::span<float>)>;

class LocalModel {
 public:
  // Initialises the weights from `init_seed` only, so every replica with the same seed starts
  // from the same weights. `data` must outlive the model.
  static std::unique_ptr<LocalModel> Create(const ModelOptions& options, uint64_t init_seed,
                                            const Encoded& data);
  virtual ~LocalModel() = default;

  // Elements of the flat parameter vector (parameters in registration order, row-major).
  virtual size_t numel() const = 0;
  virtual void Flatten(std::span<float> out) const = 0;
  virtual void Load(std::span<const float> flat) = 0;
  // The parameters inside the flat vector, by their module names (e.g. "blocks.0.qkv.weight").
  virtual std::vector<TensorSpec> ParamSpecs() const = 0;
  // Forgets AdamW's moments (a group that healed starts its inner optimizer afresh).
  virtual void ResetOptimizer() = 0;
  // AdamW's state as one flat float vector: per parameter "exp_avg/NAME", "exp_avg_sq/NAME"
  // (its shape) and "step/NAME" (a scalar; exact below 2^24 steps). A parameter that has not
  // been stepped yet exports zeros and step 0, which imports as a fresh state: AdamW's first
  // step from zero moments is its first step from no state.
  virtual std::vector<TensorSpec> OptimizerSpecs() const = 0;
  virtual void ExportOptimizer(std::span<float> out) const = 0;
  virtual void ImportOptimizer(std::span<const float> in) = 0;
  // One inner step on a batch drawn from `rng`: forward, backward, group average of the
  // gradients (and the loss, in the same buffer), clip, AdamW. Returns the group-mean loss.
  // The buffer `average` gets ends with [loss, 0]: the last float is the caller's, to agree on
  // something with the group in the same collective (the trainer uses it for a drain).
  virtual Result<float> InnerStep(SplitMix& rng, const GroupAverage& average) = 0;
  // FNV-1a of the input tokens of the last batch InnerStep drew: the batch's identity in the
  // trainer's log, so that a test can tell whether a restored run draws the same batches.
  virtual uint64_t LastBatchHash() const = 0;
  // ZeRO-3 by hand (diloco_trainer --shard-model): from now on the model keeps only its rows
  // ShardRows(spec, size, rank) of every parameter, and AdamW keeps its state of those rows;
  // numel(), Flatten, Load, ExportOptimizer and ImportOptimizer are over the rows (the buffers
  // of DilocoOptions::sharded; a scalar of the optimizer's state is rank 0's), and InnerStep,
  // Eval and GatherWhole gather the whole weights through `sum` (each trainer places its rows
  // into zeros and the group sums: exact) and free them after. Every trainer of the group calls
  // them at the same points, as it does InnerStep's average.
  virtual void Shard(uint32_t rank, uint32_t size, GroupSum sum) = 0;
  // The whole weights (a collective of the group when sharded).
  virtual Status GatherWhole(std::vector<float>* out) = 0;
  // Mean loss of the current weights over `batches` batches drawn from `rng`, forward only: no
  // gradient, no optimizer state touched. With the same weights and the same `rng` seed it is
  // the same number on every trainer (one intra-op thread), so it compares runs on equal terms.
  virtual float Eval(SplitMix& rng, uint32_t batches) = 0;
};

}  // namespace lk::diloco
