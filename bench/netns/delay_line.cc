#include "bench/netns/delay_line.h"

#include <arpa/inet.h>

#include <algorithm>
#include <set>

namespace lk::netns {

Result<SiteSpec> ParseSiteSpec(const std::string& text) {
  size_t a = text.find(',');
  size_t b = a == std::string::npos ? a : text.find(',', a + 1);
  if (b == std::string::npos) return InvalidArgument("site {} is not DEVICE,IPV4,DELAY_US", text);
  SiteSpec s;
  s.device = text.substr(0, a);
  if (s.device.empty() || s.device.size() > 15) {
    return InvalidArgument("site {}: the device name must have 1-15 characters", text);
  }
  std::string ip = text.substr(a + 1, b - a - 1);
  in_addr addr{};
  if (inet_pton(AF_INET, ip.c_str(), &addr) != 1) {
    return InvalidArgument("site {}: {} is not an IPv4 address", text, ip);
  }
  s.ipv4 = ntohl(addr.s_addr);
  std::string us = text.substr(b + 1);
  if (us.empty() || us.size() > 9 || us.find_first_not_of("0123456789") != std::string::npos) {
    return InvalidArgument("site {}: the delay must be 0-999999999 microseconds", text);
  }
  s.delay = Micros(std::stoll(us));
  return s;
}

Result<DelayLine> DelayLine::Create(std::vector<SiteSpec> sites, size_t queued_bytes_max) {
  if (sites.size() < 2) return InvalidArgument("at least two sites are needed");
  std::set<std::string> devices;
  std::set<uint32_t> addresses;
  for (const SiteSpec& s : sites) {
    if (!devices.insert(s.device).second) return InvalidArgument("device {} twice", s.device);
    if (!addresses.insert(s.ipv4).second) {
      return InvalidArgument("address of {} used twice", s.device);
    }
  }
  if (queued_bytes_max == 0) return InvalidArgument("queued_bytes_max must be positive");
  return DelayLine(std::move(sites), queued_bytes_max);
}

DelayLine::DelayLine(std::vector<SiteSpec> sites, size_t queued_bytes_max)
    : sites_(std::move(sites)),
      queued_bytes_max_(queued_bytes_max),
      counters_(sites_.size() * sites_.size()) {}

std::optional<size_t> DelayLine::SiteOf(uint32_t ipv4) const {
  for (size_t i = 0; i < sites_.size(); ++i) {
    if (sites_[i].ipv4 == ipv4) return i;
  }
  return std::nullopt;
}

bool DelayLine::Push(size_t from, uint32_t dst, Micros now, std::vector<uint8_t> data) {
  std::optional<size_t> to = SiteOf(dst);
  if (!to || *to == from || queued_bytes_ + data.size() > queued_bytes_max_) {
    ++drops_;
    return false;
  }
  PairCounters& c = counters_[from * sites_.size() + *to];
  ++c.packets;
  c.bytes += data.size();
  queued_bytes_ += data.size();
  Packet p{now + sites_[from].delay + sites_[*to].delay, seq_++, *to, std::move(data)};
  heap_.push_back(std::move(p));
  std::push_heap(heap_.begin(), heap_.end(), Later{});
  return true;
}

std::optional<Micros> DelayLine::NextDue() const {
  if (heap_.empty()) return std::nullopt;
  return heap_.front().due;
}

std::optional<Packet> DelayLine::PopDue(Micros now) {
  if (heap_.empty() || heap_.front().due > now) return std::nullopt;
  std::pop_heap(heap_.begin(), heap_.end(), Later{});
  Packet p = std::move(heap_.back());
  heap_.pop_back();
  queued_bytes_ -= p.data.size();
  return p;
}

}  // namespace lk::netns
