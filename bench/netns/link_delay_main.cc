// lk_link_delay: the propagation delay of bench/netns's shaped links, as a router in user space.
// It opens one TUN device per site (the script then moves each into its site's network
// namespace), reads every packet a site sends, and writes it into the destination site's device
// once delay(from) + delay(to) has passed (DelayLine). The kernel here has no sch_netem, so
// `tc netem delay` is not available; the rate of each link is the kernel's token bucket (tc tbf)
// on the site's device, set by the script.
//
// The devices carry virtio-net headers with TSO on, so the kernel hands over whole TCP segments
// of up to 64 KiB (and takes them back the same way): at 10 Gbit/s that is about 20,000 packets
// a second instead of 800,000, which two shared CPUs can move.
//
//   lk_link_delay [--counters FILE] [--queued-mib N] DEVICE,IPV4,DELAY_US ...
//
// Runs until SIGTERM or SIGINT; writes the per-pair byte counts to --counters (JSON, replaced
// atomically) every 100 ms and at exit. Thread-safety: one thread, one event loop.
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/netns/delay_line.h"
#include "common/flags.h"
#include "common/log.h"

namespace lk::netns {
namespace {

using SteadyClock = std::chrono::steady_clock;
// struct virtio_net_hdr, which the kernel puts before every packet with IFF_VNET_HDR (its
// header, linux/virtio_net.h, does not compile as C++).
constexpr size_t kVnetHeaderBytes = 10;
constexpr size_t kPacketBytesMax = kVnetHeaderBytes + 65536 + 256;

Micros Now() { return std::chrono::duration_cast<Micros>(SteadyClock::now().time_since_epoch()); }

Result<int> OpenTun(const std::string& device) {
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Error(Code::kUnavailable, "open /dev/net/tun: {}", std::strerror(errno));
  ifreq ifr{};
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR;
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", device.c_str());
  if (ioctl(fd, TUNSETIFF, &ifr) < 0) {
    int e = errno;
    close(fd);
    return Error(Code::kUnavailable, "TUNSETIFF {}: {}", device, std::strerror(e));
  }
  // Checksum offload and TSO: the kernel may hand us (and take from us) unsegmented TCP.
  unsigned offload = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
  if (ioctl(fd, TUNSETOFFLOAD, offload) < 0) {
    int e = errno;
    close(fd);
    return Error(Code::kUnavailable, "TUNSETOFFLOAD {}: {}", device, std::strerror(e));
  }
  return fd;
}

struct Stats {
  uint64_t ignored = 0;       // not IPv4 (the script turns IPv6 off; anything else is noise)
  uint64_t write_errors = 0;  // the destination device refused the packet
};

void WriteCounters(const std::string& path, const DelayLine& line, const Stats& stats) {
  if (path.empty()) return;
  std::string out = fmt::format("{{\"drops\":{},\"ignored\":{},\"write_errors\":{},\"pairs\":[",
                                line.drops(), stats.ignored, stats.write_errors);
  const auto& sites = line.sites();
  bool first = true;
  for (size_t a = 0; a < sites.size(); ++a) {
    for (size_t b = 0; b < sites.size(); ++b) {
      if (a == b) continue;
      const PairCounters& c = line.counters(a, b);
      out += fmt::format("{}{{\"from\":\"{}\",\"to\":\"{}\",\"packets\":{},\"bytes\":{}}}",
                         first ? "" : ",", sites[a].device, sites[b].device, c.packets, c.bytes);
      first = false;
    }
  }
  out += "]}\n";
  std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return;
  std::fputs(out.c_str(), f);
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());
}

// Reads every packet `site` has ready and queues it.
void Drain(int fd, size_t site, DelayLine* line, Stats* stats) {
  std::vector<uint8_t> buf(kPacketBytesMax);
  for (;;) {
    ssize_t n = read(fd, buf.data(), buf.size());
    if (n < 0) return;  // EAGAIN: nothing more; any other error: the device is gone
    const uint8_t* ip = buf.data() + kVnetHeaderBytes;
    if (static_cast<size_t>(n) < kVnetHeaderBytes + 20 || (ip[0] >> 4) != 4) {
      ++stats->ignored;
      continue;
    }
    uint32_t dst = (uint32_t{ip[16]} << 24) | (uint32_t{ip[17]} << 16) | (uint32_t{ip[18]} << 8) |
                   uint32_t{ip[19]};
    line->Push(site, dst, Now(), std::vector<uint8_t>(buf.begin(), buf.begin() + n));
  }
}

void ArmTimer(int timer_fd, const DelayLine& line) {
  itimerspec spec{};
  if (std::optional<Micros> due = line.NextDue()) {
    // A zero it_value disarms the timer, so a packet due at 0 is rounded up to 1 ns.
    int64_t ns = std::max<int64_t>(1, due->count() * 1000);
    spec.it_value.tv_sec = ns / 1'000'000'000;
    spec.it_value.tv_nsec = ns % 1'000'000'000;
  }
  timerfd_settime(timer_fd, TFD_TIMER_ABSTIME, &spec, nullptr);
}

int Run(DelayLine line, const std::vector<int>& fds, const std::string& counters_path) {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigprocmask(SIG_BLOCK, &mask, nullptr);
  int sig_fd = signalfd(-1, &mask, SFD_CLOEXEC);
  int timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  int ep = epoll_create1(EPOLL_CLOEXEC);
  if (sig_fd < 0 || timer_fd < 0 || ep < 0) {
    LK_LOG_ERROR("link_delay_failed reason={}", Q(std::strerror(errno)));
    return 1;
  }
  auto watch = [ep](int fd, uint64_t tag) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
    return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  };
  const uint64_t kSignal = fds.size(), kTimer = fds.size() + 1;
  for (size_t i = 0; i < fds.size(); ++i) watch(fds[i], i);
  watch(sig_fd, kSignal);
  watch(timer_fd, kTimer);
  Stats stats;
  Micros last_written{0};
  for (;;) {
    epoll_event events[16];
    int n = epoll_wait(ep, events, 16, 100);
    for (int i = 0; i < n; ++i) {
      uint64_t tag = events[i].data.u64;
      if (tag == kSignal) {
        WriteCounters(counters_path, line, stats);
        LK_LOG_INFO("link_delay_stop drops={} ignored={} write_errors={}", line.drops(),
                    stats.ignored, stats.write_errors);
        return 0;
      }
      if (tag == kTimer) {
        uint64_t expirations;
        (void)!read(timer_fd, &expirations, sizeof(expirations));
      } else {
        Drain(fds[tag], tag, &line, &stats);
      }
    }
    Micros now = Now();
    while (std::optional<Packet> p = line.PopDue(now)) {
      if (write(fds[p->to], p->data.data(), p->data.size()) < 0) ++stats.write_errors;
    }
    ArmTimer(timer_fd, line);
    if (now - last_written >= Micros(100'000)) {
      WriteCounters(counters_path, line, stats);
      last_written = now;
    }
  }
}

int Main(int argc, char** argv) {
  std::string counters_path;
  uint32_t queued_mib = 512;
  Flags flags("lk_link_delay",
              "Delays every packet between sites by delay(from) + delay(to): one TUN device per\n"
              "site (DEVICE,IPV4,DELAY_US positional arguments), created in this namespace and\n"
              "moved by the caller into the site's. Runs until SIGTERM.");
  flags.Add("counters", &counters_path, "JSON file of per-pair packet and byte counts");
  flags.Add("queued-mib", &queued_mib, "packets held at once at most; beyond it they are dropped");
  Status st = flags.Parse(argc, argv);
  if (flags.help_requested()) {
    std::fputs(flags.Help().c_str(), stdout);
    return 0;
  }
  std::vector<SiteSpec> sites;
  for (const std::string& arg : flags.positional()) {
    if (!st.ok()) break;
    Result<SiteSpec> s = ParseSiteSpec(arg);
    if (!s.ok())
      st = s.status();
    else
      sites.push_back(*s);
  }
  Result<DelayLine> line = st.ok() ? DelayLine::Create(sites, size_t{queued_mib} << 20) : st;
  if (!line.ok()) {
    std::fprintf(stderr, "lk_link_delay: %s\n", line.status().message().c_str());
    return 2;
  }
  SetLogPrefix("role=link_delay");
  std::vector<int> fds;
  for (const SiteSpec& s : sites) {
    Result<int> fd = OpenTun(s.device);
    if (!fd.ok()) {
      LK_LOG_ERROR("link_delay_failed reason={}", Q(fd.status().message()));
      return 1;
    }
    fds.push_back(*fd);
  }
  LK_LOG_INFO("link_delay_ready {}", flags.Effective());
  return Run(std::move(*line), fds, counters_path);
}

}  // namespace
}  // namespace lk::netns

int main(int argc, char** argv) { return lk::netns::Main(argc, argv); }
