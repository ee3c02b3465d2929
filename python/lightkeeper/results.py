"""The package's results as frozen dataclasses: ``Quorum`` (the answer to ``Manager.poll``) and
``SyncResult`` (what each outer step of ``DiLoCo`` did, with its ``SyncStats``).

They used to be a compiled class (``Quorum``) and plain dicts (the outer step's result). Read
them by attribute (``result.kind``, ``result.committed``, ``result.stats.outer_ms``).
Scripts written against the dicts go on working: ``result["kind"]``, ``result.get("kind")``,
``"kind" in result`` and ``result.keys()`` are the old form, kept for them; new code should
use attributes, which mypy checks.
"""

import dataclasses
from typing import Any, Iterator, Tuple


class _OldDictForm:
    """The dict-style reads of results that used to be dicts (documented as the old form)."""

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key not in self._field_names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._field_names() else default

    def __contains__(self, key: object) -> bool:
        return key in self._field_names()

    def keys(self) -> Iterator[str]:
        return iter(self._field_names())

    def to_dict(self) -> "dict[str, Any]":
        """The result as the plain dict it used to be (nested results too)."""
        return dataclasses.asdict(self)

    def _field_names(self) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Quorum(_OldDictForm):
    """The agent's answer to a poll: the quorum this outer step runs on and what the trainer
    must do before it."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    max_step: int
    reconfigure: bool = False
    heal: bool = False
    drain: bool = False
    checkpoint_now: bool = False
    initial: bool = False
    # Where a heal fetches the state from (peers' agents), in order of preference.
    heal_sources: Tuple[str, ...] = ()
    # Every member's group size (index = replica_rank) when the quorum's groups differ in size;
    # empty when they are all equal or on answers that join nothing new.
    group_sizes: Tuple[int, ...] = ()
    # A durable checkpoint to restore ("" when none) and its step.
    restore_location: str = ""
    restore_step: int = 0
    reason: str = ""
    from_board: bool = False

    @classmethod
    def _from_native(cls, q: Any) -> "Quorum":
        return cls(quorum_id=int(q.quorum_id), replica_rank=int(q.replica_rank),
                   replica_world_size=int(q.replica_world_size), max_step=int(q.max_step),
                   reconfigure=bool(q.reconfigure), heal=bool(q.heal), drain=bool(q.drain),
                   checkpoint_now=bool(q.checkpoint_now), initial=bool(q.initial),
                   heal_sources=tuple(str(s) for s in q.heal_sources),
                   group_sizes=tuple(int(n) for n in q.group_sizes),
                   restore_location=str(q.restore_location), restore_step=int(q.restore_step),
                   reason=str(q.reason), from_board=bool(q.from_board))


@dataclasses.dataclass(frozen=True)
class SyncStats(_OldDictForm):
    """Where an outer step's time and bytes went (the C++ library's SyncStats)."""

    poll_ms: float = 0.0
    join_ms: float = 0.0
    allreduce_ms: float = 0.0
    gather_ms: float = 0.0
    publish_ms: float = 0.0
    commit_ms: float = 0.0
    outer_ms: float = 0.0
    wait_ms: float = 0.0
    cross_bytes: int = 0
    sync_bytes: int = 0
    group_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class SyncResult(_OldDictForm):
    """What a join, an outer step or a flush of ``DiLoCo`` did (``DiLoCo.last_result``).

    ``kind`` is "committed", "received" (the state came from peers or a checkpoint), "joined",
    "drained" or "started" (with overlap: the exchange started, nothing landed); ``inner`` is
    what the inner optimizer had to do ("keep", "reset", "restored", which DiLoCo did)."""

    kind: str
    step: int
    quorum_id: int = 0
    replica_rank: int = 0
    replica_world_size: int = 0
    healed: bool = False
    inner: str = "keep"
    saved: bool = False
    checkpoint_now: bool = False
    state_hash: str = ""
    heal_source: str = ""
    reason: str = ""
    stats: SyncStats = dataclasses.field(default_factory=SyncStats)
    # Committed: this group's tokens, every member's summed, and whether the average was
    # token-weighted.
    tokens: int = 0
    quorum_tokens: int = 0
    weighted: bool = False
    # Committed or received: the hash of the whole global weights, equal in every member.
    global_hash: str = ""
    extra_state_restored: bool = False

    @property
    def committed(self) -> bool:
        return self.kind == "committed"

    @classmethod
    def _from_native(cls, d: "dict[str, Any]") -> "SyncResult":
        stats = d.get("stats") or {}
        names = {f.name for f in dataclasses.fields(SyncStats)}
        known = {f.name for f in dataclasses.fields(cls)} - {"stats"}
        return cls(stats=SyncStats(**{k: v for k, v in stats.items() if k in names}),
                   **{k: v for k, v in d.items() if k in known})


__all__ = ["Quorum", "SyncResult", "SyncStats"]
