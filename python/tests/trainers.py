"""Small trainers that the package's tests run as real processes (one per group_rank), each
printing one JSON line per event to stdout. Usage: trainers.py MODE [--flags]; see main()."""

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import zlib

import torch

import lightkeeper


def emit(**kv):
    # One write per event: print() writes the text and the newline separately, and an
    # unbuffered stdout (PYTHONUNBUFFERED) would make those two system calls.
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def quorum_fields(q):
    return dict(quorum_id=q.quorum_id, replica_rank=q.replica_rank,
                world=q.replica_world_size, max_step=q.max_step, heal=q.heal, drain=q.drain,
                reconfigure=q.reconfigure, initial=q.initial)


def mode_allreduce(args, m):
    """Each step: poll, allreduce a tensor whose value names the replica_rank, check the average
    (and a bfloat16 one), commit. On QuorumLost: report it and poll again."""
    step = 0
    while step < args.steps:
        q = m.poll(step)
        emit(event="poll", step=step, **quorum_fields(q))
        if q.drain:
            emit(event="drain", step=step, checkpoint_now=q.checkpoint_now)
            return 0
        dev = torch.device(args.device)
        t = torch.full((args.numel,), float(q.replica_rank + 1), dtype=torch.float32, device=dev)
        b = torch.full((1000,), float(q.replica_rank + 1), dtype=torch.bfloat16, device=dev)
        view = torch.arange(2 * args.numel, dtype=torch.float32, device=dev)[::2]  # strided
        view.fill_(float(q.replica_rank))
        try:
            m.allreduce(t)
            m.allreduce(b, op="sum")
            m.allreduce(view, op="sum")
        except lightkeeper.QuorumLost as e:
            emit(event="quorum_lost", step=step, code=e.code, message=e.message)
            continue
        w = q.replica_world_size
        want = sum(range(1, w + 1)) / w
        correct = (t.device.type == args.device and bool(torch.all(t == want)) and bool(torch.all(b.float() == w * (w + 1) / 2))
                   and bool(torch.all(view == w * (w - 1) / 2)))
        m.commit(step + 1)
        step += 1
        emit(event="commit", step=step, correct=correct, value=float(t[0]),
             current_step=m.current_step(), **quorum_fields(q))
        time.sleep(args.sleep_ms / 1000)
    m.finish()
    emit(event="finished", step=step)
    return 0


def mode_sizes(args, m):
    """One poll with set_mixed_group_sizes: report the quorum's group sizes, then show that a
    plain allreduce refuses a quorum of several sizes."""
    m.set_mixed_group_sizes(True)
    q = m.poll(0)
    emit(event="poll", step=0, group_sizes=list(q.group_sizes), **quorum_fields(q))
    try:
        m.allreduce(torch.ones(16))
        emit(event="allreduce", ok=True)
    except lightkeeper.Error as e:
        emit(event="allreduce", ok=False, code=e.code, message=e.message)
    m.finish()
    return 0


def mode_idle(args, m):
    """Polls once and then sleeps without ever joining the allreduce, so the other groups'
    allreduce blocks on it (until this process is killed)."""
    q = m.poll(0)
    emit(event="poll", step=0, **quorum_fields(q))
    time.sleep(3600)  # never joining is what this mode is for, not an order
    return 0


def mode_ddp(args, m):
    """DistributedDataParallel over manager.group_process_group(): each rank trains on its own
    data; DDP's gradient averaging keeps the replicas bitwise equal."""
    q = m.poll(0)
    emit(event="poll", step=0, **quorum_fields(q))
    pg = m.group_process_group()
    torch.manual_seed(1234 + m.group_rank)  # different initial weights: DDP must broadcast
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(99 + m.group_rank)  # different data per rank
    for i in range(args.steps):
        x = torch.randn(4, 8, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        grad = model[0].weight.grad.clone()
        opt.step()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        emit(event="ddp_step", i=i, hash=digest,
             grad=hashlib.sha256(grad.numpy().tobytes()).hexdigest())
    # The group's process group also serves plain collectives.
    t = torch.tensor([float(m.group_rank + 1)])
    torch.distributed.all_reduce(t, group=pg)
    emit(event="pg_allreduce", value=float(t[0]))
    m.finish()
    emit(event="finished")
    return 0


class TinyModel(torch.nn.Module):
    """Two layers and a bias-free head: a few hundred parameters, several named tensors."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def raw_bytes(t):
    """A tensor's bytes, 16-bit dtypes included (numpy has no bfloat16)."""
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy().tobytes()


def flat_hash(model):
    return hashlib.sha256(b"".join(raw_bytes(p) for p in model.parameters())).hexdigest()[:16]


def mode_diloco(args, m):
    """DiLoCo on TinyModel with AdamW: one JSON line per committed outer step with the hash of
    the whole model (the global weights after the commit) and of the inner optimizer state."""
    torch.manual_seed(7)  # the same initial weights everywhere; replica_rank 0's win anyway
    model = TinyModel()
    dtype = {"float32": torch.float32, "bf16": torch.bfloat16,
             "fp16": torch.float16}[args.param_dtype]
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + zlib.crc32(args.data_seed.encode()) % 1000 + m.group_rank)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    handed = {}  # the hash of the extra state handed at each outer step, by the step it ends

    def extra_state():
        # The data generator's state, padded to --extra-state-bytes (a test of the bound).
        data = gen.get_state().numpy().tobytes()
        data += b"\0" * max(0, args.extra_state_bytes - len(data))
        handed["last"] = hashlib.sha256(data).hexdigest()[:16]
        return data

    def load_extra_state(data):
        gen.set_state(torch.frombuffer(bytearray(data[:len(gen.get_state())]),
                                       dtype=torch.uint8))

    extra = dict(extra_state=extra_state, load_extra_state=load_extra_state) \
        if args.extra_state_bytes else {}
    with lightkeeper.DiLoCo(m, model, opt, sync_every=args.sync_every, **extra,
                            ckpt_dir=args.ckpt_dir or None, ckpt_every=args.ckpt_every,
                            outer_compress=args.outer_compress,
                            sync_every_s=args.sync_every_s, overlap=args.overlap,
                            outer_fragments=args.outer_fragments) as d:
        ran = 0  # inner steps since the last outer step
        nonlocal_x = [torch.zeros(1)]  # the last batch drawn
        r = d.last_result
        inner = hashlib.sha256(d.inner_state_vector().numpy().tobytes()).hexdigest()[:16]
        emit(event="joined", kind=r.kind, step=d.outer_step, inner=r.inner,
             inner_hash=inner, model_hash=flat_hash(model), heal_source=r.heal_source,
             global_hash=r.global_hash,
             extra_restored=r.extra_state_restored,
             extra_hash=hashlib.sha256(d.restored_extra_state).hexdigest()[:16]
             if d.restored_extra_state is not None else None,
             views=all(p.data_ptr() >= d._flat.data_ptr() and
                       p.data_ptr() < d._flat.data_ptr() + 4 * d._flat.numel()
                       for p in model.parameters()))
        def outer_event(r, ran, loss):
            x = nonlocal_x[0]
            inner = hashlib.sha256(d.inner_state_vector().numpy().tobytes()).hexdigest()[:16]
            emit(event="outer", kind=r.kind, step=d.outer_step, quorum_id=r.quorum_id,
                 world=r.replica_world_size, state_hash=r.state_hash,
                 model_hash=flat_hash(model), inner=r.inner, inner_hash=inner,
                 saved=r.saved, healed=r.healed, loss=float(loss), ran=ran,
                 tokens=r.tokens, quorum_tokens=r.quorum_tokens,
                 weighted=r.weighted, global_hash=r.global_hash,
                 extra_hash=handed.get("last"), x_hash=hashlib.sha256(
                     x.numpy().tobytes()).hexdigest()[:16],
                 global_weights_hash=hashlib.sha256(
                     raw_bytes(d.global_weights())).hexdigest()[:16])

        # With --overlap the step in flight counts (README's "Overlapped outer steps").
        while d.outer_step + d.in_flight < args.steps and not d.should_stop:
            nonlocal_x[0] = x = torch.randn(16, 8, generator=gen)
            xd = x.to(dtype)  # the batch in the model's dtype (x itself, for float32)
            loss = (model(xd) - xd @ target.to(dtype)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prev = d.last_result
            d.step(tokens=args.tokens)
            ran += 1
            r = d.last_result
            if r is not prev:  # an outer step ran
                outer_event(r, ran, loss)
                ran = 0
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)
        if d.in_flight:
            outer_event(d.flush(), 0, 0.0)
        emit(event="stopping", step=d.outer_step, should_stop=d.should_stop)
    emit(event="finished", step=d.outer_step)
    return 0


class Zero3:
    """ZeRO-3 by hand over the group's process group (Debian's torch 1.13 has no FSDP that
    imports on Python 3.11): each trainer keeps only its rows of every parameter (and so of
    AdamW's state) in ``holder``; an inner step gathers the whole weights into ``compute`` (an
    exact all-gather: each trainer places its rows into zeros and the group sums, x + 0 == x),
    runs forward and backward there, averages the gradients over the group and hands each
    trainer its rows of them (a reduce-scatter), then frees the whole weights."""

    def __init__(self, m, model, dtype, pg, misdescribe=False, rule="even"):
        self.m = m
        self.pg = pg
        self.dtype = dtype
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if misdescribe:
            # This trainer's model has two more rows of head.weight than its peers' (a
            # configuration mistake the group's join must refuse).
            rows, cols = self.shapes["head.weight"]
            self.shapes["head.weight"] = (rows + 2, cols)
        self.rows = {n: self.rows_of(s[0], m.group_size, m.group_rank, rule)
                     for n, s in self.shapes.items()}
        self.compute = model
        self.holder = TinyModel().to(dtype)
        with torch.no_grad():
            for (n, hp), cp in zip(self.holder.named_parameters(), model.parameters()):
                b, e = self.rows[n]
                if e > cp.shape[0]:
                    hp.data = torch.zeros((e - b,) + self.shapes[n][1:], dtype=dtype)
                else:
                    hp.data = cp.detach()[b:e].clone()

    @staticmethod
    def rows_of(rows, size, rank, rule):
        """This rank's rows: a rule's ("even", "chunk"), "skew" (rank k holds a share k + 1 of
        the rows: a tiling that follows neither rule), or "late" (the even split, but a rank
        past 0 starts a row late: that row is nobody's, which the group's join refuses)."""
        if rule in ("even", "chunk"):
            return lightkeeper.shard_rows(rows, size, rank, rule)
        if rule == "skew":
            total = size * (size + 1) // 2
            cut = [rows * (k * (k + 1) // 2) // total for k in range(size + 1)]
            return cut[rank], cut[rank + 1]
        b, e = lightkeeper.shard_rows(rows, size, rank)
        return (min(b + 1, e) if rank > 0 else b), e

    def shards(self):
        return {n: (self.shapes[n], self.rows[n][0]) for n in self.shapes}

    def _sum(self, t):
        if self.pg is not None:
            torch.distributed.all_reduce(t, group=self.pg)

    def gather(self):
        """The whole weights into ``compute`` (float32 on the wire: exact)."""
        with torch.no_grad():
            for (n, hp), cp in zip(self.holder.named_parameters(), self.compute.parameters()):
                full = torch.zeros(self.shapes[n], dtype=torch.float32)
                b, e = self.rows[n]
                full[b:e] = hp.detach().float()
                self._sum(full)
                cp.data = full.to(self.dtype)

    def free(self):
        for cp in self.compute.parameters():
            cp.data = torch.empty(0, dtype=self.dtype)
            cp.grad = None

    def grads(self):
        """The group's average gradient, this trainer's rows into ``holder``."""
        for (n, hp), cp in zip(self.holder.named_parameters(), self.compute.parameters()):
            g = cp.grad.detach().float().clone()
            self._sum(g)
            g /= self.m.group_size
            b, e = self.rows[n]
            hp.grad = g[b:e].to(self.dtype).clone()


def mode_zero3(args, m):
    """DiLoCo on TinyModel trained ZeRO-3 by hand (--shard-model: each trainer holds its rows
    of every parameter and of AdamW's state, and DiLoCo gets the rows as shards=) or
    replicated (every trainer the whole model; the gradients averaged over the group). One
    JSON line per event, with the hash of the whole model in its dtype (gathered when sharded:
    the same bytes in every layout), the library's outer state bytes and the model bytes this
    trainer holds."""
    torch.manual_seed(7)
    dtype = {"float32": torch.float32, "bf16": torch.bfloat16}[args.param_dtype]
    model = TinyModel().to(dtype)
    # torchft's order: the group's process group before DiLoCo (it needs no quorum yet).
    pg = m.group_process_group() if m.group_size > 1 else None
    z = (Zero3(m, model, dtype, pg, args.misdescribe, args.shard_rule) if args.shard_model
         else None)
    held = z.holder if z is not None else model
    opt = torch.optim.AdamW(held.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + zlib.crc32(args.data_seed.encode()) % 1000 +
                                        m.group_rank)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))

    def whole_hash():
        if z is None:
            return flat_hash(model)
        z.gather()
        h = flat_hash(model)
        z.free()
        return h

    def average_grads():
        if z is not None:
            z.grads()
            return
        if pg is None:
            return
        for p in model.parameters():
            g = p.grad.float()
            torch.distributed.all_reduce(g, group=pg)
            p.grad = (g / m.group_size).to(dtype)

    with contextlib.ExitStack() as stack:
        try:
            d = stack.enter_context(lightkeeper.DiLoCo(
                m, held, opt, sync_every=args.sync_every, ckpt_dir=args.ckpt_dir or None,
                ckpt_every=args.ckpt_every, outer_compress=args.outer_compress,
                overlap=args.overlap, group_pg=pg,
                shards=z.shards() if z is not None else None))
        except lightkeeper.InvalidArgument as e:
            emit(event="refused", value_error=isinstance(e, ValueError), message=str(e))
            return 3
        r = d.last_result

        def event(name, r, **kv):
            emit(event=name, kind=r.kind, step=d.outer_step, global_hash=r.global_hash,
                 model_hash=whole_hash(), inner=r.inner, heal_source=r.heal_source,
                 saved=r.saved, shard_model=d.sharded, model_bytes=d.model_bytes,
                 outer_state_bytes=d.outer_state_bytes,
                 inner_hash=hashlib.sha256(
                     d.inner_state_vector().numpy().tobytes()).hexdigest()[:16], **kv)

        event("joined", r)
        while d.outer_step + d.in_flight < args.steps and not d.should_stop:
            x = torch.randn(16, 8, generator=gen).to(dtype)
            if z is not None:
                z.gather()
            loss = (model(x) - x @ target.to(dtype)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            average_grads()
            if z is not None:
                z.free()
            opt.step()
            prev = d.last_result
            d.step()
            r = d.last_result
            if r is not prev:
                event("outer", r, quorum_id=r.quorum_id, world=r.replica_world_size)
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)
        if d.in_flight:
            r = d.flush()
            event("outer", r, quorum_id=r.quorum_id, world=r.replica_world_size)
        emit(event="stopping", step=d.outer_step, should_stop=d.should_stop)
    emit(event="finished", step=d.outer_step)
    return 0


def mode_readme(args, m):
    """The README's lower layer, then DiLoCo on top, in the README's order: a poll, the group's
    process group, DistributedDataParallel over it, then the DiLoCo context (group_pg=pg). Each
    group starts from its own random weights (--init-seed; DDP makes the group's trainers
    agree at construction): the DiLoCo join must hand every group the same starting state."""
    q = m.poll(0)
    emit(event="poll", step=0, **quorum_fields(q))
    pg = m.group_process_group() if m.group_size > 1 else None
    torch.manual_seed(args.init_seed)
    model = TinyModel()
    net = (torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
           if pg is not None else model)
    emit(event="built", model_hash=flat_hash(model))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + zlib.crc32(args.data_seed.encode()) % 1000
                                        + m.group_rank)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    with lightkeeper.DiLoCo(m, model, opt, sync_every=args.sync_every, group_pg=pg,
                            ckpt_dir=args.ckpt_dir or None, ckpt_every=args.ckpt_every) as d:
        r = d.last_result
        emit(event="joined", kind=r.kind, step=d.outer_step, model_hash=flat_hash(model))
        while d.outer_step < args.steps and not d.should_stop:
            x = torch.randn(16, 8, generator=gen)
            loss = (net(x) - x @ target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prev = d.last_result
            d.step()
            r = d.last_result
            if r is not prev:
                emit(event="outer", kind=r.kind, step=d.outer_step,
                     quorum_id=r.quorum_id, world=r.replica_world_size,
                     healed=r.healed, global_hash=r.global_hash,
                     model_hash=flat_hash(model))
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)
    emit(event="finished", step=d.outer_step, model_hash=flat_hash(model))
    return 0


def mode_torchft(args, m):
    """The order torchft users write: the Manager (made in main), then DistributedDataParallel
    over manager.group_process_group() with no poll before it, then the DiLoCo context. Each
    group's trainers start from different weights: DDP's broadcast makes the group agree."""
    pg = m.group_process_group()
    emit(event="pg", quorum_id=m.quorum.quorum_id if m.quorum is not None else 0)
    torch.manual_seed(args.init_seed + m.group_rank)
    model = TinyModel()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    emit(event="built", model_hash=flat_hash(model))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + m.group_rank)  # each rank its own data
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    with lightkeeper.DiLoCo(m, model, opt, sync_every=args.sync_every, group_pg=pg) as d:
        r = d.last_result
        assert isinstance(r, lightkeeper.SyncResult)
        emit(event="joined", kind=r.kind, step=d.outer_step, model_hash=flat_hash(model))
        while d.outer_step < args.steps and not d.should_stop:
            x = torch.randn(16, 8, generator=gen)
            loss = (ddp(x) - x @ target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prev = d.last_result
            d.step()
            r = d.last_result
            if r is not prev:
                emit(event="outer", kind=r.kind, step=d.outer_step, committed=r.committed,
                     old_form_kind=r["kind"], world=r.replica_world_size,
                     global_hash=r.global_hash, model_hash=flat_hash(model))
    emit(event="finished", step=d.outer_step, model_hash=flat_hash(model),
         current_step=m.current_step())
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["allreduce", "idle", "ddp", "diloco", "sizes", "readme",
                                    "torchft", "zero3"])
    p.add_argument("--group-rank", type=int, default=0)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--numel", type=int, default=4096)
    # A slow trainer's pace (time for a drain or a kill to land mid-run), not an order: tests
    # that need one event after another wait for it (conftest.wait_for).
    p.add_argument("--sleep-ms", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=60)
    p.add_argument("--no-finish", action="store_true")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--data-seed", default="g")
    p.add_argument("--outer-compress", default="none")
    p.add_argument("--sync-every-s", type=float, default=None)
    p.add_argument("--tokens", type=int, default=0)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--outer-fragments", type=int, default=1)
    p.add_argument("--extra-state-bytes", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=7)
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--shard-model", action="store_true")
    p.add_argument("--shard-rule", default="even",  # zero3: Zero3.rows_of
                   choices=["even", "chunk", "skew", "late"])
    p.add_argument("--misdescribe", action="store_true")  # zero3: a model unlike its peers'
    # A test hook: the library perturbs this trainer's shard of the global weights once, right
    # after the outer update of step N and before its commit (LK_TEST_PERTURB_STEP, read by
    # the C++ library), so that the lighthouse's divergence check and the heal that follows
    # can be exercised for real. 0: off.
    p.add_argument("--perturb-at-step", type=int, default=0)
    args = p.parse_args()
    if args.perturb_at_step:
        os.environ["LK_TEST_PERTURB_STEP"] = str(args.perturb_at_step)
    import datetime
    mode = {"allreduce": mode_allreduce, "idle": mode_idle, "ddp": mode_ddp,
            "diloco": mode_diloco, "sizes": mode_sizes, "readme": mode_readme,
            "torchft": mode_torchft, "zero3": mode_zero3}[args.mode]
    with lightkeeper.Manager(args.group_rank, args.group_size,
                             timeout=datetime.timedelta(seconds=args.timeout_s)) as m:
        if args.no_finish:
            m.finish = lambda: None  # exit as if the process died after its last step
        rc = mode(args, m)
    assert m.closed
    m.close()  # idempotent
    return rc


if __name__ == "__main__":
    sys.exit(main())
