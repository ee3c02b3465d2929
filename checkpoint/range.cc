#include "checkpoint/range.h"

#include <algorithm>
#include <charconv>

namespace lk::ckpt {
namespace {

// Digits only (no sign, no space), and the value must fit: from_chars refuses an overflow.
bool ParseU64(std::string_view s, uint64_t* v) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

Status ParseRange(std::string_view header, uint64_t size, uint64_t* begin, uint64_t* end) {
  constexpr std::string_view kUnit = "bytes=";
  if (header.substr(0, kUnit.size()) != kUnit) return InvalidArgument("range unit is not bytes");
  std::string_view spec = header.substr(kUnit.size());
  if (spec.find(',') != std::string_view::npos) return InvalidArgument("multiple ranges");
  auto dash = spec.find('-');
  if (dash == std::string_view::npos) return InvalidArgument("range without '-'");
  std::string_view a = spec.substr(0, dash), b = spec.substr(dash + 1);
  uint64_t x = 0, y = 0;
  if (a.empty()) {  // suffix: the last N bytes
    if (!ParseU64(b, &y) || y == 0) return InvalidArgument("bad suffix range '-{}'", b);
    if (size == 0) return InvalidArgument("suffix range of an empty file");
    *begin = size - std::min(y, size);
    *end = size;
    return Status::Ok();
  }
  // Every number is checked by from_chars, which refuses what does not fit 64 bits, and no sum
  // below can wrap: the end is clipped to the file before one is added to it.
  if (!ParseU64(a, &x)) return InvalidArgument("bad range start '{}'", a);
  if (x >= size) return InvalidArgument("range starts at {}, outside the {}-byte file", x, size);
  if (b.empty()) {
    y = size - 1;
  } else if (!ParseU64(b, &y)) {
    return InvalidArgument("bad range end '{}'", b);
  } else if (y < x) {
    return InvalidArgument("range ends at {} before it starts at {}", y, x);
  }
  *begin = x;
  *end = std::min(y, size - 1) + 1;
  return Status::Ok();
}

}  // namespace lk::ckpt
