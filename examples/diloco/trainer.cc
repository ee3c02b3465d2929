// The DiLoCo example trainer: its LibTorch model and data, and a short loop over the DiLoCo
// library (diloco/diloco.h), which runs the outer step, the quorum protocol and the state I/O.
#include "examples/diloco/trainer.h"

#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include "common/log.h"
#include <lightkeeper/diloco.h>
#include "diloco/net_bytes.h"
#include "diloco/outer.h"
#include "diloco/param_dtype.h"
#include <lightkeeper/session.h>

namespace lk::diloco {

namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Where the wall time and the bytes of one committed outer step went, from the commit before
// (or the start of the process) to this one, retries of a failed attempt included. Logged with
// the step, for bench/diloco_bench.sh: coordination (poll, join, commit) against training.
struct StepStats {
  double inner_ms = 0;       // the H inner steps, with the intra-group gradient allreduces
  double discarded_ms = 0;   // inner steps whose pseudo-gradient a heal threw away
  double eval_ms = 0;        // --eval-batches
  uint64_t group_bytes = 0;  // TCP bytes sent inside the group by the gradient allreduces
  SyncStats sync;            // the library's part, summed over the calls since the commit
};

void Add(SyncStats* to, const SyncStats& s) {
  to->poll_ms += s.poll_ms;
  to->join_ms += s.join_ms;
  to->allreduce_ms += s.allreduce_ms;
  to->gather_ms += s.gather_ms;
  to->publish_ms += s.publish_ms;
  to->commit_ms += s.commit_ms;
  to->outer_ms = s.outer_ms;
  to->cross_bytes += s.cross_bytes;
  to->sync_bytes += s.sync_bytes;
  to->group_bytes += s.group_bytes;
  to->wait_ms += s.wait_ms;
}

class Trainer {
 public:
  explicit Trainer(const TrainerOptions& o) : o_(o) {}
  int Run();

 private:
  Status Init();
  // The inner steps of the next outer step. False when a drain, seen by any trainer of the
  // group, stopped them.
  Result<bool> InnerSteps();
  // Applies what a Sync or Join did to the weights to the model and its optimizer.
  void Apply(const SyncResult& r);
  void WriteLogLine(const SyncResult& r);
  // XXH3 of the weights the model holds, in its own dtype's bytes: after a commit (without
  // overlap) the same in every member of the job.
  std::string ModelHash();
  // The eval loss of the model's current weights, for the next log line.
  void Evaluate();
  // Logs the step that a heal reached when it is the last one (the run ends there).
  void LogReachedByHeal(const SyncResult& r);
  // The data stream's position (the batch generator's state) and the inner step count, handed
  // to the library before each Sync: durable checkpoints save them with the weights of the
  // step they belong to, so a run restored from one draws the batches an uninterrupted run
  // would have drawn next. Restore takes them back after a durable restore.
  Status SaveExtraState();
  void RestoreExtraState(uint32_t step);
  bool half() const { return o_.param_dtype != ParamDType::kFloat32; }
  // A 16-bit model after an inner step: the step's update goes into the float32 master copy
  // (--inner-master) or stays in the weights, and the model's weights are rounded to the dtype
  // (params_ gets them too).
  void RoundModel();
  // The model's weights (params_) were replaced by the outer step: the master copy follows.
  void ResetMaster() {
    if (half() && o_.inner_master) master_ = params_;
  }
  // The library's calls on the model's buffer: params_ itself for float32, else its 16-bit
  // copy (params16_), whose result is widened back into params_.
  enum class Call { kJoin, kSync, kFlush };
  Result<SyncResult> CallLibrary(Call call);

  TrainerOptions o_;
  std::unique_ptr<client::Session> session_;
  Encoded data_;
  std::unique_ptr<LocalModel> model_;
  std::unique_ptr<Diloco> diloco_;
  std::optional<SplitMix> rng_;
  std::vector<float> params_;
  std::vector<uint16_t> params16_;  // a 16-bit model's weights (--param-dtype bf16/fp16)
  // --inner-master: the float32 weights AdamW's updates accumulate in, and a scratch buffer.
  std::vector<float> master_, stepped_;
  std::FILE* log_ = nullptr;
  StepStats stats_;
  float loss_ = 0;
  uint32_t inner_run_ = 0;  // inner steps of the current outer step (all attempts)
  uint64_t inner_step_ = 0;  // inner steps since the run began (restored with the data position)
  std::vector<std::string> batch_hashes_;  // of the inner steps since the last commit
  uint64_t tokens_ = 0;     // this trainer's tokens since the last commit
  // When the last outer step ended (the time budget counts from here).
  Clock::time_point outer_end_ = Clock::now();
  Clock::time_point last_commit_ = Clock::now();
  std::optional<float> eval_loss_;
};

Status Trainer::Init() {
  LK_ASSIGN_OR_RETURN(session_, client::Session::FromEnv(o_.group_rank, o_.group_size));
  data_ = Encode(MakeCorpus(o_.corpus_bytes));
  model_ = LocalModel::Create(o_.model, o_.seed, data_);
  DilocoOptions d;
  d.group_rank = o_.group_rank;
  d.group_size = o_.group_size;
  d.params = model_->ParamSpecs();
  d.inner_state = model_->OptimizerSpecs();
  d.outer = o_.outer;
  d.ckpt_dir = o_.ckpt_dir;
  d.ckpt_every = o_.ckpt_every;
  d.live_dir = o_.live_dir;
  d.bind_host = o_.bind_host;
  d.init_timeout = o_.init_timeout;
  d.op_timeout = o_.op_timeout;
  d.outer_compress = o_.outer_compress;
  d.overlap = o_.overlap;
  d.outer_fragments = o_.outer_fragments;
  d.param_dtype = o_.param_dtype;
  d.sharded = o_.shard_model;
  InnerStateHooks hooks;
  hooks.save = [this](std::span<float> out) {
    model_->ExportOptimizer(out);
    return Status::Ok();
  };
  LK_ASSIGN_OR_RETURN(diloco_, Diloco::Create(session_.get(), std::move(d), std::move(hooks)));
  if (o_.shard_model) {
    // The model keeps its rows from here on; its gathers go through the group's communicator,
    // which connects at the first quorum, before the first inner step.
    model_->Shard(o_.group_rank, o_.group_size,
                  [this](std::span<float> v) { return diloco_->GroupAllReduceSum(v); });
  }
  params_.resize(model_->numel());
  model_->Flatten(params_);
  if (half()) {
    params16_.resize(params_.size());
    if (o_.inner_master) master_ = params_;
    RoundModel();
  }
  if (!o_.log_path.empty()) {
    log_ = std::fopen(o_.log_path.c_str(), "a");
    if (log_ == nullptr) return InvalidArgument("cannot open --log {}", o_.log_path);
  }
  LK_LOG_INFO("trainer_start params={} shard_size={} tensors={} vocab={} corpus_bytes={}",
              diloco_->numel(), diloco_->shard_numel(), model_->ParamSpecs().size(),
              data_.vocab.size(), data_.tokens.size());
  return Status::Ok();
}

void Trainer::Apply(const SyncResult& r) {
  if (r.kind == SyncKind::kCommitted || r.kind == SyncKind::kReceived ||
      r.kind == SyncKind::kJoined || r.kind == SyncKind::kStarted) {
    model_->Load(params_);
    ResetMaster();
  }
  if (r.kind == SyncKind::kReceived) {
    // Inner work since the last commit went into the pseudo-gradient thrown away here: it is
    // not training that reached the model.
    stats_.discarded_ms += stats_.inner_ms;
    stats_.inner_ms = 0;
    tokens_ = 0;
    inner_run_ = 0;
    batch_hashes_.clear();
  }
  outer_end_ = Clock::now();
  if (r.extra_state_restored) RestoreExtraState(r.step);
  if (r.inner == InnerAction::kReset) {
    model_->ResetOptimizer();
  } else if (r.inner == InnerAction::kRestored) {
    model_->ImportOptimizer(diloco_->restored_inner_state());
    std::vector<float> check(diloco_->inner_numel());
    model_->ExportOptimizer(check);
    LK_LOG_INFO("inner_optimizer_loaded step={} hash={}", r.step, StateHash(check));
  }
  if (!rng_ && r.kind != SyncKind::kDrained) {
    uint64_t group_key =
        o_.group_id.empty() ? r.replica_rank : std::hash<std::string>{}(o_.group_id);
    rng_.emplace(MixSeed({o_.seed, group_key, o_.group_rank}));
  }
}

Result<bool> Trainer::InnerSteps() {
  float loss_sum = 0;
  // A drain seen by any trainer of the group travels in the gradients' collective, so that
  // all of them stop after the same inner step (one stopping alone would leave the others
  // waiting in the next collective). So does the end of the time budget, which rank 0's clock
  // decides: each trainer adds 1 for a drain, rank 0 kBudgetMark (above any group size) for
  // the budget, and the sum, exact in a float, says both.
  constexpr float kBudgetMark = 8192.0f;
  bool drain = false, budget_spent = false;
  const auto budget = std::chrono::duration<double>(o_.outer_step_s);
  GroupAverage average = [&](std::span<float> v) {
    const bool spent_here =
        o_.group_rank == 0 && o_.outer_step_s > 0 && Clock::now() - outer_end_ >= budget;
    v.back() = (diloco_->drain_requested() ? 1.0f : 0.0f) + (spent_here ? kBudgetMark : 0.0f);
    LK_RETURN_IF_ERROR(diloco_->GroupAllReduceSum(v));
    budget_spent = v.back() > kBudgetMark - 0.5f;
    drain = v.back() - (budget_spent ? kBudgetMark : 0.0f) > 0.5f;
    for (float& x : v) x /= static_cast<float>(o_.group_size);
    return Status::Ok();
  };
  auto inner_t0 = Clock::now();
  TcpSent b0 = SnapshotTcpSent();
  uint32_t ran = 0;
  for (; ran < o_.inner_steps && !drain && !budget_spent; ++ran) {
    auto step_t0 = Clock::now();
    LK_ASSIGN_OR_RETURN(float loss, model_->InnerStep(*rng_, average));
    if (half()) RoundModel();  // the model holds 16-bit weights, as a 16-bit model does
    loss_sum += loss;
    ++inner_step_;
    batch_hashes_.push_back(fmt::format("{:016x}", model_->LastBatchHash()));
    if (o_.inner_step_min_ms > 0) {
      std::this_thread::sleep_until(step_t0 + Millis(o_.inner_step_min_ms));
    }
  }
  inner_run_ += ran;
  tokens_ += uint64_t{ran} * o_.model.batch * o_.model.seq_len;
  stats_.group_bytes += TcpSentBetween(b0, SnapshotTcpSent());
  stats_.inner_ms += MsSince(inner_t0);
  loss_ = loss_sum / static_cast<float>(std::max(1u, ran));
  model_->Flatten(params_);
  if (drain) diloco_->RequestDrain();
  return !drain;
}

void Trainer::RoundModel() {
  if (o_.inner_master) {
    // The model stepped from params_ (the rounding of master_); the same update applied to the
    // master keeps what the rounding would drop.
    stepped_.resize(params_.size());
    model_->Flatten(stepped_);
    for (size_t i = 0; i < master_.size(); ++i) master_[i] += stepped_[i] - params_[i];
    NarrowParams(o_.param_dtype, master_, params16_);
    WidenParams(o_.param_dtype, params16_, params_);
    model_->Load(params_);
    return;
  }
  model_->Flatten(params_);
  NarrowParams(o_.param_dtype, params_, params16_);
  WidenParams(o_.param_dtype, params16_, params_);
  model_->Load(params_);
}

Result<SyncResult> Trainer::CallLibrary(Call call) {
  if (!half()) {
    return call == Call::kJoin   ? diloco_->Join(params_)
           : call == Call::kSync ? diloco_->Sync(params_, tokens_)
                                 : diloco_->Flush(params_);
  }
  // params_ holds 16-bit values exactly (RoundModel after every inner step), so this is exact.
  NarrowParams(o_.param_dtype, params_, params16_);
  Result<SyncResult> r = call == Call::kJoin   ? diloco_->Join(params16_)
                         : call == Call::kSync ? diloco_->Sync(params16_, tokens_)
                                               : diloco_->Flush(params16_);
  WidenParams(o_.param_dtype, params16_, params_);
  return r;
}

Status Trainer::SaveExtraState() {
  if (!rng_) return Status::Ok();
  const std::string s =
      fmt::format("diloco_trainer/1 rng={:016x} inner_step={}", rng_->state(), inner_step_);
  return diloco_->SetExtraState(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

void Trainer::RestoreExtraState(uint32_t step) {
  std::span<const uint8_t> b = diloco_->restored_extra_state();
  const std::string s(b.begin(), b.end());
  unsigned long long rng = 0, inner = 0;
  if (std::sscanf(s.c_str(), "diloco_trainer/1 rng=%llx inner_step=%llu", &rng, &inner) != 2) {
    // Another program's bytes (or another version's): the stream starts where it would have.
    LK_LOG_WARN("extra_state_ignored step={} bytes={}", step, b.size());
    return;
  }
  rng_.emplace(static_cast<uint64_t>(rng));
  inner_step_ = inner;
  LK_LOG_INFO("extra_state_loaded step={} rng={:016x} inner_step={}", step,
              static_cast<uint64_t>(rng), inner_step_);
}

void Trainer::Evaluate() {
  eval_loss_.reset();
  if (o_.eval_batches == 0) return;
  // After the commit, so that the commit's latency does not include it; the model holds the
  // new global weights now, identical in every member.
  auto eval_t0 = Clock::now();
  SplitMix eval_rng(MixSeed({o_.seed, 0x65766131}));  // the same batches every step and run
  // With overlap the model holds the global weights plus this group's inner progress since
  // the last call; the evaluation is of the global weights alone.
  std::span<const float> global = diloco_->global_weights();
  if (o_.overlap && global.size() == params_.size()) {
    if (half()) {
      // The global weights as the model would hold them: rounded to its dtype.
      std::vector<uint16_t> g16(global.size());
      std::vector<float> rounded(global.size());
      NarrowParams(o_.param_dtype, global, g16);
      WidenParams(o_.param_dtype, g16, rounded);
      model_->Load(rounded);
    } else {
      model_->Load(global);
    }
    eval_loss_ = model_->Eval(eval_rng, o_.eval_batches);
    model_->Load(params_);
    stats_.eval_ms += MsSince(eval_t0);
    return;
  }
  eval_loss_ = model_->Eval(eval_rng, o_.eval_batches);
  stats_.eval_ms += MsSince(eval_t0);
}

void Trainer::LogReachedByHeal(const SyncResult& r) {
  // A heal that lands on the last step (a group that was behind when the others finished, and
  // restored the final checkpoint) ends the run without a commit of its own: the log still
  // gets that step's line (healed=true), so that every finished trainer's log ends at T.
  if (r.kind != SyncKind::kReceived || r.step < o_.outer_steps) return;
  Evaluate();
  WriteLogLine(r);
  LK_LOG_INFO("reached_by_heal step={} quorum_id={} hash={} source={}", r.step, r.quorum_id,
              r.state_hash, Q(r.heal_source));
}

std::string Trainer::ModelHash() {
  std::span<const float> whole = params_;
  std::span<const uint16_t> whole16 = params16_;
  std::vector<float> gathered;
  std::vector<uint16_t> gathered16;
  if (o_.shard_model) {
    // The whole model's hash, gathered (a collective of the group), so that it is the same
    // bytes as a replicated trainer's.
    if (Status st = model_->GatherWhole(&gathered); !st.ok()) return "";
    whole = gathered;
    if (half()) {
      gathered16.resize(gathered.size());
      NarrowParams(o_.param_dtype, gathered, gathered16);  // exact: the values are rounded
      whole16 = gathered16;
    }
  }
  if (!half()) return StateHash(whole);
  // The 16-bit bytes, read as floats two at a time (an odd tail padded with zero).
  std::vector<float> packed((whole16.size() + 1) / 2, 0.0f);
  std::memcpy(packed.data(), whole16.data(), whole16.size() * sizeof(uint16_t));
  return StateHash(packed);
}

void Trainer::WriteLogLine(const SyncResult& r) {
  StepStats s = stats_;
  const double step_ms = MsSince(last_commit_);
  stats_ = StepStats();
  const uint32_t inner_run = inner_run_;
  inner_run_ = 0;
  const std::string batches =
      batch_hashes_.empty() ? "" : "\"" + fmt::format("{}", fmt::join(batch_hashes_, "\",\"")) + "\"";
  batch_hashes_.clear();
  tokens_ = 0;
  last_commit_ = Clock::now();
  // Sharded, the hash gathers the model: every trainer of the group runs it, logging or not.
  const std::string model_hash = o_.shard_model || log_ != nullptr ? ModelHash() : "";
  if (log_ == nullptr) return;
  const SyncStats& y = s.sync;
  const int64_t t_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  std::string eval = eval_loss_ ? fmt::format(",\"eval_loss\":{:.6f}", *eval_loss_) : "";
  std::fputs(
      fmt::format("{{\"step\":{},\"quorum_id\":{},\"replica_world_size\":{},\"loss\":{:.6f},"
                  "\"param_hash\":\"{}\",\"healed\":{},\"group_rank\":{},\"outer_ms\":{}{},"
                  "\"t_ms\":{},\"step_ms\":{:.1f},\"poll_ms\":{:.3f},\"join_ms\":{:.3f},"
                  "\"inner_ms\":{:.1f},\"discarded_ms\":{:.1f},\"allreduce_ms\":{:.1f},"
                  "\"gather_ms\":{:.1f},\"publish_ms\":{:.1f},\"commit_ms\":{:.3f},"
                  "\"eval_ms\":{:.1f},"
                  "\"cross_bytes\":{},\"sync_bytes\":{},\"group_bytes\":{},\"params\":{},"
                  "\"shard\":{},\"inner_steps\":{},\"group_size\":{},\"tokens\":{},"
                  "\"quorum_tokens\":{},\"weighted\":{},\"global_hash\":\"{}\","
                  "\"inner_steps_run\":{},\"group_id\":\"{}\",\"outer_compress\":\"{}\","
                  "\"overlap\":{},\"wait_ms\":{:.1f},\"inner_step\":{},\"param_dtype\":\"{}\","
                  "\"model_bytes\":{},\"outer_state_bytes\":{},\"model_hash\":\"{}\","
                  "\"shard_model\":{},\"batches\":[{}]}}\n",
                  r.step, r.quorum_id, r.replica_world_size, loss_, r.state_hash,
                  r.healed ? "true" : "false", o_.group_rank, static_cast<int64_t>(y.outer_ms),
                  eval, t_ms, step_ms, y.poll_ms, y.join_ms, s.inner_ms, s.discarded_ms,
                  y.allreduce_ms, y.gather_ms, y.publish_ms, y.commit_ms, s.eval_ms, y.cross_bytes,
                  y.sync_bytes, s.group_bytes + y.group_bytes, diloco_->numel(),
                  diloco_->shard_numel(), o_.inner_steps, o_.group_size, r.tokens,
                  r.quorum_tokens, r.weighted ? "true" : "false", r.global_hash, inner_run,
                  o_.group_id, OuterCompressName(o_.outer_compress),
                  o_.overlap ? "true" : "false", y.wait_ms, inner_step_,
                  ParamDTypeName(o_.param_dtype),
                  diloco_->param_numel() * ParamDTypeBytes(o_.param_dtype),
                  diloco_->outer_state_bytes(),
                  model_hash, o_.shard_model ? "true" : "false", batches)
          .c_str(),
      log_);
  std::fflush(log_);
}

int Trainer::Run() {
  if (Status st = Init(); !st.ok()) {
    LK_LOG_ERROR("trainer_init_failed error={}", Q(st.ToString()));
    return 1;
  }
  auto joined = CallLibrary(Call::kJoin);
  if (!joined.ok()) {
    LK_LOG_ERROR("join_failed error={}", Q(joined.status().ToString()));
    if (joined.status().reason() == Reason::kGroupSizeMismatch) {
      // A configuration error, said plainly: restarting this trainer would be refused again.
      std::fprintf(stderr, "diloco_trainer: the lighthouse refused this group: %s\n",
                   joined.status().message().c_str());
      return 2;
    }
    return 1;
  }
  Add(&stats_.sync, joined->stats);
  Apply(*joined);
  if (joined->kind == SyncKind::kDrained) return 0;
  LogReachedByHeal(*joined);
  while (diloco_->step() < o_.outer_steps) {
    // With overlap the step in flight counts: its exchange runs during the next inner steps,
    // and once it is the last one it is landed (Flush) without more inner steps.
    const bool land_last = diloco_->in_flight() && diloco_->step() + 1 >= o_.outer_steps;
    Result<SyncResult> r = Status(Code::kInternal, "no outer step ran");
    if (land_last) {
      r = CallLibrary(Call::kFlush);
    } else {
      // The inner steps come before the poll: the agent asked the lighthouse for this step's
      // round as soon as the last step was committed, so the round ran during them and the
      // poll is answered from the agent's memory, with the freshest membership right before
      // the outer sync.
      auto ran = InnerSteps();
      if (!ran.ok()) {
        LK_LOG_ERROR("inner_steps_failed step={} error={}", diloco_->step() + 1,
                     Q(ran.status().ToString()));
        return 1;
      }
      if (Status st = SaveExtraState(); !st.ok()) {
        LK_LOG_ERROR("extra_state_failed error={}", Q(st.ToString()));
        return 1;
      }
      r = CallLibrary(Call::kSync);
      // Overlap: each call reports the tokens since the previous call, committed or not.
      if (o_.overlap) tokens_ = 0;
    }
    if (!r.ok()) {
      LK_LOG_ERROR("outer_step_failed step={} error={}", diloco_->step() + 1,
                   Q(r.status().ToString()));
      return 1;
    }
    Add(&stats_.sync, r->stats);
    Apply(*r);
    if (r->kind == SyncKind::kDrained) return 0;
    if (r->kind == SyncKind::kReceived) LogReachedByHeal(*r);
    if (r->kind != SyncKind::kCommitted) continue;
    Evaluate();
    WriteLogLine(*r);
    LK_LOG_INFO("outer_committed step={} quorum_id={} world={} loss={:.4f} hash={} outer_ms={}",
                r->step, r->quorum_id, r->replica_world_size, loss_, r->state_hash,
                static_cast<int64_t>(r->stats.outer_ms));
  }
  Status st = diloco_->Finish();
  if (log_ != nullptr) std::fclose(log_);
  if (!st.ok()) {
    LK_LOG_WARN("finish_failed error={}", Q(st.ToString()));
    // A failed final save is a failed run; a failed goodbye is not (the old contract).
    if (st.message().rfind("final save", 0) == 0) return 1;
  }
  return 0;
}

}  // namespace

Status TrainerOptions::Validate() const {
  if (group_size == 0 || group_rank >= group_size) {
    return InvalidArgument("--group-rank {} must be below --group-size {}", group_rank, group_size);
  }
  if (inner_steps == 0) return InvalidArgument("--inner-steps must be at least 1");
  if (!(outer_step_s >= 0) || outer_step_s > 86'400) {
    return InvalidArgument("--outer-step-s must be in [0, 86400]");
  }
  if (group_size > 4096) return InvalidArgument("--group-size must be at most 4096");
  if (outer_steps >= (1u << 24)) return InvalidArgument("--outer-steps must be below 2^24");
  if (ckpt_every > 0 && ckpt_dir.empty()) return InvalidArgument("--ckpt-every needs --ckpt-dir");
  if (corpus_bytes < 4096) return InvalidArgument("--corpus-bytes must be at least 4096");
  if (bind_host.empty()) return InvalidArgument("--bind-host must not be empty");
  if (!(outer.lr > 0) || outer.momentum < 0 || outer.momentum >= 1) {
    return InvalidArgument("--outer-lr must be positive and --outer-momentum in [0, 1)");
  }
  return model.Validate();
}

int RunTrainer(const TrainerOptions& options) {
  Trainer trainer(options);
  return trainer.Run();
}

}  // namespace lk::diloco
