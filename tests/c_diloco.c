/* A DiLoCo trainer written in C against <lightkeeper/lightkeeper.h>: the extra state's calls
 * (lk_diloco_set_extra_state, lk_diloco_restored_extra_state, the ext option's bound) as a
 * binding in another language would use them. One tensor of four floats, a durable save after
 * every commit. Before each sync it hands "pos=S" (S: the step that sync commits).
 * Usage: c_diloco SOCKET CKPT_DIR STEPS; prints "bound ok", "restored=BYTES" (or
 * "restored=none"), one "step=S" per commit and "done"; exits non-zero on any failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lightkeeper/lightkeeper.h>

static int fail(const char* what) {
  fprintf(stderr, "%s: %s\n", what, lk_last_error());
  return 1;
}

/* The bound and bad input fail with a reason and change nothing. */
static int check_refusals(lk_diloco* d) {
  char big[65];
  memset(big, 'x', sizeof(big));
  if (lk_diloco_set_extra_state(d, big, sizeof(big)) == 0) return fail("65 bytes over 64 taken");
  if (strstr(lk_last_error(), "over the bound of 64 bytes") == NULL) return fail("bound reason");
  if (lk_diloco_set_extra_state(d, NULL, 5) == 0) return fail("NULL data taken");
  size_t size = 1;
  if (lk_diloco_restored_extra_state(d, &size) != NULL || size != 0) {
    return fail("restored extra state before any call");
  }
  printf("bound ok\n");
  return 0;
}

/* Parameter dtypes: an unknown one is refused at create, a buffer of another dtype than the
 * options' at every call (before anything is sent), and a bf16 object refuses a float buffer. */
static int check_dtypes(lk_session* s, const lk_diloco_options* o, lk_diloco* d) {
  lk_diloco_ext_options ext;
  memset(&ext, 0, sizeof(ext));
  ext.struct_size = sizeof(ext);
  ext.param_dtype = 7;
  if (lk_diloco_create_ext(s, o, &ext) != NULL) return fail("param_dtype 7 taken");
  if (strstr(lk_last_error(), "unknown param_dtype 7") == NULL) return fail("param_dtype reason");
  uint16_t half[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
  lk_diloco_result r;
  if (lk_diloco_join_typed(d, half, 4, LK_DTYPE_BFLOAT16, &r) == 0) return fail("bf16 into f32");
  if (strstr(lk_last_error(), "is bf16 but") == NULL) return fail("bf16 into f32 reason");
  if (lk_diloco_join_typed(d, half, 4, 9, &r) == 0) return fail("dtype 9 taken");
  if (half[0] != 0x3f80) return fail("a refused call changed the buffer");
  if (lk_diloco_param_dtype(d) != LK_DTYPE_FLOAT32) return fail("param_dtype of d");
  if (lk_diloco_outer_state_bytes(d) != 4 * 4 * 2) return fail("outer_state_bytes of d");
  ext.param_dtype = LK_DTYPE_BFLOAT16;
  lk_diloco* b = lk_diloco_create_ext(s, o, &ext);
  if (b == NULL) return fail("create bf16");
  float f[4] = {1, 2, 3, 4};
  if (lk_diloco_join(b, f, 4, &r) == 0) return fail("float into bf16");
  if (strstr(lk_last_error(), "is float32 but DilocoOptions::param_dtype is bf16") == NULL) {
    return fail("float into bf16 reason");
  }
  if (lk_diloco_join_typed(b, half, 4, LK_DTYPE_FLOAT16, &r) == 0) return fail("fp16 into bf16");
  if (lk_diloco_param_dtype(b) != LK_DTYPE_BFLOAT16) return fail("param_dtype of b");
  lk_diloco_close(b);
  printf("dtypes ok\n");
  return 0;
}

/* The even split of rows, and a sharded object: in this group of one its rows are the whole
 * tensor, and a buffer of any other length is refused as not its rows, before anything is sent
 * (the multi-trainer cases run in python/tests/test_sharded.py). */
static int check_sharded(lk_session* s, const lk_diloco_options* o) {
  int64_t begin = -1, end = -1;
  if (lk_diloco_shard_rows(5, 2, 1, &begin, &end) != 0 || begin != 3 || end != 5) {
    return fail("shard_rows(5, 2, 1)");
  }
  if (lk_diloco_shard_rows(5, 2, 2, &begin, &end) == 0) return fail("rank 2 of 2 taken");
  if (strstr(lk_last_error(), "below ranks 2") == NULL) return fail("shard_rows reason");
  /* torch.chunk's rule: 5 rows over 4 are 2, 2, 1, 0 (the even split: 2, 1, 1, 1). */
  if (lk_diloco_shard_rows_rule(5, 4, 1, LK_SHARD_CHUNK, &begin, &end) != 0 || begin != 2 ||
      end != 4) {
    return fail("shard_rows_rule(5, 4, 1, chunk)");
  }
  if (lk_diloco_shard_rows_rule(5, 4, 3, LK_SHARD_CHUNK, &begin, &end) != 0 || begin != 5 ||
      end != 5) {
    return fail("shard_rows_rule(5, 4, 3, chunk)");
  }
  if (lk_diloco_shard_rows_rule(5, 4, 1, 7, &begin, &end) == 0) return fail("rule 7 taken");
  if (strstr(lk_last_error(), "unknown shard rule 7") == NULL) return fail("rule reason");
  int64_t shape[2] = {5, 2};
  lk_tensor_spec spec = {"m", 0, shape, 2};
  lk_diloco_options so = *o;
  so.params = &spec;
  so.param_count = 1;
  so.ckpt_dir = NULL;
  so.ckpt_every = 0;
  lk_diloco_ext_options ext;
  memset(&ext, 0, sizeof(ext));
  ext.struct_size = sizeof(ext);
  ext.sharded = 1;
  ext.shard_rule = 2;
  if (lk_diloco_create_ext(s, &so, &ext) != NULL) return fail("shard_rule 2 taken");
  if (strstr(lk_last_error(), "unknown shard_rule 2") == NULL) return fail("shard_rule reason");
  /* Explicit rows: a group of one must hold every row. */
  int64_t rows[2] = {1, 5};
  ext.shard_rule = LK_SHARD_EVEN;
  ext.shard_rows = rows;
  if (lk_diloco_create_ext(s, &so, &ext) != NULL) return fail("rows [1, 5) alone taken");
  if (strstr(lk_last_error(), "rows [0, 1) are held by no trainer") == NULL) {
    return fail("shard_rows reason");
  }
  ext.shard_rows = NULL;
  ext.shard_rule = LK_SHARD_CHUNK;  /* a group of one holds every row under either rule */
  lk_diloco* d = lk_diloco_create_ext(s, &so, &ext);
  if (d == NULL) return fail("create sharded");
  if (lk_diloco_numel(d) != 10 || lk_diloco_param_numel(d) != 10) return fail("sharded sizes");
  float some[9] = {0};
  lk_diloco_result r;
  if (lk_diloco_join(d, some, 9, &r) == 0) return fail("9 elements into a sharded object");
  if (strstr(lk_last_error(), "this trainer's rows of the specs (sharded, group rank 0 of 1) "
                              "have 10") == NULL) {
    return fail("sharded size reason");
  }
  lk_diloco_close(d);
  printf("sharded ok\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: c_diloco SOCKET CKPT_DIR STEPS\n");
    return 2;
  }
  const uint32_t steps = (uint32_t)atoi(argv[3]);
  lk_session* s = lk_session_open(argv[1], 0, 1);
  if (s == NULL) return fail("open");
  int64_t shape[1] = {4};
  lk_tensor_spec spec = {"w", 0, shape, 1};
  lk_diloco_options o;
  memset(&o, 0, sizeof(o));
  o.group_size = 1;
  o.params = &spec;
  o.param_count = 1;
  o.nesterov = 1;
  o.outer_momentum = -1;
  o.ckpt_dir = argv[2];
  o.ckpt_every = 1;
  lk_diloco_ext_options ext;
  memset(&ext, 0, sizeof(ext));
  ext.struct_size = sizeof(ext);
  ext.extra_state_bytes_max = 64;
  lk_diloco* d = lk_diloco_create_ext(s, &o, &ext);
  if (d == NULL) return fail("create");
  if (check_refusals(d) != 0) return 1;
  if (check_dtypes(s, &o, d) != 0) return 1;
  if (check_sharded(s, &o) != 0) return 1;
  float params[4] = {1, 2, 3, 4};
  lk_diloco_result r;
  if (lk_diloco_join(d, params, 4, &r) != 0) return fail("join");
  size_t size = 0;
  const char* restored = (const char*)lk_diloco_restored_extra_state(d, &size);
  if (restored != NULL) {
    printf("restored=%.*s\n", (int)size, restored);
  } else {
    printf("restored=none\n");
  }
  while (lk_diloco_step(d) < steps) {
    for (int i = 0; i < 4; ++i) params[i] -= 0.125f;
    char pos[32];
    int n = snprintf(pos, sizeof(pos), "pos=%u", lk_diloco_step(d) + 1);
    if (lk_diloco_set_extra_state(d, pos, (size_t)n) != 0) return fail("set extra state");
    if (lk_diloco_sync(d, params, 4, &r) != 0) return fail("sync");
    if (r.kind == LK_SYNC_COMMITTED) printf("step=%u saved=%d\n", r.step, r.saved);
    fflush(stdout);
  }
  if (lk_diloco_finish(d) != 0) return fail("finish");
  lk_diloco_close(d);
  lk_session_close(s);
  printf("done\n");
  return 0;
}
