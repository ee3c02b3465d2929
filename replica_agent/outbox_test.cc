#include "replica_agent/outbox.h"

#include <doctest/doctest.h>

#include <vector>

namespace lk::agent {
namespace {

Report Commit(uint32_t step) {
  Report r;
  r.kind = ReportKind::kCommit;
  r.step = step;
  r.quorum_id = 7;
  r.body = "c" + std::to_string(step);
  return r;
}

Report Leave() {
  Report r;
  r.kind = ReportKind::kLeave;
  r.body = "leave";
  return r;
}

Report Checkpoint(uint32_t step) {
  Report r;
  r.kind = ReportKind::kCheckpoint;
  r.step = step;
  return r;
}

// Delivers everything in the outbox's order; returns the bodies.
std::vector<std::string> DrainAll(Outbox& o) {
  std::vector<std::string> out;
  while (!o.empty()) {
    out.push_back(o.front().body.empty() ? "k" + std::to_string(o.front().step) : o.front().body);
    REQUIRE(o.Done(o.front().seq));
  }
  return out;
}

TEST_CASE("outbox: reports leave in the order they came, whatever their kind") {
  Outbox o(16);
  CHECK_FALSE(o.Push(Commit(1)));
  CHECK_FALSE(o.Push(Commit(2)));
  CHECK_FALSE(o.Push(Checkpoint(2)));
  CHECK_FALSE(o.Push(Commit(3)));
  CHECK_FALSE(o.Push(Leave()));
  CHECK(o.Holds(ReportKind::kCommit));
  CHECK(o.Holds(ReportKind::kLeave));
  CHECK(o.Summary() == "commit=3 steps=1..3 checkpoint=1 leave=1");
  CHECK(DrainAll(o) == std::vector<std::string>{"c1", "c2", "k2", "c3", "leave"});
  CHECK_FALSE(o.Holds(ReportKind::kCommit));
  CHECK(o.Summary().empty());
  CHECK(o.pushed() == 5);
  CHECK(o.dropped() == 0);
}

TEST_CASE("outbox: past its bound the oldest report that is not a leave is dropped") {
  Outbox o(3);
  CHECK_FALSE(o.Push(Commit(1)));
  CHECK_FALSE(o.Push(Commit(2)));
  CHECK_FALSE(o.Push(Commit(3)));
  auto dropped = o.Push(Commit(4));
  REQUIRE(dropped);
  CHECK(dropped->step == 1);
  CHECK(o.size() == 3);
  // The leave is kept; the oldest commit before it goes.
  dropped = o.Push(Leave());
  REQUIRE(dropped);
  CHECK(dropped->step == 2);
  CHECK(o.dropped() == 2);
  CHECK(DrainAll(o) == std::vector<std::string>{"c3", "c4", "leave"});
}

TEST_CASE("outbox: an outbox of leaves only drops the newcomer") {
  Outbox o(1);
  CHECK_FALSE(o.Push(Leave()));
  auto dropped = o.Push(Commit(9));
  REQUIRE(dropped);
  CHECK(dropped->step == 9);
  CHECK(DrainAll(o) == std::vector<std::string>{"leave"});
}

TEST_CASE("outbox: a report dropped while on its way is not taken twice") {
  Outbox o(2);
  CHECK_FALSE(o.Push(Commit(1)));
  const uint64_t on_its_way = o.front().seq;
  CHECK_FALSE(o.Push(Commit(2)));
  REQUIRE(o.Push(Commit(3)));  // drops commit 1, which the sender holds
  CHECK_FALSE(o.Done(on_its_way));
  CHECK(o.size() == 2);
  CHECK(DrainAll(o) == std::vector<std::string>{"c2", "c3"});
}

TEST_CASE("outbox: a bound of zero is taken as one") {
  Outbox o(0);
  CHECK(o.max() == 1);
  CHECK_FALSE(o.Push(Commit(1)));
  CHECK(o.Push(Commit(2))->step == 1);
  CHECK(DrainAll(o) == std::vector<std::string>{"c2"});
}

}  // namespace
}  // namespace lk::agent
