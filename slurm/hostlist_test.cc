#include "slurm/hostlist.h"

#include <doctest/doctest.h>

namespace lk::slurm {
namespace {

using Hosts = std::vector<std::string>;

TEST_CASE("hostlist: expands like scontrol show hostnames") {
  // Every expected row was checked with `scontrol show hostnames` on Slurm 22.05.
  struct Row {
    std::string list;
    Hosts hosts;
  };
  const std::vector<Row> rows = {
      {"localhost", {"localhost"}},
      {"gpu[001-004,010],login1", {"gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "login1"}},
      {"b[01-2]", {"b01", "b02"}},                 // width of the lower bound
      {"b[1-010]", {"b1", "b2", "b3", "b4", "b5", "b6", "b7", "b8", "b9", "b10"}},
      {"a[01,2]", {"a01", "a2"}},                  // width per range
      {"a[0-0]", {"a0"}},
      {"a[1-2][3-4]", {"a13", "a14", "a23", "a24"}},  // leftmost group varies slowest
      {"a[1-2]-[3-4]", {"a1-3", "a1-4", "a2-3", "a2-4"}},
      {"a[1-2,5]b[1-2]", {"a1b1", "a1b2", "a2b1", "a2b2", "a5b1", "a5b2"}},
      {"r[1-2]-n[08-10]", {"r1-n08", "r1-n09", "r1-n10", "r2-n08", "r2-n09", "r2-n10"}},
      {"[1-2]", {"1", "2"}},
      {"a,,b", {"a", "b"}},                        // empty items are skipped
      {"a,", {"a"}},
      {"a b", {"a", "b"}},                         // whitespace separates too
      {"n1,n1", {"n1", "n1"}},                     // duplicates are kept
      {"n[9-11]-ib", {"n9-ib", "n10-ib", "n11-ib"}},  // Slurm 22.05 refuses this; we expand
  };
  for (const auto& row : rows) {
    CAPTURE(row.list);
    auto hosts = ExpandHostlist(row.list);
    REQUIRE_MESSAGE(hosts.ok(), hosts.status().ToString());
    CHECK(*hosts == row.hosts);
  }
}

TEST_CASE("hostlist: unparsable lists are errors that say why") {
  struct Row {
    std::string list;
    std::string reason;
  };
  const std::vector<Row> rows = {
      {"b[5-3]", "goes backwards"},
      {"a[]", "is not N or N-M"},
      {"a[x]", "is not N or N-M"},
      {"a[1-]", "is not N or N-M"},        // Slurm reads this as a1; too easy to be a typo
      {"a[-2]", "is not N or N-M"},
      {"a[1,,2]", "is not N or N-M"},
      {"a[1-2", "'[' without ']'"},         // Slurm silently makes this "a]"
      {"a]", "']' without '['"},
      {"a[1-2]]", "']' without '['"},
      {"a[[1-2]]", "nested '['"},
      {"a[1, 2]", "'[' without ']'"},
      {"a[1234567890]", "too large"},
      {"n[1-999999999]", "more than 1000000 hosts"},
      {"", "names no host"},
      {" , ", "names no host"},
  };
  for (const auto& row : rows) {
    CAPTURE(row.list);
    auto hosts = ExpandHostlist(row.list);
    REQUIRE_FALSE(hosts.ok());
    CHECK(hosts.status().code() == Code::kInvalidArgument);
    CHECK_MESSAGE(hosts.status().message().find(row.reason) != std::string::npos,
                  hosts.status().message());
  }
}

TEST_CASE("hostlist: plain names count against the host bound too (fuzz/hostlist's finding)") {
  // The fuzzer's input at its bound of 1,000: 2 * 125 * 4 hosts, then one more plain name.
  std::string crash("r[1-2]\xa9\xa9[00-124][1-4] x", 23);
  CHECK(ExpandHostlist(crash.substr(0, 21), 1000).ok());
  auto over = ExpandHostlist(crash, 1000);
  REQUIRE_FALSE(over.ok());
  CHECK(over.status().message().find("more than 1000 hosts") != std::string::npos);
  // At the real bound.
  auto big = ExpandHostlist("n[1-1000000],x");
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().message().find("more than 1000000 hosts") != std::string::npos);
  CHECK(ExpandHostlist("n[1-999999],x").ok());
}

TEST_CASE("hostlist: a product of groups over the bound is refused before it is built") {
  auto hosts = ExpandHostlist("a[1-1000][1-1000][1-1000]");
  REQUIRE_FALSE(hosts.ok());
  CHECK(hosts.status().message().find("more than") != std::string::npos);
}

TEST_CASE("hostlist: long names times many hosts are refused by their bytes - not built") {
  // Each under the host bound, but gigabytes of names together (100 bytes x a million hosts).
  const std::string prefix(100, 'x');
  for (const std::string& list :
       {prefix + "[1-999999]", "[1-999999]" + prefix, "[1-1000]" + prefix + "[1-1000]",
        "a[1-500000]," + std::string(200, 'x') + "[1-400000]"}) {
    CAPTURE(list.substr(0, 30));
    auto hosts = ExpandHostlist(list);
    REQUIRE_FALSE(hosts.ok());
    CHECK_MESSAGE(hosts.status().message().find("more than 67108864 bytes") != std::string::npos,
                  hosts.status().message());
  }
  // Just under the byte bound is fine: 40-byte names of a million hosts.
  auto ok = ExpandHostlist(std::string(33, 'y') + "[000001-999999]");
  REQUIRE_MESSAGE(ok.ok(), ok.status().ToString());
  CHECK(ok->size() == 999'999);
}

TEST_CASE("hostlist: a long list of plain names expands to them (fuzz/hostlist's finding)") {
  // libFuzzer timed out on "\0b[1-666015]": the names it expands to, joined by commas, took
  // minutes to expand again, because every item formatted the whole list into an error context
  // it did not need. 200,000 names of a real cluster's length make the same shape.
  std::string list;
  std::vector<std::string> want;
  for (int i = 0; i < 200'000; ++i) {
    want.push_back(fmt::format("nid{:06}", i));
    list += (i ? "," : "") + want.back();
  }
  auto hosts = ExpandHostlist(list);
  REQUIRE(hosts.ok());
  CHECK(*hosts == want);
  // The fuzzer's input itself, and its round trip.
  auto odd = ExpandHostlist(std::string("\0b[1-666015]", 12));
  REQUIRE(odd.ok());
  REQUIRE(odd->size() == 666'015);
  CHECK(odd->back() == std::string("\0b666015", 8));
  std::string joined;
  for (const auto& h : *odd) joined += (joined.empty() ? "" : ",") + h;
  auto again = ExpandHostlist(joined);
  REQUIRE(again.ok());
  CHECK(*again == *odd);
  // A failing item still names the list it is in.
  auto bad = ExpandHostlist("a,b[2-1],c");
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("hostlist 'a,b[2-1],c'") != std::string::npos);
}

}  // namespace
}  // namespace lk::slurm
