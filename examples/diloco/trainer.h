// The DiLoCo trainer process: inner AdamW steps on the group's local model, then an outer step
// that averages the pseudo-gradient of this trainer's shard over the quorum (its slot
// communicator) and applies outer Nesterov SGD. It polls its agent at every outer step, joins new
// quorums (rebuilds the communicator, heals, hands its state to members that lack it) and drains
// when told. See README's design notes for the protocol.
// Thread-safety: RunTrainer runs on the calling thread; a notice callback runs on the session's.
#pragma once

#include <cstdint>
#include <string>

#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>
#include "examples/diloco/local_model.h"
#include <lightkeeper/diloco.h>

namespace lk::diloco {

struct TrainerOptions {
  uint32_t group_rank = 0;
  uint32_t group_size = 1;   // trainers in this group; every group must use the same value
  uint32_t inner_steps = 20; // H: AdamW steps between outer steps (with outer_step_s: at most)
  // > 0: a time budget per outer step: the group runs inner steps until this many seconds
  // passed since the last outer step ended (rank 0's clock decides, and the decision rides in
  // the gradients' collective, so every trainer of the group stops after the same inner step).
  double outer_step_s = 0;
  // Tests and benchmarks only: each inner step lasts at least this long (the rest is slept),
  // to make one group slower than another on one machine. 0: off.
  uint32_t inner_step_min_ms = 0;
  uint32_t outer_steps = 10; // T: run until the committed step reaches T
  uint32_t seed = 1;         // model initialisation (shared) and data order (mixed with group)
  std::string group_id;      // seeds this group's data stream; empty: the first replica_rank
  std::string ckpt_dir;      // durable checkpoints of this group
  uint32_t ckpt_every = 0;   // save every K committed steps (0: only when draining)
  std::string live_dir;      // live state the agent serves to healing peers (--serve-dir)
  // The address the trainer's Gloo communicators listen on and advertise to their peers: the
  // node's address on the network the other groups reach (a site's address between sites).
  std::string bind_host = "127.0.0.1";
  std::string log_path;      // JSON lines, one per committed outer step
  uint32_t eval_batches = 0; // >0: log the global weights' loss on this many fixed batches
  uint32_t corpus_bytes = 64 << 10;
  ModelOptions model;
  OuterOptions outer;
  OuterCompress outer_compress = OuterCompress::kNone;  // the cross-group exchange's encoding
  bool overlap = false;  // overlapped outer steps (DilocoOptions::overlap)
  uint32_t outer_fragments = 1;  // DilocoOptions::outer_fragments
  // The dtype the model's weights are held in (DilocoOptions::param_dtype). bf16/fp16: the
  // weights are rounded to it after every inner step (the compute stays float32), so the model
  // is what a 16-bit model would hold, and the library gets the 16-bit buffer. Default float32.
  ParamDType param_dtype = ParamDType::kFloat32;
  // With a 16-bit param_dtype: AdamW updates a float32 master copy of the weights and the model
  // holds its rounding (mixed precision, how 16-bit models are usually trained; the master is
  // reset to the model's weights whenever the outer step replaces them). false: AdamW's update
  // lands in the 16-bit weights themselves (pure 16-bit training: updates below half a unit in
  // the last place are lost). Default true.
  bool inner_master = true;
  // Each trainer of the group keeps only its rows of every parameter and of AdamW's state
  // (ZeRO-3 by hand, LocalModel::Shard) and the library runs DiLoCo over the rows
  // (DilocoOptions::sharded). Default false: every trainer holds the whole model.
  bool shard_model = false;
  Millis init_timeout{30'000};  // communicator rendezvous + connect
  Millis op_timeout{120'000};   // one collective; the outer one waits for the slowest group
  Status Validate() const;
};

// Runs until the committed step reaches outer_steps (0), a drain (0), or a failure (non-zero).
int RunTrainer(const TrainerOptions& options);

}  // namespace lk::diloco
