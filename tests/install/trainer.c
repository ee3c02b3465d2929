/* A tiny DiLoCo trainer in C over an installed liblightkeeper, built out of tree (with
 * find_package and with pkg-config) by tests/install_test.sh. Its "model" is 17 floats in two
 * named tensors and its inner optimizer heavy-ball momentum, whose state (the momentum and a
 * step count) the library saves with durable checkpoints.
 * Usage: tiny_trainer GROUP_INDEX OUTER_STEPS [CKPT_DIR]; LK_AGENT_SOCKET names the agent.
 * Prints "step=S hash=H" per commit and "done step=S hash=H" at the end. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lightkeeper/lightkeeper.h>

#define N_PARAMS 17
#define N_INNER 18

static float momentum[N_INNER]; /* 17 momenta and the step count */

static int save_inner(void* user, float* out, size_t count) {
  (void)user;
  if (count != N_INNER) return 1;
  memcpy(out, momentum, sizeof(momentum));
  return 0;
}

static int fail(const char* what) {
  fprintf(stderr, "%s: %s (code %d)\n", what, lk_last_error(), lk_last_error_code());
  return 1;
}

static void apply(lk_diloco* d, const lk_diloco_result* r) {
  if (r->inner == LK_INNER_RESET) memset(momentum, 0, sizeof(momentum));
  if (r->inner == LK_INNER_RESTORED) {
    size_t n = 0;
    const float* m = lk_diloco_restored_inner_state(d, &n);
    if (n == N_INNER) memcpy(momentum, m, sizeof(momentum));
  }
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: tiny_trainer GROUP_INDEX OUTER_STEPS [CKPT_DIR]\n");
    return 2;
  }
  const int group = atoi(argv[1]);
  const uint32_t steps = (uint32_t)atoi(argv[2]);
  lk_session* s = lk_session_open(NULL, 0, 1);
  if (s == NULL) return fail("open");

  const int64_t w_shape[2] = {4, 3}, b_shape[1] = {5};
  lk_tensor_spec params[2] = {{"w", 0, w_shape, 2}, {"b", 12, b_shape, 1}};
  lk_tensor_spec inner[3] = {
      {"momentum/w", 0, w_shape, 2}, {"momentum/b", 12, b_shape, 1}, {"count", 17, NULL, 0}};
  lk_diloco_options o;
  memset(&o, 0, sizeof(o));
  o.group_rank = 0;
  o.group_size = 1;
  o.params = params;
  o.param_count = 2;
  o.inner_state = inner;
  o.inner_state_count = 3;
  o.inner_save = save_inner;
  o.outer_momentum = -1; /* the default */
  o.nesterov = 1;
  o.ckpt_dir = argc > 3 ? argv[3] : NULL;
  o.op_timeout_ms = 30000;
  /* A bad spec is refused with a code, not a crash. */
  lk_tensor_spec bad[1] = {{"w", 1, w_shape, 2}};
  o.params = bad;
  o.param_count = 1;
  if (lk_diloco_create(s, &o) != NULL || lk_last_error_code() != LK_ERR_INVALID_ARGUMENT) {
    fprintf(stderr, "a spec that does not start at 0 was accepted\n");
    return 1;
  }
  o.params = params;
  o.param_count = 2;
  /* So is an unknown codec of the options that came later (lk_diloco_create_ext). */
  lk_diloco_ext_options ext;
  memset(&ext, 0, sizeof(ext));
  ext.struct_size = sizeof(ext);
  ext.outer_compress = "int2";
  if (lk_diloco_create_ext(s, &o, &ext) != NULL ||
      lk_last_error_code() != LK_ERR_INVALID_ARGUMENT) {
    fprintf(stderr, "outer_compress int2 was accepted\n");
    return 1;
  }
  lk_diloco* d = lk_diloco_create(s, &o);
  if (d == NULL) return fail("diloco create");

  float p[N_PARAMS];
  for (int i = 0; i < N_PARAMS; ++i) p[i] = 0.1f * (float)i - 0.5f;
  lk_diloco_result r;
  if (lk_diloco_join(d, p, N_PARAMS, &r) != 0) return fail("join");
  apply(d, &r);
  while (r.kind != LK_SYNC_DRAINED && lk_diloco_step(d) < steps) {
    for (int k = 0; k < 3; ++k) { /* inner steps towards this group's own target */
      for (int i = 0; i < N_PARAMS; ++i) {
        float g = p[i] - (float)(group + 1) * 0.25f;
        momentum[i] = 0.5f * momentum[i] + g;
        p[i] -= 0.1f * momentum[i];
      }
      momentum[N_PARAMS] += 1.0f;
    }
    if (lk_diloco_sync(d, p, N_PARAMS, &r) != 0) return fail("sync");
    apply(d, &r);
    if (r.kind == LK_SYNC_COMMITTED) {
      printf("step=%u hash=%s world=%u\n", r.step, r.state_hash, r.replica_world_size);
      fflush(stdout);
    }
  }
  if (lk_diloco_finish(d) != 0) return fail("finish");
  printf("done step=%u hash=%s\n", lk_diloco_step(d), r.state_hash);
  lk_diloco_close(d);
  lk_session_close(s);
  return 0;
}
