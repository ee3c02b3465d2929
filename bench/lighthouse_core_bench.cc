// The lighthouse core's hot path and its largest round, timed (moved here from the unit tests,
// which check what these paths do, never how fast). Each figure is printed beside a peer measured
// in the same run: the least work any design must do for the same answers (copying the member
// list into every answer; sorting the group ids the quorum is ordered by).
// Run: build/bin/lighthouse_core_bench (a doctest binary; not registered with CTest).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "lighthouse/lighthouse_core.h"
#include "lighthouse/lighthouse_core_test_util.h"

namespace lk::lighthouse {
namespace {

using testing::Harness;
using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

TEST_CASE("bench: unchanged quorum of 16 groups, last ask to all 16 answers") {
  Harness h;
  std::vector<std::string> groups;
  for (int i = 0; i < 16; ++i) groups.push_back(fmt::format("g{:02}", i));
  h.Form(groups);
  std::vector<double> core_us, peer_us;
  for (uint32_t step = 1; step <= 2000; ++step) {
    for (size_t i = 0; i + 1 < groups.size(); ++i) REQUIRE(h.Join(groups[i], step).ok());
    auto t0 = Clock::now();
    REQUIRE(h.Join(groups.back(), step).ok());
    auto t1 = Clock::now();
    REQUIRE(h.fx.answers.size() == 16);
    // Peer: copy the member list into 16 answers, what any coordinator hands out here.
    const auto& members = h.fx.answers[0].second.members_shared
                              ? *h.fx.answers[0].second.members_shared
                              : h.fx.answers[0].second.members;
    auto p0 = Clock::now();
    std::vector<std::vector<MemberData>> copies(16, members);
    auto p1 = Clock::now();
    REQUIRE(copies.back().size() == 16);
    core_us.push_back(Micros(t1 - t0));
    peer_us.push_back(Micros(p1 - p0));
  }
  std::printf("bench core_hot_path_16 p50_us=%.1f p99_us=%.1f peer_copy_answers_p50_us=%.1f\n",
              Percentile(core_us, 0.5), Percentile(core_us, 0.99), Percentile(peer_us, 0.5));
}

TEST_CASE("bench: one round of 1,024 groups") {
  CoreOptions o;
  o.answer_members_inline = false;
  Harness h(o);
  h.job = "big";
  std::vector<std::string> groups;
  for (int g = 0; g < 1024; ++g) groups.push_back(fmt::format("g{:04}", g));
  for (const std::string& g : groups) REQUIRE(h.Beat(g).ok());
  auto t0 = Clock::now();
  for (size_t i = 0; i + 1 < groups.size(); ++i) REQUIRE(h.Join(groups[i], 0).ok());
  auto t1 = Clock::now();
  REQUIRE(h.Join(groups.back(), 0).ok());
  auto t2 = Clock::now();
  REQUIRE(h.fx.answers.size() == 1024);
  // Peer: sort the 1,024 group ids (reversed first), the order every quorum is issued in.
  std::vector<std::string> ids(groups.rbegin(), groups.rend());
  auto p0 = Clock::now();
  std::sort(ids.begin(), ids.end());
  auto p1 = Clock::now();
  std::printf("bench core_round_1024 asks_1023_ms=%.2f last_ask_ms=%.2f peer_sort_ids_ms=%.3f\n",
              Micros(t1 - t0) / 1000, Micros(t2 - t1) / 1000, Micros(p1 - p0) / 1000);
}

}  // namespace
}  // namespace lk::lighthouse
