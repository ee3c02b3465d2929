"""Shaped wide-area links between network namespaces, for bench/netns/shaped_links.py.

One namespace per site (a replica group's agent and trainers) and one hub namespace (the
lighthouse, and lk_link_delay, the user-space router that adds the propagation delay). Each site
reaches every other through its own TUN device, whose outgoing traffic the kernel's token bucket
(tc tbf) limits to the link's rate; lk_link_delay holds every packet for delay(from) + delay(to)
before it hands it to the destination's device. Sites get a one-way delay of RTT/4 each, so two
sites see each other at the profile's RTT and the lighthouse (delay 0) at RTT/2.

The kernels of the machines this runs on lack sch_netem, which is why the delay is not
`tc netem delay`; see bench/netns.md.
"""

import json
import os
import signal
import subprocess
import time

HUB_IP = "10.78.0.1"


def site_ip(i):
    return f"10.78.0.{10 + i}"


def sh(*argv, check=True):
    r = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def parse_rate_bits(text):
    """'1gbit' -> 1e9, '500mbit' -> 5e8 (tc's units, decimal)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for u, scale in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * scale
    raise ValueError(f"rate {text!r} must end in gbit, mbit or kbit")


class Links:
    """The namespaces, devices and shaping of one link profile; a context manager that removes
    all of it on exit, whatever happened inside."""

    def __init__(self, tag, sites, rate, rtt_ms, build, workdir, tcp_mem_max_mib=64,
                 site_sysctl=()):
        self.tag, self.sites, self.rate, self.rtt_ms = tag, sites, rate, rtt_ms
        self.tcp_mem_max_mib, self.site_sysctl = tcp_mem_max_mib, list(site_sysctl)
        self.build, self.workdir = build, workdir
        self.hub = f"{tag}-hub"
        self.site_ns = [f"{tag}-s{i}" for i in range(sites)]
        self.router = None
        self.counters_path = os.path.join(workdir, "link-counters.json")

    def namespaces(self):
        return [self.hub] + self.site_ns

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc):
        self.down()
        return False

    def _up(self):
        for ns in self.namespaces():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        one_way_us = int(self.rtt_ms * 1000 / 4)
        specs = [f"lkdhub,{HUB_IP},0"] + [
            f"lkd{i},{site_ip(i)},{one_way_us}" for i in range(self.sites)]
        log = open(os.path.join(self.workdir, "link-delay.log"), "w")
        # The emulator runs at nice -10: on a machine whose CPUs other work keeps busy, a router
        # that waits for its turn holds packets longer than the profile's delay (RTTs of 100 ms
        # on a 30 ms link were seen at load 12), which is no property of the link. It only
        # uses CPU while packets flow (a fifth of one at 1 Gbit/s).
        self.router = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, "nice", "-n", "-10",
             os.path.join(self.build, "bin", "lk_link_delay"),
             "--counters", self.counters_path] + specs,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 10
        while "link_delay_ready" not in open(log.name).read():
            if self.router.poll() is not None or time.time() > deadline:
                raise RuntimeError("lk_link_delay did not start: " + open(log.name).read())
            time.sleep(0.05)
        rate_bits = parse_rate_bits(self.rate)
        # The bucket holds about a millisecond at the rate (at least two 64 KiB segments, which
        # TSO hands over whole); a packet may wait up to 20 ms in the queue, a switch port's
        # buffer, before it is dropped.
        burst = max(128 << 10, int(rate_bits / 8 / 1000))
        for dev, ns, ip in [("lkdhub", self.hub, HUB_IP)] + [
                (f"lkd{i}", self.site_ns[i], site_ip(i)) for i in range(self.sites)]:
            if ns != self.hub:
                sh("ip", "-n", self.hub, "link", "set", dev, "netns", ns)
            sh("ip", "netns", "exec", ns, "sysctl", "-q", f"net.ipv6.conf.{dev}.disable_ipv6=1")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            if ns != self.hub and self.tcp_mem_max_mib:
                # TCP's buffers may grow to more than a path's bandwidth-delay product (3.75 MB
                # at 1 Gbit/s and 30 ms), as on a host tuned for wide-area transfers; the
                # kernel's default maximum send buffer (4 MiB) holds one stream below the rate.
                # These settings are the namespace's own.
                top = self.tcp_mem_max_mib << 20
                sh("ip", "netns", "exec", ns, "sysctl", "-q",
                   f"net.ipv4.tcp_wmem=4096 16384 {top}", f"net.ipv4.tcp_rmem=4096 131072 {top}")
            if ns != self.hub and self.site_sysctl:
                sh("ip", "netns", "exec", ns, "sysctl", "-q", *self.site_sysctl)
            if ns != self.hub:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", self.rate, "burst", str(burst), "latency", "20ms")

    def down(self):
        """Stops every process left in the namespaces, then removes them (the TUN devices go
        with lk_link_delay)."""
        for ns in self.namespaces():
            pids = sh("ip", "netns", "pids", ns, check=False).split()
            for p in pids:
                if self.router is not None and p == str(self.router.pid):
                    continue  # stopped below, so that it writes its last counters
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(5)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        for ns in self.namespaces():
            sh("ip", "netns", "del", ns, check=False)

    def counters(self):
        """{(from_device, to_device): bytes} as lk_link_delay last wrote them (every 100 ms)."""
        time.sleep(0.25)  # the next rewrite of the file covers everything sent until now
        with open(self.counters_path) as f:
            c = json.load(f)
        return {(p["from"], p["to"]): p["bytes"] for p in c["pairs"]}, c

    def router_cpu_s(self):
        """CPU seconds (user + system) lk_link_delay has used so far."""
        fields = open(f"/proc/{self.router.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def exec(self, site, argv):
        """argv run inside site `site`'s namespace ('hub' for the hub)."""
        ns = self.hub if site == "hub" else self.site_ns[site]
        return ["ip", "netns", "exec", ns] + list(argv)
