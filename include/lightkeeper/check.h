// LK_CHECK: an always-on assertion for broken invariants (programmer errors). It stays on in
// release builds, because a coordinator that goes on with a broken invariant can hand out two
// memberships for one quorum_id; crashing and restarting from durable state is the safe choice.
// Thread-safety: safe from any thread.
#pragma once

#include <sstream>

#include <lightkeeper/api.h>

namespace lk::internal {

class LK_API CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* expr);
  [[noreturn]] ~CheckFailure();
  template <typename T>
  CheckFailure& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

// Lets `LK_CHECK(x) << "msg"` be an expression of type void in both arms of the ternary.
struct Voidify {
  void operator&(const CheckFailure&) {}
};

}  // namespace lk::internal

#define LK_CHECK(cond)                                     \
  (cond) ? (void)0                                         \
         : ::lk::internal::Voidify() &                     \
               ::lk::internal::CheckFailure(__FILE__, __LINE__, #cond)

#define LK_CHECK_EQ(a, b) LK_CHECK((a) == (b)) << (a) << " != " << (b) << " "
