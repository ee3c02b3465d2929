"""Replicas never split in silence: the DiLoCo join hands every member the same starting state
whatever the Manager did before it, and a member whose state hash leaves the quorum's reference
state is flagged by the lighthouse at once and heals at the next quorum (trainers.py, modes
readme and diloco)."""

import json
import re
import signal
import urllib.request
from collections import defaultdict

from test_manager import events


def status(c):
    with urllib.request.urlopen(c.url + "/status", timeout=10) as r:
        return json.loads(r.read())


def metrics(c):
    with urllib.request.urlopen(c.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def groups_of(c):
    for job in status(c).get("jobs", []):
        if job.get("job") == "py":
            return {g["group_id"]: g for g in job.get("groups", [])}
    return {}


def start_groups(c, names, size, mode_args, extra=lambda g, r: []):
    ts = defaultdict(list)
    for g in names:
        c.agent(g)
    for gi, g in enumerate(names):
        for r in range(size):
            ts[g].append(c.trainer(g, [*mode_args, "--group-rank", str(r), "--group-size",
                                       str(size), "--data-seed", g,
                                       "--init-seed", str(100 * gi + r), *extra(g, r)]))
    return ts


def test_readme_order_poll_process_group_ddp_then_diloco_ends_identical(cluster_factory):
    # The README's lower layer first (a poll, the group's process group, DDP over it), then the
    # DiLoCo context: two groups of two trainers, each group from its own random weights. The
    # poll before the context used to take the first quorum's heal away from the join, and the
    # groups then trained on from their own weights, each step's averaged update applied to
    # different weights, with nothing flagged.
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "5000"))
    ts = start_groups(c, ("g0", "g1"), 2, ["readme", "--steps", "4", "--sync-every", "3"])
    every = [t for g in ts for t in ts[g]]
    for t in every:
        assert t.wait(180) == 0, t.log()
    built = {g: {events(t, "built")[0]["model_hash"] for t in ts[g]} for g in ts}
    assert len(built["g0"]) == 1 and len(built["g1"]) == 1  # DDP: the group agrees
    assert built["g0"] != built["g1"]  # the groups start apart
    joined = {events(t, "joined")[0]["model_hash"] for t in every}
    assert joined == built["g0"], (joined, built)  # replica_rank 0's weights, everywhere
    for step in (1, 2, 3, 4):
        hashes = {[e for e in events(t, "outer") if e["kind"] == "committed"][step - 1]
                  ["model_hash"] for t in every}
        assert len(hashes) == 1, f"step {step}: {hashes}"
    assert len({events(t, "finished")[0]["model_hash"] for t in every}) == 1
    assert "diverged" not in c.lighthouse.log()


def test_a_durable_restore_told_to_a_poll_before_the_context_still_happens(cluster_factory,
                                                                          tmp_dir):
    # The whole job restarts from its durable checkpoint: the heal that says so goes to the
    # first answer of the quorum, which the poll before the context took; the join must
    # restore all the same, not start over from its own weights at step 0.
    c = cluster_factory()
    ckpt = str(tmp_dir / "ckpt-g0")
    c.agent("g0")
    first = c.trainer("g0", ["readme", "--steps", "2", "--sync-every", "3", "--ckpt-dir", ckpt,
                             "--ckpt-every", "2"])
    assert first.wait(120) == 0, first.log()
    saved = [e for e in events(first, "outer") if e["kind"] == "committed" and e["step"] == 2]
    c.agents["g0"].signal(signal.SIGTERM)
    c.agents["g0"].wait(30)
    c.agent("g0")
    second = c.trainer("g0", ["readme", "--steps", "4", "--sync-every", "3", "--ckpt-dir", ckpt,
                              "--init-seed", "99"])
    assert second.wait(120) == 0, second.log()
    assert events(second, "poll")[0]["heal"]  # the poll before the context had the restore
    joined = events(second, "joined")[0]
    assert joined["step"] == 2 and joined["model_hash"] == saved[0]["model_hash"], second.log()
    assert "heal_from_earlier_poll" in second.log()
    assert [e["step"] for e in events(second, "outer") if e["kind"] == "committed"] == [3, 4]


def perturbed_run(c, names, perturbed, step, steps=6):
    """Groups of two trainers in the README's order; trainer 1 of `perturbed` perturbs its
    shard of the global weights once, after the outer update of `step` (the test hook)."""
    ts = start_groups(c, names, 2, ["readme", "--steps", str(steps), "--sync-every", "3",
                                    "--sleep-ms", "20"],
                      lambda g, r: ["--perturb-at-step", str(step)]
                      if (g, r) == (perturbed, 1) else [])
    # Flagged at once: the commit of the perturbed step itself is found off the reference.
    line = c.lighthouse.wait_log(
        rf'diverged job="?py"? quorum_id=\d+ group="?{perturbed}"? \S+ step={step} .*', 120)
    seen = groups_of(c)[perturbed]
    assert seen.get("divergences") == 1 and seen.get("diverged_step") == step, seen
    every = [t for g in ts for t in ts[g]]
    for t in every:
        assert t.wait(240) == 0, t.log()
    return ts, every, line.group(0)


def check_healed(c, ts, every, perturbed, step, steps=6):
    # The group off the reference got a heal in its poll answer at the next quorum and took
    # the reference state from live peers; from then on every trainer holds the same weights.
    heal_steps = set()
    for t in ts[perturbed]:
        healed = [e for e in events(t, "outer") if e["kind"] == "received"]
        assert healed and healed[0]["healed"] and healed[0]["step"] >= step, t.log()
        heal_steps.add(healed[0]["step"])
        assert re.search(r"quorum_joined .* healed=true .*diverged from the quorum's at step "
                         + str(step), t.log()), t.log()
    assert len(heal_steps) == 1
    for s in range(heal_steps.pop() + 1, steps + 1):
        hashes = {[e for e in events(t, "outer") if e["kind"] == "committed" and e["step"] == s]
                  [0]["model_hash"] for t in every}
        assert len(hashes) == 1, f"step {s}: {hashes}"
    assert len({events(t, "finished")[0]["model_hash"] for t in every}) == 1
    assert re.search(rf"state_diverged step={step} quorum_id=\d+ heal=true",
                     c.agents[perturbed].log()), c.agents[perturbed].log()
    lh = c.lighthouse.log()
    assert re.search(rf'diverged_healed job="?py"? group="?{perturbed}"? .* diverged_step={step}',
                     lh), lh
    assert len(re.findall(r" diverged job=", lh)) == 1, lh
    g = groups_of(c)[perturbed]
    assert not g.get("diverged") and g.get("divergences") == 1, g
    assert g.get("diverged_step") == step, g
    text = metrics(c)
    assert re.search(r'^lk_divergences_total\{job="py"\} 1$', text, re.M), text
    assert re.search(rf'^lk_group_diverged\{{job="py",group="{perturbed}"\}} 0$', text,
                     re.M), text


def test_a_perturbed_group_of_two_groups_is_flagged_by_the_tie_rule_and_heals(cluster_factory):
    # Two groups: the hashes tie one to one, and the tie goes to the lowest replica_rank's
    # state, so g1 (replica_rank 1), whose trainer perturbed its shard, is the one off it.
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "5000"))
    ts, every, line = perturbed_run(c, ("g0", "g1"), "g1", 2)
    assert "rule=tie_lowest_replica_rank reference_replica_rank=0" in line, line
    check_healed(c, ts, every, "g1", 2)
    assert not groups_of(c)["g0"].get("divergences")


def test_a_perturbed_group_of_three_groups_is_flagged_by_the_majority_and_heals(
        cluster_factory):
    c = cluster_factory(("--min-replicas", "3", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "5000"))
    ts, every, line = perturbed_run(c, ("g0", "g1", "g2"), "g1", 2)
    assert "rule=majority" in line, line
    check_healed(c, ts, every, "g1", 2)
    for g in ("g0", "g2"):
        assert not groups_of(c)[g].get("divergences")
