// Hostile Range headers: numbers at and past 64 bits, signs, spaces and empty parts. Each is
// either a clean refusal with a reason or a range inside the file, never a wrapped one.
#include "checkpoint/range.h"

#include <doctest/doctest.h>

#include <string>

namespace lk::ckpt {
namespace {

TEST_CASE("Range: overflowing and malformed numbers are refused with a reason - never wrapped") {
  struct Case {
    std::string header;
    uint64_t size;
    bool ok;
    uint64_t begin, end;
    std::string reason;  // a part of the refusal's message
  } cases[] = {
      // The largest end fits 64 bits: clipped to the file. Before the fix it wrapped to [0,0).
      {"bytes=0-18446744073709551615", 100, true, 0, 100, ""},
      {"bytes=99-18446744073709551615", 100, true, 99, 100, ""},
      {"bytes=0-18446744073709551615", UINT64_MAX, true, 0, UINT64_MAX, ""},
      {"bytes=18446744073709551614-", UINT64_MAX, true, UINT64_MAX - 1, UINT64_MAX, ""},
      {"bytes=-18446744073709551615", 100, true, 0, 100, ""},
      {"bytes=0-18446744073709551616", 100, false, 0, 0, "bad range end"},
      {"bytes=18446744073709551616-", 100, false, 0, 0, "bad range start"},
      {"bytes=-18446744073709551616", 100, false, 0, 0, "bad suffix range"},
      {"bytes=99999999999999999999999-1", 100, false, 0, 0, "bad range start"},
      {"bytes=18446744073709551615-", 100, false, 0, 0, "outside the 100-byte file"},
      {"bytes=-0", 100, false, 0, 0, "bad suffix range"},
      {"bytes=-5", 0, false, 0, 0, "empty file"},
      {"bytes=0-", 0, false, 0, 0, "outside the 0-byte file"},
      {"bytes=+1-2", 100, false, 0, 0, "bad range start"},
      {"bytes=1-+2", 100, false, 0, 0, "bad range end"},
      {"bytes= 1-2", 100, false, 0, 0, "bad range start"},
      {"bytes=1 -2", 100, false, 0, 0, "bad range start"},
      {"bytes=-", 100, false, 0, 0, "bad suffix range"},
      {"bytes=", 100, false, 0, 0, "without '-'"},
      {"bytes=1--2", 100, false, 0, 0, "bad range end"},
      {"bytes=5-4", 100, false, 0, 0, "before it starts"},
      {"BYTES=0-1", 100, false, 0, 0, "not bytes"},
      {"", 100, false, 0, 0, "not bytes"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.header);
    CAPTURE(c.size);
    uint64_t b = 7, e = 7;
    Status st = ParseRange(c.header, c.size, &b, &e);
    REQUIRE(st.ok() == c.ok);
    if (c.ok) {
      CHECK(b == c.begin);
      CHECK(e == c.end);
    } else {
      CHECK_MESSAGE(st.message().find(c.reason) != std::string::npos, st.message());
    }
  }
}

}  // namespace
}  // namespace lk::ckpt
