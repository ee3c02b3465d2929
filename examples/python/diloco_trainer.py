#!/usr/bin/python3
"""diloco_trainer.py: one trainer process of a DiLoCo run under Lightkeeper, in PyTorch.

The Python twin of the C++ diloco_trainer (examples/diloco): the same character model with the
same parameter layout (char_model.py), the same corpus and data order, the same flags (each also
an LK_* environment variable) and the same --log JSON lines, so the demo, the chaos tests and
scripts/plot_run.py run either, and a group of these and a group of C++ trainers train one job
together. Start the node's replica_agent first; the trainer finds it through LK_AGENT_SOCKET.
Run with Debian's interpreter and the package on the path:

    PYTHONPATH=build/python LK_AGENT_SOCKET=/tmp/g0.sock LK_GROUP_ID=g0 \\
        /usr/bin/python3 examples/python/diloco_trainer.py --group-rank 0 --group-size 1 ...

Exits 0 when the committed step reaches --outer-steps or on a drain, 1 on a failure, 2 on bad
flags. It uses only the package's public API: lightkeeper.Manager and lightkeeper.DiLoCo.
"""
import argparse
import base64
import copy
import datetime
import json
import math
import os
import random
import socket
import stat
import struct
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.nn.utils.convert_parameters import parameters_to_vector, vector_to_parameters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import char_model  # noqa: E402

try:
    import lightkeeper
    from lightkeeper import SyncResult
except ImportError as e:  # the package is built into build/python
    sys.exit(f"diloco_trainer.py: cannot import lightkeeper ({e}); "
             "set PYTHONPATH to the build's python directory")

# (flag, type, default, help): diloco_trainer's flags, with its defaults.
FLAGS: List[Tuple[str, Callable[[str], Any], Any, str]] = [
    ("group-rank", int, 0, "this trainer's rank inside its group"),
    ("group-size", int, 1, "trainers in this group (groups may differ)"),
    ("inner-steps", int, 20, "H: inner AdamW steps per outer step (with --outer-step-s: the "
                             "most per outer step); groups may differ"),
    ("outer-step-s", float, 0.0, "a time budget per outer step: inner steps until this many "
                                 "seconds passed since the last outer step ended; 0: exactly "
                                 "--inner-steps"),
    ("inner-step-min-ms", int, 0, "tests and benchmarks: each inner step lasts at least this "
                                  "long (sleeps the rest); 0: off"),
    ("outer-steps", int, 10, "T: run until the committed outer step reaches T"),
    ("seed", int, 1, "model initialisation (same for all groups) and data order"),
    ("group-id", str, "", "seeds this group's data stream (the agent's LK_GROUP_ID); empty: the "
                          "first replica_rank"),
    ("ckpt-dir", str, "", "durable checkpoints of this group (shared by its trainers)"),
    ("ckpt-every", int, 0, "save every K committed steps; 0: only when draining"),
    ("live-dir", str, "", "node-local directory for the live state the agent serves to healing "
                          "peers (its --serve-dir); empty: none"),
    ("bind-host", str, "127.0.0.1", "the address this trainer's communicators listen on and "
                                    "give their peers (the node's address that the other "
                                    "groups reach), or an interface name (ib0: its IPv4 "
                                    "address)"),
    ("log", str, "", "JSON lines, one per committed outer step"),
    ("eval-batches", int, 0, "after every commit, the loss of the new global weights on this "
                             "many fixed batches, logged as eval_loss; 0: none"),
    ("model-width", int, 64, "embedding width"),
    ("layers", int, 2, "transformer blocks"),
    ("heads", int, 4, "attention heads (divides --model-width)"),
    ("seq-len", int, 64, "characters of context per sample"),
    ("batch", int, 16, "samples per inner step per trainer"),
    ("inner-lr", float, 3e-3, "AdamW learning rate"),
    ("outer-lr", float, 0.7, "outer Nesterov SGD learning rate"),
    ("outer-momentum", float, 0.9, "outer Nesterov momentum"),
    ("corpus-bytes", int, 64 << 10, "size of the generated training text"),
    ("init-timeout-ms", int, 30000, "communicator rendezvous and connect deadline"),
    ("op-timeout-ms", int, 120000, "deadline of one collective (the outer allreduce waits for "
                                   "the slowest group)"),
    ("log-level", str, "info", "debug, info, warn or error"),
    ("outer-compress", str, "none", "encoding of the cross-group pseudo-gradients: none "
                                    "(float32), bf16, int8 or int4 (blockwise scales, error "
                                    "feedback); the same in every group"),
    ("param-dtype", str, "float32", "the dtype of the model's parameters: float32, bf16 or fp16 "
                                    "(the model is cast to it and trains in it; the outer "
                                    "state stays float32 and the new global weights come back "
                                    "rounded, the same bits in every member)"),
    ("outer-fragments", int, 1, "with --outer-overlap: the exchange goes on the link in this "
                                "many fragments spread over the next inner steps (1: one "
                                "burst); the same in every group"),
]


PARAM_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
    """The flags, each defaulting to its LK_* variable, then to diloco_trainer's default."""
    p = argparse.ArgumentParser(
        prog="diloco_trainer.py",
        description="A DiLoCo trainer in PyTorch: a small GPT-style character model (CPU, one "
                    "thread), --inner-steps AdamW steps, then lightkeeper.DiLoCo's outer step.")
    for name, kind, default, text in FLAGS:
        env = "LK_" + name.upper().replace("-", "_")
        value = os.environ.get(env)
        if value is not None:
            try:
                default = kind(value)
            except ValueError:
                p.error(f"bad {env}={value!r}")
        p.add_argument("--" + name, type=kind, default=default, help=f"{text} (env {env})")

    def env_true(env: str, default: str = "") -> bool:
        return os.environ.get(env, default).lower() in ("1", "true", "yes")

    p.add_argument("--keep-denormals", action="store_true", default=env_true("LK_KEEP_DENORMALS"),
                   help="compute the inner steps with IEEE denormals; the default flushes them "
                        "to zero (torch.set_flush_denormal), as the C++ trainer does: on CPUs "
                        "the optimizer state of rarely used parameters decays into that range "
                        "and every operation on it is slow; the outer step always flushes "
                        "(env LK_KEEP_DENORMALS)")
    p.add_argument("--inner-master", default=env_true("LK_INNER_MASTER", "true"),
                   type=lambda v: v.lower() in ("1", "true", "yes"), nargs="?", const=True,
                   help="with a 16-bit --param-dtype: AdamW updates a float32 master copy of "
                        "the weights and the model holds its rounding (mixed precision, the "
                        "C++ trainer's --inner-master); false: torch's AdamW on the 16-bit "
                        "parameters (pure 16-bit training) (env LK_INNER_MASTER)")
    p.add_argument("--shard-model", action="store_true", default=env_true("LK_SHARD_MODEL"),
                   help="each trainer of the group keeps only its rows of every parameter and "
                        "of AdamW's state (ZeRO-3 by hand: an inner step gathers the weights "
                        "over the group's process group and frees them after, the gradients "
                        "are averaged and each trainer keeps its rows), and DiLoCo takes the "
                        "rows as a sharded model (env LK_SHARD_MODEL)")
    p.add_argument("--shard-rule", choices=["even", "chunk"],
                   default=os.environ.get("LK_SHARD_RULE", "even"),
                   help="with --shard-model: how each parameter's rows are cut over the group: "
                        "the library's even split, or torch.chunk's (FSDP2's and DTensor's "
                        "Shard(0)); the library moves the rows where the two differ inside the "
                        "group (env LK_SHARD_RULE)")
    p.add_argument("--outer-overlap", action="store_true", default=env_true("LK_OUTER_OVERLAP"),
                   help="overlapped outer steps: the exchange of a step runs during the next "
                        "step's inner steps and lands one step late; the same in every group "
                        "(env LK_OUTER_OVERLAP)")
    a = p.parse_args(argv)
    problems: List[str] = []
    if a.group_size < 1 or not 0 <= a.group_rank < a.group_size:
        problems.append(f"--group-rank {a.group_rank} must be below --group-size {a.group_size}")
    if a.inner_steps < 1:
        problems.append("--inner-steps must be at least 1")
    if not 0 <= a.outer_step_s <= 86400:
        problems.append("--outer-step-s must be in [0, 86400]")
    if a.inner_step_min_ms < 0:
        problems.append("--inner-step-min-ms must not be negative")
    if a.ckpt_every > 0 and not a.ckpt_dir:
        problems.append("--ckpt-every needs --ckpt-dir")
    if a.corpus_bytes < 4096:
        problems.append("--corpus-bytes must be at least 4096")
    if not a.outer_lr > 0 or not 0 <= a.outer_momentum < 1:
        problems.append("--outer-lr must be positive and --outer-momentum in [0, 1)")
    if min(a.model_width, a.layers, a.heads, a.batch) < 1 or a.seq_len < 2:
        problems.append("model sizes must be positive (seq_len at least 2)")
    elif a.model_width % a.heads:
        problems.append(f"--model-width {a.model_width} is not a multiple of --heads {a.heads}")
    if not 1 <= a.outer_fragments <= 64:
        problems.append(f"--outer-fragments {a.outer_fragments} is not in [1, 64]")
    elif a.outer_fragments > 1 and not a.outer_overlap:
        problems.append(f"--outer-fragments {a.outer_fragments} needs --outer-overlap")
    if a.outer_compress not in ("none", "bf16", "int8", "int4"):
        problems.append(f"bad --outer-compress {a.outer_compress} (none, bf16, int8 or int4)")
    if a.param_dtype not in PARAM_DTYPES:
        problems.append(f"bad --param-dtype {a.param_dtype} (float32, bf16 or fp16)")
    if a.log_level not in ("debug", "info", "warn", "error"):
        problems.append(f"bad --log-level {a.log_level}")
    if problems:
        p.error("; ".join(problems))
    return a


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over a float32 master copy of each (16-bit) parameter: torch 1.13's single-tensor
    AdamW arithmetic on the master, the parameter set to its rounding (``copy_`` rounds to
    nearest even, as the library does). The state lives under the model's parameters ("step",
    "exp_avg", "exp_avg_sq", "master"), so DiLoCo saves and restores it like any optimizer's.
    When the parameter no longer is the master's rounding (an outer step replaced the
    weights), the master starts again from the parameter."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                # A restore loads state it had none of in the parameter's dtype (DiLoCo's rule
                # for torch's optimizers): this one keeps it in float32.
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    if key in st and st[key].dtype != torch.float32:
                        st[key] = st[key].to(torch.float32)
                master = st.get("master")
                if master is None or not torch.equal(master.to(p.dtype), p):
                    master = p.detach().to(torch.float32).clone()
                    st["master"] = master
                if "exp_avg" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(master)
                    st["exp_avg_sq"] = torch.zeros_like(master)
                grad = p.grad.to(torch.float32)
                st["step"] += 1
                step = float(st["step"].item())
                master.mul_(1 - lr * wd)
                st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(eps)
                master.addcdiv_(st["exp_avg"], denom, value=-lr / bias1)
                p.copy_(master)


class Logger:
    """The trainer's event lines on stderr (one event, then key=value fields), as the C++ one's."""

    LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}

    def __init__(self, level: str, rank: int) -> None:
        self.level = self.LEVELS[level]
        self.prefix = f"trainer={rank}"

    def __call__(self, level: str, event: str, **fields: Any) -> None:
        if self.LEVELS[level] < self.level:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + ".%03dZ" % (
            int(now * 1000) % 1000)
        text = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                        for k, v in fields.items())
        # One write per line keeps lines whole when several processes share stderr.
        line = f"{stamp} {level[0].upper()} {self.prefix} {event} {text}".rstrip() + "\n"
        os.write(sys.stderr.fileno(), line.encode())


def tcp_sent() -> Dict[int, int]:
    """{socket inode: tcpi_bytes_sent} over this process's TCP sockets (its communicators'),
    as diloco/net_bytes.cc counts them for the C++ trainer's byte fields."""
    out: Dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            st = os.fstat(fd)
            if not stat.S_ISSOCK(st.st_mode):
                continue
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
        except OSError:
            continue  # gone meanwhile, or a Unix socket (the agent's): not counted
        if len(info) >= TCPI_BYTES_SENT + 8:
            out[st.st_ino] = int(struct.unpack_from("=Q", info, TCPI_BYTES_SENT)[0])
    return out


# struct tcp_info (linux/tcp.h): its size and tcpi_bytes_sent's offset (kernels from 4.19).
TCP_INFO_SIZE, TCPI_BYTES_SENT = 232, 200


def tcp_sent_between(before: Dict[int, int], after: Dict[int, int]) -> int:
    return sum(max(0, v - before.get(k, 0)) for k, v in after.items())


class StepLog:
    """The --log JSON lines, field for field and format for format as the C++ trainer writes
    them (trainer.cc's WriteLogLine), so that a mixed job's members log identical text for
    identical values: the step, its quorum, the losses, the hash of this trainer's shard of the
    new global weights, and where the wall time and the bytes went since the previous commit
    (the library's figures of every call since then, and this loop's own)."""

    STATS = ("poll_ms", "join_ms", "allreduce_ms", "gather_ms", "publish_ms", "commit_ms",
             "outer_ms", "cross_bytes", "sync_bytes", "group_bytes", "wait_ms")

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        self.file = open(path, "a") if path else None
        self.args = args
        self.last_commit = time.monotonic()
        self.clear()

    def clear(self) -> None:
        self.sync: Dict[str, float] = dict.fromkeys(self.STATS, 0)
        self.inner_ms = self.discarded_ms = self.eval_ms = 0.0
        self.group_bytes = 0

    def add(self, result: SyncResult) -> None:
        for k in self.STATS:
            # outer_ms is the committed attempt's own figure, the rest add up.
            value: float = getattr(result.stats, k)
            self.sync[k] = value if k == "outer_ms" else self.sync[k] + value

    def discard(self) -> None:
        # A heal threw away the inner steps since the last commit: not training that reached
        # the model.
        self.discarded_ms += self.inner_ms
        self.inner_ms = 0.0

    def write(self, r: SyncResult, loss: float, eval_loss: Optional[float], params: int,
              shard: int, inner_run: int, inner_step: int = 0,
              batches: Sequence[int] = (), model_bytes: int = 0, outer_state_bytes: int = 0,
              model_hash: str = "") -> None:
        now = time.monotonic()
        step_ms = (now - self.last_commit) * 1000
        self.last_commit = now
        y, a = self.sync, self.args
        evals = "" if eval_loss is None else ',"eval_loss":%.6f' % eval_loss
        line = (
            '{"step":%d,"quorum_id":%d,"replica_world_size":%d,"loss":%.6f,'
            '"param_hash":"%s","healed":%s,"group_rank":%d,"outer_ms":%d%s,'
            '"t_ms":%d,"step_ms":%.1f,"poll_ms":%.3f,"join_ms":%.3f,'
            '"inner_ms":%.1f,"discarded_ms":%.1f,"allreduce_ms":%.1f,'
            '"gather_ms":%.1f,"publish_ms":%.1f,"commit_ms":%.3f,"eval_ms":%.1f,'
            '"cross_bytes":%d,"sync_bytes":%d,"group_bytes":%d,"params":%d,'
            '"shard":%d,"inner_steps":%d,"group_size":%d,"tokens":%d,"quorum_tokens":%d,'
            '"weighted":%s,"global_hash":"%s","inner_steps_run":%d,"group_id":"%s",'
            '"outer_compress":"%s","overlap":%s,"wait_ms":%.1f,"inner_step":%d,'
            '"param_dtype":"%s","model_bytes":%d,"outer_state_bytes":%d,"model_hash":"%s",'
            '"shard_model":%s,"batches":[%s]}\n') % (
                r.step, r.quorum_id, r.replica_world_size, loss, r.state_hash,
                "true" if r.healed else "false", a.group_rank, int(y["outer_ms"]), evals,
                int(time.time() * 1000), step_ms, y["poll_ms"], y["join_ms"], self.inner_ms,
                self.discarded_ms, y["allreduce_ms"], y["gather_ms"], y["publish_ms"],
                y["commit_ms"], self.eval_ms, y["cross_bytes"], y["sync_bytes"],
                self.group_bytes + y["group_bytes"], params, shard, a.inner_steps,
                a.group_size, r.tokens, r.quorum_tokens,
                "true" if r.weighted else "false", r.global_hash, inner_run, a.group_id,
                a.outer_compress, "true" if a.outer_overlap else "false", y["wait_ms"],
                inner_step, a.param_dtype, model_bytes, outer_state_bytes, model_hash,
                "true" if a.shard_model else "false",
                ",".join('"%016x"' % h for h in batches))
        self.clear()
        if self.file is not None:
            self.file.write(line)
            self.file.flush()


class DataStream:
    """Where this trainer's data comes from: the batch generator (seeded after the join, from
    the group's identity) and the inner steps run, plus torch's and Python's generators for
    anything random a real loader does. ``save`` is DiLoCo's extra_state: the library keeps
    the bytes with the weights of the outer step they go with, so a run restored from a
    durable checkpoint draws exactly the batches an uninterrupted run would have drawn next.
    ``load`` takes them back; before the generator exists (a restore at the join) it waits."""

    VERSION = "diloco_trainer.py/1"

    def __init__(self, log: Logger) -> None:
        self.log = log
        self.rng: Optional[char_model.SplitMix] = None
        self.inner_step = 0
        self.pending: Optional[Dict[str, Any]] = None  # restored state that waits for the generator

    def save(self) -> bytes:
        if self.rng is None:
            return b""
        return json.dumps({
            "v": self.VERSION, "rng": self.rng.state, "inner_step": self.inner_step,
            "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "python_rng": list(random.getstate()[1]),
        }).encode()

    def load(self, data: bytes) -> None:
        state = json.loads(data)
        if state.get("v") != self.VERSION:
            self.log("warn", "extra_state_ignored", bytes=len(data))
            return
        self.pending = state
        if self.rng is not None:
            self.apply()

    def start(self, seed: int) -> char_model.SplitMix:
        self.rng = rng = char_model.SplitMix(seed)
        if self.pending is not None:
            self.apply()
        return rng

    def apply(self) -> None:
        s, self.pending = self.pending, None
        assert s is not None and self.rng is not None
        self.rng.state = int(s["rng"])
        self.inner_step = int(s["inner_step"])
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["torch_rng"])),
                                             dtype=torch.uint8))
        random.setstate((3, tuple(s["python_rng"]), None))
        self.log("info", "extra_state_loaded", rng="%016x" % self.rng.state,
                 inner_step=self.inner_step)


class Zero3:
    """ZeRO-3 by hand over the group's process group (Debian's torch 1.13 has no FSDP that
    imports on Python 3.11; on a torch with FSDP2 its Shard(0) parameters' local tensors are
    what `holder` holds): `holder` keeps this trainer's rows of every parameter of the model
    (lightkeeper.shard_rows, by --shard-rule), and so its optimizer keeps AdamW's state of those
    rows only. `gather` puts the whole weights into the model for a forward and backward (each
    trainer places its rows into zeros and the group sums them: an exact all-gather, x + 0 ==
    x), `keep_grads` hands each trainer its rows of the group's averaged gradients (a
    reduce-scatter), and `free` drops the whole weights again."""

    def __init__(self, lm: char_model.LocalModel, rank: int, size: int,
                 group: Optional[Any], rule: str = "even") -> None:
        self.lm = lm
        self.group = group
        self.dtype = lm.params[0].dtype
        self.shapes = [tuple(p.shape) for p in lm.params]
        self.rows = [lightkeeper.shard_rows(s[0], size, rank, rule) for s in self.shapes]
        # The model cut to its rows first, then copied: the whole weights are never held twice.
        with torch.no_grad():
            for p, (b, e) in zip(lm.params, self.rows):
                p.data = p.data[b:e].clone()
        self.holder = copy.deepcopy(lm.model)
        self.free()

    def shards(self) -> Dict[str, Tuple[Sequence[int], int]]:
        names = [n for n, _ in self.holder.named_parameters()]
        return {n: (s, b) for n, s, (b, _) in zip(names, self.shapes, self.rows)}

    def gather(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The whole weights into the model: from `holder`, or from `rows` (this trainer's rows
        of every parameter in order, float32: e.g. its rows of DiLoCo's global weights).
        Returns them as one flat vector in the model's dtype (the parameters are views into
        it)."""
        full = torch.zeros(self.lm.numel, dtype=torch.float32)
        at, taken = 0, 0
        for hp, shape, (b, e) in zip(self.holder.parameters(), self.shapes, self.rows):
            n = int(torch.Size(shape).numel())
            row = n // shape[0]
            count = (e - b) * row
            src = hp.detach().reshape(-1) if rows is None else rows[taken:taken + count]
            full[at + b * row:at + e * row].copy_(src)
            at, taken = at + n, taken + count
        if self.group is not None:
            self.group.allreduce([full]).wait()
        full = full.to(self.dtype)
        at = 0
        with torch.no_grad():
            for p, shape in zip(self.lm.params, self.shapes):
                n = int(torch.Size(shape).numel())
                p.data = full[at:at + n].view(shape)
                at += n
        return full

    def keep_grads(self) -> None:
        for hp, p, (b, e) in zip(self.holder.parameters(), self.lm.params, self.rows):
            assert p.grad is not None
            hp.grad = p.grad[b:e].clone()

    def free(self) -> None:
        for p in self.lm.params:
            p.data = torch.empty(0, dtype=self.dtype)
            p.grad = None


def train(args: argparse.Namespace, log: Logger) -> int:
    op_timeout = datetime.timedelta(milliseconds=args.op_timeout_ms)
    init_timeout = datetime.timedelta(milliseconds=args.init_timeout_ms)
    # The Manager's context closes its communicators and the session with the agent at the end,
    # after the DiLoCo context said goodbye (or, on an error, without: a crash to the agent).
    with lightkeeper.Manager(args.group_rank, args.group_size, timeout=op_timeout,
                             init_timeout=init_timeout, bind_host=args.bind_host) as manager:
        return train_with(args, log, manager, op_timeout, init_timeout)


def train_with(args: argparse.Namespace, log: Logger, manager: lightkeeper.Manager,
               op_timeout: datetime.timedelta, init_timeout: datetime.timedelta) -> int:
    text = char_model.make_corpus(args.corpus_bytes)
    vocab, tokens = char_model.encode(text)
    lm = char_model.LocalModel(tokens, len(vocab), args.seed, width=args.model_width,
                               layers=args.layers, heads=args.heads, seq_len=args.seq_len,
                               batch=args.batch, inner_lr=args.inner_lr)
    if args.param_dtype != "float32":
        # A 16-bit model: its parameters (the same Parameter objects) and so AdamW's moments
        # are in that dtype, as `model.to(torch.bfloat16)` makes them.
        lm.model.to(PARAM_DTYPES[args.param_dtype])
        if args.inner_master:
            lm.optimizer = MasterAdamW(lm.params, lr=args.inner_lr, weight_decay=lm.weight_decay)
    steps = StepLog(args.log, args)
    eval_seed = char_model.mix_seed(args.seed, char_model.EVAL_TAG)
    data = DataStream(log)
    zero3: Optional[Zero3] = None
    group: Optional[Any] = None
    model, optimizer = lm.model, lm.optimizer
    if args.shard_model:
        # The gathers need the group's process group from the first inner step on: it comes
        # before DiLoCo (torchft's order; it needs no quorum of its own).
        group = (manager.group_process_group(timeout=op_timeout) if args.group_size > 1
                 else None)
        zero3 = Zero3(lm, args.group_rank, args.group_size, group, args.shard_rule)
        model = zero3.holder
        if args.param_dtype != "float32" and args.inner_master:
            optimizer = MasterAdamW(list(model.parameters()), lr=args.inner_lr,
                                    weight_decay=lm.weight_decay)
        else:
            optimizer = torch.optim.AdamW(  # type: ignore[call-arg]
                model.parameters(), lr=args.inner_lr, weight_decay=lm.weight_decay,
                foreach=False)
    diloco = lightkeeper.DiLoCo(
        manager, model, optimizer, sync_every=args.inner_steps, outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum, nesterov=True, ckpt_dir=args.ckpt_dir or None,
        ckpt_every=args.ckpt_every, live_dir=args.live_dir, timeout=op_timeout,
        init_timeout=init_timeout, outer_compress=args.outer_compress,
        sync_every_s=args.outer_step_s or None, overlap=args.outer_overlap,
        outer_fragments=args.outer_fragments, extra_state=data.save,
        load_extra_state=data.load, shards=zero3.shards() if zero3 is not None else None)
    tokens_per_step = args.batch * args.seq_len
    with diloco:
        # Entering joined the job: the model holds the job's global weights (replica_rank 0's
        # initial ones at the very first start, a heal's later).
        joined = diloco.last_result
        assert joined is not None  # the join's
        steps.add(joined)
        if diloco.should_stop:
            log("info", "drain", step=diloco.outer_step, reason=joined.reason)
            return 0
        group_key = (char_model.std_hash(args.group_id) if args.group_id
                     else joined.replica_rank)
        rng = data.start(char_model.mix_seed(args.seed, group_key, args.group_rank))
        # The group's inner gradients are averaged over a process group of its own (the
        # DiLoCo's agrees on drains at every step): every trainer of the group asks for it
        # here, right after the same join.
        if zero3 is None and args.group_size > 1:
            group = manager.group_process_group(timeout=op_timeout)
        log("info", "trainer_start", params=lm.numel, shard_size=diloco.shard_numel,
            vocab=len(vocab), corpus_bytes=len(text))

        def average(buf: torch.Tensor) -> None:
            # Gradients and the loss in one collective per inner step, summed then divided,
            # as the C++ trainer does.
            if group is not None:
                group.allreduce([buf]).wait()
                buf.div_(args.group_size)

        def evaluate() -> Optional[float]:
            # After the commit, so that the commit's latency does not include it; the model
            # holds the new global weights now, identical in every member.
            if args.eval_batches <= 0:
                return None
            e0 = time.monotonic()
            if zero3 is not None:
                # The whole global weights for the evaluation, gathered and freed after.
                zero3.gather(diloco.global_weights().float() if args.outer_overlap else None)
                with torch.no_grad():
                    value = float(lm.eval_loss(char_model.SplitMix(eval_seed),
                                               args.eval_batches))
                zero3.free()
                steps.eval_ms += (time.monotonic() - e0) * 1000
                return value
            if args.outer_overlap:
                # The model carries this group's inner progress on top of the global weights:
                # the evaluation is of the global weights alone, as every member holds them.
                with torch.no_grad():
                    flat = parameters_to_vector(lm.model.parameters())
                    vector_to_parameters(diloco.global_weights().to(flat.dtype),
                                         lm.model.parameters())
                    value = float(lm.eval_loss(char_model.SplitMix(eval_seed),
                                               args.eval_batches))
                    vector_to_parameters(flat, lm.model.parameters())
                steps.eval_ms += (time.monotonic() - e0) * 1000
                return value
            value = float(lm.eval_loss(char_model.SplitMix(eval_seed), args.eval_batches))
            steps.eval_ms += (time.monotonic() - e0) * 1000
            return value

        def log_reached_by_heal(r: SyncResult, mean_loss: float) -> None:
            # A heal that lands on the last step (a group that was behind when the others
            # finished, and restored the final checkpoint) ends the run without a commit of its
            # own: the log still gets that step's line (healed=true), as the C++ trainer's does.
            if r.kind != "received" or r.step < args.outer_steps:
                return
            steps.write(r, mean_loss, evaluate(), lm.numel, diloco.shard_numel, 0,
                        data.inner_step, (), *sizes())
            log("info", "reached_by_heal", step=r.step, quorum_id=r.quorum_id,
                hash=r.state_hash, source=r.heal_source)

        def sizes() -> Tuple[int, int, str]:
            # model_bytes, outer_state_bytes and the hash of the model's weights in their own
            # dtype's bytes (the C++ trainer's model_hash: the 16-bit bytes read as float32
            # pairs, an odd tail padded with zero).
            if zero3 is not None:
                # The whole model's hash, the same bytes in every layout.
                flat = zero3.gather().detach()
                zero3.free()
            else:
                flat = parameters_to_vector(lm.model.parameters()).detach()
            raw = flat.view(torch.int16) if flat.element_size() == 2 else flat
            if raw.dtype == torch.int16:
                if raw.numel() % 2:
                    raw = torch.cat([raw, torch.zeros(1, dtype=torch.int16)])
                raw = raw.view(torch.float32)
            return diloco.model_bytes, diloco.outer_state_bytes, char_model.state_hash(raw)

        batches: List[int] = []  # hashes of the batches of the inner steps since the last commit

        def log_commit(r: SyncResult, mean_loss: float, inner_run: int) -> None:
            steps.write(r, mean_loss, evaluate(), lm.numel, diloco.shard_numel, inner_run,
                        data.inner_step, batches, *sizes())
            batches.clear()
            log("info", "outer_committed", step=r.step, quorum_id=r.quorum_id,
                world=r.replica_world_size, loss="%.4f" % mean_loss,
                hash=r.state_hash, outer_ms=int(r.stats.outer_ms))

        log_reached_by_heal(joined, 0.0)
        loss_sum = torch.zeros((), dtype=torch.float32)
        inner = 0  # inner steps since the last outer step
        inner_run = 0  # ... since the last commit (a failed attempt's steps count too)
        t0, b0 = time.monotonic(), tcp_sent()
        # With --outer-overlap the step in flight counts; the last one lands after the loop.
        while (diloco.outer_step + diloco.in_flight < args.outer_steps and
               not diloco.should_stop):
            s0 = time.monotonic()
            if zero3 is not None:
                zero3.gather()
            loss, _ = lm.inner_step(rng, average)
            if zero3 is not None:
                zero3.keep_grads()
                zero3.free()
            optimizer.step()
            data.inner_step += 1
            batches.append(lm.last_batch_hash)
            if args.inner_step_min_ms > 0:
                rest = s0 + args.inner_step_min_ms / 1000 - time.monotonic()
                if rest > 0:
                    time.sleep(rest)
            loss_sum += loss
            before = diloco.last_result
            # The inner steps' time and bytes end where the outer step begins (the library's
            # own figures, poll to commit, come in its stats). The bytes are counted only at
            # the step that syncs, or after a drain's early one.
            inner += 1
            t1 = time.monotonic()
            b1 = tcp_sent() if inner == args.inner_steps else None
            diloco.step(tokens=tokens_per_step)
            r = diloco.last_result
            if r is before or r is None:
                continue  # no outer step at this inner step
            ran, inner = inner, 0
            inner_run += ran
            steps.inner_ms += (t1 - t0) * 1000
            steps.group_bytes += tcp_sent_between(b0, b1 if b1 is not None else tcp_sent())
            steps.add(r)
            if r.kind == "started":
                log("info", "outer_started", step=r.step + 1, quorum_id=r.quorum_id)
            elif r.kind == "committed":
                log_commit(r, float(loss_sum / max(1, ran)), inner_run)
                inner_run = 0
            elif r.kind == "received":
                steps.discard()
                batches.clear()
                inner_run = 0
                log("info", "state_received", step=r.step, source=r.heal_source,
                    healed=r.healed)
                log_reached_by_heal(r, float(loss_sum / max(1, ran)))
            else:
                log("info", "drain", step=r.step, checkpoint_now=r.checkpoint_now,
                    reason=r.reason)
            last_loss = float(loss_sum / max(1, ran))
            loss_sum.zero_()
            t0, b0 = time.monotonic(), tcp_sent()
            if diloco.outer_step + diloco.in_flight >= args.outer_steps and diloco.in_flight:
                # The last step's exchange lands without more inner steps.
                landed = diloco.flush()
                assert landed is not None  # one was in flight
                steps.add(landed)
                if landed.kind == "committed":
                    log_commit(landed, last_loss, 0)
                elif landed.kind == "received":
                    log_reached_by_heal(landed, 0.0)
    # Leaving the context after the last outer step ran the final barrier, the final save and
    # the goodbye to the agent; after a drain, the save the agent asked for.
    log("info", "trainer_done", step=diloco.outer_step)
    return 0


def main(argv: Sequence[str]) -> int:
    args = parse_flags(argv)
    log = Logger(args.log_level, args.group_rank)
    # One intra-op thread: several trainers share a node's cores, and one thread keeps every
    # kernel's reduction order, so runs replay exactly (and match the C++ trainer's).
    torch.set_num_threads(1)
    torch.set_flush_denormal(not args.keep_denormals)  # this thread runs the inner steps
    log("info", "trainer_config", **vars(args))
    try:
        return train(args, log)
    except lightkeeper.Error as e:
        if getattr(e, "reason", "") == "GROUP_SIZE_MISMATCH":
            # A configuration error, said plainly: restarting this trainer would be refused again.
            log("error", "trainer_failed", code=e.code, reason=e.reason, error=e.message)
            print(f"diloco_trainer.py: the lighthouse refused this group: {e.message}",
                  file=sys.stderr)
            return 2
        # The agent is gone, or no quorum could be joined: the launcher restarts the group.
        log("error", "trainer_failed", code=e.code, error=e.message)
    except RuntimeError as e:
        # An in-group collective failed (a trainer of this group is gone): the group is going
        # down; the agent reports it.
        log("error", "trainer_failed", code="group_collective", error=str(e))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
