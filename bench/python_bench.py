"""Figures for the Python package (issue 13), each beside the C++ path measured in the same run.

  1. Manager.allreduce of a 64 MiB float32 tensor, 2 groups of one trainer on loopback, against
     the C++ communicator called directly on the same buffer (alternating rounds, same quorum,
     same processes). Goal: at least 0.95x.
  2. Coordination per outer step from Python: DiLoCo.step() at a sync minus the cross-group
     allreduce and the outer update + in-group gather (the library's allreduce_ms and
     gather_ms), 2 groups of one trainer; against the C++ diloco_trainer's poll + join +
     publish + commit (the same parts of its Sync) in 2 groups of one trainer, same run.

Usage (after ninja -C build lightkeeper_python lighthouse replica_agent diloco_trainer):
    /usr/bin/python3 bench/python_bench.py [--build build] [--rounds 10] [--steps 20]
Prints Markdown to stdout.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))
from conftest import Cluster  # noqa: E402  (the tests' process helpers)


def run_pair(cluster, args_for, timeout_s, script, live=True):
    procs = []
    for g in ("b0", "b1"):
        cluster.agent(g)
    for g in ("b0", "b1"):
        env = dict(os.environ, LK_AGENT_SOCKET=cluster.sockets[g], LK_GROUP_ID=g,
                   LK_LIVE_DIR=cluster.live_dirs[g] if live else "")
        procs.append(subprocess.Popen(["/usr/bin/python3", str(script), *args_for(g)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                      text=True))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise SystemExit(f"bench worker failed:\n{se[-3000:]}")
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


def cpp_diloco(cluster_dir, build, steps, timeout_s, live=True):
    """Two groups of one C++ diloco_trainer; its --log lines, steady steps only."""
    trainer = build / "bin" / "diloco_trainer"
    if not trainer.exists():
        return None
    c = Cluster(Path(cluster_dir), ("--min-replicas", "2", "--join-timeout-ms", "300",
                                    "--heartbeat-timeout-ms", "5000"))
    try:
        procs, logs = [], []
        for g in ("c0", "c1"):
            c.agent(g)
        for g in ("c0", "c1"):
            log = Path(cluster_dir) / f"cpp-{g}.jsonl"
            logs.append(log)
            env = dict(os.environ, LK_AGENT_SOCKET=c.sockets[g], LK_GROUP_ID=g)
            procs.append(subprocess.Popen(
                [str(trainer), "--group-rank", "0", "--group-size", "1", "--inner-steps", "4",
                 "--outer-steps", str(steps), "--seed", "3", "--log", str(log),
                 "--model-width", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
                 "--batch", "8", "--corpus-bytes", "16384"]
                + (["--live-dir", c.live_dirs[g]] if live else []),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True))
        for p in procs:
            _, se = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise SystemExit(f"diloco_trainer failed:\n{se[-3000:]}")
        rows = [json.loads(l) for log in logs for l in log.read_text().splitlines()]
        return [r for r in rows if r["step"] > 2]
    finally:
        c.close()


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    build = Path(a.build).resolve()
    os.environ["LK_BIN_DIR"] = str(build / "bin")
    os.environ["PYTHONPATH"] = str(build / "python")
    import conftest
    conftest.BIN_DIR = build / "bin"
    worker = ROOT / "bench" / "python_bench_worker.py"
    load0 = open("/proc/loadavg").read().split()[:3]
    print(f"# Python package figures\n\nRun of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f", load average at start {' '.join(load0)}, {os.cpu_count()} CPUs.\n")

    with tempfile.TemporaryDirectory(prefix="lk-pybench-") as d:
        (Path(d) / "ar").mkdir()
        c = Cluster(Path(d) / "ar", ("--min-replicas", "2", "--join-timeout-ms", "300",
                                     "--heartbeat-timeout-ms", "10000"))
        try:
            res = run_pair(c, lambda g: ["allreduce", "--rounds", str(a.rounds), "--mib",
                                         str(a.mib)], 900, worker)
        finally:
            c.close()
        m_s = [x for r in res for x in r["manager_s"]]
        d_s = [x for r in res for x in r["direct_s"]]
        nbytes = res[0]["bytes"]
        ok = all(r["ok"] for r in res)
        busbw = lambda s: 2 * (2 - 1) / 2 * nbytes / s / 1e9  # noqa: E731
        print(f"## Manager.allreduce, {a.mib} MiB float32, 2 groups x 1 trainer, loopback Gloo\n")
        print("| path | median s | p90 s | busbw GB/s (median) |\n|---|---|---|---|")
        for name, xs in (("Manager.allreduce (Python)", m_s),
                         ("C++ communicator, direct (lk_comm_allreduce)", d_s)):
            xs = sorted(xs)
            print(f"| {name} | {med(xs):.4f} | {xs[int(0.9 * (len(xs) - 1))]:.4f} | "
                  f"{busbw(med(xs)):.2f} |")
        print(f"\nManager.allreduce speed against the C++ communicator's (C++ median time / "
              f"Python median time): **{med(d_s) / med(m_s):.3f}x**; "
              f"{len(m_s)} rounds per path over both members, results correct: {ok}.\n")

        print("## Coordination per outer step, 2 groups x 1 trainer (the C++ trainer's tiny "
              "model beside a Python model of similar size; steady steps 3.."
              f"{a.steps})\n")
        print("Coordination is the sync's wall time minus the cross-group allreduce and the outer "
              "update with the in-group gather (the library's `allreduce_ms` and `gather_ms`): "
              "for Python the wall time of `DiLoCo.step()` at a sync, for C++ the step's wall "
              "time minus its inner steps (`step_ms - inner_ms - eval_ms`). Beside it, from the "
              "library's own counters of the same steps: poll + join + commit (the figure the "
              "C++ trainer's earlier runs quote) and the live-state publish.\n")
        print("| trainer | live state | coordination median ms | poll+join+commit median ms | "
              "publish median ms | outer step median ms (commit to commit) | "
              "coordination / outer step |\n|---|---|---|---|---|---|---|")
        ratios = []
        for live in (False, True):
            tag = "live" if live else "nolive"
            (Path(d) / f"dl-{tag}").mkdir()
            c = Cluster(Path(d) / f"dl-{tag}", ("--min-replicas", "2", "--join-timeout-ms",
                                                "300", "--heartbeat-timeout-ms", "5000"))
            try:
                res = run_pair(c, lambda g: ["diloco", "--steps", str(a.steps), "--width", "128"],
                               900, worker, live)
            finally:
                c.close()
            rows = [r for w in res for r in w["rows"] if r["step"] > 2]
            coord = [r["wall_ms"] - r["allreduce_ms"] - r["gather_ms"] for r in rows]
            pjc = [r["poll_ms"] + r["join_ms"] + r["commit_ms"] for r in rows]
            pub = [r["publish_ms"] for r in rows]
            outer = [r["step_ms"] for r in rows]
            print(f"| Python DiLoCo.step(), {res[0]['params']} params | {'yes' if live else 'no'} "
                  f"| {med(coord):.3f} | {med(pjc):.4f} | {med(pub):.3f} | {med(outer):.2f} | "
                  f"{med(coord) / med(outer):.4f} |")
            (Path(d) / f"cpp-{tag}").mkdir()
            cpp = cpp_diloco(Path(d) / f"cpp-{tag}", build, a.steps, 900, live)
            if not cpp:
                print("| C++ | (no build/bin/diloco_trainer in this build) | | | | | |")
                continue
            cc = [r["step_ms"] - r["inner_ms"] - r.get("eval_ms", 0) - r["allreduce_ms"]
                  - r["gather_ms"] for r in cpp]
            cpjc = [r["poll_ms"] + r["join_ms"] + r["commit_ms"] for r in cpp]
            cpub = [r["publish_ms"] for r in cpp]
            so = [r["step_ms"] for r in cpp]
            print(f"| C++ diloco_trainer Sync, {cpp[0]['params']} params | "
                  f"{'yes' if live else 'no'} | {med(cc):.3f} | {med(cpjc):.4f} | "
                  f"{med(cpub):.3f} | {med(so):.2f} | {med(cc) / med(so):.4f} |")
            ratios.append((tag, med(coord) / med(cc)))
        print("\nPython / C++ coordination: " + ", ".join(f"**{r:.2f}x** ({t})" for t, r in ratios)
              + ".")
        print(f"\nload average at end {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
