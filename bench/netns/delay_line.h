// The pure core of lk_link_delay, the wide-area link emulator of bench/netns: which site a packet
// goes to and when it arrives there. Each site has an access link with a one-way propagation
// delay; a packet from site a to site b arrives delay(a) + delay(b) after it left a, so sites with
// delay RTT/4 see each other at an RTT of RTT and a hub site with delay 0 at RTT/2. The rate of a
// link is not modelled here: the kernel's token bucket (tc tbf) on each site's device does that,
// with a real queue and real back-pressure to TCP.
//
// It exists because the machines this runs on have kernels without sch_netem (tc netem delay),
// while a delay is what makes a shaped link a wide-area one: TCP's window, slow start and the
// ring's round trips all scale with it.
//
// Thread-safety: none; the shell calls it from its one event loop.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <lightkeeper/status.h>

namespace lk::netns {

using Micros = std::chrono::microseconds;

struct SiteSpec {
  std::string device;  // the TUN device of the site, e.g. "lkd0"
  uint32_t ipv4 = 0;   // the site's address, host order
  Micros delay{0};     // one-way propagation delay of the site's access link
};

// Parses "DEVICE,A.B.C.D,DELAY_US" (e.g. "lkd0,10.78.0.10,7500").
Result<SiteSpec> ParseSiteSpec(const std::string& text);

// Counts of what crossed between two sites (including IP headers; GSO packets count once).
struct PairCounters {
  uint64_t packets = 0;
  uint64_t bytes = 0;
};

struct Packet {
  Micros due{0};     // when it reaches its destination (the shell's monotonic clock)
  uint64_t seq = 0;  // arrival order, to keep FIFO order among equal due times
  size_t to = 0;     // destination site index
  std::vector<uint8_t> data;
};

class DelayLine {
 public:
  // Sites with distinct devices and addresses; at least two.
  static Result<DelayLine> Create(std::vector<SiteSpec> sites, size_t queued_bytes_max);

  const std::vector<SiteSpec>& sites() const { return sites_; }
  // The site that owns `ipv4` (host order), if any.
  std::optional<size_t> SiteOf(uint32_t ipv4) const;

  // A packet read from site `from` at `now`, headed for `dst` (its IPv4 destination). Returns
  // false (and counts a drop) when the destination is unknown, is the sender, or the line
  // already holds queued_bytes_max.
  bool Push(size_t from, uint32_t dst, Micros now, std::vector<uint8_t> data);
  // The earliest due time of a queued packet, if any.
  std::optional<Micros> NextDue() const;
  // Removes and returns the next packet due at or before `now`.
  std::optional<Packet> PopDue(Micros now);

  const PairCounters& counters(size_t from, size_t to) const {
    return counters_[from * sites_.size() + to];
  }
  uint64_t drops() const { return drops_; }
  size_t queued_bytes() const { return queued_bytes_; }

 private:
  struct Later {
    bool operator()(const Packet& a, const Packet& b) const {
      return a.due != b.due ? a.due > b.due : a.seq > b.seq;
    }
  };
  DelayLine(std::vector<SiteSpec> sites, size_t queued_bytes_max);

  std::vector<SiteSpec> sites_;
  size_t queued_bytes_max_;
  std::vector<PairCounters> counters_;
  std::vector<Packet> heap_;  // a min-heap by (due, seq) under Later
  size_t queued_bytes_ = 0;
  uint64_t seq_ = 0;
  uint64_t drops_ = 0;
};

}  // namespace lk::netns
