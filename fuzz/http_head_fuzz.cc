// The HTTP request-head parser on arbitrary bytes. Invariants: a parse either fails with a
// reason or round-trips (FormatHead of what it read parses back to the same values); the query
// string and percent-decoding of any target never fail, and encoding then decoding is the
// identity.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <lightkeeper/check.h>
#include "common/http/head.h"
#include "common/http/http.h"

namespace {

bool SameHead(const lk::http::Head& a, const lk::http::Head& b) {
  return a.method == b.method && a.target == b.target && a.version == b.version &&
         a.keep_alive == b.keep_alive && a.expect_continue == b.expect_continue &&
         a.content_length == b.content_length && a.content_type == b.content_type &&
         a.accept == b.accept && a.authorization == b.authorization && a.range == b.range &&
         a.gateway == b.gateway;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  lk::http::Head h;
  std::string why = lk::http::ParseHead(text, &h);
  if (!why.empty()) return 0;
  LK_CHECK(!h.method.empty() && !h.target.empty()) << "a head without method or target parsed";
  LK_CHECK(h.version == 10 || h.version == 11) << "version " << h.version;
  std::string again = lk::http::FormatHead(h);
  lk::http::Head h2;
  std::string why2 = lk::http::ParseHead(again, &h2);
  LK_CHECK(why2.empty()) << "formatted head does not parse: " << why2 << "\n" << again;
  LK_CHECK(SameHead(h, h2)) << "head changed in a round trip:\n" << again;

  // What the server does with the target next.
  auto q = h.target.find('?');
  std::string path = lk::http::PercentDecode(h.target.substr(0, q));
  if (q != std::string_view::npos) (void)lk::http::ParseQuery(h.target.substr(q + 1));
  LK_CHECK(lk::http::PercentDecode(lk::http::PercentEncode(path)) == path)
      << "percent-encoding does not round-trip";
  return 0;
}
