"""A ``torch.distributed.Store`` over the lighthouse's rendezvous KV, reached through the node's
agent, and the group's Gloo process group built on it.

The KV is scoped to one quorum_id (old epochs are collected), so a store lives in the quorum it
was made in; that is enough for a process group, which needs its store only to connect.
"""

import datetime
import re
from typing import TYPE_CHECKING, Any, List, Optional, Union

import torch.distributed as dist

from lightkeeper import _native
from lightkeeper.errors import Error, InvalidArgument

if TYPE_CHECKING:
    # torch 1.13 declares these in its stub of the C extension only; torch.distributed
    # re-exports them at run time (when distributed is available), invisibly to mypy.
    from torch._C._distributed_c10d import ProcessGroup, Store
else:
    ProcessGroup = dist.ProcessGroup
    Store = dist.Store

_SAFE_KEY = re.compile(r"^[A-Za-z0-9_./-]+$")


def _encode_key(key: str) -> str:
    # The agent forwards the key inside a URL path: anything but plain characters goes as hex.
    return key if _SAFE_KEY.match(key) else "x" + key.encode().hex()


class AgentStore(Store):
    """torch.distributed's Store over the agent's KV, under ``prefix`` in ``quorum_id``.

    It supports what process groups use to connect (set, get, wait, check). The KV has no atomic
    add or delete, so ``add``, ``compare_set``, ``delete_key`` and ``num_keys`` raise."""

    def __init__(self, session: "_native.Session", quorum_id: int, prefix: str,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> None:
        super().__init__()
        self._session = session
        self._quorum_id = quorum_id
        self._prefix = prefix
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + _encode_key(key)

    def _timeout_ms(self, timeout: Optional[datetime.timedelta] = None) -> int:
        t = self._timeout if timeout is None else timeout
        return max(1, int(t.total_seconds() * 1000))

    def set(self, key: str, value: Union[str, bytes]) -> None:
        if isinstance(value, str):
            value = value.encode()
        self._session.kv_put(self._quorum_id, self._key(key), bytes(value))

    def get(self, key: str) -> bytes:
        return self._session.kv_get(self._quorum_id, self._key(key), self._timeout_ms())

    def check(self, keys: List[str]) -> bool:
        for key in keys:
            try:
                self._session.kv_get(self._quorum_id, self._key(key), 0)
            except Error as e:
                if e.code == "not_found":
                    return False
                raise
        return True

    def wait(self, keys: List[str],
             timeout: Optional[datetime.timedelta] = None) -> None:
        for key in keys:
            self._session.kv_get(self._quorum_id, self._key(key), self._timeout_ms(timeout))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def add(self, key: str, value: int) -> int:
        raise InvalidArgument("the lighthouse KV has no atomic add")

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise InvalidArgument("the lighthouse KV has no compare-and-set")

    def delete_key(self, key: str) -> bool:
        raise InvalidArgument("the lighthouse KV does not delete keys")

    def num_keys(self) -> int:
        raise InvalidArgument("the lighthouse KV does not count keys")


def gloo_process_group(store: Store, rank: int, size: int, timeout: datetime.timedelta,
                       bind_host: str = "127.0.0.1") -> ProcessGroup:
    """ProcessGroupGloo over ``store``, without init_process_group (no global default group)."""
    # torch 1.13's stub has neither ProcessGroupGloo._Options nor the constructor that takes
    # them (the one that binds the device to bind_host), so this one call goes untyped.
    gloo: Any = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._timeout = timeout
    opts._devices = [gloo.create_device(hostname=bind_host)]
    pg: ProcessGroup = gloo(store, rank, size, opts)
    return pg


__all__ = ["AgentStore", "ProcessGroup", "Store", "gloo_process_group"]
