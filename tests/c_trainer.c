/* A trainer written in C against replica_agent/client/lightkeeper.h, as a binding in another
 * language would use it: polls, the rendezvous KV, the peer-wait mark, commits and goodbye.
 * Compiled as C, so the header is checked as C too.
 * Usage: c_trainer SOCKET STEPS; prints one line per step ("step=S quorum_id=Q world=W
 * from_board=B") and "done" at the end; exits non-zero with the error on any failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "replica_agent/client/lightkeeper.h"

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

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: c_trainer SOCKET STEPS\n");
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
  if (lk_session_finish(s) != 0) return fail("finish");
  lk_session_close(s);
  printf("done notices=%d\n", notices);
  return 0;
}
