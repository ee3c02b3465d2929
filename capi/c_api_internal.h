// What the two halves of the C API share: the session object, which fans the session's notices
// out to the caller's callbacks, its communicators and its DiLoCo objects, and the per-thread
// error. Internal to liblightkeeper.
// Thread-safety: the notice fan-out's lists are guarded by `mu`; the rest as lightkeeper.h says.
#pragma once

#include <memory>
#include <mutex>
#include <set>
#include <string>

#include <lightkeeper/status.h>
#include <lightkeeper/lightkeeper.h>
#include <lightkeeper/session.h>

namespace lk::capi {

// The notice receivers of one session. Shared with the session's notice thread, which may run
// a callback after lk_session_close returned, so it is owned jointly and the lists are cleared
// at close.
struct Fanout {
  std::mutex mu;
  lk_notice_fn fn = nullptr;
  void* fn_user = nullptr;
  lk_notice_ex_fn ex_fn = nullptr;
  void* ex_user = nullptr;
  std::set<lk_comm*> comms;
  std::set<lk_diloco*> dilocos;
  void Deliver(const client::Notice& n);
};

// Hands a notice to a DiLoCo object (c_api_diloco.cc).
void DeliverToDiloco(lk_diloco* d, const client::Notice& n);

// Records the error for lk_last_error / lk_last_error_code and returns -1.
int Fail(const Status& st);

}  // namespace lk::capi

struct lk_session {
  std::unique_ptr<lk::client::Session> session;
  lk::client::PollResult last;
  std::shared_ptr<lk::capi::Fanout> fanout;
};
