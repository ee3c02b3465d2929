"""lightkeeper.Manager against real processes: a lighthouse, one replica_agent per group and
Python trainers (trainers.py) that poll, allreduce and commit."""

import json
import signal

import pytest

import lightkeeper
from conftest import thread_asleep, wait_for


def events(proc, name=None):
    out = []
    for line in proc.out().splitlines():
        if line.startswith("{"):
            e = json.loads(line)
            if name is None or e.get("event") == name:
                out.append(e)
    return out


def test_import_has_the_public_names():
    for name in ("Manager", "DiLoCo", "QuorumLost", "Error", "Quorum"):
        assert hasattr(lightkeeper, name)
    assert issubclass(lightkeeper.QuorumLost, lightkeeper.Error)


def test_manager_without_agent_raises_error_with_code(tmp_dir):
    with pytest.raises(lightkeeper.Error) as e:
        lightkeeper.Manager(0, 1, socket=str(tmp_dir / "nobody.sock"))
    assert e.value.code in ("unavailable", "not_found", "internal")
    with pytest.raises(lightkeeper.Error) as e:
        lightkeeper.Manager(2, 1, socket=str(tmp_dir / "nobody.sock"))


def test_two_groups_quorum_and_allreduce_average_in_place(cluster_factory):
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    c.agent("g0")
    c.agent("g1")
    t0 = c.trainer("g0", ["allreduce", "--steps", "4"])
    t1 = c.trainer("g1", ["allreduce", "--steps", "4"])
    assert t0.wait(60) == 0, t0.log()
    assert t1.wait(60) == 0, t1.log()
    for t in (t0, t1):
        commits = events(t, "commit")
        assert [e["step"] for e in commits] == [1, 2, 3, 4]
        for e in commits:
            assert e["world"] == 2
            assert e["correct"], e
            assert e["value"] == 1.5  # (1 + 2) / 2, in place
            assert e["current_step"] == e["step"]
    ranks = {events(t, "commit")[0]["replica_rank"] for t in (t0, t1)}
    assert ranks == {0, 1}
    qids = {events(t, "commit")[0]["quorum_id"] for t in (t0, t1)}
    assert len(qids) == 1  # one quorum for both


def test_groups_of_different_sizes_share_a_quorum_when_they_mix(cluster_factory):
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    c.agent("g0")
    c.agent("g1")
    ts = [c.trainer("g0", ["sizes"])]
    ts += [c.trainer("g1", ["sizes", "--group-rank", str(r), "--group-size", "2"])
           for r in range(2)]
    for t in ts:
        assert t.wait(60) == 0, t.log()
    for t in ts:
        poll = events(t, "poll")[0]
        assert poll["world"] == 2
        assert poll["group_sizes"] == [1, 2]  # index = replica_rank; g0 sorts first
        ar = events(t, "allreduce")[0]
        assert not ar["ok"]
        assert ar["code"] == "conflict"
        assert "different sizes [1, 2]" in ar["message"]


def test_cuda_tensors_allreduce_on_nccl(cluster_factory):
    import torch

    if not torch.cuda.is_available() or not lightkeeper._native.nccl_built:
        pytest.skip("no CUDA device (or no NCCL in this build): the NCCL path is not run here")
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    c.agent("g0")
    c.agent("g1")
    ts = [c.trainer(g, ["allreduce", "--steps", "2", "--device", "cuda"]) for g in ("g0", "g1")]
    for t in ts:
        assert t.wait(120) == 0, t.log()
        commits = events(t, "commit")
        assert [e["step"] for e in commits] == [1, 2]
        assert all(e["correct"] and e["value"] == 1.5 for e in commits), commits


def test_failure_notice_raises_quorum_lost_in_a_blocked_allreduce(cluster_factory):
    # min-replicas 1 so that g0 goes on alone after the kill; the long join timeout makes the
    # first quorum wait until both healthy groups asked, so it holds both.
    c = cluster_factory(("--min-replicas", "1", "--join-timeout-ms", "10000",
                         "--heartbeat-timeout-ms", "3000"))
    c.agent("g0")
    c.agent("g1")
    # g1's trainer joins the quorum and never allreduces: g0's allreduce blocks on it. The op
    # timeout is far above the test's bound, so only the failure notice can end the wait.
    idle = c.trainer("g1", ["idle"])
    busy = c.trainer("g0", ["allreduce", "--steps", "2", "--timeout-s", "600"])
    idle.wait_log(r'"world": 2', 30)
    busy.wait_log(r'"world": 2', 30)
    # After its poll, busy's main thread has nothing left but its allreduce, which waits on g1
    # (the rendezvous g1 never joins): once that thread is blocked, busy is inside it.
    wait_for(lambda: thread_asleep(busy.popen.pid), 30, "busy blocked inside its allreduce")
    idle.signal(signal.SIGKILL)  # g1's agent reports the crash; the lighthouse tells g0
    assert busy.wait(60) == 0, busy.log()
    lost = events(busy, "quorum_lost")
    assert lost, busy.log()
    assert lost[0]["code"] == "aborted"
    commits = events(busy, "commit")
    assert [e["step"] for e in commits] == [1, 2]
    assert all(e["world"] == 1 and e["correct"] for e in commits)
    polls = events(busy, "poll")
    assert polls[0]["world"] == 2 and polls[-1]["world"] == 1
    assert polls[-1]["quorum_id"] > polls[0]["quorum_id"]


def test_drain_reaches_the_trainer_which_exits_cleanly(cluster_factory):
    c = cluster_factory()
    agent = c.agent("g0", ["--drain-timeout-ms", "5000"])
    t = c.trainer("g0", ["allreduce", "--steps", "100000", "--sleep-ms", "20"])
    t.wait_log(r'"event": "commit"', 30)
    agent.signal(signal.SIGTERM)
    assert t.wait(30) == 0, t.log()
    assert events(t, "drain"), t.log()
    assert agent.wait(30) == 0


def test_finish_means_no_crash_is_reported_and_without_it_one_is(cluster_factory):
    c = cluster_factory()
    agent = c.agent("g0")
    t = c.trainer("g0", ["allreduce", "--steps", "3"])
    assert t.wait(60) == 0, t.log()
    assert events(t, "finished")
    agent.wait_log(r"left reason=finished", 20)
    agent.wait_log(r"trainer_exited .*during_drain=true", 20)
    assert "trainer_crashed" not in agent.log()
    # The same run without finish(): its exit is a crash to the agent.
    agent2 = c.agent("g1")
    t2 = c.trainer("g1", ["allreduce", "--steps", "3", "--no-finish"])
    assert t2.wait(60) == 0, t2.log()
    agent2.wait_log("trainer_crashed", 20)


def test_ddp_over_the_group_process_group(cluster_factory):
    c = cluster_factory()
    c.agent("g0")
    ts = [c.trainer("g0", ["ddp", "--group-rank", str(r), "--group-size", "2", "--steps", "5"])
          for r in range(2)]
    for t in ts:
        assert t.wait(90) == 0, t.log()
    steps = [events(t, "ddp_step") for t in ts]
    assert len(steps[0]) == len(steps[1]) == 5
    for a, b in zip(*steps):
        assert a["hash"] == b["hash"]  # replicas bitwise equal after every step
        assert a["grad"] == b["grad"]  # the gradients were averaged
    assert steps[0][0]["hash"] != steps[0][-1]["hash"]  # and they trained
    assert [events(t, "pg_allreduce")[0]["value"] for t in ts] == [3.0, 3.0]
