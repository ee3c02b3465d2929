"""One trainer process of bench/python_bench.py; prints one JSON line of results.

  allreduce: Manager.allreduce of a 64 MiB float32 tensor against the C++ communicator called
             directly (lk_comm_allreduce through the module, no Python layer) on the same
             buffer, alternating, in the same quorum.
  diloco:    DiLoCo.step() at each sync: its wall time, and the library's own split of it.
"""

import argparse
import datetime
import json
import sys
import time

import torch

import lightkeeper
from lightkeeper import _native


def bench_allreduce(args, m):
    q = m.poll(0)
    n = args.mib * (1 << 20) // 4
    t = torch.ones(n, dtype=torch.float32)
    direct = _native.Comm(m._native_session(), "gloo", m.group_rank, "bench/direct/", "127.0.0.1",
                          30000, 120000, 0)
    direct.reconfigure(q.quorum_id, q.replica_rank, q.replica_world_size)
    m.allreduce(t)  # builds the Manager's communicator; both are warm from here on
    direct.allreduce(t.data_ptr(), n, "float32", "avg")
    manager_s, direct_s = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        m.allreduce(t)
        manager_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        direct.allreduce(t.data_ptr(), n, "float32", "avg")
        direct_s.append(time.perf_counter() - t0)
    ok = bool(torch.all(t == 1.0))
    m.commit(1)
    m.finish()
    print(json.dumps(dict(mode="allreduce", manager_s=manager_s, direct_s=direct_s, ok=ok,
                          world=q.replica_world_size, bytes=4 * n)), flush=True)


def bench_diloco(args, m):
    torch.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(2)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(11 + m.group_rank)
    rows = []
    last_commit = time.perf_counter()
    with lightkeeper.DiLoCo(m, model, opt, sync_every=args.sync_every) as d:
        while d.outer_step < args.steps and not d.should_stop:
            x = torch.randn(32, args.width, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prev = d.last_result
            t0 = time.perf_counter()
            d.step()
            t1 = time.perf_counter()
            wall_ms = (t1 - t0) * 1000
            r = d.last_result
            if r is not prev and r is not None and r.committed:
                s = r.stats
                step_ms = (t1 - last_commit) * 1000  # commit to commit, inner steps included
                last_commit = t1
                rows.append(dict(step=r.step, wall_ms=wall_ms, step_ms=step_ms, **{k: s[k] for k in (
                    "poll_ms", "join_ms", "allreduce_ms", "gather_ms", "publish_ms",
                    "commit_ms", "outer_ms")}))
    print(json.dumps(dict(mode="diloco", rows=rows, params=sum(p.numel() for p in
                                                              model.parameters()))), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["allreduce", "diloco"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sync-every", type=int, default=4)
    args = p.parse_args()
    m = lightkeeper.Manager(0, 1, timeout=datetime.timedelta(seconds=300))
    (bench_allreduce if args.mode == "allreduce" else bench_diloco)(args, m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
