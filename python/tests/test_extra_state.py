"""The trainer's own extra state (data position, RNG states) in durable checkpoints: the
DiLoCo context's extra_state / load_extra_state against real processes (trainers.py), and the
example trainer (examples/python/diloco_trainer.py) restored from a drain's checkpoint drawing
exactly the batches of a run that never stopped."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import BIN_DIR, HERE, PYTHON
from test_manager import events

EXAMPLE = HERE.parents[1] / "examples" / "python" / "diloco_trainer.py"


def outer_commits(proc):
    return [e for e in events(proc, "outer") if e["kind"] == "committed"]


def test_extra_state_comes_back_from_the_durable_checkpoint_of_its_step(cluster_factory,
                                                                         tmp_dir):
    c = cluster_factory()
    ckpt = str(tmp_dir / "ckpt-g0")
    c.agent("g0")
    first = c.trainer("g0", ["diloco", "--steps", "4", "--sync-every", "3", "--ckpt-dir", ckpt,
                             "--ckpt-every", "2", "--extra-state-bytes", "1"])
    assert first.wait(120) == 0, first.log()
    joined = events(first, "joined")[0]
    assert joined["extra_restored"] is False and joined["extra_hash"] is None  # a first start
    at_save = [e for e in outer_commits(first) if e["saved"]][-1]
    assert at_save["step"] == 4 and at_save["extra_hash"], first.log()
    # The bytes are part of the checkpoint like the weights: listed and checksummed.
    inspect = subprocess.run([str(BIN_DIR / "lkctl"), "checkpoint", "inspect", ckpt],
                             capture_output=True, text=True, timeout=60)
    assert "extra_state/rank-00000" in inspect.stdout, inspect.stdout
    verify = subprocess.run([str(BIN_DIR / "lkctl"), "checkpoint", "verify", ckpt],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    c.agents["g0"].signal(signal.SIGTERM)
    c.agents["g0"].wait(30)
    c.agent("g0")
    second = c.trainer("g0", ["diloco", "--steps", "6", "--sync-every", "3", "--ckpt-dir", ckpt,
                              "--extra-state-bytes", "1"])
    assert second.wait(120) == 0, second.log()
    joined = events(second, "joined")[0]
    assert joined["step"] == 4 and joined["extra_restored"] is True, second.log()
    # The bytes handed with step 4's outer step, back whole.
    assert joined["extra_hash"] == at_save["extra_hash"]


def test_extra_state_past_its_bound_fails_with_a_clear_error(cluster_factory):
    c = cluster_factory()
    c.agent("g0")
    t = c.trainer("g0", ["diloco", "--steps", "2", "--sync-every", "2",
                         "--extra-state-bytes", str(5 << 20)])
    assert t.wait(60) != 0
    assert "over the bound of 4194304 bytes" in t.log(), t.log()


def test_extra_state_bytes_max_out_of_range_is_refused():
    import lightkeeper
    for bad in (0, -1, (64 << 20) + 1):
        with pytest.raises(lightkeeper.Error) as e:
            lightkeeper.DiLoCo(None, None, None, sync_every=1, extra_state_bytes_max=bad)
        assert "extra_state_bytes_max" in str(e.value)


def read_log(path: Path):
    """The example trainer's --log: step -> (batch hashes, global hash), the last line of a
    step winning (two lives append to one file)."""
    out = {}
    for line in path.read_text().splitlines():
        o = json.loads(line)
        out[o["step"]] = (o["batches"], o["global_hash"])
    return out


def example(c, group, tmp_dir, steps, log, extra=()):
    env = {"LK_AGENT_SOCKET": c.sockets[group], "LK_GROUP_ID": group,
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    argv = [PYTHON, str(EXAMPLE), "--group-rank", "0", "--group-size", "1", "--inner-steps", "4",
            "--outer-steps", str(steps), "--seed", "7", "--group-id", group,
            "--ckpt-dir", str(tmp_dir / f"ckpt-{c.dir.name}-{group}"), "--log", str(log),
            "--model-width", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
            "--batch", "4", "--corpus-bytes", "8192", "--live-dir", c.live_dirs[group], *extra]
    return c._spawn(argv, log.with_suffix(".stderr"), env)


def test_example_trainer_restored_after_a_drain_draws_the_batches_of_an_unstopped_run(
        cluster_factory, tmp_dir):
    # A run stopped by Slurm's warning (SIGUSR2: checkpoint and drain), then restored.
    c = cluster_factory()
    c.agent("g0", ["--drain-timeout-ms", "20000"])
    log = tmp_dir / "stopped.jsonl"
    t = example(c, "g0", tmp_dir, 1000, log, ["--inner-step-min-ms", "20"])
    t.wait_log(r"outer_committed step=2", 120)
    c.agents["g0"].signal(signal.SIGUSR2)
    assert t.wait(60) == 0, t.log()
    c.agents["g0"].wait(30)
    drained = [line for line in t.log().splitlines() if " drain " in line]
    assert drained and "checkpoint_now=True" in drained[-1], t.log()
    k = max(read_log(log))  # the last committed step, which the drain saved
    c.agent("g0")
    again = example(c, "g0", tmp_dir, k + 2, log)
    assert again.wait(120) == 0, again.log()
    assert "extra_state_loaded" in again.log(), again.log()
    # The same group run from the start in a job of its own, never stopped.
    ref_dir = tmp_dir / "ref"
    ref_dir.mkdir()
    r = cluster_factory_in(ref_dir)
    r.agent("g0")
    ref_log = ref_dir / "ref.jsonl"
    ref = example(r, "g0", ref_dir, k + 2, ref_log)
    try:
        assert ref.wait(120) == 0, ref.log()
    finally:
        r.close()
    got, want = read_log(log), read_log(ref_log)
    for step in range(1, k + 3):
        assert len(got[step][0]) == 4, (step, got[step])
        assert got[step][0] == want[step][0], f"step {step}: batches differ"
        if step <= k:
            assert got[step][1] == want[step][1]


def cluster_factory_in(path):
    from conftest import Cluster
    return Cluster(path, ("--min-replicas", "1", "--join-timeout-ms", "300",
                          "--heartbeat-timeout-ms", "3000"))
