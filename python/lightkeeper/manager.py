"""``Manager``: one trainer's link to Lightkeeper (torchft's Manager, shaped for DiLoCo).

Each outer step a trainer calls ``poll(step)``; the answer (a ``Quorum``) says which quorum the
step runs on, whether to heal and from where, and whether to drain. ``allreduce`` averages a
tensor in place across the quorum's groups (this trainer's slot: the trainers with the same
group_rank), ``commit`` reports the step, ``finish`` says the trainer is done so that its exit
is not reported as a crash.

A ``Manager`` is a context manager: ``with Manager(...) as m:`` closes it (``close()``) on the
way out, communicators first, then the session with the agent.
"""

import datetime
import os
from types import TracebackType
from typing import Callable, Dict, List, Optional, Tuple, Type, Union

import torch

from lightkeeper import _native
from lightkeeper.errors import Error, InvalidArgument
from lightkeeper.place import resolve_bind_host, task_place_from_env
from lightkeeper.results import Quorum
from lightkeeper.store import AgentStore, ProcessGroup, gloo_process_group

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _ms(t: datetime.timedelta) -> int:
    return max(1, int(t.total_seconds() * 1000))


class Manager:
    """Connects to the node's replica agent.

    Args:
        group_rank: this trainer's rank inside its replica group; ``None`` takes it from the
            launcher (torchrun's ``RANK``, else Slurm's ``SLURM_PROCID``; ``place.py``), else 0.
        group_size: the group's number of trainers (``None``: ``WORLD_SIZE``, else
            ``SLURM_NTASKS``, else 1). Groups of a job use the same, unless every
            trainer averages across sizes (``DiLoCo`` does; see ``set_mixed_group_sizes``).
        socket: the agent's Unix socket; ``None`` takes ``$LK_AGENT_SOCKET``.
        timeout: the deadline of one collective (the cross-group one waits for the slowest
            group); past it the collective raises ``QuorumLost``.
        init_timeout: the deadline of a communicator's rendezvous and connect.
        bind_host: the address this trainer's communicators listen on, or the name of a
            network interface (``ib0``: its IPv4 address); ``None`` takes ``$LK_BIND_HOST``,
            else 127.0.0.1 (one node).
    """

    def __init__(self, group_rank: Optional[int] = None, group_size: Optional[int] = None,
                 socket: Optional[str] = None, *,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120),
                 init_timeout: datetime.timedelta = datetime.timedelta(seconds=30),
                 bind_host: Optional[str] = None) -> None:
        self._bind_host = resolve_bind_host(bind_host or os.environ.get("LK_BIND_HOST")
                                            or "127.0.0.1")
        if group_rank is None or group_size is None:
            place = task_place_from_env()
            if group_rank is None:
                group_rank = place.rank if place else 0
            if group_size is None:
                group_size = place.size if place else 1
        if group_size < 1 or not 0 <= group_rank < group_size:
            raise InvalidArgument(f"group_rank {group_rank} is not in [0, group_size "
                                  f"{group_size})")
        for name, t in (("timeout", timeout), ("init_timeout", init_timeout)):
            if t <= datetime.timedelta(0):
                raise InvalidArgument(f"{name} must be positive, not {t}")
        self._session = _native.Session(socket or "", group_rank, group_size)
        self._group_rank = group_rank
        self._group_size = group_size
        self._timeout_ms = _ms(timeout)
        self._init_timeout_ms = _ms(init_timeout)
        # "gloo" / ("nccl", device) -> _native.Comm
        self._comms: Dict[Union[str, Tuple[str, int]], _native.Comm] = {}
        self._quorum: Optional[Quorum] = None
        self._quorum_id = 0        # of the last poll (the Manager's or DiLoCo's)
        self._group_sizes: List[int] = []  # of that quorum's members, when they differ
        self._replica_rank = 0
        self._replica_world_size = 0
        self._step = 0
        self._pg_count = 0
        self._mixed_group_sizes = False  # set_mixed_group_sizes
        self._finished = False
        self._closed = False

    # The context and its end.

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Error:
            # The exception on its way out says what went wrong; a close that cannot finish
            # (a DiLoCo object still open over the session) must not replace it. The session
            # then closes with its last reference.
            pass

    def close(self) -> None:
        """Closes the communicators and the session with the agent. Idempotent; calls after it
        raise ``InvalidArgument``. It does not say ``finish()``: a trainer that leaves without
        it (an exception out of the ``with``) is reported as a crash, as it should be. Close a
        ``DiLoCo`` context over this Manager first (its exit does)."""
        if self._closed:
            return
        if self._session.users > len(self._comms):
            # A DiLoCo object of the library runs on the session: refuse before closing anything.
            raise InvalidArgument("close() inside a DiLoCo context over this Manager: leave the "
                                  "DiLoCo context first")
        for comm in self._comms.values():
            comm.close()
        self._comms.clear()
        self._session.close()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # The quorum of each outer step.

    def poll(self, step: Optional[int] = None) -> Quorum:
        """Asks the agent which quorum outer step ``step`` (default: ``current_step()``) runs on;
        blocks until it is known, at once when nothing changed."""
        return self._poll(self._step if step is None else step, adopt_heal_step=True)

    def _poll(self, step: int, adopt_heal_step: bool) -> Quorum:
        q = Quorum._from_native(self._session.poll(step))
        self._quorum = q
        if q.quorum_id != self._quorum_id:
            # Sizes come with the answer that joins a quorum; later answers of it leave them out.
            self._group_sizes = list(q.group_sizes)
        self._note_quorum(q.quorum_id, q.replica_rank, q.replica_world_size)
        if adopt_heal_step and q.heal and q.max_step > self._step:
            # After healing, the trainer holds the state of max_step (torchft's convention).
            self._step = q.max_step
        return q

    def commit(self, step: int, ok: bool = True, state_hash: Optional[str] = None, *,
               tokens: int = 0) -> None:
        """Reports outer step ``step`` as committed (or failed, ``ok=False``), with a hash of the
        state it produced so that the lighthouse can tell diverged replicas apart, and the
        tokens (samples) the whole group processed in the step (0: not reported), which the
        lighthouse shows as the group's contribution."""
        self._session.commit(step, ok, state_hash or "", tokens)
        if ok:
            self._step = step

    def set_mixed_group_sizes(self, on: bool = True) -> None:
        """Says that this trainer averages across groups of other trainer counts, so that its
        group may share quorums with groups of other sizes (``Quorum.group_sizes`` then gives
        each member's size). Off by default: ``allreduce`` needs every group laid out alike.
        ``DiLoCo`` turns it on itself. Call it before the first poll, in every trainer of the
        group."""
        self._mixed_group_sizes = bool(on)
        self._session.set_mixed_group_sizes(bool(on))

    def current_step(self) -> int:
        """The last committed outer step (or the step a heal brings this trainer to)."""
        return self._step

    @property
    def quorum(self) -> Optional[Quorum]:
        """The answer of the last poll (None before the first)."""
        return self._quorum

    # Collectives.

    def allreduce(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        """Reduces ``tensor`` in place across the current quorum's groups (``op``: "avg" or
        "sum"). float32 or bfloat16; CPU tensors on Gloo, CUDA tensors on NCCL when the build
        has it. A contiguous tensor is reduced where it lies, without copies. Raises
        ``QuorumLost`` when a failure notice, a dead peer or the deadline cuts it short."""
        if op not in ("avg", "sum"):
            raise InvalidArgument(f'allreduce op is "avg" or "sum", not {op!r}')
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise InvalidArgument(
                f"allreduce takes float32 or bfloat16 tensors, not {tensor.dtype}")
        if tensor.device.type == "cpu":
            device = -1
        elif tensor.device.type == "cuda":
            device = tensor.device.index if tensor.device.index is not None else 0
            # Stream.synchronize has no annotations in torch 1.13 (mypy --strict).
            synchronize: Callable[[], None] = torch.cuda.current_stream(tensor.device).synchronize
            synchronize()
        else:
            raise InvalidArgument(f"allreduce takes CPU or CUDA tensors, not {tensor.device}")
        if self._quorum_id == 0:
            raise InvalidArgument("allreduce needs a poll first")
        if len(set(self._group_sizes)) > 1:
            raise Error("conflict",
                        f"the quorum's groups have different sizes {self._group_sizes}: a plain "
                        "allreduce needs every group laid out alike (DiLoCo averages across "
                        "sizes by fragments)")
        comm = self._comm_for(device)
        if comm.quorum_id != self._quorum_id:
            comm.reconfigure(self._quorum_id, self._replica_rank, self._replica_world_size)
        if self._session.lost_quorum_id() >= self._quorum_id:
            # The notice came before the communicator of this quorum existed, so its abort
            # reached only the old one.
            comm.abort_quorum(self._quorum_id, "quorum lost before the allreduce")
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._session.set_peer_wait(True)
        try:
            comm.allreduce(work.data_ptr(), work.numel(), dtype, op)
        finally:
            self._session.set_peer_wait(False)
        if work is not tensor:
            with torch.no_grad():
                tensor.copy_(work)
        return tensor

    def group_process_group(self, timeout: datetime.timedelta = datetime.timedelta(minutes=5)
                            ) -> ProcessGroup:
        """A ``torch.distributed`` ProcessGroup over this group's trainers (Gloo, on CPU), for
        ``DistributedDataParallel(model, process_group=...)`` without init_process_group.

        Every trainer of the group calls it at the same point: right after constructing the
        Manager (torchft's order: Manager, then DDP over this, then DiLoCo) or after a poll.
        Its rendezvous goes through the lighthouse KV of the last poll's quorum, under this
        group's replica_rank; with no poll yet it polls for itself first (at the current step).
        The group keeps it across later quorums (its members do not change while the group
        lives)."""
        if self._quorum_id == 0:
            # Why a poll of its own and not a key outside every quorum: the lighthouse's KV is
            # scoped to quorum epochs on purpose (old epochs are collected, a key of a dead
            # quorum can never be read by a late trainer of a new one), and the group has no
            # name of its own before it joins a quorum (replica_rank is what keeps two groups'
            # keys apart). The C++ library's in-group communicator rendezvous the same way, in
            # the first quorum the group joins. The agent answers every trainer of the group
            # with the same quorum, so they meet under the same keys. The poll changes nothing
            # the join depends on: the session keeps an answer's heal for the DiLoCo join
            # (diloco/README.md, "What the join guarantees"), and the Manager does not take a
            # heal's step as its own here, since nothing healed yet.
            # The rendezvous averages nothing across groups, so this poll may share a quorum
            # with groups of other trainer counts, whatever the trainer says for its own
            # averages (set_mixed_group_sizes; DiLoCo turns it on at its join): without this,
            # a group of 2 that builds its process group before DiLoCo (torchft's order) beside
            # a group of 1 was refused with group_size_mismatch.
            self._session.set_mixed_group_sizes(True)
            try:
                self._poll(self._step, adopt_heal_step=False)
            finally:
                self._session.set_mixed_group_sizes(self._mixed_group_sizes)
        self._pg_count += 1
        prefix = f"pg/r{self._replica_rank}/n{self._pg_count}/"
        store = AgentStore(self._session, self._quorum_id, prefix, timeout)
        return gloo_process_group(store, self.group_rank, self.group_size, timeout,
                                  self._bind_host)

    # The rest of the trainer API.

    def register_checkpoint(self, step: int, location: str, manifest_digest: str = "") -> None:
        """Registers a durable checkpoint (a directory every group can read) at the lighthouse,
        so that a job whose groups all lost their live state restores it."""
        self._session.register_checkpoint(step, location, manifest_digest)

    def kv_put(self, key: str, value: bytes, quorum_id: Optional[int] = None) -> None:
        """The lighthouse's rendezvous KV of the current quorum (or ``quorum_id``)."""
        self._session.kv_put(self._qid(quorum_id), key, bytes(value))

    def kv_get(self, key: str, timeout: datetime.timedelta = datetime.timedelta(seconds=30),
               quorum_id: Optional[int] = None) -> bytes:
        """Waits up to ``timeout`` for ``key`` in the current quorum's KV (or ``quorum_id``)."""
        return self._session.kv_get(self._qid(quorum_id), key, _ms(timeout))

    def drain_requested(self) -> bool:
        """True once the agent told this trainer to drain (a poll or a notice)."""
        return bool((self._quorum is not None and self._quorum.drain)
                    or self._session.drain_noticed())

    def checkpoint_requested(self) -> bool:
        """True when the drain asked for a durable save before exiting."""
        return bool((self._quorum is not None and self._quorum.checkpoint_now)
                    or self._session.notices()["checkpoint_now"])

    def finish(self) -> None:
        """Tells the agent this trainer is done, so its exit is not reported as a crash. Call it
        once, at the end (``DiLoCo`` does)."""
        if not self._finished:
            self._session.finish()
            self._finished = True

    @property
    def group_rank(self) -> int:
        return self._group_rank

    @property
    def group_size(self) -> int:
        return self._group_size

    @property
    def bind_host(self) -> str:
        """The address this trainer's communicators listen on."""
        return self._bind_host

    # For DiLoCo (package-internal): the session its library object runs on, and what its outer
    # steps tell the Manager, so that poll(), allreduce() and current_step() go on from there.

    def _native_session(self) -> "_native.Session":
        if self._closed:
            raise InvalidArgument("the Manager is closed")
        return self._session

    def _observe_outer_step(self, step: int, quorum_id: int, replica_rank: int,
                            replica_world_size: int) -> None:
        """An outer step of DiLoCo ran on quorum ``quorum_id`` and left the trainer at ``step``
        (never moves the step back)."""
        self._note_quorum(quorum_id, replica_rank, replica_world_size)
        if step > self._step:
            self._step = step

    def _note_quorum(self, quorum_id: int, replica_rank: int, replica_world_size: int) -> None:
        self._quorum_id = quorum_id
        self._replica_rank = replica_rank
        self._replica_world_size = replica_world_size

    def _comm_for(self, device: int) -> "_native.Comm":
        key: Union[str, Tuple[str, int]] = "gloo" if device < 0 else ("nccl", device)
        comm = self._comms.get(key)
        if comm is None:
            backend = "gloo" if device < 0 else "nccl"
            comm = _native.Comm(self._session, backend, self._group_rank, f"py/{backend}/",
                                self._bind_host, self._init_timeout_ms, self._timeout_ms,
                                max(device, 0))
            self._comms[key] = comm
        return comm

    def _qid(self, quorum_id: Optional[int]) -> int:
        if quorum_id is not None:
            return quorum_id
        if self._quorum_id == 0:
            raise InvalidArgument("the KV needs a poll first")
        return self._quorum_id
