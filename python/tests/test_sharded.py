"""DiLoCo over sharded models (the HSDP layout: each group's trainers hold rows of every
parameter, DiLoCo across groups): ``DiLoCo(shards=...)`` with real processes (trainers.py, mode
zero3, ZeRO-3 by hand), mixed in one job with replicated groups, healing and restoring across
layouts; and the refusals of bad shard descriptions."""

import json
import re
import signal
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import lightkeeper
from conftest import wait_for
from test_manager import events


def commits(proc):
    return [e for e in events(proc, "outer") if e["kind"] == "committed"]


def zero3(c, group, size, steps, extra=(), shard=True):
    """The trainers of one group (started together: the group's process group needs them)."""
    flags = ["zero3", "--steps", str(steps), "--sync-every", "3", "--data-seed", group,
             "--group-size", str(size), *extra]
    if shard:
        flags.append("--shard-model")
    return [c.trainer(group, flags + ["--group-rank", str(r)]) for r in range(size)]


def by_step(trainers, key):
    out = defaultdict(set)
    for t in trainers:
        for e in commits(t):
            out[e["step"]].add(e[key])
    return out


# bf16 weights in sharded groups: the example trainers' test below (both languages).
@pytest.mark.parametrize("compress,overlap,dtype,layout", [("none", False, "float32", "chunk"),
                                                          ("int8", True, "float32", "skew")])
def test_sharded_and_replicated_groups_hold_the_same_weights_at_every_commit(
        cluster_factory, compress, overlap, dtype, layout):
    # A replicated group of 1 and sharded groups of 2 and 3 in one job: the groups' row layouts
    # differ (fragment-wise exchange), no trainer of a sharded group ever holds the whole model
    # outside an inner step, and every member ends every commit with the same global weights.
    c = cluster_factory(("--min-replicas", "3", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    groups = {"g0": 1, "g1": 2, "g2": 3}
    ts = {}
    for g in groups:
        c.agent(g)
    for g, size in groups.items():
        flags = ["--outer-compress", compress, "--param-dtype", dtype]
        if g == "g2":
            # Not the even split: torch.chunk's rows (FSDP2's Shard(0): TinyModel's 16 and 4
            # rows over 3 are 6/6/4 and 2/2/0 there, 6/5/5 and 2/1/1 in the even split), or a
            # tiling of no rule (shares 1:2:3); the group moves the rows that differ at every
            # outer step.
            flags += ["--shard-rule", layout]
        ts[g] = zero3(c, g, size, 4, flags + (["--overlap"] if overlap else []), shard=size > 1)
    everyone = [t for g in ts for t in ts[g]]
    for t in everyone:
        assert t.wait(120) == 0, t.log()
    for t in everyone:
        assert [e["step"] for e in commits(t)] == [1, 2, 3, 4], t.log()
        assert all(e["world"] == 3 for e in commits(t))
    hashes = by_step(everyone, "global_hash")
    models = by_step(everyone, "model_hash")
    for step in (1, 2, 3, 4):
        assert len(hashes[step]) == 1 and "" not in hashes[step], (step, hashes[step])
        # The whole model, gathered from the shards, is the replicated trainer's bit for bit
        # (with overlap each group's model carries its own inner progress on top).
        assert overlap or len(models[step]) == 1, (step, models[step])
    # Each sharded trainer holds its rows only: model and outer state about 1/n of the
    # replicated trainer's (TinyModel's rows do not all split evenly: within a row of each).
    whole = commits(ts["g0"][0])[-1]
    assert not whole["shard_model"]
    for g in ("g1", "g2"):
        for t in ts[g]:
            last = commits(t)[-1]
            assert last["shard_model"]
            n = groups[g]
            if g == "g1" or layout == "chunk":  # the skewed tiling holds shares 1:2:3
                assert last["model_bytes"] < whole["model_bytes"] * 1.5 / n, (g, last, whole)
            # The outer state is the even split whatever the caller's rows.
            assert last["outer_state_bytes"] < whole["outer_state_bytes"] * 1.5 / n
        # The group's rows tile the model: their bytes add up to the whole.
        assert sum(commits(t)[-1]["model_bytes"] for t in ts[g]) == whole["model_bytes"]
    # g2 exchanged its rows at the join and moves the rows off the even split inside the group.
    kind = {"chunk": "chunk", "skew": "explicit"}[layout]
    for t in ts["g2"]:
        assert re.search(rf"shard_rows_agreed layout={kind} group_size=3 "
                         r"elements_moved_per_step=[1-9]", t.log()), t.log()


def test_a_sharded_group_restores_a_checkpoint_of_another_layout_and_heals_after_kill(
        cluster_factory, tmp_dir):
    c = cluster_factory(("--min-replicas", "1", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    ckpt = str(tmp_dir / "ckpt-g1")
    c.agent("g1")
    # A sharded group of 2 saves every 2 steps, per shard.
    first = zero3(c, "g1", 2, 4, ["--ckpt-dir", ckpt, "--ckpt-every", "2"])
    for t in first:
        assert t.wait(120) == 0, t.log()
    at_save = [e for e in commits(first[0]) if e["saved"]][-1]
    assert at_save["step"] == 4, first[0].log()
    # The whole job restarts as a sharded group of 3: it restores step 4 by rows (another
    # layout), with the same global weights and the inner optimizer resumed, nothing gathered.
    c.agents["g1"].signal(signal.SIGTERM)
    c.agents["g1"].wait(30)
    c.agent("g1")
    second = zero3(c, "g1", 3, 60, ["--ckpt-dir", ckpt, "--sleep-ms", "100"])
    for t in second:
        wait_for(lambda: events(t, "joined"), 90, "the restored group's join")
    for t in second:
        joined = events(t, "joined")[0]
        assert joined["step"] == 4 and joined["kind"] == "received", t.log()
        assert joined["heal_source"].startswith("durable"), joined
        assert joined["global_hash"] == at_save["global_hash"]
        assert joined["model_hash"] == at_save["model_hash"]
        assert joined["inner"] == "restored", joined
    # A replicated group joins the running job and heals from the sharded group's live rows.
    c.agent("g0")
    late = zero3(c, "g0", 1, 60, ["--sleep-ms", "150"], shard=False)[0]
    wait_for(lambda: commits(late), 90, "the replicated group's first commit")
    assert events(late, "joined")[0]["heal_source"] == "peers", late.log()
    # kill -9 of one sharded trainer ends its group's life; a new life of the group (a sharded
    # group of 2 now) heals from the replicated group's live state, by rows.
    second[1].signal(signal.SIGKILL)
    for t in (second[0], second[2]):
        assert t.wait(90) != 0, t.log()
    c.agents["g1"].signal(signal.SIGTERM)
    c.agents["g1"].wait(30)
    c.agent("g1")
    third = zero3(c, "g1", 2, 60, ["--ckpt-dir", ckpt])
    for t in third + [late]:
        assert t.wait(120) == 0, t.log()
    for t in third:
        joined = events(t, "joined")[0]
        assert joined["kind"] == "received" and joined["heal_source"] == "peers", t.log()
        assert joined["inner"] == "reset"  # the DiLoCo convention for a live heal
    mine = {e["step"]: (e["global_hash"], e["model_hash"]) for e in commits(late)}
    for t in third:
        theirs = {e["step"]: (e["global_hash"], e["model_hash"]) for e in commits(t)}
        common = sorted(set(mine) & set(theirs))
        assert common and common[-1] == 60, (mine, theirs)
        assert all(mine[s] == theirs[s] for s in common)


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _rows_of(model, rank, size, rule="even"):
    """The model cut to rank's rows under rule, with its shards description."""
    shards = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            b, e = lightkeeper.shard_rows(p.shape[0], size, rank, rule)
            shards[name] = (tuple(p.shape), b)
            p.data = p.data[b:e].clone()
    return shards


def test_shard_rows_is_the_even_split_and_refuses_nonsense():
    assert [lightkeeper.shard_rows(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8),
                                                                    (8, 10)]
    assert lightkeeper.shard_rows(2, 3, 2) == (2, 2)  # fewer rows than trainers: none here
    # torch.chunk's rule (FSDP2's Shard(0)): ceil(rows / size) each, the last short or empty.
    assert [lightkeeper.shard_rows(10, 4, r, "chunk") for r in range(4)] == [(0, 3), (3, 6),
                                                                            (6, 9), (9, 10)]
    assert [lightkeeper.shard_rows(5, 4, r, "chunk") for r in range(4)] == [(0, 2), (2, 4),
                                                                           (4, 5), (5, 5)]
    chunks = torch.arange(23).chunk(5)
    assert [lightkeeper.shard_rows(23, 5, r, "chunk") for r in range(5)] == [
        (int(c[0]), int(c[-1]) + 1) for c in chunks]
    for bad in ((0, 2, 0), (5, 2, 2), (5, 0, 0), (5, 2, 0, "Shard(0)")):
        with pytest.raises(ValueError):
            lightkeeper.shard_rows(*bad)


def test_bad_shard_descriptions_are_refused_naming_the_parameter_and_rows():
    group = types.SimpleNamespace(group_rank=1, group_size=2)  # the layout needs rank and size

    def refused(shards_of, model=None):
        m, opt = _model_and_opt() if model is None else model
        shards = shards_of(m)
        d = lightkeeper.DiLoCo(group, m, opt, sync_every=2, shards=shards)
        with pytest.raises(lightkeeper.InvalidArgument) as e:
            d._flatten()
        assert isinstance(e.value, ValueError)
        return str(e.value)

    def good(m):
        return _rows_of(m, 1, 2)

    # The right description is taken: the library's specs are the whole model's.
    m, opt = _model_and_opt()
    d = lightkeeper.DiLoCo(group, m, opt, sync_every=2, shards=good(m))
    d._flatten()
    assert [s.name for s in d._specs] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [s.offset for s in d._specs] == [0, 15, 20, 30]
    assert [list(s.shape) for s in d._specs] == [[5, 3], [5], [2, 5], [2]]
    assert d._flat.numel() == 2 * 3 + 2 + 1 * 5 + 1  # rows [3,5), [3,5), [1,2), [1,2)

    # (Overlaps and gaps between trainers are the group's to find, at its join: the test with
    # real trainers below.)
    def past_end(m):
        s = good(m)
        s["2.weight"] = ((1, 5), 1)  # global rows 1, but it starts at row 1
        return s
    msg = refused(past_end)
    assert "2.weight" in msg and "[1, 2)" in msg, msg

    def wrong_shape(m):
        s = good(m)
        s["0.weight"] = ((5, 4), 3)  # the local rows have 3 columns
        return s
    msg = refused(wrong_shape)
    assert "0.weight" in msg and "(5, 4)" in msg, msg

    def missing(m):
        s = good(m)
        del s["2.bias"]
        return s
    assert "2.bias" in refused(missing)

    def unknown(m):
        s = good(m)
        s["nope"] = ((1,), 0)
        return s
    assert "nope" in refused(unknown)

    # torch.chunk's rows are taken too (rank 1 of 4: 0.weight's 5 rows are [2, 4) there, [2, 3)
    # in the even split), and rows of no rule: the library gets them as they are.
    chunk_group = types.SimpleNamespace(group_rank=1, group_size=4)
    m, opt = _model_and_opt()
    d = lightkeeper.DiLoCo(chunk_group, m, opt, sync_every=2,
                           shards=_rows_of(m, 1, 4, "chunk"))
    d._flatten()
    assert d._sharding.rows["0.weight"] == (2, 4) and d._flat.numel() == 2 * 3 + 2 + 1 * 5 + 1
    m, opt = _model_and_opt()
    s = _rows_of(m, 1, 4, "chunk")
    m[0].bias.data = m[0].bias.data[:1].clone()
    s["0.bias"] = ((5,), 2)  # [2, 3): the even split's rows, beside 0.weight's chunk rows
    d = lightkeeper.DiLoCo(chunk_group, m, opt, sync_every=2, shards=s)
    d._flatten()
    assert d._sharding.rows["0.bias"] == (2, 3)

    # A dtype the library does not take is refused first, by name.
    m, opt = _model_and_opt()
    m.double()
    msg = refused(good, (m, opt))
    assert "float64" in msg, msg


@pytest.mark.parametrize("sharded,dtype", [("python", "float32"), ("python", "bf16"),
                                           ("cpp", "float32"), ("cpp", "bf16")])
def test_an_example_trainer_with_shard_model_agrees_with_the_other_replicated_at_every_commit(
        cluster_factory, tmp_dir, sharded, dtype):
    # One example trainer with --shard-model (ZeRO-3 by hand, DiLoCo over the rows) in a group
    # of 2, beside the other language's example trainer holding the whole model in a group of
    # 1: the same global weights and the same whole model (gathered) after every commit.
    from test_bf16 import example
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    steps = 3
    c.agent("g0")
    c.agent("g1")
    logs = {"g0": [tmp_dir / "whole.jsonl"], "g1": [tmp_dir / "rows-0.jsonl",
                                                    tmp_dir / "rows-1.jsonl"]}
    procs = [example(c, "g0", tmp_dir, steps, logs["g0"][0], sharded == "python",
                     ["--param-dtype", dtype])]
    for r in range(2):
        procs.append(example(c, "g1", tmp_dir, steps, logs["g1"][r], sharded == "cpp",
                             ["--param-dtype", dtype, "--shard-model", "--group-rank", str(r),
                              "--group-size", "2"]))
    for p in procs:
        assert p.wait(180) == 0, p.log()
    rows = [{json.loads(line)["step"]: json.loads(line)
             for line in Path(path).read_text().splitlines()}
            for path in logs["g0"] + logs["g1"]]
    whole, shards = rows[0], rows[1:]
    for step in range(1, steps + 1):
        for r in shards:
            assert r[step]["global_hash"] == whole[step]["global_hash"], step
            assert r[step]["model_hash"] == whole[step]["model_hash"], step
            assert r[step]["shard_model"] and not whole[step]["shard_model"]
    # Each trainer of the sharded group holds its rows: the two add up to the whole model, and
    # each one's outer state is about half the replicated trainer's.
    assert sum(r[steps]["model_bytes"] for r in shards) == whole[steps]["model_bytes"]
    for r in shards:
        assert r[steps]["outer_state_bytes"] < 0.6 * whole[steps]["outer_state_bytes"]


def test_the_cpp_example_sharded_restores_into_another_group_size_with_its_optimizer(
        cluster_factory, tmp_dir):
    # diloco_trainer --shard-model saves per shard in a group of 2 (AdamW's rows and rank 0's
    # step counts) and a group of 3 restores it: the same global weights, AdamW resumed.
    from test_bf16 import example
    c = cluster_factory(("--min-replicas", "1", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    ckpt = str(tmp_dir / "ckpt")

    def group(size, steps, tag):
        c.agent("g0")
        procs = [example(c, "g0", tmp_dir, steps, tmp_dir / f"{tag}-{r}.jsonl", True,
                         ["--shard-model", "--group-rank", str(r), "--group-size", str(size),
                          "--ckpt-dir", ckpt, "--ckpt-every", "2"]) for r in range(size)]
        for p in procs:
            assert p.wait(180) == 0, p.log()
        c.agents["g0"].signal(signal.SIGTERM)
        c.agents["g0"].wait(30)
        return procs

    group(2, 4, "first")
    first = [json.loads(x) for x in (tmp_dir / "first-0.jsonl").read_text().splitlines()]
    second = group(3, 6, "second")
    lines = [json.loads(x) for x in (tmp_dir / "second-0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [5, 6], lines
    for p in second:
        log = p.log()
        assert re.search(r"inner_optimizer_loaded step=4", log), log
        assert "quorum_joined" in log and "inner_state=restored" in log, log
    assert first[-1]["step"] == 4
    restored = [json.loads(x) for x in (tmp_dir / "second-1.jsonl").read_text().splitlines()]
    assert all(x["global_hash"] == y["global_hash"] for x, y in zip(lines, restored))


def test_trainers_of_a_group_that_describe_different_models_are_refused_at_the_join(
        cluster_factory):
    # Each trainer's own rows are consistent, but rank 1's model has two more rows of
    # head.weight: the group's join refuses it in both trainers (InvalidArgument, a
    # ValueError) before any state moves, and the job is left as it was.
    c = cluster_factory(("--min-replicas", "1", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    c.agent("g0")
    c.agent("g1")
    ts = [c.trainer("g0", ["zero3", "--steps", "2", "--group-size", "2", "--group-rank", str(r),
                           "--shard-model", *(["--misdescribe"] if r == 1 else [])])
          for r in range(2)]
    # Rows that do not tile: in g1 (a group of 3, TinyModel's 16 rows: 6/5/5 even, 6/6/4 by
    # torch.chunk) rank 1 cuts its rows by torch.chunk's rule, [6, 12), and rank 2 by the even
    # split, [11, 16): row 11 twice. In g2 (a group of 2) rank 1 starts a row late: row 8 is
    # nobody's. Each trainer's own description is consistent; the group's join refuses them.
    c.agent("g2")

    def shard_group(g, rules):
        return [c.trainer(g, ["zero3", "--steps", "2", "--group-size", str(len(rules)),
                              "--group-rank", str(r), "--shard-model", "--shard-rule", rule])
                for r, rule in enumerate(rules)]
    ts1 = shard_group("g1", ["even", "chunk", "even"])
    ts2 = shard_group("g2", ["even", "late"])
    for group, message in ((ts, "describe different models"),
                           (ts1, "rows [11, 16) of group rank 2 overlap rows up to 12 of "
                                 "group rank 1"),
                           (ts2, "rows [8, 9) are held by no trainer of the group")):
        refusals = []
        for t in group:
            # 3: this trainer's refusal. All see the same in-group sum and refuse together,
            # but the agent stops a group's other trainers once one exited, which may come
            # first.
            assert t.wait(90) != 0, t.log()
            refusals += events(t, "refused")
            assert not events(t, "outer")
        assert refusals, [t.log() for t in group]
        for refused in refusals:
            assert refused["value_error"], refused
            assert message in refused["message"], refused
