"""lightkeeper.DiLoCo against real processes: the C++ library's outer step on a PyTorch model,
with groups of Python trainers (trainers.py, mode diloco)."""

import re
import signal
import subprocess
from collections import defaultdict

import pytest

from conftest import BIN_DIR, Cluster
from test_manager import events


def outer_commits(proc):
    return [e for e in events(proc, "outer") if e["kind"] == "committed"]


def test_two_groups_commit_bitwise_equal_weights_at_every_step(cluster_factory):
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    ts = []
    for g in ("g0", "g1"):
        c.agent(g)
        ts.append(c.trainer(g, ["diloco", "--steps", "4", "--sync-every", "3",
                                "--data-seed", g]))
    for t in ts:
        assert t.wait(120) == 0, t.log()
    by_step = defaultdict(set)
    for t in ts:
        joined = events(t, "joined")[0]
        assert joined["views"]  # the parameters are views into the flat buffer
        commits = outer_commits(t)
        assert [e["step"] for e in commits] == [1, 2, 3, 4], t.log()
        for e in commits:
            assert e["world"] == 2
            by_step[e["step"]].add(e["model_hash"])
        assert events(t, "finished")
    for step, hashes in by_step.items():
        assert len(hashes) == 1, f"step {step}: {hashes}"
    # Both started from the same global weights (replica_rank 0's) and trained on different
    # data, so equal weights after each commit come from the outer step, not equal inputs.
    assert len({events(t, "joined")[0]["model_hash"] for t in ts}) == 1
    # replica_rank 0 joined with its own weights; the other received them and started its
    # inner optimizer afresh.
    kinds = sorted((events(t, "joined")[0]["kind"], events(t, "joined")[0]["inner"]) for t in ts)
    assert kinds == [("joined", "keep"), ("received", "reset")], kinds
    losses = [[e["loss"] for e in outer_commits(t)] for t in ts]
    assert losses[0] != losses[1]
    for g in ("g0", "g1"):
        assert "trainer_crashed" not in c.agents[g].log()


def test_three_groups_with_int4_outer_compression_commit_bitwise_equal_weights(cluster_factory):
    # The encoded exchange: each owner decodes and sums the contributions in float32 and every
    # member decodes the same encoded result, so the weights agree bit for bit after each
    # commit, though every pseudo-gradient lost precision on the way.
    c = cluster_factory(("--min-replicas", "3", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    ts = []
    for g in ("g0", "g1", "g2"):
        c.agent(g)
        ts.append(c.trainer(g, ["diloco", "--steps", "4", "--sync-every", "3",
                                "--data-seed", g, "--outer-compress", "int4"]))
    for t in ts:
        assert t.wait(120) == 0, t.log()
    by_step = defaultdict(set)
    for t in ts:
        commits = outer_commits(t)
        assert [e["step"] for e in commits] == [1, 2, 3, 4], t.log()
        for e in commits:
            assert e["world"] == 3
            by_step[e["step"]].add(e["model_hash"])
    assert len(by_step) == 4
    for step, hashes in by_step.items():
        assert len(hashes) == 1, f"step {step}: {hashes}"


def test_an_unknown_outer_compress_is_refused_by_name(cluster_factory):
    c = cluster_factory(("--min-replicas", "1",))
    c.agent("g0")
    t = c.trainer("g0", ["diloco", "--steps", "1", "--outer-compress", "int2"])
    assert t.wait(60) != 0
    assert "unknown outer_compress 'int2'" in t.log(), t.log()


def test_two_groups_of_two_trainers_shard_the_outer_state(cluster_factory):
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "5000"))
    ts = defaultdict(list)
    for g in ("g0", "g1"):
        c.agent(g)
        for r in range(2):
            ts[g].append(c.trainer(g, ["diloco", "--group-rank", str(r), "--group-size", "2",
                                       "--steps", "3", "--sync-every", "2", "--data-seed", g]))
    for g in ts:
        for t in ts[g]:
            assert t.wait(180) == 0, t.log()
    for step in (1, 2, 3):
        models = {outer_commits(t)[step - 1]["model_hash"] for g in ts for t in ts[g]}
        assert len(models) == 1  # all four trainers hold the same global weights
        shard0 = {outer_commits(ts[g][0])[step - 1]["state_hash"] for g in ts}
        shard1 = {outer_commits(ts[g][1])[step - 1]["state_hash"] for g in ts}
        assert len(shard0) == 1 and len(shard1) == 1
        assert shard0 != shard1  # each trainer holds its own shard


def test_drain_sets_should_stop_and_the_context_exits_cleanly(cluster_factory):
    c = cluster_factory()
    agent = c.agent("g0", ["--drain-timeout-ms", "10000"])
    t = c.trainer("g0", ["diloco", "--steps", "100000", "--sync-every", "2", "--sleep-ms", "5"])
    t.wait_log(r'"kind": "committed"', 60)
    agent.signal(signal.SIGTERM)
    assert t.wait(60) == 0, t.log()
    stop = events(t, "stopping")
    assert stop and stop[0]["should_stop"], t.log()
    assert events(t, "outer")[-1]["kind"] == "drained"
    assert agent.wait(30) == 0


@pytest.mark.parametrize("saved,restored", [("float32", "float32"), ("bf16", "bf16"),
                                            ("float32", "bf16"), ("bf16", "float32")])
def test_durable_restore_resumes_the_inner_optimizer(cluster_factory, tmp_dir, saved, restored):
    # bf16: the model and torch's AdamW moments are bf16, the checkpoint float32; the restore
    # gives back the same bf16 weights and moments. The checkpoint holds the float32 outer state
    # whatever the model's dtype, so a job that changes its model's dtype between lives restores
    # the same global weights, bit for bit, and trains on from them.
    c = cluster_factory()
    ckpt = str(tmp_dir / "ckpt-g0")
    c.agent("g0")
    first = c.trainer("g0", ["diloco", "--steps", "4", "--sync-every", "3",
                             "--ckpt-dir", ckpt, "--ckpt-every", "2", "--param-dtype", saved])
    assert first.wait(120) == 0, first.log()
    saved_steps = [e for e in outer_commits(first) if e["saved"]]
    assert [e["step"] for e in saved_steps] == [2, 4], first.log()
    at_save = saved_steps[-1]
    assert at_save["global_hash"], first.log()
    # The project's checkpoint format, tensors named by the model's parameter names.
    inspect = subprocess.run([str(BIN_DIR / "lkctl"), "checkpoint", "inspect", ckpt],
                             capture_output=True, text=True, timeout=60)
    assert inspect.returncode == 0, inspect.stderr
    assert re.search(r"^step 4$", inspect.stdout, re.M), inspect.stdout
    names = set(re.findall(r"^tensor (\S+)", inspect.stdout, re.M))
    for name in ("embed.weight", "embed.bias", "head.weight", "outer_momentum/embed.weight",
                 "inner/exp_avg/embed.weight", "inner/exp_avg_sq/head.weight",
                 "inner/step/embed.bias"):
        assert name in names, sorted(names)
    verify = subprocess.run([str(BIN_DIR / "lkctl"), "checkpoint", "verify", ckpt],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and "verified" in verify.stdout, verify.stdout + verify.stderr
    # The whole job restarts: a new life of the group with no live state anywhere restores the
    # registered durable checkpoint of step 4, inner optimizer included.
    c.agents["g0"].signal(signal.SIGTERM)
    c.agents["g0"].wait(30)
    c.agent("g0")
    second = c.trainer("g0", ["diloco", "--steps", "6", "--sync-every", "3",
                              "--ckpt-dir", ckpt, "--param-dtype", restored])
    assert second.wait(120) == 0, second.log()
    joined = events(second, "joined")[0]
    assert joined["step"] == 4, second.log()
    assert joined["kind"] == "received", joined
    assert joined["heal_source"].startswith("durable"), joined
    assert joined["global_hash"] == at_save["global_hash"]  # the same float32 global weights
    if saved == restored:
        assert joined["inner"] == "restored", second.log()
        assert joined["inner_hash"] == at_save["inner_hash"]  # AdamW resumes where it stopped
        assert joined["model_hash"] == at_save["model_hash"]
    commits = outer_commits(second)
    assert [e["step"] for e in commits] == [5, 6]
    assert all(e["global_hash"] for e in commits)


def test_drain_in_a_group_of_two_stops_both_trainers_together_without_a_hang(cluster_factory):
    c = cluster_factory()
    agent = c.agent("g0", ["--drain-timeout-ms", "15000"])
    ts = [c.trainer("g0", ["diloco", "--group-rank", str(r), "--group-size", "2", "--steps",
                           "100000", "--sync-every", "3", "--sleep-ms", "5"]) for r in range(2)]
    for t in ts:
        t.wait_log(r'"kind": "committed"', 90)
    agent.signal(signal.SIGTERM)
    for t in ts:
        assert t.wait(60) == 0, t.log()
    last = [events(t, "outer")[-1] for t in ts]
    assert [e["kind"] for e in last] == ["drained", "drained"], [t.log() for t in ts]
    assert last[0]["step"] == last[1]["step"]
    assert all(events(t, "stopping")[0]["should_stop"] for t in ts)
    assert agent.wait(30) == 0


def test_a_late_group_heals_from_live_peers_with_a_fresh_inner_optimizer(cluster_factory):
    c = cluster_factory(("--min-replicas", "1", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    c.agent("g0")
    first = c.trainer("g0", ["diloco", "--steps", "12", "--sync-every", "3", "--sleep-ms", "300",
                             "--data-seed", "g0"])
    first.wait_log(r'"step": 2, "quorum_id"', 90)
    c.agent("g1")
    late = c.trainer("g1", ["diloco", "--steps", "12", "--sync-every", "3", "--data-seed", "g1"])
    assert first.wait(60) == 0, first.log()
    assert late.wait(60) == 0, late.log()
    joined = events(late, "joined")[0]
    assert joined["kind"] == "received" and joined["step"] >= 2, late.log()
    assert joined["heal_source"] == "peers", joined
    assert joined["inner"] == "reset"  # the DiLoCo convention for a live heal
    mine = {e["step"]: e["model_hash"] for e in outer_commits(first)}
    theirs = {e["step"]: e["model_hash"] for e in outer_commits(late)}
    common = sorted(set(mine) & set(theirs))
    assert common, (mine, theirs)
    assert all(mine[s] == theirs[s] for s in common)


def test_sync_every_s_and_outer_fragments_out_of_range_are_refused():
    import lightkeeper
    for bad in (0, -1.0, 1e9):
        try:
            lightkeeper.DiLoCo(None, None, None, sync_every=4, sync_every_s=bad)
        except lightkeeper.Error as e:
            assert e.code == "invalid_argument"
        else:
            raise AssertionError(f"sync_every_s={bad} was taken")
    for bad in (0, -1, 65):
        try:
            lightkeeper.DiLoCo(None, None, None, sync_every=4, outer_fragments=bad)
        except lightkeeper.Error as e:
            assert e.code == "invalid_argument" and "outer_fragments" in str(e)
        else:
            raise AssertionError(f"outer_fragments={bad} was taken")


def test_time_budgets_and_tokens_weigh_the_outer_average(cluster_factory):
    """Two groups of two trainers with one time budget per outer step, one group's inner steps
    twice as long: each group's trainers stop after the same inner step, every commit reports
    the group's tokens (what its trainers passed to step(), summed), the average is weighted,
    and every trainer holds the same global weights (global_hash) at every step."""
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "5000"))
    ts = defaultdict(list)
    for g, sleep_ms in (("g0", "10"), ("g1", "20")):
        c.agent(g)
        for r in range(2):
            ts[g].append(c.trainer(g, ["diloco", "--group-rank", str(r), "--group-size", "2",
                                       "--steps", "3", "--sync-every", "1000",
                                       "--sync-every-s", "0.3", "--sleep-ms", sleep_ms,
                                       "--tokens", "16", "--data-seed", g]))
    for g in ts:
        for t in ts[g]:
            assert t.wait(180) == 0, t.log()
    for step in (1, 2, 3):
        rows = {g: [outer_commits(t)[step - 1] for t in ts[g]] for g in ts}
        for g, (a, b) in rows.items():
            assert a["ran"] == b["ran"], (g, step, a, b)  # one stop for the group
            assert a["ran"] < 1000  # the budget ended the inner steps, not sync_every
            assert a["tokens"] == b["tokens"] == a["ran"] * 16 * 2
            assert a["weighted"] and b["weighted"]
        totals = {e["quorum_tokens"] for g in rows for e in rows[g]}
        assert totals == {rows["g0"][0]["tokens"] + rows["g1"][0]["tokens"]}
        assert len({e["global_hash"] for g in rows for e in rows[g]}) == 1
        assert len({e["model_hash"] for g in rows for e in rows[g]}) == 1


def test_overlapped_outer_steps_agree_across_groups_and_a_lone_group_matches_blocking(
        cluster_factory, tmp_dir):
    # Two overlapped groups: every step is committed, by both, with one global hash; the first
    # outer step only starts the exchange ("started"), the last one is landed by flush(), after
    # which the model holds exactly the global weights.
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    ts = []
    for g in ("g0", "g1"):
        c.agent(g)
        ts.append(c.trainer(g, ["diloco", "--steps", "4", "--sync-every", "3",
                                "--data-seed", g, "--overlap"]))
    for t in ts:
        assert t.wait(120) == 0, t.log()
    by_step = defaultdict(set)
    for t in ts:
        outer = events(t, "outer")
        assert outer[0]["kind"] == "started", t.log()
        commits = [e for e in outer if e["kind"] == "committed"]
        assert [e["step"] for e in commits] == [1, 2, 3, 4], t.log()
        for e in commits:
            by_step[e["step"]].add(e["global_hash"])
            # Between outer steps the model carries the group's progress on the global weights.
            assert e["global_weights_hash"] != e["model_hash"] or e is commits[-1]
        assert commits[-1]["global_weights_hash"] == commits[-1]["model_hash"]
    for step, hashes in by_step.items():
        assert len(hashes) == 1 and "" not in hashes, f"step {step}: {hashes}"

    # A group alone: its stand-in for the average is the average, so overlapped and blocking
    # runs commit the same global weights at every step, bit for bit. Each run is a cluster of
    # its own (its own lighthouse state).
    def alone(name, flags):
        sub = tmp_dir / name
        sub.mkdir()
        c = Cluster(sub, ("--min-replicas", "1", "--join-timeout-ms", "300"))
        try:
            c.agent("g0")
            t = c.trainer("g0", ["diloco", "--steps", "4", "--sync-every", "3",
                                 "--data-seed", "g0"] + flags)
            assert t.wait(120) == 0, t.log()
            return [(e["step"], e["global_hash"]) for e in outer_commits(t)]
        finally:
            c.close()
    blocking, overlapped = alone("blocking", []), alone("overlapped", ["--overlap"])
    assert [s for s, _ in blocking] == [1, 2, 3, 4]
    assert overlapped == blocking


def test_overlap_in_fragments_agrees_across_groups_and_needs_overlap(cluster_factory):
    # Two overlapped groups whose exchanges go in 3 fragments each (with int8 on the wire): one
    # global hash per step, every step committed by both.
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    ts = []
    for g in ("g0", "g1"):
        c.agent(g)
        ts.append(c.trainer(g, ["diloco", "--steps", "4", "--sync-every", "3", "--data-seed", g,
                                "--overlap", "--outer-fragments", "3", "--outer-compress",
                                "int8", "--sleep-ms", "5"]))
    for t in ts:
        assert t.wait(120) == 0, t.log()
        assert "exchange_fragments pieces=3 " in t.log(), t.log()
    by_step = defaultdict(set)
    for t in ts:
        commits = outer_commits(t)
        assert [e["step"] for e in commits] == [1, 2, 3, 4], t.log()
        for e in commits:
            by_step[e["step"]].add(e["global_hash"])
    for step, hashes in by_step.items():
        assert len(hashes) == 1 and "" not in hashes, f"step {step}: {hashes}"

    # Fragments are spread over the inner steps of an overlapped exchange: without overlap the
    # option is refused by name when the DiLoCo object is made.
    c.agent("g2")
    t = c.trainer("g2", ["diloco", "--steps", "1", "--outer-fragments", "3"])
    assert t.wait(60) != 0
    assert "outer_fragments 3 needs overlap" in t.log(), t.log()
