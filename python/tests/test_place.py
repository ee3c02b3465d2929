"""The trainer's place in its group from torchrun's and Slurm's variables (no agent needed)."""
import pytest

import lightkeeper
from lightkeeper import task_place_from_env


def test_no_launcher_variables_leave_it_to_the_arguments():
    assert task_place_from_env({"PATH": "/bin"}) is None


def test_slurm_task_takes_rank_size_and_local_rank():
    p = task_place_from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"})
    assert p == lightkeeper.TaskPlace(rank=3, size=8, local_rank=1, source="slurm")


def test_torchrun_inside_slurm_wins():
    p = task_place_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "5",
                             "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert p == lightkeeper.TaskPlace(rank=5, size=8, local_rank=1, source="torchrun")


@pytest.mark.parametrize("env,named", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK=x"),
    ({"RANK": "1"}, "RANK is set without WORLD_SIZE"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4"),
    ({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}, "SLURM_PROCID=-1"),
])
def test_bad_values_are_refused_by_name(env, named):
    with pytest.raises(lightkeeper.Error) as e:
        task_place_from_env(env)
    assert e.value.code == "invalid_argument"
    assert named in str(e.value)


def test_manager_takes_its_place_from_slurm(monkeypatch):
    # No agent socket: the session fails, but only after the place was taken; a bad place fails
    # first, naming the variable.
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(lightkeeper.Error) as e:
        lightkeeper.Manager(socket="/nonexistent/agent.sock")
    assert "SLURM_PROCID=7" in str(e.value)


@pytest.mark.parametrize("given,address", [
    ("lo", "127.0.0.1"),                  # an interface's name: its IPv4 address
    ("127.0.0.9", "127.0.0.9"),           # an address as it is
    ("node17.cluster", "node17.cluster"),  # a host name as it is
    ("lk-none0", "lk-none0"),              # no such interface: taken for a host name
])
def test_bind_host_takes_an_interface_name(given, address):
    from lightkeeper.place import resolve_bind_host
    assert resolve_bind_host(given) == address
