/* Lightkeeper's trainer API in plain C, so that trainers in any language can bind to it
 * (liblightkeeper.so; the Python package binds it).
 *
 * Errors: every function that returns int returns 0 on success and -1 on error; one that returns
 * a pointer returns NULL on error. lk_last_error() then says why and lk_last_error_code() gives
 * the machine-readable code (per thread, until the thread's next failing call): bindings branch
 * on the code, never on the message.
 *
 * Ownership: every object made by lk_*_open / lk_*_create is the caller's until its
 * lk_*_close. Strings passed in are copied; buffers passed in are borrowed for the call only
 * (lk_comm_allreduce, lk_diloco_join, lk_diloco_sync work on them in place).
 *
 * Thread-safety: one session per trainer process. The calls on one session, and on the
 * communicators and the DiLoCo object made over it, come from one thread at a time, except
 * lk_comm_abort, lk_comm_abort_quorum and lk_diloco_drain_requested, which any thread may call
 * at any time (in particular from a notice callback while an allreduce is blocked). Notice
 * callbacks run on the session's own thread, one at a time; a callback must not call
 * lk_session_on_notice*, lk_comm_create/close or lk_diloco_create/close (they wait for it). A
 * session outlives the communicators and the DiLoCo object made over it: close them first. */
#ifndef LIGHTKEEPER_H_
#define LIGHTKEEPER_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every function declared here is exported from liblightkeeper.so, which hides the rest. */
#pragma GCC visibility push(default)

/* ---- Errors ------------------------------------------------------------------------------- */

/* The codes of lk_last_error_code(); the same set as the wire's reason codes. */
enum {
  LK_OK = 0,
  LK_ERR_INVALID_ARGUMENT = 1,
  LK_ERR_UNAUTHENTICATED = 2,
  LK_ERR_PERMISSION_DENIED = 3,
  LK_ERR_NOT_FOUND = 4,
  LK_ERR_CONFLICT = 5,
  LK_ERR_TOO_LARGE = 6,
  LK_ERR_DEADLINE_EXCEEDED = 7, /* a wait ran out */
  LK_ERR_UNAVAILABLE = 8,       /* the agent or a peer is gone */
  LK_ERR_ABORTED = 9,           /* cut short by a failure notice or lk_comm_abort: QuorumLost */
  LK_ERR_DATA_LOSS = 10,
  LK_ERR_RESOURCE_EXHAUSTED = 11,
  LK_ERR_INTERNAL = 12
};

const char* lk_last_error(void);
int lk_last_error_code(void);
/* The wire's reason code of the last error, by its name ("GROUP_SIZE_MISMATCH": the lighthouse
 * refused this group's size; "UNSPECIFIED" when none came with it). */
const char* lk_last_error_reason(void);

/* ---- Session: the trainer's link to its node agent ----------------------------------------- */

typedef struct lk_session lk_session;

typedef struct lk_poll_result {
  uint32_t quorum_id;
  uint32_t replica_rank;
  uint32_t replica_world_size;
  uint32_t max_step;
  int reconfigure;            /* rebuild the cross-group communicator for quorum_id */
  int heal;                   /* fetch state before the next outer step */
  int drain;                  /* stop now (after a durable save when checkpoint_now) */
  int initial;                /* first start: take replica_rank 0's initial weights */
  int checkpoint_now;         /* with drain: save a durable checkpoint first */
  uint32_t heal_source_count; /* read each with lk_session_heal_source */
  int from_board; /* answered from the agent's shared memory, without a socket round trip */
  /* Added after the fields above (which keep their places). */
  uint32_t restore_step; /* the step of restore_location, when there is one */
  int has_restore;       /* restore the durable checkpoint lk_session_restore_location names */
} lk_poll_result;

/* socket_path NULL: use $LK_AGENT_SOCKET. Connects and says hello (the agent then watches this
 * process's pid). Returns NULL on error. */
lk_session* lk_session_open(const char* socket_path, uint32_t group_rank, uint32_t group_size);
/* Closes the connection; NULL is a no-op. Close communicators and DiLoCo objects first. */
void lk_session_close(lk_session* s);
/* Blocks until the agent answers for outer step `step` (at once when nothing changed). */
int lk_session_poll(lk_session* s, uint32_t step, lk_poll_result* out);
/* The i-th heal source of the last poll, as "HOST:PORT", NUL-terminated into buf. */
int lk_session_heal_source(lk_session* s, uint32_t i, char* buf, size_t cap);
/* The last poll's durable checkpoint to restore ("" when none) and the lighthouse's reason for
 * the quorum, NUL-terminated into buf. *len (when not NULL) gets the length without the NUL,
 * which may exceed cap - 1: the call then fails with LK_ERR_TOO_LARGE and buf is untouched. */
int lk_session_restore_location(lk_session* s, char* buf, size_t cap, size_t* len);
int lk_session_poll_reason(lk_session* s, char* buf, size_t cap, size_t* len);
/* This trainer averages across groups of other trainer counts (on != 0): its group may then
 * share quorums with groups of other sizes. Off by default; call before the first poll, the
 * same in every trainer of the group. The DiLoCo object (lk_diloco_create) turns it on. */
int lk_session_set_mixed_group_sizes(lk_session* s, int on);
/* The last poll's group size of every member (index = replica_rank) into out[0..cap): *count
 * gets how many there are, 0 unless the poll joined a quorum whose groups differ in size. Fails
 * with LK_ERR_TOO_LARGE (out untouched) when cap is below *count. */
int lk_session_poll_group_sizes(lk_session* s, uint32_t* out, size_t cap, size_t* count);
/* Around the cross-group collective: waiting == 1 before it, 0 after. While every trainer of a
 * group waits on the other groups, the lighthouse does not count the time as this group's stall. */
int lk_session_set_peer_wait(lk_session* s, int waiting);
/* Done: the trainer's exit is then not reported as a crash. */
int lk_session_finish(lk_session* s);
/* Reports outer step `step` committed (ok != 0) or failed; state_hash may be NULL. */
int lk_session_commit(lk_session* s, uint32_t step, int ok, const char* state_hash);
/* The same with the tokens (samples) the whole group processed in this outer step, which the
 * lighthouse shows as the group's contribution; 0: not reported. */
int lk_session_commit_tokens(lk_session* s, uint32_t step, int ok, const char* state_hash,
                             uint64_t tokens);
/* Registers a durable checkpoint (a directory every group can read) at the lighthouse, so that a
 * job whose groups all lost their live state restores it. Once per committed checkpoint, from
 * one trainer of the group; manifest_digest may be NULL or "". */
int lk_session_register_checkpoint(lk_session* s, uint32_t step, const char* location,
                                   const char* manifest_digest);
/* The lighthouse's rendezvous KV, scoped to quorum_id, through the agent. */
int lk_kv_put(lk_session* s, uint32_t quorum_id, const char* key, const void* value, size_t len);
/* Waits up to timeout_ms for the key; *len gets the value's size (which may exceed cap). */
int lk_kv_get(lk_session* s, uint32_t quorum_id, const char* key, void* buf, size_t cap,
              size_t* len, uint32_t timeout_ms);

/* Notices: a member of the watched quorum was lost (abort collectives in flight), or the agent
 * drains the group (checkpoint_now: save a durable checkpoint before exiting). */
typedef void (*lk_notice_fn)(void* user, uint32_t quorum_id, int lost, int drain);
/* Replaces the session's callback of that kind; fn NULL removes it. Both kinds may be set; each
 * notice reaches both. The communicators and DiLoCo objects of the session get every notice
 * as well, whatever is set here. */
void lk_session_on_notice(lk_session* s, lk_notice_fn fn, void* user);
typedef struct lk_notice {
  uint32_t quorum_id;
  int lost;
  int drain;
  int checkpoint_now;
  const char* reason; /* valid during the callback only */
} lk_notice;
typedef void (*lk_notice_ex_fn)(void* user, const lk_notice* notice);
void lk_session_on_notice_ex(lk_session* s, lk_notice_ex_fn fn, void* user);

/* ---- Cross-group communicator ------------------------------------------------------------- */

typedef struct lk_comm lk_comm;

/* Element types. lk_comm_allreduce takes FLOAT32 and BFLOAT16; the DiLoCo parameter buffer
 * (lk_diloco_ext_options.param_dtype) all three. */
enum { LK_DTYPE_FLOAT32 = 0, LK_DTYPE_BFLOAT16 = 1, LK_DTYPE_FLOAT16 = 2 };
/* How a sharded caller cuts every tensor's rows over its group (DilocoOptions::shard_rule):
 * LK_SHARD_EVEN, the library's even split (the first rows % ranks ranks one row more), or
 * LK_SHARD_CHUNK, torch.chunk's (FSDP2's and DTensor's Shard(0): ceil(rows / ranks) each, the
 * last ranks short or empty). */
enum { LK_SHARD_EVEN = 0, LK_SHARD_CHUNK = 1 };
enum { LK_REDUCE_SUM = 0, LK_REDUCE_AVG = 1 };

typedef struct lk_comm_options {
  const char* backend;    /* "gloo" (host buffers) or "nccl" (device buffers); NULL: "gloo" */
  uint32_t slot;          /* the cross-group slot, usually the trainer's group_rank */
  const char* key_prefix; /* put before every KV key, so communicators never share keys; NULL: "" */
  /* Gloo: the address to listen on, or an interface name (ib0); NULL: "127.0.0.1" */
  const char* bind_host;
  uint32_t init_timeout_ms; /* rendezvous + connect; 0: 30000 */
  uint32_t op_timeout_ms;   /* one collective; 0: 60000 */
  int device_index;         /* NCCL: the CUDA device */
} lk_comm_options;

/* A communicator of one slot across the quorum's groups, rendezvousing through the session's KV
 * (on a connection of its own). It is aborted by the session's lost-quorum and drain notices.
 * options NULL: all defaults. */
lk_comm* lk_comm_create(lk_session* s, const lk_comm_options* options);
void lk_comm_close(lk_comm* c);
/* On a new quorum_id: aborts the old communicator and builds the new one within the init
 * timeout; the same quorum_id again returns the first call's outcome. */
int lk_comm_reconfigure(lk_comm* c, uint32_t quorum_id, uint32_t replica_rank, uint32_t world_size);
/* In place on `count` elements at `data`. LK_ERR_ABORTED when a notice or lk_comm_abort cut it
 * short or a peer failed, LK_ERR_DEADLINE_EXCEEDED past the op timeout; it never hangs. After an
 * error the buffer's content is unspecified and the communicator stays failed until the next
 * quorum_id. */
int lk_comm_allreduce(lk_comm* c, void* data, size_t count, int dtype, int op);
/* Aborts the collective in flight and later ones until a newer reconfigure; any thread. */
void lk_comm_abort(lk_comm* c, const char* reason);
/* The same, only when the communicator belongs to quorum_id or an older one. */
void lk_comm_abort_quorum(lk_comm* c, uint32_t quorum_id, const char* reason);
uint32_t lk_comm_quorum_id(const lk_comm* c);

/* ---- DiLoCo outer step (diloco/diloco.h in C++; its header comment is the full story) ------- */

typedef struct lk_diloco lk_diloco;

/* One named tensor inside a flat float32 buffer: elements [offset, offset + prod(shape)). */
typedef struct lk_tensor_spec {
  const char* name;
  size_t offset;
  const int64_t* shape; /* ndim entries; ndim 0: a scalar */
  uint32_t ndim;
} lk_tensor_spec;

/* Fills `out` (count floats: the inner_state buffer) with the inner optimizer's state; called on
 * the calling thread before each durable save. Returns 0, or non-zero to fail the save. */
typedef int (*lk_inner_save_fn)(void* user, float* out, size_t count);

typedef struct lk_diloco_options {
  uint32_t group_rank;
  uint32_t group_size;
  const lk_tensor_spec* params; /* tile the flat parameter buffer in order */
  size_t param_count;
  const lk_tensor_spec* inner_state; /* tile the inner optimizer buffer; NULL/0: none */
  size_t inner_state_count;
  lk_inner_save_fn inner_save; /* with inner_state: fills it for a durable save */
  void* inner_save_user;
  float outer_lr;            /* 0: 0.7 */
  float outer_momentum;      /* in [0, 1); negative: 0.9 */
  int nesterov;              /* 0: heavy-ball momentum, otherwise Nesterov */
  const char* ckpt_dir;      /* NULL or "": no durable checkpoints */
  uint32_t ckpt_every;       /* 0: on drain and at finish only */
  uint32_t ckpt_keep;        /* 0: 3 */
  const char* live_dir;      /* the agent's --serve-dir; NULL or "": none */
  const char* bind_host;     /* NULL: "127.0.0.1" */
  uint32_t init_timeout_ms;  /* 0: 30000 */
  uint32_t op_timeout_ms;    /* 0: 120000 */
  uint32_t stuck_timeout_ms; /* 0: op timeout + 60000 */
} lk_diloco_options;

/* lk_diloco_result.kind */
enum {
  LK_SYNC_COMMITTED = 0,
  LK_SYNC_RECEIVED = 1,
  LK_SYNC_JOINED = 2,
  LK_SYNC_DRAINED = 3,
  LK_SYNC_STARTED = 4 /* overlap: the exchange started, nothing was in flight to land */
};
/* lk_diloco_result.inner */
enum { LK_INNER_KEEP = 0, LK_INNER_RESET = 1, LK_INNER_RESTORED = 2 };

typedef struct lk_diloco_result {
  int kind;
  uint32_t step;
  uint32_t quorum_id;
  uint32_t replica_rank;
  uint32_t replica_world_size;
  int healed;
  int inner; /* LK_INNER_*: what the caller's inner optimizer must do now */
  int saved;
  int checkpoint_now;
  char state_hash[17];   /* 16 hex digits and a NUL */
  char heal_source[256]; /* truncated to fit */
  char reason[256];      /* truncated to fit */
  double poll_ms, join_ms, allreduce_ms, gather_ms, publish_ms, commit_ms, outer_ms;
  uint64_t cross_bytes, sync_bytes, group_bytes;
} lk_diloco_result;

/* Takes over the session's notices for its own communicators (the callbacks set with
 * lk_session_on_notice still get them). Returns NULL on error (bad specs, bad options). */
lk_diloco* lk_diloco_create(lk_session* s, const lk_diloco_options* options);

/* Options that came after lk_diloco_options, for lk_diloco_create_ext; lk_diloco_options keeps
 * its layout, so programs built against it go on working. struct_size must be set to
 * sizeof(lk_diloco_ext_options) of the caller's header: a field past it counts as unset, which
 * lets this struct grow without breaking callers built against a shorter one. */
typedef struct lk_diloco_ext_options {
  size_t struct_size;
  /* The cross-group exchange's encoding (DilocoOptions::outer_compress): NULL, "" or "none"
   * (float32), "bf16", "int8" or "int4" (blockwise scales, error feedback). Every group of a job
   * must use the same. */
  const char* outer_compress;
  /* Non-zero: overlapped outer steps (DilocoOptions::overlap): lk_diloco_sync starts the
   * exchange and returns; the next sync (or lk_diloco_flush) lands it. Every group of a job
   * uses the same setting. */
  int overlap;
  /* With overlap: the exchange goes on the link in this many fragments spread over the inner
   * steps that run meanwhile (DilocoOptions::outer_fragments); 0 or 1: one burst. At most 64.
   * Every group of a job uses the same setting. */
  uint32_t outer_fragments;
  /* The most bytes lk_diloco_set_extra_state takes (DilocoOptions::extra_state_bytes_max);
   * 0: 4 MiB. At most 64 MiB. */
  uint64_t extra_state_bytes_max;
  /* The model's parameter dtype (DilocoOptions::param_dtype): LK_DTYPE_FLOAT32 (0, the default),
   * LK_DTYPE_BFLOAT16 or LK_DTYPE_FLOAT16; anything else fails lk_diloco_create_ext. A 16-bit
   * model calls lk_diloco_join_typed, lk_diloco_sync_typed and lk_diloco_flush_typed; the outer
   * state stays float32 and the new global weights come back rounded to nearest even. */
  int param_dtype;
  /* Non-zero: the caller holds only its rows of every parameter (DilocoOptions::sharded): the
   * buffers of join, sync and flush hold lk_diloco_param_numel() elements, this trainer's rows
   * (lk_diloco_shard_rows) of every tensor in order, and the inner state callback's buffer its
   * rows of the inner state. */
  int sharded;
  /* With sharded: LK_SHARD_EVEN (0, the default) or LK_SHARD_CHUNK, the rule of the caller's
   * rows (lk_diloco_shard_rows_rule); anything else fails lk_diloco_create_ext. */
  int shard_rule;
  /* With sharded, when the rows follow no rule (DilocoOptions::shard_rows): param_count pairs
   * BEGIN, END (2 * param_count numbers), this trainer's rows [BEGIN, END) of each parameter in
   * order; NULL: the rows of shard_rule. The group's trainers must tile every tensor (checked
   * at the first join). inner_shard_rows: the same for the inner_state tensors (2 *
   * inner_state_count numbers), required with shard_rows when there is inner state. */
  const int64_t* shard_rows;
  const int64_t* inner_shard_rows;
} lk_diloco_ext_options;

/* lk_diloco_create with the options of `ext` too; ext NULL: all unset. */
lk_diloco* lk_diloco_create_ext(lk_session* s, const lk_diloco_options* options,
                                const lk_diloco_ext_options* ext);
void lk_diloco_close(lk_diloco* d);
/* params: `count` floats (the whole flat parameter buffer), in place. */
int lk_diloco_join(lk_diloco* d, float* params, size_t count, lk_diloco_result* out);
int lk_diloco_sync(lk_diloco* d, float* params, size_t count, lk_diloco_result* out);
/* The same with the tokens (samples) this trainer processed since the last commit: the group's
 * trainers' counts are summed, and the cross-group average weights each group's pseudo-gradient
 * by its sum (every trainer of the group passes its count; 0 everywhere: a plain average). */
int lk_diloco_sync_tokens(lk_diloco* d, float* params, size_t count, uint64_t tokens,
                          lk_diloco_result* out);
/* What the last join or sync of d adds to its lk_diloco_result (a struct of its own, so that
 * lk_diloco_result keeps its size for callers built against an older header). */
typedef struct lk_diloco_tokens {
  uint64_t tokens;        /* committed: this group's tokens in the step (0: not reported) */
  uint64_t quorum_tokens; /* committed: every member's, summed */
  int weighted;           /* committed: the average was token-weighted */
  char global_hash[17];   /* committed or received: hash of the whole global weights, equal in
                             every member whatever its layout; "" otherwise */
} lk_diloco_tokens;
void lk_diloco_last_tokens(const lk_diloco* d, lk_diloco_tokens* out);
/* Overlap: lands the exchange in flight without starting another (Diloco::Flush): after the
 * last sync. LK_SYNC_JOINED with params unchanged when nothing was in flight. */
int lk_diloco_flush(lk_diloco* d, float* params, size_t count, lk_diloco_result* out);
/* Overlap: 1 while an exchange is in flight. A loop to T outer steps runs while
 * lk_diloco_step(d) + lk_diloco_in_flight(d) < T, then calls lk_diloco_flush. */
int lk_diloco_in_flight(const lk_diloco* d);
/* How long the last join, sync or flush waited for the exchange in flight (milliseconds). */
double lk_diloco_last_wait_ms(const lk_diloco* d);
/* Overlap: the whole global weights of the last commit or received state (the caller's weights
 * carry the inner progress since), valid until the next call on d; *count gets its length (0
 * without overlap). */
const float* lk_diloco_global_weights(const lk_diloco* d, size_t* count);
int lk_diloco_drain_requested(const lk_diloco* d);
/* Marks a drain as noticed (Diloco::RequestDrain): for a trainer that learned of it from another
 * trainer of its group before its own notice came. */
void lk_diloco_request_drain(lk_diloco* d);
int lk_diloco_group_allreduce_sum(lk_diloco* d, float* values, size_t count);
int lk_diloco_finish(lk_diloco* d);
/* After a result with inner == LK_INNER_RESTORED: the restored inner state (the inner_state
 * layout), valid until the next call on d. *count gets its length. */
const float* lk_diloco_restored_inner_state(const lk_diloco* d, size_t* count);
/* The trainer's own state (data position, RNG states, schedule: opaque bytes, at most
 * extra_state_bytes_max) that goes with the weights passed to the next lk_diloco_sync: call it
 * before each sync. Durable checkpoints save, under this trainer's group_rank, the bytes that go
 * with the saved step (Diloco::SetExtraState has the whole story). size 0: none. Returns 0, or
 * non-zero past the bound (lk_last_error says why; the bytes set before stay). */
int lk_diloco_set_extra_state(lk_diloco* d, const void* data, size_t size);
/* This trainer's extra state, when the last join, sync or flush restored it from a durable
 * checkpoint (saved by the trainer of the same group_rank); valid until the next call on d.
 * NULL (and *size 0) when that call restored none: no restore, a heal from live peers (the
 * trainer's data position is its own), or a checkpoint without this rank's bytes. */
const void* lk_diloco_restored_extra_state(const lk_diloco* d, size_t* size);
uint32_t lk_diloco_step(const lk_diloco* d);
size_t lk_diloco_numel(const lk_diloco* d);
size_t lk_diloco_shard_numel(const lk_diloco* d);
/* Elements of the buffer join, sync and flush take: lk_diloco_numel, or when created sharded
 * this trainer's rows under its shard_rule (lk_diloco_shard_numel under LK_SHARD_EVEN). */
size_t lk_diloco_param_numel(const lk_diloco* d);
/* Rows [*begin, *end) of a tensor whose first dimension has `rows` rows (a scalar: 1) that
 * trainer `rank` of a group of `ranks` holds (the library's even split, DilocoOptions::sharded).
 * Returns -1 (lk_last_error says why) when rank >= ranks or rows < 1. */
int lk_diloco_shard_rows(int64_t rows, uint32_t ranks, uint32_t rank, int64_t* begin,
                         int64_t* end);
/* The same under `rule` (LK_SHARD_EVEN or LK_SHARD_CHUNK); -1 for any other rule. */
int lk_diloco_shard_rows_rule(int64_t rows, uint32_t ranks, uint32_t rank, int rule,
                              int64_t* begin, int64_t* end);
/* lk_diloco_join, lk_diloco_sync_tokens and lk_diloco_flush over a parameter buffer of `count`
 * elements of `dtype` (LK_DTYPE_*), which must be the param_dtype d was created with (else they
 * fail, lk_last_error naming both, and the buffer is untouched). For FLOAT32 they are the plain
 * calls. On a failure a 16-bit buffer is left as it was. */
int lk_diloco_join_typed(lk_diloco* d, void* params, size_t count, int dtype,
                         lk_diloco_result* out);
int lk_diloco_sync_typed(lk_diloco* d, void* params, size_t count, int dtype, uint64_t tokens,
                         lk_diloco_result* out);
int lk_diloco_flush_typed(lk_diloco* d, void* params, size_t count, int dtype,
                          lk_diloco_result* out);
/* Converts `count` elements from in_dtype to out_dtype (LK_DTYPE_*: float32 to bf16 or fp16 and
 * back, or a copy) with the DiLoCo library's rounding: to nearest, ties to even, as torch's
 * .to(torch.bfloat16) and .half(); infinities kept, a NaN stays a NaN. For bindings that lay a
 * model out themselves, and for tests against a reference. Returns 0, or non-zero for an
 * unknown pair (lk_last_error says which). */
int lk_dtype_convert(const void* in, int in_dtype, void* out, int out_dtype, size_t count);
/* The param_dtype of d (LK_DTYPE_*). */
int lk_diloco_param_dtype(const lk_diloco* d);
/* Bytes of outer state the library holds for this trainer (Diloco::outer_state_bytes): its shard
 * of the float32 global weights and momentum, residuals, retry and overlap buffers and a 16-bit
 * model's float32 staging buffer; not the caller's model. */
uint64_t lk_diloco_outer_state_bytes(const lk_diloco* d);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* LIGHTKEEPER_H_ */
