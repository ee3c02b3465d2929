// SIGPIPE without a process-wide side effect. Library code (the trainer's client library, its
// communicators, the HTTP server inside a trainer) must not change the disposition of SIGPIPE in
// a user's process, yet a write to a socket whose peer went away raises it, and its default
// action kills the process. Where a call cannot say MSG_NOSIGNAL (sendfile(2), Gloo's writev),
// the writing thread blocks SIGPIPE for the duration and takes one that the call raised before
// unblocking it again, so that it is never delivered. Threads started inside the guard inherit
// the blocked mask (Gloo's device loop), where a SIGPIPE stays pending and harmless.
// Thread-safety: the guard acts on the calling thread only.
#pragma once

#include <signal.h>
#include <time.h>

namespace lk {

class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    // One already pending (raised before, or sent to the process) is not ours to take.
    sigset_t pending;
    sigemptyset(&pending);
    was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
  }
  ~ScopedSigpipeBlock() {
    if (!was_pending_) {
      timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

}  // namespace lk
