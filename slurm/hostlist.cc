#include "slurm/hostlist.h"

#include <cctype>
#include <charconv>
#include <cstdint>

namespace lk::slurm {
namespace {

// Numbers above this are refused: Slurm node indices are small, and the bound keeps the
// arithmetic below far from overflow.
constexpr uint64_t kIndexMax = 999'999'999;

bool IsSeparator(char c) { return c == ',' || std::isspace(static_cast<unsigned char>(c)); }

bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// One bracket group, expanded to its zero-padded suffixes ("01-03,7" -> 01 02 03 7).
Status ExpandGroup(std::string_view item, std::string_view group, size_t hosts_max,
                   std::vector<std::string>* out) {
  size_t start = 0;
  while (start <= group.size()) {
    size_t comma = group.find(',', start);
    if (comma == std::string_view::npos) comma = group.size();
    std::string_view range = group.substr(start, comma - start);
    start = comma + 1;
    size_t dash = range.find('-');
    std::string_view lo = range.substr(0, dash);
    std::string_view hi = dash == std::string_view::npos ? lo : range.substr(dash + 1);
    if (!AllDigits(lo) || !AllDigits(hi)) {
      return InvalidArgument("hostlist item '{}': range '{}' is not N or N-M with digits", item,
                             range);
    }
    if (lo.size() > 9 || hi.size() > 9) {
      return InvalidArgument("hostlist item '{}': number in '{}' is too large", item, range);
    }
    // At most 9 digits each (checked above): these cannot overflow, and from_chars never throws.
    uint64_t lo_v = 0, hi_v = 0;
    std::from_chars(lo.data(), lo.data() + lo.size(), lo_v);
    std::from_chars(hi.data(), hi.data() + hi.size(), hi_v);
    if (lo_v > hi_v || hi_v > kIndexMax) {
      return InvalidArgument("hostlist item '{}': range '{}' goes backwards", item, range);
    }
    if (out->size() + (hi_v - lo_v) + 1 > hosts_max) {
      return InvalidArgument("hostlist item '{}' expands to more than {} hosts", item, hosts_max);
    }
    for (uint64_t v = lo_v; v <= hi_v; ++v) {
      out->push_back(fmt::format("{:0{}}", v, lo.size()));
    }
  }
  return Status::Ok();
}

// One item without top-level separators: literal text and bracket groups.
Status ExpandItem(std::string_view item, size_t hosts_max, std::vector<std::string>* out,
                  size_t* bytes) {
  std::vector<std::string> partial = {""};
  size_t partial_bytes = 0;  // of all names in `partial`
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] == ']') {
      return InvalidArgument("hostlist item '{}': ']' without '['", item);
    }
    if (item[i] != '[') {
      size_t next = item.find_first_of("[]", i);
      if (next == std::string_view::npos) next = item.size();
      // Appended to every partial name: bounded first, like the product below.
      if (partial_bytes + partial.size() * (next - i) + *bytes > kHostlistBytesMax) {
        return InvalidArgument("hostlist item '{}' expands to more than {} bytes", item,
                               kHostlistBytesMax);
      }
      partial_bytes += partial.size() * (next - i);
      for (auto& p : partial) p.append(item.substr(i, next - i));
      i = next;
      continue;
    }
    size_t close = item.find(']', i);
    if (close == std::string_view::npos) {
      return InvalidArgument("hostlist item '{}': '[' without ']'", item);
    }
    std::string_view group = item.substr(i + 1, close - i - 1);
    if (group.find('[') != std::string_view::npos) {
      return InvalidArgument("hostlist item '{}': nested '['", item);
    }
    std::vector<std::string> suffixes;
    LK_RETURN_IF_ERROR(ExpandGroup(item, group, hosts_max, &suffixes));
    if (partial.size() * suffixes.size() + out->size() > hosts_max) {
      return InvalidArgument("hostlist item '{}' expands to more than {} hosts", item, hosts_max);
    }
    size_t suffix_bytes = 0;
    for (const auto& x : suffixes) suffix_bytes += x.size();
    // Every partial name is joined with every suffix: the bytes of the product, bounded before
    // a byte of it is allocated (each factor is at most a million names of a bounded item).
    if (partial_bytes * suffixes.size() + suffix_bytes * partial.size() + *bytes > kHostlistBytesMax) {
      return InvalidArgument("hostlist item '{}' expands to more than {} bytes", item,
                             kHostlistBytesMax);
    }
    std::vector<std::string> next;
    next.reserve(partial.size() * suffixes.size());
    for (const auto& p : partial) {
      for (const auto& s : suffixes) next.push_back(p + s);
    }
    partial = std::move(next);
    partial_bytes = 0;
    for (const auto& p : partial) partial_bytes += p.size();
    i = close + 1;
  }
  // An item without a bracket group adds a host too: "a[1-1000000],b" is one over the bound
  // (found by fuzz/hostlist).
  if (out->size() + partial.size() > hosts_max) {
    return InvalidArgument("hostlist item '{}' expands to more than {} hosts", item, hosts_max);
  }
  *bytes += partial_bytes;
  for (auto& p : partial) out->push_back(std::move(p));
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::string>> ExpandHostlist(std::string_view list, size_t hosts_max) {
  std::vector<std::string> hosts;
  size_t bytes = 0;  // of all names in `hosts`
  size_t i = 0;
  while (i < list.size()) {
    if (IsSeparator(list[i])) {
      ++i;
      continue;
    }
    // An item ends at the first separator outside brackets; commas inside brackets separate
    // ranges, not hosts.
    size_t end = i;
    int depth = 0;
    while (end < list.size() && (depth > 0 || !IsSeparator(list[end]))) {
      if (list[end] == '[') ++depth;
      if (list[end] == ']') --depth;
      if (depth > 0 && std::isspace(static_cast<unsigned char>(list[end]))) break;
      ++end;
    }
    std::string_view item = list.substr(i, end - i);
    // The context is formatted on failure only: it quotes the whole list, and formatting it for
    // every item made a list of n names cost n times its length (found by fuzz/hostlist).
    if (Status st = ExpandItem(item, hosts_max, &hosts, &bytes); !st.ok()) {
      return st.WithContext(fmt::format("hostlist '{}'", list));
    }
    i = end;
  }
  if (hosts.empty()) return InvalidArgument("hostlist '{}' names no host", list);
  return hosts;
}

}  // namespace lk::slurm
