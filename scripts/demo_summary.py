#!/usr/bin/python3
"""The summary of a scripts/demo.sh run, read from its logs, not from what the demo meant to do.

Reads RUN_DIR (and RUN_DIR/ref, the reference run): the trainers' --log JSON lines
(trainer-GROUP-RANK.LIFE.jsonl, one line per committed outer step), the agents' logs
(agent-GROUP.LIFE.log), the lighthouse's log (lighthouse.log, at debug level: every quorum it
issued and every commit it recorded, each life after a `lighthouse_start` line), its /status at
the end (status.json) and the demo's record of what it did and when (actions.txt: "T_MS STEP
WHAT", the committed step when it acted). For each stage it prints what happened and at which
committed step, marked [ok] when the stage's effect happened while the job was still training
(before its last step), [FAILED] otherwise; exits 1 when any line is [FAILED].

usage: demo_summary.py RUN_DIR STEPS [--trainer cpp|python] [--events EVENTS_OUT]
EVENTS_OUT gets the stages as "FIRST-LAST LABEL" lines for scripts/plot_run.py.
"""
import argparse
import datetime
import glob
import json
import os
import re
import sys

LOG_NAME = re.compile(r"trainer-(?P<g>[^-]+)-(?P<r>\d+)\.(?P<life>\d+)\.jsonl$")


def log_time_ms(line):
    """The epoch milliseconds of a lighthouse or agent log line (ISO 8601 UTC first)."""
    stamp = line.split(" ", 1)[0]
    try:
        t = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ")
    except ValueError:
        return None
    return int(t.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000)


def fields(line):
    """The key=value fields of a log line (values unquoted)."""
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}


class Run:
    """One run's logs: trainers by (group, life, rank), agents, lighthouse lives, actions."""

    def __init__(self, d):
        self.dir = d
        self.lines = {}  # (group, life, rank) -> [json line]
        for p in sorted(glob.glob(os.path.join(d, "trainer-*.jsonl"))):
            m = LOG_NAME.search(p)
            if not m:
                continue
            out = []
            with open(p, errors="replace") as f:
                for ln in f:
                    try:
                        out.append(json.loads(ln))
                    except ValueError:
                        pass
            self.lines[(m["g"], int(m["life"]), int(m["r"]))] = out
        self.actions = []  # (t_ms, step, what)
        path = os.path.join(d, "actions.txt")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                for ln in f:
                    parts = ln.split(None, 2)
                    if len(parts) == 3:
                        self.actions.append((int(parts[0]), int(parts[1]), parts[2].strip()))
        self.lh_lives = []  # [[line]] per lighthouse life
        path = os.path.join(d, "lighthouse.log")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                for ln in f:
                    if " lighthouse_start " in ln or not self.lh_lives:
                        self.lh_lives.append([])
                    self.lh_lives[-1].append(ln.rstrip("\n"))
        try:
            with open(os.path.join(d, "status.json")) as f:
                jobs = json.load(f).get("jobs", [])
            self.status = jobs[0] if jobs else {}
        except (OSError, ValueError):
            self.status = {}

    def action(self, what):
        for a in self.actions:
            if a[2] == what:
                return a
        return None

    def life_lines(self, group, life):
        return [d for (g, l, _), v in self.lines.items() if g == group and l == life for d in v]

    def first(self, group, life):
        """The first committed step of a group's life (the earliest line of any of its ranks)."""
        v = self.life_lines(group, life)
        return min(v, key=lambda d: (d["step"], d.get("t_ms", 0))) if v else None

    def lives(self, group):
        return sorted({l for (g, l, _) in self.lines if g == group})

    def groups(self):
        return sorted({g for (g, _, _) in self.lines})

    def all_lines(self):
        return [d for v in self.lines.values() for d in v]

    def agent_exit(self, group, life):
        path = os.path.join(self.dir, f"agent-{group}.{life}.log")
        code = None
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                for ln in f:
                    if " agent_exit " in ln:
                        code = int(fields(ln).get("code", -1))
        return code

    def final_eval(self, steps):
        v = [d["eval_loss"] for d in self.all_lines() if d["step"] == steps and "eval_loss" in d]
        return sum(v) / len(v) if v else None

    def quorum_of(self, n):
        """The first line logged in a quorum of n groups."""
        v = [d for d in self.all_lines() if d.get("replica_world_size") == n]
        return min(v, key=lambda d: d["step"]) if v else None


class Summary:
    def __init__(self):
        self.failed = False
        self.events = []

    def line(self, ok, text):
        if not ok:
            self.failed = True
        print(f"  {'[ok]    ' if ok else '[FAILED]'} {text}")


def kill_stage(run, steps, s):
    """kill -9 of a trainer of g1: its agent ends the group, the others go on without it."""
    act = run.action("kill g1/1")
    if act is None:
        s.line(False, "kill -9 of trainer g1/1: not done (the run never reached its step)")
        return None
    t_kill, k, _ = act
    code = run.agent_exit("g1", 1)
    after = [d for (g, l, _), v in run.lines.items() if g != "g1" and l == 1 for d in v
             if d.get("t_ms", 0) > t_kill and d.get("replica_world_size") == 2]
    on = min(after, key=lambda d: d["step"]) if after else None
    ok = code == 3 and on is not None and on["step"] < steps
    text = (f"kill -9 of trainer g1/1 at committed step {k}: g1's agent exited "
            f"{code if code is not None else 'never'} (3: a trainer of its group died) and ended "
            f"the group; ")
    if on is not None:
        text += (f"g0 and g2 committed step {on['step']} without g1 "
                 f"{(on['t_ms'] - t_kill) / 1000:.1f} s later (quorum_id {on['quorum_id']}, "
                 f"{on['replica_world_size']} groups)")
    else:
        text += "the others committed no step without g1"
    s.line(ok, text)
    return k


def return_stage(run, steps, k, s):
    """g1 comes back as a new incarnation and heals from its peers."""
    act, kill = run.action("relaunch g1"), run.action("kill g1/1")
    if act is None or kill is None:
        s.line(False, "g1 back and healed: not done (no relaunch)")
        return None
    first = run.first("g1", 2)
    if first is None:
        s.line(False, f"g1 back and healed: relaunched at step {act[1]}, but it never committed")
        return None
    b = first["step"]
    ok = b < steps and first.get("healed") is True and first.get("replica_world_size", 0) >= 2
    s.line(ok, f"g1 back and healed at step {b}, {(first['t_ms'] - kill[0]) / 1000:.1f} s after "
               f"the kill: a new incarnation (relaunched at step {act[1]}), its first commit "
               f"{'healed' if first.get('healed') else 'NOT healed'} from its peers (quorum_id "
               f"{first['quorum_id']}, {first['replica_world_size']} groups)"
               + ("" if b < steps else f"; not mid-run: the run ends at step {steps}"))
    if k is not None:
        s.events.append((k, b, f"g1: killed at step {k}, back and healed at step {b}"))
    return b


def join_stage(run, steps, s):
    """g3 joins and trains in a quorum of four."""
    act = run.action("launch g3")
    if act is None:
        s.line(False, "g3 joined: not done (the run ended before its turn)")
        return None
    first = run.first("g3", 1)
    four = run.quorum_of(4)
    if first is None or four is None:
        s.line(False, f"g3 joined: started at step {act[1]}, but "
                      + ("it never committed" if first is None else
                         f"it first committed step {first['step']} and never in a quorum of four"))
        return None
    f = four["step"]
    ok = f < steps
    s.line(ok, f"g3 joined: started at step {act[1]}, first commit at step {first['step']} "
               f"({'healed' if first.get('healed') else 'not healed'}); a quorum of four from step "
               f"{f} (quorum_id {four['quorum_id']})"
               + ("" if ok else f"; not mid-run: the run ends at step {steps}"))
    s.events.append((act[1], f, f"g3: started at step {act[1]}, quorum of four from step {f}"))
    return f


def lighthouse_stage(run, steps, s):
    """The lighthouse killed with -9 and restarted: it issues quorums and records commits again."""
    kill, back = run.action("kill lighthouse"), run.action("restart lighthouse")
    if kill is None or back is None:
        s.line(False, "lighthouse kill -9 and restart: not done (the run ended before its turn)")
        return
    before = [fields(ln) for life in run.lh_lives[:-1] for ln in life if " quorum_issued " in ln]
    last = run.lh_lives[-1] if len(run.lh_lives) > 1 else []
    issued = [fields(ln) for ln in last if " quorum_issued " in ln]
    commits = [fields(ln) for ln in last if " commit " in ln and "ok=true" in ln]
    qid_before = int(before[-1]["quorum_id"]) if before else 0
    # The steps the groups committed without it: after the last one it recorded, before it
    # started again.
    recorded = [int(fields(ln).get("committed_step", 0)) for life in run.lh_lives[:-1]
                for ln in life if " commit " in ln]
    restart_ms = log_time_ms(run.lh_lives[-1][0]) if len(run.lh_lives) > 1 else 0
    away = sorted({d["step"] for d in run.all_lines()
                   if d["step"] > max(recorded, default=0) and d.get("t_ms", 0) < restart_ms})
    text = (f"lighthouse kill -9 at committed step {kill[1]} (quorum_id {qid_before}), restarted "
            f"{(back[0] - kill[0]) / 1000:.1f} s later at step {back[1]}, the groups having "
            f"committed {len(away)} step{'' if len(away) == 1 else 's'} without it; ")
    if not issued or not commits:
        s.line(False, text + ("it issued no quorum" if not issued else "it recorded no commit")
               + " before the run ended")
        return
    q = issued[0]
    m, c, qid = int(q["max_step"]), int(commits[0]["step"]), int(q["quorum_id"])
    ok = m < steps and c < steps and qid >= qid_before and len(away) > 0
    s.line(ok, text + f"its first quorum: quorum_id {qid} ({'a new one' if q['changed'] == 'true' else 'the same members'}"
               f") for step {m}, and it recorded commits from step {c}"
               + ("" if qid >= qid_before else "; ** the quorum_id went back **")
               + ("" if m < steps and c < steps else f"; not mid-run: the run ends at step {steps}"))
    s.events.append((kill[1], back[1], f"lighthouse: killed at step {kill[1]}, back at step "
                                       f"{back[1]} ({len(away)} steps without it)"))


def end_stage(run, steps, s):
    """Every group's last life trains to the end; the lighthouse recorded the last step."""
    short = []
    for g in run.groups():
        life = run.lives(g)[-1]
        ranks = [v for (gg, l, _), v in run.lines.items() if gg == g and l == life]
        reached = min((v[-1]["step"] if v else 0) for v in ranks)
        code = run.agent_exit(g, life)
        if reached != steps or code != 0:
            short.append(f"{g} reached step {reached}, agent exit {code}")
    committed = run.status.get("committed_step")
    ok = not short and committed == steps
    head = (f"not every group reached step {steps}: {'; '.join(short)}" if short else
            f"every group reached step {steps} ({' '.join(run.groups())}) and its agent exited 0")
    s.line(ok, f"{head}; the lighthouse recorded committed step {committed} of {steps}")


def replicas(run, s):
    hashes = {}
    for d in run.all_lines():
        hashes.setdefault((d["step"], d["group_rank"]), set()).add(d["param_hash"])
    bad = sum(1 for h in hashes.values() if len(h) > 1)
    s.line(bad == 0 and bool(hashes), f"replicas identical: {len(hashes) - bad} of {len(hashes)} "
                                f"(step, shard) pairs agree across groups")


def reference(run, ref, steps, s):
    """The final eval loss against the reference, and what the reference repeated."""
    loss, ref_loss = run.final_eval(steps), ref.final_eval(steps)
    drain, back = ref.action("drain g1"), ref.first("g1", 2)
    g3, four = ref.first("g3", 1), ref.quorum_of(4)
    run_back, run_g3, run_four = run.first("g1", 2), run.first("g3", 1), run.quorum_of(4)
    done = all(v is not None for v in (loss, ref_loss, drain, back, g3, four))
    if not done:
        s.line(False, f"final eval loss {loss}: the reference did not run to the end with the "
                      f"same membership changes (logs in {ref.dir})")
        return
    step = lambda d: d["step"] if d is not None else "-"
    s.line(True, f"final eval loss {loss:.4f} against the reference's {ref_loss:.4f} "
                 f"({100 * (loss - ref_loss) / ref_loss:+.1f}%)")
    print(f"  reference: the same job and seeds without failures, with the run's membership "
          f"changes at the same committed steps: g1 drained at step {drain[1]} and was back at "
          f"step {back['step']} (the run: killed at {run.action('kill g1/1')[1]}, back at "
          f"{step(run_back)}); g3's first commit at step {g3['step']}, a quorum of four from "
          f"step {four['step']} (the run: {step(run_g3)}, {step(run_four)}); no lighthouse "
          f"restart (it changes no membership). The loss is of the final global weights on "
          f"fixed batches (eval_loss).")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--trainer", default="cpp")
    p.add_argument("--events", default="")
    a = p.parse_args(argv)
    run, ref = Run(a.run_dir), Run(os.path.join(a.run_dir, "ref"))
    s = Summary()
    print(f"  trainer: {a.trainer}; {a.steps} outer steps; stages marked [ok] happened while the "
          f"job trained on, [FAILED] did not")
    k = kill_stage(run, a.steps, s)
    return_stage(run, a.steps, k, s)
    join_stage(run, a.steps, s)
    lighthouse_stage(run, a.steps, s)
    end_stage(run, a.steps, s)
    replicas(run, s)
    reference(run, ref, a.steps, s)
    if a.events:
        with open(a.events, "w") as f:
            for first, last, label in s.events:
                f.write(f"{first}-{last} {label}\n")
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
