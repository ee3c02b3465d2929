// Hostlist expansion: Slurm's compact node lists ("gpu[001-004,010],login1") into host names.
// Pure: no I/O. Thread-safety: free functions on values, safe from any thread.
//
// Follows `scontrol show hostnames` on Slurm 22.05 for every list Slurm accepts: items are
// separated by commas or whitespace outside brackets (empty items are skipped), a bracket group
// holds comma-separated numbers and ranges, the width of a range is the width of its lower bound
// ("01-10" -> 01..10, "1-010" -> 1..10), several groups in one item expand as a cartesian product
// with the leftmost group varying slowest, duplicates and order are kept. Where Slurm silently
// guesses (an unclosed "a[1-2", an open range "a[1-]") this parser returns an error instead,
// because a wrong node list would make an agent count the wrong number of peers.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <lightkeeper/status.h>

namespace lk::slurm {

// A list that expands to more hosts than this is an error: no cluster has that many nodes, and
// the bound keeps a typo such as "n[1-999999999]" from exhausting memory.
inline constexpr size_t kHostlistHostsMax = 1'000'000;
// The same for the bytes of all host names together: a million hosts of a long literal prefix
// ("x" * 10000 + "[1-100000]") would be gigabytes.
inline constexpr size_t kHostlistBytesMax = size_t{64} << 20;

// Expands `list` into host names in order. Errors name the offending item and the reason.
// `hosts_max` lowers the host bound (the fuzz target uses it to stay fast; the checks are the
// same at any bound).
Result<std::vector<std::string>> ExpandHostlist(std::string_view list,
                                                size_t hosts_max = kHostlistHostsMax);

}  // namespace lk::slurm
