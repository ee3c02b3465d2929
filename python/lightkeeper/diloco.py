"""``DiLoCo``: the DiLoCo outer step of Lightkeeper's C++ library on a PyTorch model.

    with lightkeeper.DiLoCo(manager, model, inner_opt, sync_every=H) as diloco:
        while diloco.outer_step < T and not diloco.should_stop:
            loss = model(batch()).mean(); loss.backward()
            inner_opt.step(); inner_opt.zero_grad()
            diloco.step()

With ``overlap=True`` the exchange of each outer step runs during the next step's inner steps
and lands one step late; the loop then counts the step in flight and lands the last one:

        while diloco.outer_step + diloco.in_flight < T and not diloco.should_stop:
            ...
            diloco.step()
        diloco.flush()

The outer step itself (poll, join, heal, pseudo-gradient, cross-group average, outer Nesterov
update, in-group all-gather and agreement, live state, commit, drain, final barrier) is the C++
library's (``lk_diloco_*``); this module only lays the model's parameters out for it: one flat
buffer of the model's dtype (float32, bfloat16 or float16) with every parameter a view into it,
so that the library reads and writes the weights where they are. The outer state is float32
whatever the model's dtype: a bf16 or fp16 model's new global weights come back rounded to it
(to nearest even, as ``.to(torch.bfloat16)`` rounds), the same bits in every member. It also
carries the inner optimizer's state into durable checkpoints and back out of them, and makes
the group's trainers agree on a drain at every inner step.
"""

import ctypes
import datetime
import os
import time
from types import TracebackType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from lightkeeper import _native
from lightkeeper.errors import Error, InvalidArgument
from lightkeeper.manager import Manager
from lightkeeper.results import SyncResult
from lightkeeper.store import ProcessGroup


def _ms(t: datetime.timedelta) -> int:
    return max(1, int(t.total_seconds() * 1000))


def _float_view(address: int, count: int) -> torch.Tensor:
    """A float32 tensor over memory the library owns (valid for the duration of a callback)."""
    if count == 0:
        return torch.empty(0, dtype=torch.float32)
    array = (ctypes.c_float * count).from_address(address)
    return torch.frombuffer(array, dtype=torch.float32, count=count)


SHARD_RULES = ("even", "chunk")


def shard_rows(rows: int, group_size: int, group_rank: int,
               rule: str = "even") -> Tuple[int, int]:
    """Rows ``[begin, end)`` of a parameter's first dimension (``rows`` long) that trainer
    ``group_rank`` of a group of ``group_size`` holds in a sharded model (``DiLoCo(shards=...)``)
    under ``rule``: ``"even"``, the library's even split (the first ``rows % group_size`` ranks
    one row more), or ``"chunk"``, ``torch.chunk``'s (FSDP2's and DTensor's ``Shard(0)``:
    ``ceil(rows / group_size)`` rows each, the last ranks short or empty). The two agree
    whenever ``group_size`` divides ``rows``."""
    if rows < 1 or not 0 <= group_rank < group_size:
        raise InvalidArgument(f"rows {rows} must be at least 1 and group_rank {group_rank} "
                              f"in [0, {group_size})")
    if rule not in SHARD_RULES:
        raise InvalidArgument(f"unknown shard rule {rule!r} (even or chunk)")
    begin, end = _native.shard_rows(rows, group_size, group_rank, rule)
    return int(begin), int(end)


# One parameter of a sharded model: its global shape, and the first of its rows this trainer
# holds (DiLoCo's ``shards``).
ShardSpec = Tuple[Sequence[int], int]


class _Sharding:
    """Where a sharded model's parameters sit: each trainer holds rows [begin, end) of every
    parameter (any contiguous rows: the even split, torch.chunk's, or another tiling), its local
    tensors packed in the model's order; the library's specs are the whole model's, and the
    group's trainers check at their first join that their rows tile every parameter."""

    def __init__(self, shards: Mapping[str, ShardSpec], group_rank: int, group_size: int):
        self.shards = shards
        self.group_rank = group_rank
        self.group_size = group_size
        self.global_shapes: Dict[str, Tuple[int, ...]] = {}
        self.rows: Dict[str, Tuple[int, int]] = {}

    def check(self, named: List[Tuple[str, torch.nn.Parameter]]) -> None:
        """Refuses, naming the parameter and the rows, a description this trainer's tensors
        contradict (the group's tiling is checked at the join, where all rows are known)."""
        names = {n for n, _ in named}
        for extra in sorted(set(self.shards) - names):
            raise InvalidArgument(f"shards names {extra!r}, which is not a parameter of the model")
        for name, p in named:
            if name not in self.shards:
                raise InvalidArgument(
                    f"parameter {name} has no entry in shards (a sharded model describes every "
                    "parameter: {name: (global_shape, first_row)})")
            shape_in, first = self.shards[name]
            shape = tuple(int(d) for d in shape_in)
            if not shape or any(d < 1 for d in shape):
                raise InvalidArgument(
                    f"parameter {name}: global shape {shape} is not rows of a tensor (a sharded "
                    "parameter has at least one dimension, all positive)")
            local = tuple(p.shape)
            if len(local) != len(shape) or local[1:] != shape[1:]:
                raise InvalidArgument(f"parameter {name} is {local} here, which is not rows of "
                                      f"its global shape {shape}")
            held = (int(first), int(first) + local[0])
            if held[0] < 0 or held[1] > shape[0]:
                raise InvalidArgument(
                    f"parameter {name}: this trainer holds rows [{held[0]}, {held[1]}), which "
                    f"are not rows of its global {shape[0]}")
            self.global_shapes[name] = shape
            self.rows[name] = held


class _InnerLayout:
    """Where each piece of the inner optimizer's state lives in one flat float32 buffer: for
    every parameter (in the model's order) every tensor of its optimizer state, by key. The
    layout is found by running a copy of the optimizer one step on copies of the parameters,
    because torch optimizers create their state lazily at the first step."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 params: List[Tuple[str, torch.nn.Parameter]],
                 sharding: Optional[_Sharding] = None):
        # (parameter, name, key, local shape, offset in this trainer's buffer).
        self.entries: List[Tuple[torch.nn.Parameter, str, str, Tuple[int, ...], int]] = []
        # The library's specs: the whole state's shapes and offsets (this trainer's rows of it
        # when sharded). Scalars (a step count) are rank 0's rows of a sharded model's state.
        self._specs: List[Tuple[str, int, Tuple[int, ...]]] = []
        # A sharded model's scalars this trainer does not hold: rank 0's, shared on a restore.
        self.borrowed: List[Tuple[torch.nn.Parameter, str]] = []
        # A sharded model's rows of each of the library's specs (its parameter's rows; a scalar
        # rank 0's).
        self.rows: List[Tuple[int, int]] = []
        self.total = 0
        whole = 0
        probe_state = self._probe(optimizer, [p for _, p in params])
        for (name, p), state in zip(params, probe_state):
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                shape = tuple(value.shape)
                full = shape
                held = True
                if sharding is not None:
                    if shape == tuple(p.shape):
                        full = sharding.global_shapes[name]
                        self.rows.append(sharding.rows[name])
                    elif shape == ():
                        held = sharding.group_rank == 0
                        self.rows.append((0, 1) if held else (0, 0))
                    else:
                        raise InvalidArgument(
                            f"the inner optimizer's {key} of parameter {name} is {shape}, "
                            "neither the parameter's shape nor a scalar: a sharded model's "
                            "optimizer state must be cut by rows")
                # The C++ example names them the same way (exp_avg/NAME, exp_avg_sq/NAME,
                # step/NAME), so the two trainers read each other's checkpoints.
                self._specs.append((f"{key}/{name}", whole, full))
                whole += max(1, int(torch.Size(full).numel()))
                if held:
                    self.entries.append((p, f"{key}/{name}", key, shape, self.total))
                    self.total += self._count(shape)  # 0 where this rank holds no rows
                else:
                    self.borrowed.append((p, key))

    @staticmethod
    def _probe(optimizer: torch.optim.Optimizer,
               params: List[torch.nn.Parameter]) -> List[Dict[str, Any]]:
        clones = {id(p): torch.zeros_like(p, device="cpu", dtype=torch.float32).requires_grad_()
                  for p in params}
        groups: List[Dict[str, Any]] = []
        for g in optimizer.param_groups:
            group = {k: v for k, v in g.items() if k != "params"}
            group["params"] = [clones[id(p)] for p in g["params"] if id(p) in clones]
            groups.append(group)
        groups = [g for g in groups if g["params"]]
        probe: torch.optim.Optimizer = type(optimizer)(groups, **optimizer.defaults)
        for c in clones.values():
            c.grad = torch.zeros_like(c)
        probe.step()
        return [probe.state.get(clones[id(p)], {}) for p in params]

    def specs(self) -> List["_native.TensorSpec"]:
        return [_native.TensorSpec(name, offset, list(shape))
                for name, offset, shape in self._specs]

    @staticmethod
    def _count(shape: Tuple[int, ...]) -> int:
        return 1 if shape == () else int(torch.Size(shape).numel())

    def save(self, optimizer: torch.optim.Optimizer, out: torch.Tensor) -> None:
        """The optimizer's current state into ``out`` (zeros where it has none yet)."""
        for p, _, key, shape, offset in self.entries:
            n = self._count(shape)
            value = optimizer.state.get(p, {}).get(key)
            dst = out[offset:offset + n]
            if value is None:
                dst.zero_()
            else:
                dst.copy_(value.detach().reshape(-1).to(torch.float32))

    def load(self, optimizer: torch.optim.Optimizer, flat: torch.Tensor,
             group_sum: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """The optimizer's state from ``flat`` (a restore), in each value's own dtype/device.
        A sharded model's trainers other than rank 0 take its scalars (the step counts) from
        rank 0 through ``group_sum`` (an in-group sum every trainer of the group calls)."""
        if group_sum is not None:
            scalars = [(p, key, offset) for p, _, key, shape, offset in self.entries
                       if shape == ()]
            if self.borrowed:
                scalars = [(p, key, -1) for p, key in self.borrowed]
            shared = torch.zeros(len(scalars), dtype=torch.float32)
            for i, (_, _, offset) in enumerate(scalars):
                if offset >= 0:
                    shared[i] = flat[offset]
            group_sum(shared)
            for i, (p, key, _) in enumerate(scalars):
                optimizer.state[p][key] = shared[i].clone().reshape(())
        for p, _, key, shape, offset in self.entries:
            n = self._count(shape)
            src = flat[offset:offset + n].reshape(shape)
            state = optimizer.state[p]
            old = state.get(key)
            if old is not None:
                state[key] = src.to(dtype=old.dtype, device=old.device).clone()
            else:
                # torch's optimizers keep a parameter's moments in its dtype (a bf16 model's
                # AdamW moments are bf16); scalars such as the step count stay float32.
                on = p.device if shape != () else torch.device("cpu")
                dtype = p.dtype if shape != () else torch.float32
                state[key] = src.to(device=on, dtype=dtype).clone()

    def digest(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        out = torch.zeros(self.total, dtype=torch.float32)
        self.save(optimizer, out)
        return out


class DiLoCo:
    """DiLoCo over Lightkeeper: a context manager around the training loop.

    Args (torchft's names where the concept is the same):
        manager: this trainer's ``lightkeeper.Manager``.
        model: the model; its parameters become views into one flat buffer. They are all
            float32, all bfloat16 or all float16 (a mix, or another dtype, raises
            ``InvalidArgument`` naming the parameter, before anything is sent); the outer state
            is float32 in every case.
        inner_optimizer: the inner optimizer (e.g. AdamW); its state goes into durable
            checkpoints and comes back from them.
        sync_every: inner steps (calls of ``step()``) per outer step; with ``sync_every_s``
            the most inner steps per outer step.
        sync_every_s: a time budget per outer step (seconds), or None: the outer step comes
            once this much time passed since the last one ended, so that a faster group runs
            more inner steps instead of waiting for a slower one. Group rank 0's clock decides
            and the group's trainers agree on it at every inner step (as on a drain).
        outer_lr, outer_momentum, nesterov: the outer SGD.
        ckpt_dir: durable checkpoints of this group (its trainers share it); None: none.
        ckpt_every: a durable save every K committed outer steps; 0: on drain and at the end.
        group_pg: the group's process group (torchrun's, NCCL...) for the drain agreement at
            each inner step; None: ``manager.group_process_group()`` when group_size > 1.
        live_dir: the node-local directory the agent serves to healing peers (its
            ``--serve-dir``); None: ``$LK_LIVE_DIR``, else none (peers then heal over the
            communicator).
        ckpt_keep, bind_host, timeout, init_timeout: as the C++ library's options.
        outer_compress: the encoding of the cross-group exchange: "none" (float32), "bf16",
            "int8" or "int4" (blockwise scales with error feedback; every member still ends
            with bitwise-identical weights). Every group of a job must use the same.
        overlap: overlapped outer steps (the C++ library's DilocoOptions::overlap): each outer
            step's exchange runs on a thread of the library while the next inner steps compute,
            and lands at the next outer step with the inner progress made meanwhile kept on
            top of the new global weights. ``in_flight`` says whether one is on the wire,
            ``flush()`` lands it, and the context's exit lands it when the loop did not.
            Every group of a job uses the same setting.
        outer_fragments: with ``overlap``, the exchange goes on the link in this many fragments
            spread over the inner steps that run meanwhile (a steady trickle instead of one
            burst per outer step); 1: one burst. At most 64; the same in every group.
        extra_state: the trainer's own state for durable checkpoints, per rank (its data
            loader's position, torch/python RNG states, LR schedule), as bytes: called right
            before each outer step (and before the join) with the loop where the next inner
            step would start. Each durable save writes the bytes that go with the saved step's
            weights (with ``overlap``, those of the step's own outer step), checksummed in the
            checkpoint like the weights. None: nothing saved.
        load_extra_state: called with the bytes when a durable restore brought this rank's
            (in the context's ``__enter__`` or at an outer step); ``restored_extra_state``
            holds them too. Never called after a heal from live peers: the trainer's own data
            position is its own, and it goes on from where it is. A checkpoint written by a
            group of another size hands group rank r the bytes rank r saved, or nothing.
        extra_state_bytes_max: the bound on those bytes (default 4 MiB, at most 64 MiB);
            more fails the outer step with ``invalid_argument``.
        shards: a sharded model (FSDP inside the group, DiLoCo across: the HSDP layout), by an
            explicit description: ``{name: (global_shape, first_row)}`` for every parameter,
            whose local tensor holds rows ``first_row`` on of the parameter's ``global_shape``.
            Any contiguous rows will do as long as the group's trainers together hold every
            row of every parameter once: the library's even split, ``torch.chunk``'s (FSDP2's
            and DTensor's ``Shard(0)``; ``lightkeeper.shard_rows(rows, group_size, group_rank,
            rule)`` names both), or another tiling. A description this trainer's tensors
            contradict raises ``InvalidArgument`` naming the parameter and the rows before
            anything is sent; rows that overlap or leave rows to nobody across the group are
            refused the same way at the group's first join, in every trainer of the group. The
            library's outer state is the even split in every group, so groups of any layouts
            mix; where a group's rows differ from it, the library moves those rows inside the
            group at each outer step.
            The library then holds the outer state of these rows only, never gathers the
            model, heals and restores by rows (from groups and checkpoints of any layout), and
            the inner optimizer's state is saved and restored per shard. None: every trainer
            holds the whole model.
    """

    def __init__(self, manager: Manager, model: torch.nn.Module,
                 inner_optimizer: torch.optim.Optimizer, sync_every: int, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, ckpt_dir: Optional[str] = None, ckpt_every: int = 0,
                 group_pg: Optional[ProcessGroup] = None, live_dir: Optional[str] = None,
                 ckpt_keep: int = 3,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120),
                 init_timeout: datetime.timedelta = datetime.timedelta(seconds=30),
                 outer_compress: str = "none", sync_every_s: Optional[float] = None,
                 overlap: bool = False, outer_fragments: int = 1,
                 extra_state: Optional[Callable[[], bytes]] = None,
                 load_extra_state: Optional[Callable[[bytes], None]] = None,
                 extra_state_bytes_max: int = 4 << 20,
                 shards: Optional[Mapping[str, ShardSpec]] = None) -> None:
        if sync_every < 1:
            raise InvalidArgument(f"sync_every must be at least 1, not {sync_every}")
        if not 1 <= int(outer_fragments) <= 64:
            raise InvalidArgument(f"outer_fragments must be in [1, 64], not {outer_fragments}")
        if sync_every_s is not None and not 0 < sync_every_s <= 86400:
            raise InvalidArgument(
                f"sync_every_s must be in (0, 86400] or None, not {sync_every_s}")
        if not 0 < int(extra_state_bytes_max) <= 64 << 20:
            raise InvalidArgument("extra_state_bytes_max must be in (0, 64 MiB], "
                                  f"not {extra_state_bytes_max}")
        self.sync_every_s = sync_every_s
        self._sharding: Optional[_Sharding] = None
        if shards is not None:
            if manager is None:
                raise InvalidArgument("shards needs the manager (its group_rank and group_size)")
            self._sharding = _Sharding(shards, manager.group_rank, manager.group_size)
        self._extra_state = extra_state
        self._load_extra_state = load_extra_state
        self._extra_state_bytes_max = int(extra_state_bytes_max)
        # This rank's extra state of the last durable restore (the last outer step's, or the
        # join's), or None.
        self.restored_extra_state: Optional[bytes] = None
        self.manager = manager
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self._options: Dict[str, Any] = dict(outer_lr=outer_lr, outer_momentum=outer_momentum,
                             nesterov=nesterov, ckpt_dir=ckpt_dir or "",
                             ckpt_every=ckpt_every, ckpt_keep=ckpt_keep,
                             live_dir=live_dir if live_dir is not None
                             else os.environ.get("LK_LIVE_DIR", ""),
                             timeout_ms=_ms(timeout), init_timeout_ms=_ms(init_timeout),
                             outer_compress=outer_compress, overlap=bool(overlap),
                             outer_fragments=int(outer_fragments))
        self._group_pg = group_pg
        self._native: Optional[_native.Diloco] = None
        self._inner_steps = 0
        self._tokens = 0  # this trainer's tokens since the last outer step
        self._outer_end = time.monotonic()  # when the last outer step ended (sync_every_s)
        self.outer_step = 0
        self.should_stop = False
        self.last_result: Optional[SyncResult] = None
        self._drained = False

    # Layout.

    def _flatten(self) -> None:
        named = [(n, p) for n, p in self.model.named_parameters()]
        if not named:
            raise InvalidArgument("the model has no parameters")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise InvalidArgument(f"parameters on several devices: {sorted(map(str, devices))}")
        first_name, first = named[0]
        if first.dtype not in _PARAM_DTYPES:
            raise InvalidArgument(f"parameter {first_name} is {first.dtype}; DiLoCo takes "
                                  "float32, bfloat16 or float16 parameters")
        for n, p in named:
            if p.dtype != first.dtype:
                raise InvalidArgument(
                    f"parameter {n} is {p.dtype} but {first_name} is {first.dtype}; DiLoCo "
                    "takes parameters of one dtype (float32, bfloat16 or float16)")
        self._dtype = first.dtype
        self._device = devices.pop()
        if self._sharding is not None:
            self._sharding.check(named)
        total = sum(p.numel() for _, p in named)
        flat = torch.empty(total, dtype=self._dtype, device=self._device)
        specs: List[_native.TensorSpec] = []
        offset = 0
        whole = 0  # the parameter's offset in the whole model (the library's specs)
        with torch.no_grad():
            for name, p in named:
                count = p.numel()
                flat[offset:offset + count].copy_(p.reshape(-1))
                # The parameter becomes a view into the flat buffer (same Parameter object, so
                # the optimizer's references stay valid).
                p.data = flat[offset:offset + count].view_as(p)
                shape = (list(self._sharding.global_shapes[name]) if self._sharding is not None
                         else list(p.shape))
                specs.append(_native.TensorSpec(name, whole, shape))
                offset += count
                whole += int(torch.Size(shape).numel())
        self._flat = flat
        # The library works on host memory: a CUDA model is copied through a host buffer at
        # each outer step (pinned, so the copies run at the bus's speed).
        self._host = flat if flat.device.type == "cpu" else torch.empty(
            total, dtype=self._dtype, pin_memory=True)
        self._specs = specs
        self._named = named

    # The context.

    def __enter__(self) -> "DiLoCo":
        self._flatten()
        self._inner = _InnerLayout(self.inner_optimizer, self._named, self._sharding)
        opt = self.inner_optimizer

        def save_inner(address: int, count: int) -> None:
            self._inner.save(opt, _float_view(address, count))

        m = self.manager
        o = self._options
        self._native = _native.Diloco(
            m._native_session(), group_rank=m.group_rank, group_size=m.group_size,
            params=self._specs, inner_state=self._inner.specs(), inner_save=save_inner,
            outer_lr=o["outer_lr"], outer_momentum=o["outer_momentum"], nesterov=o["nesterov"],
            ckpt_dir=o["ckpt_dir"], ckpt_every=o["ckpt_every"], ckpt_keep=o["ckpt_keep"],
            live_dir=o["live_dir"], bind_host=m.bind_host,
            init_timeout_ms=o["init_timeout_ms"], op_timeout_ms=o["timeout_ms"],
            stuck_timeout_ms=0, outer_compress=o["outer_compress"], overlap=o["overlap"],
            outer_fragments=o["outer_fragments"],
            extra_state_bytes_max=self._extra_state_bytes_max,
            param_dtype=_PARAM_DTYPES[self._dtype], sharded=self._sharding is not None,
            shard_rows=([self._sharding.rows[n] for n, _ in self._named]
                        if self._sharding is not None else []),
            inner_shard_rows=self._inner.rows if self._sharding is not None else [])
        try:
            self._call("join")
            if not self.should_stop and m.group_size > 1 and self._group_pg is None:
                self._group_pg = m.group_process_group()
        except BaseException:
            # No __exit__ follows a failed __enter__: the library's object goes now, so that it
            # does not outlive the context (nor keep the Manager's session from closing).
            self._native = None
            raise
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._native is None:
            return
        try:
            if exc_type is None and not self._drained and self._native.in_flight:
                self.flush()  # the model gets the last step's weights (overlap)
            if exc_type is None and not self._drained:
                # The final barrier, a durable save unless the last commit made one, and the
                # goodbye to the agent (so the exit is not reported as a crash).
                self._native.finish()
            elif exc_type is None:
                # Drained: Sync already saved when asked. The goodbye tells the agent the exit
                # is not a crash; a drained agent may be gone already.
                try:
                    self.manager.finish()
                except Error:
                    pass
        finally:
            self._native = None  # closes the library's object before the Manager's session

    # The loop.

    def step(self, tokens: int = 0) -> None:
        """Call right after every ``inner_optimizer.step()``, with the tokens (samples) this
        trainer processed in it. Every ``sync_every`` calls (or once ``sync_every_s`` passed)
        it runs the outer step and loads the new global weights into the model; the outer
        average weighs each group's pseudo-gradient by its tokens (every trainer of every group
        passes them, or none does: then it is the plain average). At any call it stops the loop
        (``should_stop``) when the agent drains the group."""
        if self._native is None:
            raise InvalidArgument("DiLoCo.step() outside its context")
        if self.should_stop:
            return
        if tokens < 0:
            raise InvalidArgument(f"tokens must not be negative, not {tokens}")
        self._inner_steps += 1
        self._tokens += int(tokens)
        drain, budget_spent = self._agree()
        if drain or budget_spent or self._inner_steps % self.sync_every == 0:
            self._call("sync")

    def _agree(self) -> Tuple[bool, bool]:
        """Whether any trainer of the group saw a drain, and whether group rank 0 found the
        time budget spent: all of them must stop after the same inner step (one stopping alone
        would leave the others in the next collective)."""
        native = self._live()
        noticed = native.drain_requested()
        spent = (self.sync_every_s is not None and self.manager.group_rank == 0 and
                 time.monotonic() - self._outer_end >= self.sync_every_s)
        if self.manager.group_size == 1:
            return noticed, spent
        flag = torch.tensor([1.0 if noticed else 0.0, 1.0 if spent else 0.0],
                            dtype=torch.float32)
        if self._group_pg is not None:
            on = flag.to(self._device) if _is_nccl(self._group_pg) else flag
            _all_reduce(on, group=self._group_pg)
            flag = on.cpu()
        else:
            native.group_allreduce_sum(flag.data_ptr(), 2)
        drain = flag[0].item() > 0
        if drain and not noticed:
            native.request_drain()
        return drain, flag[1].item() > 0

    def _hand_extra_state(self) -> None:
        if self._extra_state is None:
            return
        data = self._extra_state()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"extra_state() must return bytes, not {type(data).__name__}")
        self._live().set_extra_state(bytes(data))

    def _live(self) -> "_native.Diloco":
        if self._native is None:
            raise InvalidArgument("DiLoCo is used outside its context")
        return self._native

    def _call(self, what: str) -> SyncResult:
        native = self._live()
        if what != "flush":
            self._hand_extra_state()
        if self._host is not self._flat:
            self._host.copy_(self._flat)
        if what == "join":
            raw = native.join(self._host.data_ptr(), self._host.numel())
        elif what == "flush":
            raw = native.flush(self._host.data_ptr(), self._host.numel())
        else:
            raw = native.sync(self._host.data_ptr(), self._host.numel(), self._tokens)
        if self._host is not self._flat:
            self._flat.copy_(self._host)
        r = SyncResult._from_native(raw)
        self.last_result = r
        self.outer_step = r.step
        # The Manager's poll(), allreduce() and current_step() go on from this outer step.
        self.manager._observe_outer_step(r.step, r.quorum_id, r.replica_rank,
                                         r.replica_world_size)
        if r.inner == "reset":
            self.inner_optimizer.state.clear()
        elif r.inner == "restored":
            state = torch.frombuffer(bytearray(native.restored_inner_state()),
                                     dtype=torch.float32)

            def group_sum(t: torch.Tensor) -> None:
                native.group_allreduce_sum(t.data_ptr(), t.numel())

            sharded_group = self._sharding is not None and self.manager.group_size > 1
            self._inner.load(self.inner_optimizer, state, group_sum if sharded_group else None)
        if r.extra_state_restored:
            self.restored_extra_state = native.restored_extra_state()
            if self._load_extra_state is not None and self.restored_extra_state is not None:
                self._load_extra_state(self.restored_extra_state)
        if r.kind == "drained":
            self.should_stop = True
            self._drained = True
        self._inner_steps = 0  # the next outer step counts its inner steps afresh
        self._tokens = 0
        self._outer_end = time.monotonic()
        return r

    def flush(self) -> Optional[SyncResult]:
        """With ``overlap``: lands the outer step in flight (after the loop's last ``step()``),
        as the next outer step would but without starting another one; the model gets the new
        global weights. Returns the result (``last_result``), or None when nothing was in
        flight."""
        if self._native is None:
            raise InvalidArgument("DiLoCo.flush() outside its context")
        if self.should_stop or not self._native.in_flight:
            return None
        return self._call("flush")

    @property
    def in_flight(self) -> bool:
        """With ``overlap``: an outer step's exchange is on the wire (started, not landed)."""
        return self._native is not None and self._native.in_flight

    def global_weights(self) -> torch.Tensor:
        """With ``overlap``: the global weights of the last commit (or received state) in the
        flat layout of the model's parameters, a float32 copy (the model itself carries the
        inner progress made since). Without overlap the model holds them after each commit
        (rounded to its dtype for a 16-bit model), and this is a copy of the model's flat
        buffer in its dtype."""
        raw = self._native.global_weights() if self._native is not None else b""
        if not raw:
            return self._flat.detach().cpu().clone()
        return torch.frombuffer(bytearray(raw), dtype=torch.float32)

    # For tests and tools.

    def inner_state_vector(self) -> torch.Tensor:
        """The inner optimizer's state in the checkpoint's layout (a copy)."""
        return self._inner.digest(self.inner_optimizer)

    @property
    def shard_numel(self) -> int:
        return self._native.shard_numel if self._native is not None else 0

    @property
    def sharded(self) -> bool:
        """The model is sharded (``shards``): this trainer holds its rows of every parameter."""
        return self._sharding is not None

    @property
    def param_dtype(self) -> str:
        """The model's parameter dtype as the library names it: "float32", "bf16" or "fp16"."""
        return _PARAM_DTYPES[self._dtype]

    @property
    def model_bytes(self) -> int:
        """Bytes of parameters this trainer holds (the flat buffer)."""
        return int(self._flat.numel() * self._flat.element_size())

    @property
    def outer_state_bytes(self) -> int:
        """Bytes of outer state the library holds for this trainer (its float32 shard of the
        global weights and momentum, retry and overlap buffers, and a 16-bit model's float32
        staging buffer); 0 outside the context."""
        return self._native.outer_state_bytes if self._native is not None else 0


# The parameter dtypes the library takes, by the names its options use.
_PARAM_DTYPES: Dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# torch 1.13's torch.distributed functions carry no annotations, and mypy --strict refuses an
# untyped call from typed code; the alias gives the one the package calls a type.
_all_reduce: Callable[..., Any] = dist.all_reduce


def _is_nccl(pg: Any) -> bool:
    try:
        return bool(pg.name().lower() == "nccl")
    except Exception:  # noqa: BLE001 - ProcessGroup wrappers without name()
        return False
