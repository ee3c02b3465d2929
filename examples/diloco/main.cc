// diloco_trainer: one trainer process of a DiLoCo run under Lightkeeper. Start the node's
// replica_agent first; the trainer finds it through LK_AGENT_SOCKET. Every flag is also an LK_*
// environment variable.
#include <torch/torch.h>

#include <cstdio>

#include "common/flags.h"
#include "common/log.h"
#include "common/task_place.h"
#include "examples/diloco/trainer.h"

int main(int argc, char** argv) {
  using namespace lk;
  diloco::TrainerOptions o;
  double outer_lr = o.outer.lr, outer_momentum = o.outer.momentum;
  uint32_t init_timeout_ms = static_cast<uint32_t>(o.init_timeout.count());
  uint32_t op_timeout_ms = static_cast<uint32_t>(o.op_timeout.count());
  std::string log_level = "info";
  std::string outer_compress = "none";
  std::string param_dtype = "float32";
  Flags flags("diloco_trainer",
              "A DiLoCo trainer: a small GPT-style character model on LibTorch (CPU, one thread).\n"
              "Runs --inner-steps AdamW steps, then an outer step that averages this trainer's\n"
              "shard of the pseudo-gradient over the quorum and applies outer Nesterov SGD;\n"
              "polls its replica_agent (LK_AGENT_SOCKET) at every outer step, heals and drains\n"
              "when told. Exits 0 when the committed step reaches --outer-steps or on a drain.");
  flags.Add("group-rank", &o.group_rank,
            "this trainer's rank inside its group (default: torchrun's RANK, else Slurm's "
            "SLURM_PROCID, else 0)");
  flags.Add("group-size", &o.group_size,
            "trainers in this group (groups may differ: their quorums average fragment by "
            "fragment; a refusal, GROUP_SIZE_MISMATCH, makes the trainer exit 2; default: "
            "torchrun's WORLD_SIZE, else Slurm's SLURM_NTASKS, else 1)");
  flags.Add("inner-steps", &o.inner_steps,
            "H: inner AdamW steps per outer step (with --outer-step-s: the most per outer step); "
            "groups may use different values: the outer average weighs each group by its tokens");
  flags.Add("outer-step-s", &o.outer_step_s,
            "a time budget per outer step: run inner steps until this many seconds passed since "
            "the last outer step ended (at most --inner-steps), so that a faster group does more "
            "steps instead of waiting; 0: exactly --inner-steps");
  flags.Add("inner-step-min-ms", &o.inner_step_min_ms,
            "tests and benchmarks: each inner step lasts at least this long (sleeps the rest), "
            "to make one group slower than another; 0: off");
  flags.Add("outer-steps", &o.outer_steps, "T: run until the committed outer step reaches T");
  flags.Add("seed", &o.seed, "model initialisation (same for all groups) and data order");
  flags.Add("group-id", &o.group_id,
            "seeds this group's data stream (the agent's LK_GROUP_ID); empty: the first "
            "replica_rank");
  flags.Add("ckpt-dir", &o.ckpt_dir, "durable checkpoints of this group (shared by its trainers)");
  flags.Add("ckpt-every", &o.ckpt_every, "save every K committed steps; 0: only when draining");
  flags.Add("live-dir", &o.live_dir,
            "node-local directory for the live state the agent serves to healing peers "
            "(its --serve-dir); empty: none, healing peers get state over the communicator");
  flags.Add("bind-host", &o.bind_host,
            "the address this trainer's communicators listen on and give their peers (the "
            "node's address that the other groups reach), or an interface name (ib0: its IPv4 "
            "address)");
  flags.Add("log", &o.log_path, "JSON lines, one per committed outer step");
  flags.Add("eval-batches", &o.eval_batches,
            "after every commit, the loss of the new global weights on this many batches drawn "
            "from --seed alone (the same batches in every trainer and run), logged as eval_loss; "
            "0: none");
  flags.Add("model-width", &o.model.width, "embedding width");
  flags.Add("layers", &o.model.layers, "transformer blocks");
  flags.Add("heads", &o.model.heads, "attention heads (divides --model-width)");
  flags.Add("seq-len", &o.model.seq_len, "characters of context per sample");
  flags.Add("batch", &o.model.batch, "samples per inner step per trainer");
  flags.Add("inner-lr", &o.model.inner_lr, "AdamW learning rate");
  flags.Add("outer-lr", &outer_lr, "outer Nesterov SGD learning rate");
  flags.Add("outer-momentum", &outer_momentum, "outer Nesterov momentum");
  flags.Add("corpus-bytes", &o.corpus_bytes, "size of the generated training text");
  flags.Add("init-timeout-ms", &init_timeout_ms, "communicator rendezvous and connect deadline");
  flags.Add("op-timeout-ms", &op_timeout_ms,
            "deadline of one collective (the outer allreduce waits for the slowest group)");
  flags.Add("outer-compress", &outer_compress,
            "encoding of the cross-group pseudo-gradients: none (float32), bf16, int8 or int4 "
            "(blockwise scales, error feedback); the same in every group");
  flags.Add("outer-overlap", &o.overlap,
            "overlapped outer steps: the exchange of a step runs during the next step's inner "
            "steps and lands one step late; the same in every group");
  flags.Add("shard-model", &o.shard_model,
            "each trainer of the group keeps only its rows of every parameter and of AdamW's "
            "state (ZeRO-3 by hand: an inner step gathers the weights through the group's "
            "communicator and frees them after, and each trainer keeps its rows of the averaged "
            "gradients); DiLoCo runs over the rows");
  flags.Add("outer-fragments", &o.outer_fragments,
            "with --outer-overlap: the exchange goes on the link in this many fragments spread "
            "over the next inner steps (1: one burst); the same in every group");
  flags.Add("param-dtype", &param_dtype,
            "the dtype the model's weights are held in: float32, bf16 or fp16 (rounded to nearest "
            "even after every inner step; the outer state stays float32 and the new global "
            "weights come back rounded, the same bits in every member)");
  flags.Add("inner-master", &o.inner_master,
            "with a 16-bit --param-dtype: AdamW updates a float32 master copy of the weights and "
            "the model holds its rounding (mixed precision); false: AdamW's updates land in the "
            "16-bit weights themselves (pure 16-bit training)");
  bool keep_denormals = false;
  flags.Add("keep-denormals", &keep_denormals,
            "compute the inner steps with IEEE denormals; the default flushes them to zero, "
            "because on CPUs the optimizer state of rarely used parameters decays into that "
            "range and every operation on it is slow (bench/denormals_bench.sh); the outer step "
            "always flushes");
  flags.Add("log-level", &log_level, "debug, info, warn or error");
  Status st = flags.Parse(argc, argv);
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    return 0;
  }
  o.outer.lr = static_cast<float>(outer_lr);
  o.outer.momentum = static_cast<float>(outer_momentum);
  o.init_timeout = Millis(init_timeout_ms);
  o.op_timeout = Millis(op_timeout_ms);
  LogLevel level;
  if (st.ok() && !ParseLogLevel(log_level, &level)) st = InvalidArgument("bad --log-level {}", log_level);
  if (st.ok() && !diloco::ParseOuterCompress(outer_compress, &o.outer_compress)) {
    st = InvalidArgument("bad --outer-compress {} (none, bf16, int8 or int4)", outer_compress);
  }
  if (st.ok() && !diloco::ParseParamDType(param_dtype, &o.param_dtype)) {
    st = InvalidArgument("bad --param-dtype {} (float32, bf16 or fp16)", param_dtype);
  }
  // The launcher's place for what the flags did not say (one Slurm job or torchrun per group).
  std::string place_source = "flags";
  if (st.ok() && (!flags.IsSet("group-rank") || !flags.IsSet("group-size"))) {
    auto place = TaskPlaceFromEnv(EnvironMap());
    if (!place.ok()) {
      st = place.status();
    } else if (place->has_value()) {
      if (!flags.IsSet("group-rank")) o.group_rank = (*place)->rank;
      if (!flags.IsSet("group-size")) o.group_size = (*place)->size;
      place_source = (*place)->source;
    }
  }
  if (st.ok() && !flags.positional().empty()) {
    st = InvalidArgument("unexpected argument {}", flags.positional().front());
  }
  if (st.ok()) st = o.Validate();
  if (!st.ok()) {
    std::fprintf(stderr, "diloco_trainer: %s\n", st.message().c_str());
    return 2;
  }
  SetLogLevel(level);
  SetLogPrefix(fmt::format("trainer={}", o.group_rank));
  // One intra-op thread: several trainers share a node's cores, and one thread keeps every
  // kernel's reduction order, so runs replay exactly.
  torch::set_num_threads(1);
  at::globalContext().setFlushDenormal(!keep_denormals);  // this thread runs the inner steps
  LK_LOG_INFO("trainer_config {} place={}", flags.Effective(), place_source);
  return diloco::RunTrainer(o);
}
