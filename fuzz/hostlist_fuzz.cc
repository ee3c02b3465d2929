// The Slurm hostlist parser. Invariants: an expansion either fails with a reason or gives
// non-empty host names without separators or brackets, within the bounds, and the expanded
// names joined with commas expand to themselves. The host bound is lowered to 1,000: lists near
// the real bound of a million cost seconds each under the sanitizers, and the bound's checks are
// the same at any value.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <lightkeeper/check.h>
#include "slurm/hostlist.h"

constexpr size_t kHostsMax = 1'000;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view list(reinterpret_cast<const char*>(data), size);
  auto hosts = lk::slurm::ExpandHostlist(list, kHostsMax);
  if (!hosts.ok()) {
    LK_CHECK(!hosts.status().message().empty()) << "a refusal without a reason";
    return 0;
  }
  LK_CHECK(!hosts->empty() && hosts->size() <= kHostsMax) << hosts->size();
  std::string joined;
  size_t bytes = 0;
  for (const auto& h : *hosts) {
    LK_CHECK(!h.empty() && h.find_first_of("[], \t\n\v\f\r") == std::string::npos)
        << "host name '" << h << "'";
    bytes += h.size();
    if (!joined.empty()) joined += ',';
    joined += h;
  }
  LK_CHECK(bytes <= lk::slurm::kHostlistBytesMax) << bytes;
  auto again = lk::slurm::ExpandHostlist(joined, kHostsMax);
  LK_CHECK(again.ok() && *again == *hosts) << "expanded names do not expand to themselves";
  return 0;
}
