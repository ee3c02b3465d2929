"""scripts/demo.sh end to end, with either trainer (CTest demo_cpp, demo_python; label e2e).

Runs the demo as a user would (shortened by its environment knobs: fewer outer steps), then
checks every claim of its summary against the logs, parsed here on their own (not with
scripts/demo_summary.py): the trainers' JSON lines, the agents' logs, the lighthouse's debug
log (every quorum it issued, every commit it recorded) and its /status at the end. Each stage
must have happened while the job still trained (before its last step), at the committed step
the summary names. A last case feeds the summary a run whose join came too late (the same logs
with the quorum of four cut to the last step) and checks that it says so and exits 1.

Environment: LK_BIN_DIR (the build's bin/), PYTHONPATH (the build's python/), TMPDIR.
LK_KEEP_TEST_DIRS=1 keeps the demo's directory; a failed case always keeps it.
"""
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile

import pytest

SOURCE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("LK_BIN_DIR", os.path.join(SOURCE, "build", "bin"))
STEPS = 24
# The pace: each inner step at least this long, so that an outer step takes at least 1.6 s
# and a stage (a group's return: new processes, a join, a heal) fits in a few of them on a
# loaded machine.
PACE_MS = 200

RUNS = {}  # trainer -> (dir, stdout): one demo per trainer, shared by the cases below


def run_demo(trainer):
    if trainer in RUNS:
        return RUNS[trainer]
    if trainer == "python" and not os.path.exists(
            os.path.join(BIN, "..", "python", "lightkeeper", "__init__.py")):
        pytest.fail(f"no lightkeeper package next to {BIN} (ninja lightkeeper_python)")
    d = tempfile.mkdtemp(prefix=f"lk-demo-{trainer}-")
    env = dict(os.environ, LK_DEMO_SKIP_BUILD="1", LK_DEMO_BIN=BIN, LK_DEMO_DIR=d,
               LK_DEMO_STEPS=str(STEPS), LK_DEMO_INNER_STEP_MIN_MS=str(PACE_MS),
               LK_DEMO_STAGE_TIMEOUT_S="120")
    # Its own process group, so that a demo past its deadline is stopped with everything it
    # started (the deadline is below CTest's TIMEOUT).
    p = subprocess.Popen(["bash", os.path.join(SOURCE, "scripts", "demo.sh"), "--trainer", trainer],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        stdout, _ = p.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        stdout += "\n** demo.sh ran past 480 s: stopped **\n"
    out = re.sub(r"\x1b\[[0-9;]*m", "", stdout)
    print(out)
    RUNS[trainer] = (d, out, p.returncode)
    return RUNS[trainer]


@pytest.fixture(scope="module", autouse=True)
def cleanup(request):
    yield
    for d, _, rc in RUNS.values():
        if rc == 0 and request.session.testsfailed == 0 and os.environ.get("LK_KEEP_TEST_DIRS") != "1":
            shutil.rmtree(d, ignore_errors=True)
        else:
            print(f"demo logs kept in {d}")


# ---- the logs, parsed here ----

def iso_ms(line):
    t = datetime.datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%fZ")
    return int(t.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000)


def kv(line):
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}


class Logs:
    def __init__(self, d):
        self.dir = d
        self.trainer = {}  # (group, life, rank) -> [dict]
        for p in glob.glob(os.path.join(d, "trainer-*.jsonl")):
            g, r, life = re.search(r"trainer-(\w+)-(\d+)\.(\d+)\.jsonl$", p).groups()
            with open(p, errors="replace") as f:
                self.trainer[(g, int(life), int(r))] = [json.loads(ln) for ln in f if ln.strip()]
        self.lighthouse = []  # one list of lines per life of the lighthouse
        if os.path.exists(os.path.join(d, "lighthouse.log")):
            with open(os.path.join(d, "lighthouse.log"), errors="replace") as f:
                for ln in f:
                    if " lighthouse_start " in ln:
                        self.lighthouse.append([])
                    if self.lighthouse:
                        self.lighthouse[-1].append(ln.rstrip("\n"))

    def agent(self, group, life):
        with open(os.path.join(self.dir, f"agent-{group}.{life}.log"), errors="replace") as f:
            return f.read().splitlines()

    def agent_exit(self, group, life):
        codes = [int(kv(ln)["code"]) for ln in self.agent(group, life) if " agent_exit " in ln]
        return codes[-1] if codes else None

    def lines(self, group=None, life=None):
        return [d for (g, l, _), v in self.trainer.items() for d in v
                if (group is None or g == group) and (life is None or l == life)]

    def first(self, group, life):
        v = self.lines(group, life)
        return min(v, key=lambda d: d["step"]) if v else None

    def eval_at(self, step):
        v = [d["eval_loss"] for d in self.lines() if d["step"] == step]
        assert v and max(v) == min(v), f"eval_loss at step {step} differs across members: {v}"
        return v[0]


def summary_line(out, pattern):
    """The summary's line that matches `pattern` (a regex with groups), which must be [ok]."""
    text = out[out.index("== summary"):]
    for ln in text.splitlines():
        m = re.search(pattern, ln)
        if m:
            assert ln.lstrip().startswith("[ok]"), ln
            return m
    raise AssertionError(f"no summary line matches {pattern!r} in:\n{text}")


def num(m, name):
    return int(m.group(name))


# ---- the cases ----

@pytest.mark.parametrize("trainer", ["cpp", "python"])
def test_demo_exits_0_with_every_stage_ok_and_a_plot(trainer):
    d, out, rc = run_demo(trainer)
    assert rc == 0, f"demo.sh --trainer {trainer} exited {rc}; logs in {d}"
    assert not re.search(r"^\s*\[FAILED\]", out, re.M)
    assert "** " not in out, "a stage's wait ended without its effect"
    with open(os.path.join(d, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(d, "events.txt"), errors="replace") as f:
        assert len(f.read().splitlines()) == 3  # the plot marks the three stages


@pytest.mark.parametrize("trainer", ["cpp", "python"])
def test_kill_and_return_happen_mid_run_at_the_steps_the_summary_names(trainer):
    d, out, _ = run_demo(trainer)
    logs = Logs(d)
    m = summary_line(out, r"kill -9 of trainer g1/1 at committed step (?P<k>\d+): g1's agent "
                          r"exited (?P<code>\d+) .* committed step (?P<s>\d+) without g1 .*"
                          r"\(quorum_id (?P<q>\d+), 2 groups\)")
    k, s = num(m, "k"), num(m, "s")
    # The kill: g1's agent saw its trainer die when the job had committed step k (or k+1: a
    # commit can land between the demo's reading of the step and its kill).
    agent = logs.agent("g1", 1)
    died = [iso_ms(ln) for ln in agent if " trainer_exited " in ln and "during_drain=false" in ln]
    assert died, "g1's agent logged no trainer death"
    at_death = max(x["step"] for x in logs.lines() if x["t_ms"] <= died[0])
    assert k <= at_death <= k + 1
    assert logs.agent_exit("g1", 1) == num(m, "code") == 3
    # The others went on without g1: their first step in a quorum of two.
    # (The first quorum may have had two groups too, when the third started late.)
    # Until g1 is back, that is: a later quorum of two is another stage's business.
    back = logs.first("g1", 2)["step"]
    without = [x for x in logs.lines()
               if x["replica_world_size"] == 2 and x["t_ms"] > died[0] and x["step"] < back]
    assert min(x["step"] for x in without) == s and s > k and s < STEPS
    assert {x["quorum_id"] for x in without if x["step"] == s} == {num(m, "q")}
    assert {x["group_id"] for x in without} == {"g0", "g2"}

    m = summary_line(out, r"g1 back and healed at step (?P<b>\d+), .*\(relaunched at step "
                          r"(?P<r>\d+)\), its first commit healed .*\(quorum_id (?P<q>\d+), "
                          r"(?P<w>\d+) groups\)")
    first = logs.first("g1", 2)
    assert first["step"] == num(m, "b") < STEPS
    assert first["healed"] is True and first["quorum_id"] == num(m, "q")
    assert first["replica_world_size"] == num(m, "w") == 3
    assert k <= num(m, "r") <= first["step"]
    # The new incarnation trained on to the end with the others.
    for r in (0, 1):
        steps = [x["step"] for x in logs.trainer[("g1", 2, r)]]
        assert steps == list(range(first["step"], STEPS + 1))


@pytest.mark.parametrize("trainer", ["cpp", "python"])
def test_fourth_group_trains_in_a_quorum_of_four_mid_run(trainer):
    d, out, _ = run_demo(trainer)
    logs = Logs(d)
    m = summary_line(out, r"g3 joined: started at step (?P<j>\d+), first commit at step "
                          r"(?P<f>\d+) \(healed\); a quorum of four from step (?P<four>\d+) "
                          r"\(quorum_id (?P<q>\d+)\)")
    first = logs.first("g3", 1)
    assert first["step"] == num(m, "f") and first["healed"] is True
    four = [x for x in logs.lines() if x["replica_world_size"] == 4]
    assert min(x["step"] for x in four) == num(m, "four") < STEPS
    assert {x["quorum_id"] for x in four if x["step"] == num(m, "four")} == {num(m, "q")}
    # Every group trained in that quorum: each logged a step in it before the last.
    assert {x["group_id"] for x in four if x["step"] < STEPS} == {"g0", "g1", "g2", "g3"}
    # The lighthouse issued it with four members.
    issued = [kv(ln) for life in logs.lighthouse for ln in life if " quorum_issued " in ln]
    assert any(q["quorum_id"] == m.group("q") and q["members"] == "4" for q in issued)
    # g3 was started after g1 was back (the demo waits for each stage's effect).
    assert num(m, "j") >= logs.first("g1", 2)["step"]


@pytest.mark.parametrize("trainer", ["cpp", "python"])
def test_lighthouse_restart_happens_mid_run_and_it_issues_quorums_again(trainer):
    d, out, _ = run_demo(trainer)
    logs = Logs(d)
    m = summary_line(out, r"lighthouse kill -9 at committed step (?P<l>\d+) \(quorum_id "
                          r"(?P<q0>\d+)\), restarted [\d.]+ s later at step (?P<r>\d+), the "
                          r"groups having committed (?P<away>\d+) steps? without it; its first "
                          r"quorum: quorum_id (?P<q>\d+) .* for step (?P<m>\d+), and it recorded "
                          r"commits from step (?P<c>\d+)")
    assert len(logs.lighthouse) == 2, "the lighthouse started twice"
    before, after = logs.lighthouse
    # Its first life ended with the job at the step the summary names (the demo read it from
    # the trainers' logs, which follow the lighthouse's record by at most a step).
    last_commit = [int(kv(ln)["committed_step"]) for ln in before if " commit " in ln]
    assert num(m, "l") - 1 <= last_commit[-1] <= num(m, "l") + 1
    q_before = [int(kv(ln)["quorum_id"]) for ln in before if " quorum_issued " in ln]
    assert q_before[-1] == num(m, "q0")
    # The groups trained on without it: steps beyond its record, logged before it came back.
    back_ms = iso_ms(after[0])
    away = {x["step"] for x in logs.lines() if x["step"] > last_commit[-1] and x["t_ms"] < back_ms}
    assert len(away) == num(m, "away") > 0
    assert max(away) <= num(m, "r")
    issued = [kv(ln) for ln in after if " quorum_issued " in ln]
    commits = [kv(ln) for ln in after if " commit " in ln and "ok=true" in ln]
    assert issued and commits
    assert int(issued[0]["quorum_id"]) == num(m, "q") >= num(m, "q0")  # ids never go back
    assert int(issued[0]["max_step"]) == num(m, "m") < STEPS
    assert int(commits[0]["step"]) == num(m, "c") < STEPS
    # The job went on with it, to the last step. (A commit made during the outage and
    # delivered after it may be refused: the agents do not keep those yet, issue 27.)
    assert max(int(c["step"]) for c in commits) == STEPS


@pytest.mark.parametrize("trainer", ["cpp", "python"])
def test_every_group_ends_at_the_last_step_with_identical_replicas(trainer):
    d, out, _ = run_demo(trainer)
    logs = Logs(d)
    m = summary_line(out, r"every group reached step (?P<t>\d+) \((?P<groups>[\w ]+)\) and its "
                          r"agent exited 0; the lighthouse recorded committed step (?P<c>\d+) of")
    assert num(m, "t") == num(m, "c") == STEPS
    assert m.group("groups").split() == ["g0", "g1", "g2", "g3"]
    for g in ("g0", "g1", "g2", "g3"):
        life = max(l for (gg, l, _) in logs.trainer if gg == g)
        for r in (0, 1):
            assert logs.trainer[(g, life, r)][-1]["step"] == STEPS
        assert logs.agent_exit(g, life) == 0
    with open(os.path.join(d, "status.json")) as f:
        assert json.load(f)["jobs"][0]["committed_step"] == STEPS
    m = summary_line(out, r"replicas identical: (?P<a>\d+) of (?P<n>\d+) \(step, shard\)")
    pairs = {}
    for x in logs.lines():
        pairs.setdefault((x["step"], x["group_rank"]), set()).add(x["param_hash"])
    assert num(m, "n") == len(pairs) == 2 * STEPS
    assert num(m, "a") == sum(1 for h in pairs.values() if len(h) == 1) == len(pairs)


@pytest.mark.parametrize("trainer", ["cpp", "python"])
def test_final_loss_is_compared_with_a_reference_that_repeats_the_changes(trainer):
    d, out, _ = run_demo(trainer)
    run, ref = Logs(d), Logs(os.path.join(d, "ref"))
    m = summary_line(out, r"final eval loss (?P<loss>[\d.]+) against the reference's "
                          r"(?P<ref>[\d.]+) \((?P<pct>[+-][\d.]+)%\)")
    loss, ref_loss = run.eval_at(STEPS), ref.eval_at(STEPS)
    assert float(m.group("loss")) == pytest.approx(loss, abs=1e-4)
    assert float(m.group("ref")) == pytest.approx(ref_loss, abs=1e-4)
    assert float(m.group("pct")) == pytest.approx(100 * (loss - ref_loss) / ref_loss, abs=0.06)
    # What the summary says the reference did, against its logs: no failure (every agent
    # exited 0, the lighthouse started once), g1 drained where the run's was killed and came
    # back, g3 joined where the run's did.
    m = re.search(r"reference: .* g1 drained at step (?P<drain>\d+) and was back at step "
                  r"(?P<back>\d+) \(the run: killed at (?P<k>\d+), back at (?P<rb>\d+)\); g3's "
                  r"first commit at step (?P<g3>\d+), a quorum of four from step (?P<four>\d+)",
                  out)
    assert m, "the summary does not say what the reference repeated"
    assert len(ref.lighthouse) == 1
    for (g, life, _) in ref.trainer:
        assert ref.agent_exit(g, life) == 0
    drained = max(x["step"] for x in ref.lines("g1", 1))
    assert drained >= num(m, "drain") >= num(m, "k")
    assert ref.first("g1", 2)["step"] == num(m, "back")
    assert run.first("g1", 2)["step"] == num(m, "rb")
    assert ref.first("g3", 1)["step"] == num(m, "g3")
    assert min(x["step"] for x in ref.lines() if x["replica_world_size"] == 4) == num(m, "four")
    # The reference made each change no earlier than the run did.
    launched = int(re.search(r"g3 joined: started at step (\d+)", out).group(1))
    assert ref.first("g3", 1)["step"] > launched
    assert ref.first("g1", 2)["step"] > num(m, "k")


def test_summary_fails_a_stage_that_did_not_happen_mid_run():
    """The same logs, with every line of the quorum of four before the last step taken out (as
    when the fourth group's first commit came with the last step): the summary marks the join
    FAILED and exits 1."""
    d, _, rc = run_demo("cpp")
    assert rc == 0
    late = tempfile.mkdtemp(prefix="lk-demo-late-")
    try:
        shutil.copytree(d, late, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            "*.sock", "live-*", "ckpt-*", "lighthouse-data"))
        for p in glob.glob(os.path.join(late, "trainer-*.jsonl")):
            with open(p, errors="replace") as f:
                kept = [ln for ln in f if '"replica_world_size":4,' not in ln
                        or json.loads(ln)["step"] == STEPS]
            with open(p, "w") as f:
                f.writelines(kept)
        p = subprocess.run(["/usr/bin/python3", os.path.join(SOURCE, "scripts", "demo_summary.py"),
                            late, str(STEPS)], stdout=subprocess.PIPE, text=True)
        print(p.stdout)
        assert p.returncode == 1
        joined = [ln for ln in p.stdout.splitlines() if "g3 joined" in ln]
        assert len(joined) == 1 and joined[0].lstrip().startswith("[FAILED]")
        assert f"a quorum of four from step {STEPS}" in joined[0]
        assert "not mid-run" in joined[0]
    finally:
        shutil.rmtree(late, ignore_errors=True)
