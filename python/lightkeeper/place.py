"""Where this trainer sits in its replica group, from the launcher's environment.

The same rule as the C++ trainer (``common/task_place.h``): torchrun's ``RANK`` /
``WORLD_SIZE`` / ``LOCAL_RANK`` first (torchrun inside a Slurm step sets them per process),
then Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``. One Slurm job or one
torchrun per replica group, so the launcher's rank is the rank inside the group.
"""

import dataclasses
import fcntl
import os
import socket
import struct
from typing import Mapping, Optional

from lightkeeper.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class TaskPlace:
    rank: int                  # rank inside the group
    size: int                  # trainers in the group
    local_rank: Optional[int]  # rank on this node (picks the device), if known
    source: str                # "torchrun" or "slurm"


def _number(env: Mapping[str, str], name: str) -> Optional[int]:
    if name not in env:
        return None
    value = env[name]
    if not value.isdigit():
        raise InvalidArgument(f"{name}={value} is not a rank or size (a number)")
    return int(value)


def _place(env: Mapping[str, str], rank_var: str, size_var: str, local_var: str,
           source: str) -> Optional[TaskPlace]:
    rank, size, local = _number(env, rank_var), _number(env, size_var), _number(env, local_var)
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        have, missing = (rank_var, size_var) if rank is not None else (size_var, rank_var)
        raise InvalidArgument(
            f"{have} is set without {missing}: cannot place this trainer in its group")
    if size == 0 or rank >= size:
        raise InvalidArgument(f"{rank_var}={rank} is not below {size_var}={size}")
    return TaskPlace(rank, size, local, source)


def task_place_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[TaskPlace]:
    """The place the environment names (``os.environ`` by default), ``None`` when it names none.
    A variable that is set but not a number, or a rank not below the size, raises
    ``InvalidArgument`` (an ``Error`` with code ``invalid_argument``, and a ``ValueError``)
    naming it: a trainer must not guess its rank."""
    env = os.environ if env is None else env
    return (_place(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun")
            or _place(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm"))


def resolve_bind_host(bind_host: str) -> str:
    """The address ``bind_host`` stands for, by the C++ library's rule (``ResolveBindHost``).

    The name of one of this host's network interfaces (``ib0``) stands for its IPv4 address, so
    that one command line serves every node of a cluster; anything else (an address, a host
    name) is returned as it is. An interface without an IPv4 address raises InvalidArgument.
    """
    if not bind_host or len(bind_host) >= 16:
        return bind_host
    if bind_host not in {name for _, name in socket.if_nameindex()}:
        return bind_host
    siocgifaddr = 0x8915  # Linux's ioctl for an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), siocgifaddr,
                                struct.pack("256s", bind_host.encode()))
        except OSError as e:
            raise InvalidArgument(f"interface {bind_host}: no IPv4 address ({e.strerror})") from e
    return socket.inet_ntoa(ifreq[20:24])
