"""The package's typed face: the stub of the compiled module matches it, results are frozen
dataclasses that still read like the dicts they were, bad arguments raise InvalidArgument (a
ValueError), the Manager is a context manager, and torchft's order (Manager, DDP over
group_process_group(), then DiLoCo) works against a real lighthouse and agents."""

import ast
import dataclasses
import datetime
from pathlib import Path

import pytest
import torch

import lightkeeper
from lightkeeper import _native
from test_manager import events

STUB = Path(lightkeeper.__file__).with_name("_native.pyi")


def stub_classes():
    """{class name: {member names}} of _native.pyi, and its module-level names."""
    tree = ast.parse(STUB.read_text())
    classes, names = {}, set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body
                                  if isinstance(n, (ast.FunctionDef, ast.AnnAssign))
                                  and not (isinstance(n, ast.FunctionDef)
                                           and n.name == "__init__")}
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):  # a module-level function (convert_dtype)
            names.add(node.name)
    return classes, names


def test_the_stub_names_what_the_module_has():
    classes, names = stub_classes()
    public = {n for n in dir(_native) if not n.startswith("_")}
    assert public == set(classes) | names, public ^ (set(classes) | names)
    for cls, members in classes.items():
        have = {n for n in dir(getattr(_native, cls)) if not n.startswith("_")}
        assert members == have, (cls, members ^ have)
    assert (Path(lightkeeper.__file__).with_name("py.typed")).exists()


def test_results_are_frozen_dataclasses_that_read_like_the_old_dicts():
    q = lightkeeper.Quorum(quorum_id=3, replica_rank=1, replica_world_size=2, max_step=5,
                           heal=True, heal_sources=("a",), group_sizes=(1, 2))
    assert dataclasses.is_dataclass(q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.heal = False  # type: ignore[misc]
    assert q["heal"] is True and q["group_sizes"] == (1, 2)  # the old form
    assert q.get("nothing", 7) == 7 and "quorum_id" in q and "nothing" not in q
    with pytest.raises(KeyError):
        q["nothing"]
    r = lightkeeper.SyncResult._from_native({
        "kind": "committed", "step": 4, "quorum_id": 2, "replica_rank": 0,
        "replica_world_size": 2, "healed": False, "inner": "keep", "saved": True,
        "checkpoint_now": False, "state_hash": "ab", "heal_source": "", "reason": "",
        "stats": {"outer_ms": 12.5, "cross_bytes": 9, "wait_ms": 1.0}, "tokens": 3,
        "quorum_tokens": 6, "weighted": True, "global_hash": "cd",
        "extra_state_restored": False})
    assert r.committed and r.step == 4 and r.stats.outer_ms == 12.5
    assert r["kind"] == "committed" and r["stats"]["cross_bytes"] == 9  # the old form
    assert r.to_dict()["stats"]["outer_ms"] == 12.5
    assert sorted(r.keys())[:3] == ["checkpoint_now", "extra_state_restored", "global_hash"]


def test_bad_arguments_raise_invalid_argument_a_value_error(tmp_dir):
    assert issubclass(lightkeeper.InvalidArgument, ValueError)
    assert issubclass(lightkeeper.InvalidArgument, lightkeeper.Error)
    with pytest.raises(ValueError) as e:
        lightkeeper.Manager(2, 1, socket=str(tmp_dir / "nobody.sock"))
    assert isinstance(e.value, lightkeeper.InvalidArgument)
    assert e.value.code == "invalid_argument"
    with pytest.raises(lightkeeper.InvalidArgument):
        lightkeeper.Manager(0, 1, socket=str(tmp_dir / "nobody.sock"),
                            timeout=datetime.timedelta(0))
    with pytest.raises(lightkeeper.InvalidArgument):
        lightkeeper.DiLoCo(None, None, None, sync_every=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # options are keyword-only
        lightkeeper.DiLoCo(None, None, None, 4, 0.7)  # type: ignore[arg-type,misc]
    # Not an argument error: no agent there.
    with pytest.raises(lightkeeper.Error) as e2:
        lightkeeper.Manager(0, 1, socket=str(tmp_dir / "nobody.sock"))
    assert not isinstance(e2.value, ValueError)


def test_manager_context_close_and_invalid_argument_from_the_library(cluster_factory):
    c = cluster_factory()
    c.agent("g0")
    with lightkeeper.Manager(0, 1, socket=c.sockets["g0"]) as m:
        with pytest.raises(lightkeeper.InvalidArgument):
            m.allreduce(torch.ones(4))  # needs a poll first (the package's check)
        with pytest.raises(lightkeeper.InvalidArgument):
            m.allreduce(torch.ones(4, dtype=torch.int32))
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # The C++ library refuses the encoding (LK_ERR_INVALID_ARGUMENT): InvalidArgument.
        with pytest.raises(ValueError) as e:
            with lightkeeper.DiLoCo(m, model, opt, sync_every=2, outer_compress="bogus"):
                pass
        assert isinstance(e.value, lightkeeper.InvalidArgument), e.value
        assert "bogus" in str(e.value)
        with lightkeeper.DiLoCo(m, model, opt, sync_every=1) as d:
            # The library's DiLoCo object runs on the session: close() refuses, changing nothing.
            with pytest.raises(lightkeeper.InvalidArgument):
                m.close()
            assert not m.closed
            model(torch.ones(2)).sum().backward()
            opt.step()
            d.step()
            r = d.last_result
            assert isinstance(r, lightkeeper.SyncResult) and r.committed and r.step == 1
            assert m.current_step() == 1  # the Manager follows DiLoCo's outer steps
    assert m.closed
    m.close()  # idempotent
    with pytest.raises(lightkeeper.InvalidArgument):
        m.poll(0)


def test_torchft_order_manager_then_ddp_then_diloco(cluster_factory):
    # Two groups of two trainers, each trainer from its own random weights: Manager(), then
    # DDP(model, process_group=manager.group_process_group()) with no poll before it, then the
    # DiLoCo context. It used to raise "group_process_group() needs a poll first".
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "5000"))
    ts = {}
    for g in ("g0", "g1"):
        c.agent(g)
        ts[g] = [c.trainer(g, ["torchft", "--group-rank", str(r), "--group-size", "2",
                               "--steps", "3", "--sync-every", "2", "--init-seed", str(seed)])
                 for r, seed in ((0, 11 if g == "g0" else 21), (1, 11 if g == "g0" else 21))]
    every = [t for g in ts for t in ts[g]]
    for t in every:
        assert t.wait(180) == 0, t.log()
        assert "needs a poll first" not in t.log()
    for g in ts:
        # DDP's broadcast at construction: the group's trainers agree (from rank 0's weights).
        assert len({events(t, "built")[0]["model_hash"] for t in ts[g]}) == 1
        assert len({events(t, "pg")[0]["quorum_id"] for t in ts[g]}) == 1
    assert len({events(t, "joined")[0]["model_hash"] for t in every}) == 1
    for step in (1, 2, 3):
        commits = [[e for e in events(t, "outer") if e["committed"]][step - 1] for t in every]
        assert all(e["old_form_kind"] == "committed" and e["world"] == 2 for e in commits)
        assert len({e["model_hash"] for e in commits}) == 1, f"step {step}: {commits}"
    finished = [events(t, "finished")[0] for t in every]
    assert len({e["model_hash"] for e in finished}) == 1
    assert all(e["step"] == 3 and e["current_step"] == 3 for e in finished), finished
