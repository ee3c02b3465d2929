"""The Markdown report and the smoke checks of bench/netns/shaped_links.py, from its results."""

import statistics

from links import parse_rate_bits


def report(r, args):
    rate_Bps = parse_rate_bits(r["rate"]) / 8
    rtts = r["rtt_ms_measured"]
    extra = f" (sites: {', '.join(r['site_sysctl'])})" if r["site_sysctl"] else ""
    lines = [f"### {r['profile']}: {r['rate']}, {r['rtt_ms']:g} ms RTT between sites{extra}", "",
             f"- round trip site 0 -> site 1 (TCP connect, {len(rtts)} tries): min "
             f"{min(rtts):.1f} ms, median {statistics.median(rtts):.1f} ms"]
    ip = r.get("iperf_bytes_per_s")
    if ip:
        lines.append(f"- link capacity, iperf3 one stream site 0 -> site 1: {ip / 1e6:.1f} MB/s, "
                     f"{ip / rate_Bps:.2f}x of the {r['rate']} shaping (lk_link_delay meanwhile "
                     f"used {r['router_cpu_share']:.2f} of a CPU)")
    dp = r.get("dp")
    if dp:
        lines.append(f"- plain data parallelism on the same link: one float32 allreduce of the "
                     f"model's size {dp['allreduce_ms']:.0f} ms (mean of {args.inner_steps} "
                     f"back to back), {dp['link_bytes_per_outer_step']:,} link bytes site 0 -> 1 "
                     f"for H={args.inner_steps} of them")
    for sname, e in r["settings"].items():
        d = e["diloco"]
        lines += ["", f"Setting `{sname}` (trainer flags: `{' '.join(e['flags']) or 'none'}`): "
                  f"{d['params']:,} parameters, H={args.inner_steps}, {args.groups} groups of "
                  f"{args.group_size}, steps reached {sorted(set(d['steps'].values()))}, replicas "
                  f"equal at every step: {d['hashes_agree']}; medians over steady steps.", "",
                  "| figure | DiLoCo | yardstick (same run) | yardstick | ratio |",
                  "|---|---|---|---|---|"]
        row = lambda *c: lines.append("| " + " | ".join(c) + " |")  # noqa: E731
        link01 = d["link_bytes"].get("lkd0->lkd1", 0) / max(1, args.outer_steps)
        if dp:
            db = dp["link_bytes_per_outer_step"]
            row("bytes per outer step: a trainer's `cross_bytes` (TCP)", f"{d['cross_bytes']:,.0f}",
                "plain DP: link bytes of H gradient allreduces", f"{db:,}",
                f"{d['cross_bytes'] / db:.3f}")
            row("bytes per outer step: link bytes site 0 -> 1, whole job / steps", f"{link01:,.0f}",
                "the same", f"{db:,}", f"{link01 / db:.3f}")
        if "alone" in e:
            a = e["alone"]
            row("outer step, wall time (ms)", f"{d['step_ms']:.0f}",
                "compute alone: same trainers, no cross-group communication", f"{a['step_ms']:.0f}",
                f"{d['step_ms'] / a['step_ms']:.3f}")
            row("outer step / its own inner steps (`step_ms / inner_ms`, divides out the load)",
                f"{d['step_per_inner']:.3f}", "the same, compute alone",
                f"{a['step_per_inner']:.3f}", f"{d['step_per_inner'] / a['step_per_inner']:.3f}")
            if len(e["rounds"]) > 1:
                per = [x["step_per_inner_ratio"] for x in e["rounds"]]
                row(f"the same ratio in each of {len(per)} rounds (median)",
                    ", ".join(f"{x:.3f}" for x in per), "", "",
                    f"{statistics.median(per):.3f}")
            row("time outside the inner steps per outer step (ms)",
                f"{d['outside_ms']:.0f}", "the same, compute alone", f"{a['outside_ms']:.0f}",
                f"{d['outside_ms'] / a['outside_ms']:.2f}")
        if dp:
            dp_step = d["inner_ms"] + dp["h_allreduces_ms"]
            row("outer step, wall time (ms)", f"{d['step_ms']:.0f}",
                "plain DP: the same inner steps + H measured allreduces", f"{dp_step:.0f}",
                f"{d['step_ms'] / dp_step:.3f}")
            row("cross-group allreduce (ms)", f"{d['allreduce_ms']:.0f}",
                "one DP allreduce of the same size (warm, back to back)",
                f"{dp['allreduce_ms']:.0f}", f"{d['allreduce_ms'] / dp['allreduce_ms']:.2f}")
        row("spread of the groups' inner steps per outer step (ms; the blocking allreduce waits "
            "it out)", f"{d['inner_skew_ms']:.0f}", "the allreduce", f"{d['allreduce_ms']:.0f}",
            f"{d['inner_skew_ms'] / d['allreduce_ms']:.2f}")
        lr = d.get("link_50ms")
        if lr:
            row("busiest 50 ms of site 0's sending, steady steps (MB/s)",
                f"{lr['peak_Bps'] / 1e6:.1f}", f"the shaping ({r['rate']})",
                f"{rate_Bps / 1e6:.1f}", f"{lr['peak_Bps'] / rate_Bps:.2f}")
            row("median 50 ms of site 0's sending (MB/s)", f"{lr['median_Bps'] / 1e6:.1f}",
                "its mean over the same samples", f"{lr['mean_Bps'] / 1e6:.1f}",
                f"{lr['median_Bps'] / max(1.0, lr['mean_Bps']):.2f}")
        wire_ms = d["cross_bytes"] / rate_Bps * 1000
        row("cross-group allreduce (ms)", f"{d['allreduce_ms']:.0f}",
            "its `cross_bytes` at the shaped rate", f"{wire_ms:.0f}",
            f"{d['allreduce_ms'] / wire_ms:.2f}")
        if ip:
            row("cross-group allreduce (ms)", f"{d['allreduce_ms']:.0f}",
                "its `cross_bytes` at iperf3's rate", f"{d['cross_bytes'] / ip * 1000:.0f}",
                f"{d['allreduce_ms'] / (d['cross_bytes'] / ip * 1000):.2f}")
    return "\n".join(lines)


def smoke_checks(r, args):
    problems = []
    if len(r["namespaces"]) != args.groups + 1:
        problems.append(f"namespaces during the run: {r['namespaces']}")
    if r["namespaces_left"]:
        problems.append(f"namespaces left after the run: {r['namespaces_left']}")
    if min(r["rtt_ms_measured"]) < r["rtt_ms"]:
        problems.append(f"RTT {min(r['rtt_ms_measured']):.2f} ms below the profile's {r['rtt_ms']}")
    for sname, e in r["settings"].items():
        d = e["diloco"]
        if set(d["steps"].values()) != {args.outer_steps}:
            problems.append(f"{sname}: steps reached {d['steps']}")
        if not d["cross_bytes"] > 4 * d["params"] / args.group_size:
            problems.append(f"{sname}: cross_bytes {d['cross_bytes']} below one shard's float32")
        if d["link_bytes"].get("lkd0->lkd1", 0) < d["cross_bytes"] * (args.outer_steps - 1):
            problems.append(f"{sname}: the shaped link carried {d['link_bytes']}, less than the "
                            f"trainers' cross_bytes")
        if not d["hashes_agree"]:
            problems.append(f"{sname}: the groups' param_hash differ at a step")
        if not e["reach"]:
            problems.append(f"{sname}: a site's agent was not reachable from the other site")
    return problems
