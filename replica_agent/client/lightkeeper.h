/* Lightkeeper's trainer API in plain C, so that trainers in any language can bind to it.
 * Every function returns 0 on success and -1 on error; lk_last_error() then says why (per
 * thread). Thread-safety: one session per trainer; calls on one session from one thread at a
 * time; the notice callback runs on the session's own thread. */
#ifndef LIGHTKEEPER_H_
#define LIGHTKEEPER_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_session lk_session;

typedef struct lk_poll_result {
  uint32_t quorum_id;
  uint32_t replica_rank;
  uint32_t replica_world_size;
  uint32_t max_step;
  int reconfigure;
  int heal;
  int drain;
  int initial;
  int checkpoint_now;
  uint32_t heal_source_count; /* read each with lk_session_heal_source */
  int from_board; /* answered from the agent's shared memory, without a socket round trip */
} lk_poll_result;

/* socket_path NULL: use $LK_AGENT_SOCKET. Returns NULL on error. */
lk_session* lk_session_open(const char* socket_path, uint32_t group_rank, uint32_t group_size);
void lk_session_close(lk_session* s);
int lk_session_poll(lk_session* s, uint32_t step, lk_poll_result* out);
/* The i-th heal source of the last poll, as "HOST:PORT", NUL-terminated into buf. */
int lk_session_heal_source(lk_session* s, uint32_t i, char* buf, size_t cap);
/* Around the cross-group collective: waiting == 1 before it, 0 after. While every trainer of a
 * group waits on the other groups, the lighthouse does not count the time as this group's stall. */
int lk_session_set_peer_wait(lk_session* s, int waiting);
/* Done: the trainer's exit is then not reported as a crash. */
int lk_session_finish(lk_session* s);
int lk_session_commit(lk_session* s, uint32_t step, int ok, const char* state_hash);
int lk_kv_put(lk_session* s, uint32_t quorum_id, const char* key, const void* value, size_t len);
/* Waits up to timeout_ms for the key; *len gets the value's size (which may exceed cap). */
int lk_kv_get(lk_session* s, uint32_t quorum_id, const char* key, void* buf, size_t cap,
              size_t* len, uint32_t timeout_ms);
typedef void (*lk_notice_fn)(void* user, uint32_t quorum_id, int lost, int drain);
void lk_session_on_notice(lk_session* s, lk_notice_fn fn, void* user);
const char* lk_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* LIGHTKEEPER_H_ */
