#include "bench/netns/delay_line.h"

#include <doctest/doctest.h>

namespace lk::netns {
namespace {

uint32_t Ip(uint32_t last) { return (10u << 24) | (78u << 16) | last; }

DelayLine Line() {
  auto line = DelayLine::Create(
      {{"hub", Ip(1), Micros(0)}, {"s0", Ip(10), Micros(7500)}, {"s1", Ip(11), Micros(2500)}}, 100);
  REQUIRE(line.ok());
  return std::move(*line);
}

TEST_CASE("a packet between sites arrives after both sites' delays, to the right device") {
  DelayLine line = Line();
  REQUIRE(line.Push(1, Ip(11), Micros(1000), {1, 2, 3}));
  CHECK(line.NextDue() == Micros(1000 + 7500 + 2500));
  CHECK_FALSE(line.PopDue(Micros(10'999)).has_value());
  auto p = line.PopDue(Micros(11'000));
  REQUIRE(p.has_value());
  CHECK(p->to == 2);
  CHECK(p->data == std::vector<uint8_t>{1, 2, 3});
  CHECK(line.counters(1, 2).bytes == 3);
  CHECK(line.counters(1, 2).packets == 1);
  CHECK(line.counters(2, 1).bytes == 0);
  CHECK(line.queued_bytes() == 0);
}

TEST_CASE("packets leave in due order, and in arrival order when due together") {
  DelayLine line = Line();
  REQUIRE(line.Push(1, Ip(11), Micros(0), {1}));  // due 10000
  REQUIRE(line.Push(0, Ip(11), Micros(0), {2}));  // due 2500: the hub is closer
  REQUIRE(line.Push(0, Ip(11), Micros(0), {3}));  // due 2500, after {2}
  std::vector<uint8_t> order;
  while (auto p = line.PopDue(Micros(20'000))) order.push_back(p->data[0]);
  CHECK(order == std::vector<uint8_t>{2, 3, 1});
}

TEST_CASE("unknown destinations, packets to the sender and a full line are dropped and counted") {
  DelayLine line = Line();
  CHECK_FALSE(line.Push(1, Ip(99), Micros(0), {1}));
  CHECK_FALSE(line.Push(1, Ip(10), Micros(0), {1}));
  CHECK(line.Push(1, Ip(1), Micros(0), std::vector<uint8_t>(100)));
  CHECK_FALSE(line.Push(1, Ip(1), Micros(0), {1}));  // 101 bytes would pass the bound of 100
  CHECK(line.drops() == 3);
  CHECK(line.counters(1, 0).bytes == 100);
}

TEST_CASE("site specs parse, and bad ones are refused with the reason") {
  auto s = ParseSiteSpec("lkd0,10.78.0.10,7500");
  REQUIRE(s.ok());
  CHECK(s->device == "lkd0");
  CHECK(s->ipv4 == Ip(10));
  CHECK(s->delay == Micros(7500));
  CHECK_FALSE(ParseSiteSpec("lkd0,10.78.0.10").ok());
  CHECK_FALSE(ParseSiteSpec("lkd0,10.78.0.300,1").ok());
  CHECK_FALSE(ParseSiteSpec("lkd0,10.78.0.1,-5").ok());
  CHECK_FALSE(ParseSiteSpec("a-device-name-too-long,10.78.0.1,5").ok());
  CHECK_FALSE(DelayLine::Create({{"a", Ip(1), Micros(0)}, {"a", Ip(2), Micros(0)}}, 1).ok());
  CHECK_FALSE(DelayLine::Create({{"a", Ip(1), Micros(0)}, {"b", Ip(1), Micros(0)}}, 1).ok());
  CHECK_FALSE(DelayLine::Create({{"a", Ip(1), Micros(0)}}, 1).ok());
}

}  // namespace
}  // namespace lk::netns
