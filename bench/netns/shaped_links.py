#!/usr/bin/python3
"""DiLoCo on shaped wide-area links between network namespaces, beside its yardsticks.

For each link profile (rate and round trip between sites), in one run with the same namespaces:

  1. the link's own round trip (TCP connects between two sites) and capacity (iperf3, one
     stream, site 0 to site 1);
  2. plain data parallelism's traffic: comm_test_peer in two sites allreduces a float32 buffer of
     the model's size H times (one allreduce of the gradient per inner step), timed, with the
     bytes the link carried;
  3. for each setting (a name and extra trainer flags): a DiLoCo job, one group per site, and
     the same trainers with no cross-group communication (each group a job of its own, all at
     the same time, so the CPUs are as busy), their --log lines and the link's byte counters.

Prints a Markdown report and writes every figure to --out/results.json. Root only.
Usage: see bench/netns.md, or --help.
"""

import argparse
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from links import HUB_IP, Links, site_ip  # noqa: E402
from report import report, smoke_checks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_settings(path):
    """NAME FLAGS... per line; '#' starts a comment."""
    out = []
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, flags = line.partition(" ")
            out.append((name, shlex.split(flags)))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default=os.path.join(ROOT, "build"), help="build directory")
    p.add_argument("--out", default="", help="directory for logs and results.json (default: a "
                   "new lk-shaped-* directory under $TMPDIR)")
    p.add_argument("--tag", default=f"lk{os.getpid()}", help="namespace name prefix")
    p.add_argument("--profile", action="append", default=[],
                   help="NAME=RATE,RTT_MS, e.g. 1g30=1gbit,30 (repeatable; default 1g30 and "
                        "10g10)")
    p.add_argument("--setting", action="append", default=[],
                   help="NAME=TRAINER-FLAGS, e.g. 'int8=--outer-compress int8' (repeatable; "
                        "default: the lines of bench/netns/settings)")
    p.add_argument("--settings-file", default=os.path.join(ROOT, "bench", "netns", "settings"))
    p.add_argument("--groups", type=int, default=2, help="sites, one replica group each")
    p.add_argument("--group-size", type=int, default=1, help="trainers per group")
    p.add_argument("--inner-steps", type=int, default=8)
    p.add_argument("--outer-steps", type=int, default=10)
    p.add_argument("--model", default="--model-width 256 --layers 4 --heads 4 --seq-len 16 "
                   "--batch 2", help="model flags of the trainers (the default: 3.2 M "
                   "parameters, 12.7 MB of float32, 0.1 s on the wire at 1 Gbit/s)")
    p.add_argument("--trainer", choices=["cpp", "python"], default="cpp")
    p.add_argument("--iperf-seconds", type=int, default=5)
    p.add_argument("--tcp-mem-max-mib", type=int, default=64,
                   help="largest TCP send and receive buffer in the site namespaces "
                        "(net.ipv4.tcp_wmem/tcp_rmem there); 0: the kernel's defaults")
    p.add_argument("--site-sysctl", action="append", default=[],
                   help="KEY=VALUE set in every site namespace (repeatable; only network "
                        "settings are per namespace), e.g. net.ipv4.tcp_slow_start_after_idle=0")
    p.add_argument("--rounds", type=int, default=1,
                   help="DiLoCo and compute-alone runs per setting, alternating which goes first")
    p.add_argument("--no-alone", action="store_true", help="skip the compute-alone runs")
    p.add_argument("--busy-alone", action="store_true",
                   help="also run compute alone while iperf3 carries the DiLoCo run's exchange "
                        "rate each way between sites 0 and 1 (the machine's cost of moving the "
                        "bytes, for overlapped outer steps)")
    p.add_argument("--smoke", action="store_true",
                   help="a short run that checks what a test can: the job committed every step "
                        "across the shaped link with equal replicas, the link carried the "
                        "cross-group bytes, its RTT is at least the profile's, each site reads "
                        "the other's agent status with the token (and is refused without); "
                        "exits 1 otherwise (never checks a speed)")
    p.add_argument("--job-timeout-s", type=int, default=600)
    return p.parse_args(argv)


class Procs:
    """Every process a run starts, stopped (SIGKILL) on the way out whatever happened."""

    def __init__(self):
        self.procs = []

    def start(self, argv, log_path, env=None):
        log = open(log_path, "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        p.log_path = log_path
        self.procs.append(p)
        return p

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def wait_for_line(path, needle, proc, timeout_s=20):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = open(path).read()
        for line in text.splitlines():
            if needle in line:
                return line
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"no '{needle}' in {path}: {open(path).read()[-2000:]}")


def field(line, key):
    for part in line.split():
        if part.startswith(key + "="):
            return part[len(key) + 1:]
    raise KeyError(key)


def rtt_probe(links, rounds=5):
    """Round trips site 0 -> site 1, each a TCP connect (SYN, SYN-ACK), in milliseconds."""
    server = subprocess.Popen(links.exec(1, [sys.executable, "-c", (
        "import socket,sys\n"
        f"s=socket.socket(); s.bind(('{site_ip(1)}', 0)); s.listen(16)\n"
        "print(s.getsockname()[1], flush=True)\n"
        "while True: s.accept()[0].close()\n")]), stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        out = subprocess.run(links.exec(0, [sys.executable, "-c", (
            "import socket,time\n"
            f"for _ in range({rounds}):\n"
            "    t=time.perf_counter()\n"
            f"    c=socket.create_connection(('{site_ip(1)}', {port}))\n"
            "    print((time.perf_counter()-t)*1000, flush=True); c.close()\n")]),
            stdout=subprocess.PIPE, text=True, check=True, timeout=60).stdout
        return [float(x) for x in out.split()]
    finally:
        server.kill()
        server.wait()


def iperf(links, seconds, out):
    server = subprocess.Popen(links.exec(1, ["iperf3", "-s", "-1", "-B", site_ip(1), "-p", "5201"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        # -O 1: the first second (slow start) is left out of the figure, as usual for a
        # capacity measurement.
        r = subprocess.run(links.exec(0, ["iperf3", "-c", site_ip(1), "-p", "5201", "-t",
                                          str(seconds), "-O", "1", "-J"]),
                           stdout=subprocess.PIPE, text=True, timeout=seconds + 61)
        open(os.path.join(out, "iperf3.json"), "w").write(r.stdout)
        j = json.loads(r.stdout)
        return j["end"]["sum_received"]["bits_per_second"] / 8
    finally:
        server.kill()
        server.wait()


def dp_yardstick(links, build, params, inner_steps, out, procs):
    """One float32 allreduce of `params` elements per inner step over the same links, one member
    per site (as the cross-group slot communicator has): the time and the link bytes site 0 -> 1
    of H of them, after one warm-up round, which builds the connections and opens TCP's
    window."""
    n = links.sites
    store = os.path.join(out, "dp-store")
    os.makedirs(store, exist_ok=True)
    peers = []
    for i in range(n):
        p = subprocess.Popen(links.exec(i, [os.path.join(build, "bin", "comm_test_peer"),
                                            "--store", "file:" + store, "--bind", site_ip(i),
                                            "--op-timeout-ms", "300000"]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=open(os.path.join(out, f"dp-peer{i}.log"), "w"), text=True)
        procs.procs.append(p)
        peers.append(p)

    def each(cmds):
        for p, c in zip(peers, cmds):
            p.stdin.write(c + "\n")
            p.stdin.flush()
        answers = [p.stdout.readline().strip() for p in peers]
        for a in answers:
            if not a.startswith("ok"):
                raise RuntimeError(f"comm_test_peer: {a}")
        return answers

    for p in peers:
        if p.stdout.readline().strip() != "ok ready":
            raise RuntimeError("comm_test_peer did not start")
    each([f"reconfigure 1 {i} {n}" for i in range(n)])
    each([f"bench {params} 1"] * n)
    before, _ = links.counters()
    answers = each([f"bench {params} {inner_steps}"] * n)
    after, _ = links.counters()
    for p in peers:
        p.stdin.write("exit\n")
        p.stdin.flush()
        p.wait(30)
    us = max(int(field(a, "us")) for a in answers)
    sent = after[("lkd0", "lkd1")] - before[("lkd0", "lkd1")]
    return {"allreduce_ms": us / 1000 / inner_steps, "h_allreduces_ms": us / 1000,
            "link_bytes_per_outer_step": sent}


def trainer_argv(args, group, rank, setting_flags, log_path):
    # No --ckpt-dir: the final durable save (after the last commit, so in no figure) would write
    # the weights and AdamW's state of every group of every run, hundreds of MB a run.
    common = ["--group-rank", str(rank), "--group-size", str(args.group_size),
              "--inner-steps", str(args.inner_steps), "--outer-steps", str(args.outer_steps),
              "--seed", "1", "--bind-host", site_ip(group), "--log", log_path,
              "--op-timeout-ms", "300000"]
    common += shlex.split(args.model) + list(setting_flags)
    if args.trainer == "cpp":
        return [os.path.join(args.build, "bin", "diloco_trainer")] + common
    return [sys.executable, os.path.join(ROOT, "examples", "python", "diloco_trainer.py")] + common


def run_job(args, links, out, name, setting_flags, alone, procs, busy_bytes_per_s=0):
    """A DiLoCo job, one group per site; alone: every group a job of its own (no cross-group
    communication), all running at once. busy_bytes_per_s: meanwhile iperf3 carries this many
    bytes per second each way between sites 0 and 1 (the compute-alone run with the link and
    the machine as busy as the exchange keeps them). Returns the trainers' log rows and the
    link bytes."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    jobs = [f"alone{g}" for g in range(args.groups)] if alone else ["shaped"] * args.groups
    token = secrets.token_hex(16)
    token_file = os.path.join(d, "tokens")
    with open(token_file, "w") as f:
        f.write("".join(f"{j} {token}\n" for j in sorted(set(jobs))))
    os.chmod(token_file, 0o600)
    job_token = os.path.join(d, "job-token")
    with open(job_token, "w") as f:
        f.write(token + "\n")
    os.chmod(job_token, 0o600)
    lh = procs.start(links.exec("hub", [
        os.path.join(args.build, "bin", "lighthouse"), "--bind", f"{HUB_IP}:0",
        "--data-dir", os.path.join(d, "lh"), "--token-file", token_file,
        "--min-replicas", "1" if alone else str(args.groups), "--join-timeout-ms", "2000"]),
        os.path.join(d, "lighthouse.log"))
    lh_addr = field(wait_for_line(lh.log_path, "listening address=", lh), "address")
    agents, trainers = [], []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(args.build, "python")
    for g in range(args.groups):
        sock = os.path.join(d, f"g{g}.sock")
        agents.append(procs.start(links.exec(g, [
            os.path.join(args.build, "bin", "replica_agent"), "--lighthouse", f"http://{lh_addr}",
            "--job", jobs[g], "--group-id", f"g{g}", "--socket", sock, "--token-file", job_token,
            "--serve", f"{site_ip(g)}:0", "--heartbeat-interval-ms", "200"]),
            os.path.join(d, f"agent-g{g}.log")))
    serve = []
    for g, a in enumerate(agents):
        serve.append(field(wait_for_line(a.log_path, "agent_listening", a), "serve"))
    # Checked before the trainers start: the agents leave once their trainers are done.
    reach = agents_reach_each_other(links, serve, token) if not alone else None
    before, _ = links.counters()
    if busy_bytes_per_s > 0:
        procs.start(links.exec(1, ["iperf3", "-s", "-B", site_ip(1), "-p", "5202"]),
                    os.path.join(d, "iperf3-server.log"))
        time.sleep(0.3)
        procs.start(links.exec(0, ["iperf3", "-c", site_ip(1), "-p", "5202", "--bidir",
                                   "-b", str(int(busy_bytes_per_s * 8)), "-t", "3600"]),
                    os.path.join(d, "iperf3-client.log"))
    sampler_path = os.path.join(d, "link-site0-50ms.txt")
    if not alone:
        procs.start(links.exec(0, ["/usr/bin/python3", "-c", LINK_SAMPLER, sampler_path]),
                    os.path.join(d, "link-sampler.log"))
    t0 = time.time()
    for g in range(args.groups):
        for r in range(args.group_size):
            e = dict(env, LK_AGENT_SOCKET=os.path.join(d, f"g{g}.sock"), LK_GROUP_ID=f"g{g}")
            trainers.append(procs.start(
                links.exec(g, trainer_argv(args, g, r, setting_flags,
                                           os.path.join(d, f"trainer-g{g}-{r}.jsonl"))),
                os.path.join(d, f"trainer-g{g}-{r}.log"), env=e))
    failed = []
    for t in trainers:
        try:
            rc = t.wait(max(1, args.job_timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            failed.append((t.log_path, rc))
    wall_s = time.time() - t0
    mono_end, wall_end = time.monotonic(), time.time()
    after, raw = links.counters()
    procs.stop_all()
    if failed:
        raise RuntimeError(f"{name}: trainers failed: {failed}; logs in {d}")
    rows = {}
    for g in range(args.groups):
        for r in range(args.group_size):
            with open(os.path.join(d, f"trainer-g{g}-{r}.jsonl")) as f:
                rows[(g, r)] = [json.loads(x) for x in f if x.strip()]
    cross = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"rows": rows, "link_bytes": cross, "wall_s": wall_s, "reach": reach,
            "drops": raw["drops"], "dir": d, "sampler": None if alone else sampler_path,
            "mono_end": mono_end, "wall_end": wall_end}


# Samples the bytes site 0 sends (every device but lo, /proc/net/dev of the namespace it runs
# in) every 50 ms until killed: "monotonic_s tx_bytes" per line, flushed each time.
LINK_SAMPLER = r"""
import sys, time
out = open(sys.argv[1], "w")
def tx():
    total = 0
    for line in open("/proc/net/dev").readlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() != "lo":
            total += int(rest.split()[8])
    return total
t = time.monotonic()
while True:
    out.write(f"{time.monotonic():.4f} {tx()}\n")
    out.flush()
    t += 0.05
    time.sleep(max(0.0, t - time.monotonic()))
"""


def link_rates(path, t_first, t_last):
    """The bytes per second site 0 sent in each 50 ms sample between two moments (monotonic
    seconds): its median and the busiest sample's."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                rows.append((float(parts[0]), int(parts[1])))
    rates = [(b1 - b0) / (t1 - t0) for (t0, b0), (t1, b1) in zip(rows, rows[1:])
             if t0 >= t_first and t1 <= t_last and t1 > t0]
    if not rates:
        return None
    return {"samples": len(rates), "median_Bps": statistics.median(rates), "peak_Bps": max(rates),
            "mean_Bps": sum(rates) / len(rates)}


AGENT_STATUS_PROBE = """
import sys, urllib.error, urllib.request
url, token = sys.argv[1], sys.argv[2]
def get(headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
# The job's token is let in, a request without it is refused: the route is reachable and guarded.
sys.exit(0 if (get({"Authorization": "Bearer " + token}), get({})) == (200, 401) else 1)
"""


def agents_reach_each_other(links, serve, token):
    """Whether each site reads the next site's agent status on its --serve address with the
    job's token (200) and is refused without it (401)."""
    ok = []
    for g in range(len(serve)):
        url = f"http://{serve[(g + 1) % len(serve)]}/v1/agent/status"
        r = subprocess.run(links.exec(g, [sys.executable, "-c", AGENT_STATUS_PROBE, url, token]),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ok.append(r.returncode == 0)
    return all(ok)


def summarize(job, groups):
    """Medians over the steady steps (not a trainer's first) of every trainer."""
    # With --outer-overlap the last line is the landing of the last exchange (Flush), with no
    # inner steps of its own: it is the run's tail, not a step.
    steady = [x for rows in job["rows"].values() for x in rows[1:] if x["inner_ms"] > 0]
    med = lambda k: statistics.median(x[k] for x in steady)  # noqa: E731
    s = {k: med(k) for k in ("step_ms", "inner_ms", "allreduce_ms", "cross_bytes", "poll_ms",
                             "commit_ms", "gather_ms", "join_ms")}
    # Per step, then the median: the difference of two medians is not a step's.
    s["outside_ms"] = statistics.median(x["step_ms"] - x["inner_ms"] for x in steady)
    s["step_per_inner"] = statistics.median(x["step_ms"] / x["inner_ms"] for x in steady)
    # How far apart the groups' inner steps ended: a blocking allreduce waits for the slowest.
    per_step = {}
    for rows in job["rows"].values():
        for x in rows[1:]:
            if x["inner_ms"] > 0:
                per_step.setdefault(x["step"], []).append(x["inner_ms"])
    s["inner_skew_ms"] = statistics.median(max(v) - min(v) for v in per_step.values())
    s["params"] = steady[0]["params"]
    s["steps"] = {f"g{g}-{r}": rows[-1]["step"] for (g, r), rows in job["rows"].items()}
    s["wall_s"] = job["wall_s"]
    s["link_bytes"] = {f"{a}->{b}": v for (a, b), v in sorted(job["link_bytes"].items()) if v}
    # Every group's trainer of rank r holds the same shard of the global weights after a step.
    by_step = {}
    for (g, r), rows in job["rows"].items():
        for x in rows:
            by_step.setdefault((r, x["step"]), set()).add(x["param_hash"])
    s["hashes_agree"] = all(len(h) == 1 for h in by_step.values())
    # The link's rate in 50 ms samples over the steady steps (from the end of the first step to
    # the end of the last one with inner steps): one burst per outer step, or a trickle. The
    # logs' `t_ms` is wall-clock milliseconds; the sampler's time is monotonic, so the window
    # is taken relative to the end of the run on both clocks.
    if job.get("sampler"):
        firsts = [rows[0]["t_ms"] / 1000.0 for rows in job["rows"].values() if rows]
        lasts = [x["t_ms"] / 1000.0 for rows in job["rows"].values() for x in rows
                 if x["inner_ms"] > 0]
        shift = job["mono_end"] - job["wall_end"]
        s["link_50ms"] = link_rates(job["sampler"], max(firsts) + shift, max(lasts) + shift)
    return s


def run_setting(args, links, out, sname, sflags, procs):
    """The DiLoCo run and its compute-alone run, --rounds times. Rounds alternate which of the
    two goes first, so that a load that drifts over the minutes falls on both alike; the
    report's table is round 0's, with every round's load-free ratio beside it."""
    entry, rounds = None, []
    for k in range(args.rounds):
        suffix = f"-{k}" if k else ""
        kinds = [False, True] if not args.no_alone and not args.smoke else [False]
        if k % 2:
            kinds.reverse()
        got = {}
        for alone in kinds:
            job = run_job(args, links, out, f"{sname}-{'alone' if alone else 'diloco'}{suffix}",
                          sflags, alone, procs)
            got[alone] = job
        d = summarize(got[False], args.groups)
        e = {"flags": sflags, "diloco": d, "reach": got[False]["reach"],
             "drops": got[False]["drops"]}
        if args.busy_alone and True in got:
            # The same bytes per second as the DiLoCo run's exchange moved, each way, for the
            # whole compute-alone run.
            rate = d["cross_bytes"] / (d["step_ms"] / 1000.0)
            busy = run_job(args, links, out, f"{sname}-busy{suffix}", sflags, True, procs,
                           busy_bytes_per_s=rate)
            e["busy"] = summarize(busy, args.groups)
            e["busy"]["bytes_per_s"] = rate
        if True in got:
            e["alone"] = summarize(got[True], args.groups)
            rounds.append({"step_per_inner_ratio":
                           d["step_per_inner"] / e["alone"]["step_per_inner"],
                           "step_ratio": d["step_ms"] / e["alone"]["step_ms"]})
            if "busy" in e:
                rounds[-1]["busy_step_ratio"] = d["step_ms"] / e["busy"]["step_ms"]
                rounds[-1]["busy_inner_ms"] = e["busy"]["inner_ms"]
                rounds[-1]["alone_step_ms"] = e["alone"]["step_ms"]
                rounds[-1]["busy_step_ms"] = e["busy"]["step_ms"]
                rounds[-1]["diloco_step_ms"] = d["step_ms"]
        entry = entry or e
        entry["reach"] = entry["reach"] and e["reach"]
    entry["rounds"] = rounds
    return entry


def run_profile(args, name, rate, rtt_ms, settings):
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    result = {"profile": name, "rate": rate, "rtt_ms": rtt_ms, "site_sysctl": args.site_sysctl,
              "settings": {}}
    tag = f"{args.tag}-{name}"  # a separator, so that one run's tag is no prefix of another's
    procs = Procs()
    with Links(tag, args.groups, rate, rtt_ms, args.build, out, args.tcp_mem_max_mib,
               args.site_sysctl) as links:
        try:
            result["namespaces"] = sorted(set(subprocess.run(
                ["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout.split()) &
                set(links.namespaces()))
            result["rtt_ms_measured"] = rtt_probe(links)
            if not args.smoke:
                cpu0 = links.router_cpu_s()
                result["iperf_bytes_per_s"] = iperf(links, args.iperf_seconds, out)
                # The emulator's share of one CPU while iperf3 ran: near 1, it is the limit.
                result["router_cpu_share"] = (links.router_cpu_s() - cpu0) / (args.iperf_seconds + 1)
            for sname, sflags in settings:
                result["settings"][sname] = run_setting(args, links, out, sname, sflags, procs)
            if not args.smoke:
                params = next(iter(result["settings"].values()))["diloco"]["params"]
                result["dp"] = dp_yardstick(links, args.build, params, args.inner_steps, out,
                                            procs)
        finally:
            procs.stop_all()
    result["namespaces_left"] = sorted(set(subprocess.run(
        ["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout.split()) &
        set(links.namespaces()))
    return result


def main(argv):
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("shaped_links.py needs root (ip netns, tc)")
    args.build = os.path.abspath(args.build)
    if not args.out:
        import tempfile
        args.out = tempfile.mkdtemp(prefix="lk-shaped-")
    os.makedirs(args.out, exist_ok=True)
    profiles = args.profile or (["smoke=1gbit,20"] if args.smoke else ["1g30=1gbit,30",
                                                                        "10g10=10gbit,10"])
    if args.setting:
        settings = [(s.partition("=")[0], shlex.split(s.partition("=")[2])) for s in args.setting]
    else:
        settings = read_settings(args.settings_file)
    if args.smoke:
        settings = settings[:1]
    load = open("/proc/loadavg").read().split()[:3]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    print(f"# shaped links: {os.cpu_count()} CPUs, load average {' '.join(load)} at start; "
          f"commit {commit.strip() or 'unknown'}; logs in {args.out}")
    results, problems = [], []
    for prof in profiles:
        name, _, spec = prof.partition("=")
        rate, rtt = spec.split(",")
        r = run_profile(args, name, rate, float(rtt), settings)
        results.append(r)
        print(report(r, args), flush=True)
        if args.smoke:
            problems += smoke_checks(r, args)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)
    load = open("/proc/loadavg").read().split()[:3]
    print(f"\n# load average {' '.join(load)} at the end; figures in {args.out}/results.json")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    if args.smoke:
        print("shaped links smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
