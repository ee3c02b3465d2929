// DiLoCo as a library: the outer step of a DiLoCo trainer over flat float32 parameter buffers,
// on top of the client Session. One Diloco object per trainer process. It owns the cross-group
// ("slot") communicator, the in-group communicator (Gloo over the agent's KV, no torch), the
// live state it publishes for healing peers and the durable checkpoints of the group; the
// caller owns the model, the data, the inner optimizer and the loop:
//
//   auto d = Diloco::Create(session.get(), options, hooks);
//   d->Join(params);                        // params: this trainer's initial weights in, the
//                                           // job's current global weights out
//   while (d->step() < T) {
//     inner steps (the caller's optimizer); stop early when drain_requested() (agreed in group)
//     auto r = d->Sync(params);             // params: local weights in, new global weights out
//     if (r->kind == SyncKind::kDrained) break;
//     if (r->inner == InnerAction::kReset) reset the inner optimizer;
//     if (r->inner == InnerAction::kRestored) load restored_inner_state() into it;
//   }
//   d->Finish();                            // barrier, final save, goodbye to the agent
//
// With DilocoOptions::overlap the loop runs `while (d->step() + d->in_flight() < T)` and calls
// d->Flush(params) before Finish: each Sync lands the previous step's exchange and starts this
// one's (see the option).
//
// Each call of Sync runs the whole protocol: poll; join a new quorum (communicator reconfigure,
// heal from live peers, else from the registered durable checkpoint, else the slot state sync);
// this trainer's shard of the pseudo-gradient (global - local); the cross-group average; the
// outer Nesterov update; the in-group all-gather of the new weights and the group's agreement;
// publishing the live state; the commit with the state hash; saves. A cross-group allreduce cut
// short by a lost member is retried on the next quorum with the same pseudo-gradient, inside
// the same call. The decisions are in diloco/core.h (pure, table-tested).
//
// Sharding: each parameter (a TensorSpec) is split over the group's trainers by rows of its
// first dimension, exactly like the checkpoint library's even row split, so that a checkpoint
// saved by N trainers restores into any number of trainers. This trainer's outer state (its
// shard of the global weights and of the outer momentum) is the concatenation, in parameter
// order, of its rows of every parameter.
//
// Checkpoints are the project's sharded safetensors + manifest format. Tensors are named by the
// caller's names: the global weights under the parameter's own name, the outer momentum under
// "outer_momentum/NAME", the inner optimizer state (durable checkpoints only) under
// "inner/NAME", the trainer's extra state (SetExtraState; durable only) under
// "extra_state/rank-RRRRR". Live state (what healing peers fetch) holds the global weights and the outer
// momentum only: a heal from live peers starts the inner optimizer afresh (the DiLoCo
// convention), a durable restore resumes it.
//
// Thread-safety: every method from one thread (the trainer's), except drain_requested(), which
// any thread may call. The Diloco installs the session's notice callback (Session::OnNotice) to
// abort its collectives on a lost quorum or a drain; do not replace it while the Diloco lives.
// The Session must outlive the Diloco.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/api.h>
#include <lightkeeper/clock.h>
#include <lightkeeper/status.h>

namespace lk::client {
class Session;
struct Notice;
}  // namespace lk::client

namespace lk::diloco {

// One named tensor inside a flat float32 buffer: elements [offset, offset + numel()), row-major.
struct TensorSpec {
  std::string name;            // unique; the tensor's name in checkpoints
  size_t offset = 0;           // first element in the flat buffer
  std::vector<int64_t> shape;  // empty: a scalar, stored as one row of one element
  LK_API size_t numel() const;
};

// Checks that `specs` tile [0, total) in order: offsets ascending, no gaps or overlaps, names
// non-empty and unique, every dimension positive. `total` gets the buffer's length.
LK_API Status ValidateSpecs(const std::vector<TensorSpec>& specs, size_t* total);

// Rows [begin, end) of a tensor's first dimension.
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool operator==(const RowRange&) const = default;
};
// How a sharded caller cuts every tensor's rows over the trainers of its group.
//  - kEven: the library's even split: the first rows % ranks ranks one row more (the
//    checkpoint library's split, and the one the outer state is cut by in every group).
//  - kChunk: torch.chunk's rule, FSDP2's and DTensor's Shard(0): ceil(rows / ranks) rows per
//    rank, the last ranks short or empty.
// A scalar is one row, rank 0's, under both. The two agree whenever ranks divides the rows.
enum class ShardRule { kEven, kChunk };
LK_API std::string_view ShardRuleName(ShardRule rule);  // "even", "chunk"
LK_API bool ParseShardRule(std::string_view name, ShardRule* out);

// The rows of `spec` that trainer `rank` of a group of `ranks` holds under `rule`. The outer
// state is cut by kEven in every group; with DilocoOptions::sharded the caller's buffer holds
// exactly the rows of DilocoOptions::shard_rule of every tensor, in tensor order.
LK_API RowRange ShardRows(const TensorSpec& spec, uint32_t ranks, uint32_t rank,
                          ShardRule rule = ShardRule::kEven);

struct OuterOptions {
  float lr = 0.7f;        // the DiLoCo paper's outer learning rate
  float momentum = 0.9f;  // outer momentum, in [0, 1)
  bool nesterov = true;   // Nesterov momentum (PyTorch SGD(nesterov=True)); false: heavy ball
};

// How the cross-group exchange carries the pseudo-gradients (comm/compress.h has the formats).
// kNone is the float32 ring allreduce; the others encode every trainer's shard, the owner of
// each chunk decodes and sums the contributions in float32 and encodes the result, and every
// member decodes the same bytes, so the global weights stay bitwise identical in every member.
enum class OuterCompress { kNone, kBf16, kInt8, kInt4 };
LK_API std::string_view OuterCompressName(OuterCompress codec);  // "none", "bf16", "int8", "int4"
LK_API bool ParseOuterCompress(std::string_view name, OuterCompress* out);

// The dtype of the model's parameters, the buffer that Join, Sync and Flush take. The outer
// state (global weights, outer momentum, the exchange) is float32 whatever it is, as the DiLoCo
// papers and torchft keep it: the pseudo-gradient is the float32 global weights minus the
// up-cast local weights, and the new global weights go back into the model rounded to its
// dtype (to nearest, ties to even, as torch's `.to(torch.bfloat16)` and `.half()`; NaN and
// infinities kept). diloco/README.md, "16-bit parameters", has the design.
enum class ParamDType { kFloat32, kBfloat16, kFloat16 };
LK_API std::string_view ParamDTypeName(ParamDType dtype);  // "float32", "bf16", "fp16"
// Takes "float32", "bf16" or "fp16" (and "float", "bfloat16", "float16", "half").
LK_API bool ParseParamDType(std::string_view name, ParamDType* out);

inline constexpr uint64_t kExtraStateBytesLimit = uint64_t{64} << 20;

struct DilocoOptions {
  uint32_t group_rank = 0;  // this trainer's rank inside its group
  // Trainers of the group (at most 4096). Groups of a job may differ: a quorum of several
  // sizes averages fragment by fragment between the trainers that hold each (diloco/mixed.h).
  uint32_t group_size = 1;
  // The model's parameters inside the flat parameter buffer that Join and Sync take. Every
  // trainer of every group passes the same list (names, shapes, order).
  std::vector<TensorSpec> params;
  // The dtype of the parameter buffer (offsets and shapes count elements of it). Default
  // kFloat32: Join/Sync/Flush over std::span<float>. kBfloat16 or kFloat16: the overloads over
  // std::span<uint16_t> (the 16-bit bit patterns), and the float ones refuse with
  // kInvalidArgument, as the 16-bit ones do for kFloat32. Every member of a job holds the same
  // float32 global weights and, after each commit, the same 16-bit weights; groups of one job
  // may differ in it (the exchange is float32 either way).
  ParamDType param_dtype = ParamDType::kFloat32;
  // The caller holds only its rows of every parameter (the HSDP layout: sharded inside the
  // group, DiLoCo across groups). Then the buffer of Join, Sync and Flush holds param_numel()
  // elements: this trainer's rows of every tensor of `params`, in order (shard_rows, or
  // ShardRows(spec, group_size, group_rank, shard_rule)); the inner_state buffer (its hook's
  // and restored_inner_state()) likewise holds this trainer's rows of `inner_state`;
  // global_weights() is this trainer's rows. No trainer ever holds the whole model: there is
  // no in-group all-gather, heals and durable restores go by rows, and the global_hash is the
  // same as a replicated group's, so sharded and replicated groups (of any sizes and layouts)
  // share quorums. Default false: the buffers hold the whole model.
  bool sharded = false;
  // With `sharded`: how the caller's rows are cut (ShardRule; default kEven). With kChunk (a
  // model sharded by FSDP2 or DTensor Shard(0)) the library keeps its outer state in the even
  // split all the same, so that groups of every rule share one exchange, heals and
  // checkpoints, and moves the rows where the two splits differ inside the group at each outer
  // step (one in-group sum of those rows only: diloco/README.md, "Sharded models"). Ignored
  // without `sharded`, and where shard_rows is given.
  ShardRule shard_rule = ShardRule::kEven;
  // With `sharded`: this trainer's rows of every tensor of `params` (one range per tensor, in
  // order) when they follow no rule: any contiguous rows (empty ones too), as long as the
  // group's trainers together hold every row of every tensor exactly once. Empty (default): the
  // rows of shard_rule. Whatever the rows, the group's trainers exchange them at their first
  // join and refuse overlaps and rows nobody holds with kInvalidArgument naming the tensor, the
  // rows and the group ranks, before any state moves; the rows that differ from the even split
  // move inside the group as with kChunk.
  std::vector<RowRange> shard_rows;
  // ... and of every tensor of `inner_state`, likewise; required with shard_rows when
  // inner_state is not empty (the inner state's rows need not follow the parameters').
  std::vector<RowRange> inner_shard_rows;
  // The inner optimizer's state (e.g. AdamW's moments and step count) inside a flat float32
  // buffer of its own, saved with durable checkpoints and restored from them (the same on every
  // trainer of the group; diloco/README.md, "The inner optimizer's state"). Empty (default):
  // none is saved, and every restore resets the inner optimizer.
  std::vector<TensorSpec> inner_state;
  OuterOptions outer;
  // The encoding of the cross-group exchange; default kNone (float32). Every group of a job uses
  // the same one (another fails the attempt with kConflict). A lossy codec keeps an
  // error-feedback residual per trainer, never saved (diloco/README.md, "Compressed exchange").
  OuterCompress outer_compress = OuterCompress::kNone;
  // Overlapped outer steps (streaming DiLoCo's idea): Sync starts this step's exchange on a
  // thread of its own and returns at once; the next Sync (or Flush) lands it. The committed
  // step trails the inner work by one. Default false; every group of a job uses the same
  // setting (diloco/README.md, "Overlapped outer steps").
  bool overlap = false;
  // With overlap: the exchange in flight goes on the link in this many fragments, in [1, 64],
  // paced over the inner steps that run meanwhile. Default 1 (one burst); every group of a job
  // uses the same setting (diloco/README.md, "Fragments").
  uint32_t outer_fragments = 1;
  std::string ckpt_dir;     // durable checkpoints of this group (its trainers share it); "": none
  uint32_t ckpt_every = 0;  // a durable save every K committed steps; 0: on drain and at Finish
  uint32_t ckpt_keep = 3;   // durable checkpoints kept
  // The node-local directory the agent serves to healing peers (its --serve-dir); "": peers
  // that heal get this group's state over the slot communicator instead.
  std::string live_dir;
  // Gloo: the address this trainer listens on, or an interface name (ib0: its IPv4 address).
  std::string bind_host = "127.0.0.1";
  Millis init_timeout{30'000};          // communicator rendezvous + connect
  Millis op_timeout{120'000};           // one collective; the outer one waits for the slowest group
  // How long a failed quorum may last before Sync gives up with kDeadlineExceeded: long enough
  // for the lighthouse to notice a dead peer. 0: op_timeout + 60 s.
  Millis stuck_timeout{0};
  // The most bytes SetExtraState takes (the trainer's own per-rank state saved with durable
  // checkpoints: data position, RNG states, schedule); more fails that call with
  // kInvalidArgument. Default 4 MiB, at most kExtraStateBytesLimit (64 MiB): the bytes are
  // copied at every Sync and written by every durable save.
  uint64_t extra_state_bytes_max = uint64_t{4} << 20;
  // true: Create installs the session's notice callback. false: the owner keeps the session's
  // callback (e.g. a binding that fans notices out to several objects) and passes every notice
  // on to HandleNotice.
  bool own_notices = true;
  LK_API Status Validate() const;
};

// What the caller's inner optimizer must do after a call that replaced the weights.
enum class InnerAction {
  kKeep,      // the weights are this group's own outer step: keep the optimizer as it is
  kReset,     // the weights came from a peer or the first start: start the optimizer afresh
  kRestored,  // a durable restore: load restored_inner_state() into the optimizer
};

enum class SyncKind {
  kCommitted,  // an outer step was committed: params hold the new global weights
  kReceived,   // joined a quorum and took state from elsewhere (a heal, or the first start's
               // weights of replica_rank 0): params hold it; the pseudo-gradient was dropped
  kJoined,     // Join only: joined with this group's own state (params unchanged apart from
               // -0.0 turned into +0.0)
  kDrained,    // the agent drains the group: leave the loop (saved first when it asked)
  kStarted,    // overlap only: this step's exchange started and nothing was in flight to land
               // (the first Sync after Join or a heal); params unchanged, nothing committed
};

// Where one call's time and bytes went. Bytes are TCP bytes this process sent (the kernel's
// counters), so they include framing.
struct SyncStats {
  double poll_ms = 0;        // Session::Poll, waiting for the quorum
  double join_ms = 0;        // joining new quorums: communicator rebuild, heal, state sync
  double allreduce_ms = 0;   // the cross-group pseudo-gradient allreduce (all attempts)
  double gather_ms = 0;      // the outer update and the in-group all-gather of the new weights
  double publish_ms = 0;     // live state for healing peers
  double commit_ms = 0;      // Session::Commit
  double outer_ms = 0;       // the committed attempt, from its allreduce to its commit
  // Overlap: how long this call waited for the exchange in flight to finish (the part of it
  // the inner steps did not hide); allreduce_ms and cross_bytes count that exchange.
  double wait_ms = 0;
  uint64_t cross_bytes = 0;  // sent by the cross-group allreduce
  uint64_t sync_bytes = 0;   // sent while joining quorums
  uint64_t group_bytes = 0;  // sent by the in-group all-gather
};

struct SyncResult {
  SyncKind kind = SyncKind::kCommitted;
  uint32_t step = 0;  // committed outer steps (it jumps forward after a heal)
  uint32_t quorum_id = 0;
  uint32_t replica_rank = 0;
  uint32_t replica_world_size = 0;
  // kReceived: the state came from a heal (not the first start's initial weights).
  // kCommitted: such a heal happened since the previous commit.
  bool healed = false;
  // kReceived/kJoined: "peers", "durable LOCATION", "replica_rank N" (the slot state sync) or
  // "" (this group's own state); the log line heal_* says the same.
  std::string heal_source;
  InnerAction inner = InnerAction::kKeep;
  std::string state_hash;       // of this trainer's shard of the global weights (16 hex digits)
  // kCommitted/kReceived: of the whole global weights (a sum of per-row hashes over the
  // group's trainers, never gathered: diloco/core.h RowHashSum), equal in every member
  // whatever its group's layout, sharded or not; "" otherwise.
  std::string global_hash;
  // kCommitted: the tokens of this group (summed over its trainers) in the committed outer
  // step, its weight in the cross-group average, and the quorum's total; 0 when not reported.
  uint64_t tokens = 0;
  uint64_t quorum_tokens = 0;
  bool weighted = false;  // kCommitted: token-weighted (every member reported tokens)
  bool saved = false;           // a durable checkpoint was saved (and registered) in this call
  // This call restored this trainer's extra state from a durable checkpoint (kReceived or
  // kJoined): restored_extra_state() holds it, and the caller loads it (see SetExtraState).
  bool extra_state_restored = false;
  bool checkpoint_now = false;  // kDrained: the agent asked for a durable save
  std::string reason;           // the lighthouse's reason for the quorum, or the drain's
  SyncStats stats;
};

// The caller's inner optimizer state, for durable saves. `save` fills `out` (the length of the
// inner_state buffer) with the optimizer's current state; it is called before each durable
// save, on the trainer's thread. Unset (or inner_state empty): nothing is saved.
struct InnerStateHooks {
  std::function<Status(std::span<float> out)> save;
};

class Diloco {
 public:
  // Builds the communicators (no network traffic yet: they connect at the first quorum) and
  // installs the session's notice callback. `session` is borrowed.
  LK_API static Result<std::unique_ptr<Diloco>> Create(client::Session* session, DilocoOptions options,
                                                InnerStateHooks hooks = {});
  LK_API ~Diloco();
  Diloco(const Diloco&) = delete;
  Diloco& operator=(const Diloco&) = delete;

  // Joins the job before the first inner step. `params` (the whole flat parameter buffer) holds
  // this trainer's initial weights; on return it holds the job's global weights: its own at the
  // very first start of replica_rank 0 (every group then takes replica_rank 0's), a heal's
  // otherwise. Polls until a quorum is joined (kJoined or kReceived) or the agent drains
  // (kDrained). Errors: a poll failed (the agent is gone) or no quorum could be joined within
  // stuck_timeout.
  LK_API Result<SyncResult> Join(std::span<float> params);
  // The same for a 16-bit model (DilocoOptions::param_dtype kBfloat16 or kFloat16): `params`
  // holds the bit patterns of that dtype, widened to float32 for the outer step and rounded
  // back on return. On an error the caller's buffer is left as it was.
  LK_API Result<SyncResult> Join(std::span<uint16_t> params);

  // The outer step after the inner steps: `params` holds the local weights on entry and the new
  // global weights on return (kCommitted), or the state another member gave (kReceived), or is
  // unchanged (kDrained). Errors are fatal for the trainer (the agent is gone, an in-group
  // collective failed: the group is going down, no quorum within stuck_timeout); the caller
  // exits non-zero, and the agent reports the crash.
  LK_API Result<SyncResult> Sync(std::span<float> params);
  // The same, with the tokens (samples) this trainer processed in the inner steps since the
  // last commit. The group's trainers' counts are summed (an in-group collective: every trainer
  // of the group passes its count, or all pass 0), the sum is reported with the commit, and
  // the cross-group average weights each group's pseudo-gradient by it. A retry after a lost
  // member keeps the count; a heal drops it with the pseudo-gradient.
  LK_API Result<SyncResult> Sync(std::span<float> params, uint64_t tokens);
  // The same for a 16-bit model (see Join(std::span<uint16_t>)).
  LK_API Result<SyncResult> Sync(std::span<uint16_t> params);
  LK_API Result<SyncResult> Sync(std::span<uint16_t> params, uint64_t tokens);

  // Overlap: lands the exchange in flight, as the next Sync would but without starting another
  // one (after the last Sync, before Finish): params get the new global weights plus the inner
  // progress since the last call. kCommitted, or what a retry found (kReceived, kDrained);
  // kJoined with params unchanged when nothing was in flight. Finish lands it too, into a
  // buffer of its own, when the caller did not.
  LK_API Result<SyncResult> Flush(std::span<float> params);
  LK_API Result<SyncResult> Flush(std::span<uint16_t> params);  // a 16-bit model's
  // Overlap: an exchange is in flight (started by the last Sync, not landed). A loop that runs
  // to T outer steps runs `while (step() + in_flight() < T)` and calls Flush after it.
  LK_API bool in_flight() const;
  // Overlap: the whole global weights of the last commit (or received state), which the
  // caller's weights no longer equal (they carry the inner progress since); e.g. to evaluate
  // the model every member holds. Empty without overlap: params hold them after each commit.
  LK_API std::span<const float> global_weights() const;

  // True once a drain notice arrived. The inner loop should stop at an inner step that every
  // trainer of the group agrees on (e.g. by carrying the flag in the gradient allreduce) and
  // call Sync, which then answers the drain without a cross-group allreduce.
  LK_API bool drain_requested() const;
  // Marks a drain as noticed, as the agent's drain notice does: for a trainer that learned of
  // the drain from another trainer of its group (through the collective that agreed on it)
  // before its own notice came. The next Sync then waits for the agent's drain answer instead
  // of starting a cross-group allreduce that the rest of the group will not join.
  LK_API void RequestDrain();

  // A notice of the session (with own_notices false): aborts the slot collective on a lost
  // quorum or a drain and notes the drain. Any thread; it does not block.
  LK_API void HandleNotice(const client::Notice& notice);

  // Sums `values` over the trainers of this group in place on the library's in-group Gloo
  // communicator (identity for a group of one), for a caller without a group communicator of
  // its own (the C++ example's gradient average). Available after Join. A failure means a
  // trainer of the group is gone: the caller exits.
  LK_API Status GroupAllReduceSum(std::span<float> values);

  // After the last Sync: a barrier across the quorum (so no member leaves while another still
  // receives the final allreduce), a durable save unless the last commit just saved one, and
  // the goodbye to the agent (so the exit is not taken for a crash).
  LK_API Status Finish();

  // The inner optimizer state of the last durable restore (the inner_state layout), valid after
  // a result with inner == kRestored until the next call.
  LK_API std::span<const float> restored_inner_state() const;

  // The trainer's own state that goes with the weights passed to the next Sync (or Join): its
  // data loader's position, RNG states, learning-rate schedule, inner step; opaque bytes of this
  // trainer's, at most DilocoOptions::extra_state_bytes_max (more: kInvalidArgument, and the
  // bytes set before stay). Call it before each Sync with the state after the inner steps that
  // Sync ends. The library keeps the bytes with that pseudo-gradient and, once it is committed,
  // with the committed step, so every durable save of a step (after the commit, on drain, at
  // Finish; with overlap one call later) writes the bytes that belong to that step's weights,
  // whole and checksummed like the weights, under this trainer's group_rank. Empty: none saved.
  // What comes back (restored_extra_state, with SyncResult::extra_state_restored):
  //  - a durable restore hands each trainer the bytes saved by the trainer of the same
  //    group_rank, also when the checkpoint was written by a group of another size (a rank that
  //    had no counterpart, or whose counterpart saved none, gets nothing);
  //  - a new life of the group (a start, a requeue) that heals from live peers gets its rank's
  //    bytes from the newest checkpoint of its own ckpt_dir that holds them: the weights are
  //    the peers', the data position the group's own;
  //  - a heal later in a life, or the slot state sync, hands back nothing: the trainer's data
  //    position goes on from where it is (the library pairs the state it received with the
  //    bytes last set here).
  LK_API Status SetExtraState(std::span<const uint8_t> bytes);
  // This trainer's extra state restored by the last call (Join, Sync, Flush) from a durable
  // checkpoint; empty when that call restored none. Valid until the next call.
  LK_API std::span<const uint8_t> restored_extra_state() const;

  LK_API uint32_t step() const;           // committed outer steps held
  LK_API size_t numel() const;            // elements of the whole model's parameters
  LK_API size_t shard_numel() const;      // elements of this trainer's shard of the outer state
  // Elements of the buffer Join, Sync and Flush take: numel(), or when sharded this trainer's
  // rows under shard_rule (shard_numel() under the even split).
  LK_API size_t param_numel() const;
  LK_API size_t inner_numel() const;      // elements of the inner_state buffer (this trainer's
                                          // rows of it when sharded)
  LK_API std::string state_hash() const;  // of this trainer's shard of the global weights
  LK_API ParamDType param_dtype() const;  // DilocoOptions::param_dtype
  // Bytes of outer state the library holds for this trainer now: its shard of the global
  // weights and outer momentum, the error-feedback residuals, the pseudo-gradient kept for a
  // retry, the overlap pipeline's buffers and, for a 16-bit model, the float32 staging buffer
  // (diloco/README.md, "16-bit parameters"). Not the model, which is the caller's.
  LK_API uint64_t outer_state_bytes() const;

 private:
  class Impl;
  explicit Diloco(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lk::diloco
