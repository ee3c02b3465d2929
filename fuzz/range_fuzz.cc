// The HTTP Range parser of the shard server. Input: 8 bytes of file size (little endian), then
// the header value. Invariants: a parse either fails with a reason or gives begin < end <= size,
// and "bytes=BEGIN-(END-1)" parses back to the same range.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "checkpoint/range.h"
#include <lightkeeper/check.h>
#include "fmt/format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t file_size = 0;
  for (int i = 0; i < 8; ++i) file_size |= uint64_t{data[i]} << (8 * i);
  std::string_view header(reinterpret_cast<const char*>(data + 8), size - 8);
  uint64_t begin = 0, end = 0;
  lk::Status st = lk::ckpt::ParseRange(header, file_size, &begin, &end);
  if (!st.ok()) {
    LK_CHECK(!st.message().empty()) << "a refusal without a reason";
    return 0;
  }
  LK_CHECK(begin < end && end <= file_size)
      << "range [" << begin << "," << end << ") of a " << file_size << "-byte file";
  uint64_t b2 = 0, e2 = 0;
  std::string again = fmt::format("bytes={}-{}", begin, end - 1);
  st = lk::ckpt::ParseRange(again, file_size, &b2, &e2);
  LK_CHECK(st.ok() && b2 == begin && e2 == end) << again << ": " << st.ToString();
  return 0;
}
