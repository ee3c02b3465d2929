/* A trainer written in C against <lightkeeper/lightkeeper.h>, as a binding in another
 * language would use it: polls, the rendezvous KV, the peer-wait mark, commits and goodbye.
 * Compiled as C, so the header is checked as C too, and linked against liblightkeeper.so. At the
 * first quorum it also builds a cross-group communicator over the C API (a world of one),
 * averages a buffer, aborts it and checks the abort's error code.
 * Usage: c_trainer SOCKET STEPS; prints one line per step ("step=S quorum_id=Q world=W
 * from_board=B") and "done" at the end; exits non-zero with the error on any failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <lightkeeper/lightkeeper.h>

static int notices;

static void on_notice(void* user, uint32_t quorum_id, int lost, int drain) {
  (void)user;
  (void)quorum_id;
  (void)lost;
  (void)drain;
  ++notices;
}

static int fail(const char* what) {
  fprintf(stderr, "%s: %s\n", what, lk_last_error());
  return 1;
}

/* The communicator calls at the first quorum: a world of one averages to itself, an aborted
 * communicator fails the next allreduce with LK_ERR_ABORTED, and the poll's strings read back. */
static int check_comm(lk_session* s, const lk_poll_result* p) {
  char reason[256];
  size_t len = 0;
  if (lk_session_poll_reason(s, reason, sizeof(reason), &len) != 0) return fail("poll reason");
  if (len == 0 || strlen(reason) != len) {
    fprintf(stderr, "poll reason of %zu bytes: '%s'\n", len, reason);
    return 1;
  }
  if (lk_session_poll_reason(s, reason, 1, &len) == 0 || lk_last_error_code() != LK_ERR_TOO_LARGE) {
    fprintf(stderr, "a reason longer than its buffer was not refused with LK_ERR_TOO_LARGE\n");
    return 1;
  }
  if (lk_session_restore_location(s, reason, sizeof(reason), &len) != 0) return fail("restore location");
  if (p->has_restore || len != 0) {
    fprintf(stderr, "a restore location at the first start\n");
    return 1;
  }
  lk_comm_options o;
  memset(&o, 0, sizeof(o));
  o.key_prefix = "c-trainer/";
  o.init_timeout_ms = 10000;
  o.op_timeout_ms = 10000;
  o.backend = "carrier-pigeon";
  if (lk_comm_create(s, &o) != NULL || lk_last_error_code() != LK_ERR_INVALID_ARGUMENT) {
    fprintf(stderr, "an unknown backend was accepted\n");
    return 1;
  }
  o.backend = "gloo";
  lk_comm* c = lk_comm_create(s, &o);
  if (c == NULL) return fail("comm create");
  if (lk_comm_reconfigure(c, p->quorum_id, p->replica_rank, p->replica_world_size) != 0) {
    return fail("comm reconfigure");
  }
  float v[4] = {1.5f, -2.0f, 0.25f, 8.0f};
  if (lk_comm_allreduce(c, v, 4, LK_DTYPE_FLOAT32, LK_REDUCE_AVG) != 0) return fail("allreduce");
  if (v[0] != 1.5f || v[1] != -2.0f || v[2] != 0.25f || v[3] != 8.0f) {
    fprintf(stderr, "a world of one changed the buffer\n");
    return 1;
  }
  if (lk_comm_quorum_id(c) != p->quorum_id) {
    fprintf(stderr, "communicator quorum %u, want %u\n", lk_comm_quorum_id(c), p->quorum_id);
    return 1;
  }
  lk_comm_abort(c, "test");
  if (lk_comm_allreduce(c, v, 4, LK_DTYPE_FLOAT32, LK_REDUCE_SUM) == 0 ||
      lk_last_error_code() != LK_ERR_ABORTED) {
    fprintf(stderr, "an allreduce after abort did not fail with LK_ERR_ABORTED: %s\n",
            lk_last_error());
    return 1;
  }
  lk_comm_close(c);
  printf("comm ok\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    fprintf(stderr, "usage: c_trainer SOCKET STEPS [CHECKPOINT_LOCATION]\n");
    return 2;
  }
  uint32_t steps = (uint32_t)atoi(argv[2]);
  /* Errors come back as NULL or -1 with a message, never a crash. */
  if (lk_session_open("/nonexistent/agent.sock", 0, 1) != NULL || lk_last_error()[0] == '\0') {
    fprintf(stderr, "opening a missing socket did not fail with a message\n");
    return 1;
  }
  lk_session* s = lk_session_open(argv[1], 0, 1);
  if (s == NULL) return fail("open");
  lk_session_on_notice(s, on_notice, NULL);
  char buf[64];
  for (uint32_t step = 0; step < steps; ++step) {
    if (step > 0) {
      struct timespec inner = {0, 20 * 1000 * 1000}; /* the inner steps */
      nanosleep(&inner, NULL);
    }
    lk_poll_result p;
    if (lk_session_poll(s, step, &p) != 0) return fail("poll");
    if (p.drain) return fail("unexpected drain");
    if (p.replica_world_size != 1 || p.replica_rank != 0) {
      fprintf(stderr, "world %u rank %u, want 1 and 0\n", p.replica_world_size, p.replica_rank);
      return 1;
    }
    if (lk_session_heal_source(s, p.heal_source_count, buf, sizeof(buf)) == 0) {
      fprintf(stderr, "a heal source past the end was returned\n");
      return 1;
    }
    if (step == 0 && check_comm(s, &p) != 0) return 1;
    if (p.reconfigure) {
      /* replica_rank 0 publishes what the others need for this quorum; read it back. */
      char key[32], got[32];
      size_t len = 0;
      snprintf(key, sizeof(key), "c/%u", p.quorum_id);
      if (lk_kv_put(s, p.quorum_id, key, "id", 2) != 0) return fail("kv put");
      if (lk_kv_get(s, p.quorum_id, key, got, sizeof(got), &len, 5000) != 0) return fail("kv get");
      if (len != 2 || memcmp(got, "id", 2) != 0) {
        fprintf(stderr, "kv get returned %zu bytes\n", len);
        return 1;
      }
    }
    if (lk_session_set_peer_wait(s, 1) != 0) return fail("peer wait");
    if (lk_session_set_peer_wait(s, 0) != 0) return fail("peer wait");
    if (lk_session_commit(s, step + 1, 1, "h") != 0) return fail("commit");
    if (lk_session_commit(s, step + 1, 1, "h") == 0) {
      fprintf(stderr, "a second commit of step %u was accepted\n", step + 1);
      return 1;
    }
    printf("step=%u quorum_id=%u world=%u from_board=%d\n", step, p.quorum_id,
           p.replica_world_size, p.from_board);
    fflush(stdout);
  }
  if (argc > 3) {
    /* A durable checkpoint of the last committed step is registered at the lighthouse (the
     * agent's commits may still be on their way: the client retries a registration refused as
     * not yet committed); one at a step never committed and a relative location are refused. */
    if (lk_session_register_checkpoint(s, steps, argv[3], NULL) != 0) {
      return fail("register checkpoint");
    }
    if (lk_session_register_checkpoint(s, steps + 100, argv[3], "") == 0 ||
        lk_last_error_code() != LK_ERR_CONFLICT) {
      fprintf(stderr, "a checkpoint at an uncommitted step: %s\n", lk_last_error());
      return 1;
    }
    if (lk_session_register_checkpoint(s, steps, "relative/ckpt", NULL) == 0 ||
        lk_last_error_code() != LK_ERR_INVALID_ARGUMENT) {
      fprintf(stderr, "a relative checkpoint location: %s\n", lk_last_error());
      return 1;
    }
    printf("checkpoint ok\n");
  }
  if (lk_session_finish(s) != 0) return fail("finish");
  lk_session_close(s);
  printf("done notices=%d\n", notices);
  return 0;
}
