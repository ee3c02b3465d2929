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
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import char_model  # noqa: E402

try:
    import lightkeeper
except ImportError as e:  # the package is built into build/python
    sys.exit(f"diloco_trainer.py: cannot import lightkeeper ({e}); "
             "set PYTHONPATH to the build's python directory")

# (flag, type, default, help): diloco_trainer's flags, with its defaults.
FLAGS = [
    ("group-rank", int, 0, "this trainer's rank inside its group"),
    ("group-size", int, 1, "trainers per group (the same for every group)"),
    ("inner-steps", int, 20, "H: inner AdamW steps per outer step"),
    ("outer-steps", int, 10, "T: run until the committed outer step reaches T"),
    ("seed", int, 1, "model initialisation (same for all groups) and data order"),
    ("group-id", str, "", "seeds this group's data stream (the agent's LK_GROUP_ID); empty: the "
                          "first replica_rank"),
    ("ckpt-dir", str, "", "durable checkpoints of this group (shared by its trainers)"),
    ("ckpt-every", int, 0, "save every K committed steps; 0: only when draining"),
    ("live-dir", str, "", "node-local directory for the live state the agent serves to healing "
                          "peers (its --serve-dir); empty: none"),
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
]


def parse_flags(argv):
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
    a = p.parse_args(argv)
    problems = []
    if a.group_size < 1 or not 0 <= a.group_rank < a.group_size:
        problems.append(f"--group-rank {a.group_rank} must be below --group-size {a.group_size}")
    if a.inner_steps < 1:
        problems.append("--inner-steps must be at least 1")
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
    if a.log_level not in ("debug", "info", "warn", "error"):
        problems.append(f"bad --log-level {a.log_level}")
    if problems:
        p.error("; ".join(problems))
    return a


class Logger:
    """The trainer's event lines on stderr (one event, then key=value fields), as the C++ one's."""

    LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}

    def __init__(self, level, rank):
        self.level = self.LEVELS[level]
        self.prefix = f"trainer={rank}"

    def __call__(self, level, event, **fields):
        if self.LEVELS[level] < self.level:
            return
        text = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                        for k, v in fields.items())
        print(f"{level.upper()} {self.prefix} {event} {text}".rstrip(), file=sys.stderr,
              flush=True)


class StepLog:
    """The --log JSON lines, field for field as the C++ trainer writes them (trainer.cc's
    WriteLogLine): the step, its quorum, the losses, the hash of this trainer's shard of the new
    global weights, and where the step's wall time and bytes went since the previous commit."""

    def __init__(self, path, args):
        self.file = open(path, "a") if path else None
        self.args = args
        self.last_commit = time.monotonic()
        self.inner_ms = 0.0
        self.discarded_ms = 0.0
        self.eval_ms = 0.0

    def discard(self):
        # A heal threw away the inner steps since the last commit: not training that reached
        # the model.
        self.discarded_ms += self.inner_ms
        self.inner_ms = 0.0

    def write(self, r, loss, eval_loss, params, shard):
        now = time.monotonic()
        step_ms = (now - self.last_commit) * 1000
        self.last_commit = now
        s = r.stats
        # The same format as the C++ line (fmt's {:.6f} is printf's %.6f): a mixed job's
        # members log identical text for identical values.
        evals = "" if eval_loss is None else ',"eval_loss":%.6f' % eval_loss
        line = (
            '{"step":%d,"quorum_id":%d,"replica_world_size":%d,"loss":%.6f,'
            '"param_hash":"%s","healed":%s,"group_rank":%d,"outer_ms":%d%s,'
            '"t_ms":%d,"step_ms":%.1f,"poll_ms":%.3f,"join_ms":%.3f,'
            '"inner_ms":%.1f,"discarded_ms":%.1f,"allreduce_ms":%.1f,'
            '"gather_ms":%.1f,"publish_ms":%.1f,"commit_ms":%.3f,"eval_ms":%.1f,'
            '"cross_bytes":%d,"sync_bytes":%d,"group_bytes":%d,"params":%d,'
            '"shard":%d,"inner_steps":%d,"group_size":%d}\n') % (
                r.step, r.quorum_id, r.replica_world_size, loss, r.state_hash,
                "true" if r.healed else "false", self.args.group_rank, int(s.outer_ms), evals,
                int(time.time() * 1000), step_ms, s.poll_ms, s.join_ms, self.inner_ms,
                self.discarded_ms, s.allreduce_ms, s.gather_ms, s.publish_ms, s.commit_ms,
                self.eval_ms, s.cross_bytes, s.sync_bytes, s.group_bytes, params, shard,
                self.args.inner_steps, self.args.group_size)
        self.inner_ms = self.discarded_ms = self.eval_ms = 0.0
        if self.file is not None:
            self.file.write(line)
            self.file.flush()


def main(argv):
    args = parse_flags(argv)
    log = Logger(args.log_level, args.group_rank)
    # One intra-op thread: several trainers share a node's cores, and one thread keeps every
    # kernel's reduction order, so runs replay exactly (and match the C++ trainer's).
    torch.set_num_threads(1)
    log("info", "trainer_config", **{k: v for k, v in vars(args).items()})
    text = char_model.make_corpus(args.corpus_bytes)
    vocab, tokens = char_model.encode(text)
    lm = char_model.LocalModel(tokens, len(vocab), args.seed, width=args.model_width,
                               layers=args.layers, heads=args.heads, seq_len=args.seq_len,
                               batch=args.batch, inner_lr=args.inner_lr)
    manager = lightkeeper.Manager(
        args.group_rank, args.group_size,
        timeout=datetime.timedelta(milliseconds=args.op_timeout_ms),
        init_timeout=datetime.timedelta(milliseconds=args.init_timeout_ms))
    steps_log = StepLog(args.log, args)
    diloco = lightkeeper.DiLoCo(
        manager, lm.model, lm.optimizer, sync_every=args.inner_steps, outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum, nesterov=True, ckpt_dir=args.ckpt_dir or None,
        ckpt_every=args.ckpt_every, live_dir=args.live_dir or None)
    eval_seed = char_model.mix_seed(args.seed, char_model.EVAL_TAG)
    with diloco:
        first = diloco.last_result
        group_key = (char_model.std_hash(args.group_id) if args.group_id
                     else first.replica_rank)
        rng = char_model.SplitMix(char_model.mix_seed(args.seed, group_key, args.group_rank))
        group = diloco.group_pg
        log("info", "trainer_start", params=lm.numel, shard=diloco.shard_numel,
            vocab=len(vocab), corpus_bytes=len(text))

        def average(buf):
            # Gradients, loss and the drain flag in one collective per inner step, as the C++
            # trainer: a drain seen by any trainer of the group stops all of them after the
            # same inner step.
            buf[-1] = 1.0 if diloco.drain_requested else 0.0
            if group is not None and args.group_size > 1:
                group.allreduce([buf]).wait()
                buf.div_(args.group_size)
            return bool(buf[-1] > 0)

        loss_sum = torch.zeros((), dtype=torch.float32)
        inner = 0
        t0 = time.monotonic()
        while diloco.outer_step < args.outer_steps and not diloco.should_stop:
            loss, drain = lm.inner_step(rng, average)
            if drain:
                diloco.stop()
                break
            lm.optimizer.step()
            loss_sum += loss
            inner += 1
            if not diloco.step():
                continue
            steps_log.inner_ms += (time.monotonic() - t0) * 1000
            r = diloco.last_result
            if r.committed:
                mean_loss = float(loss_sum / inner)
                eval_loss = None
                if args.eval_batches > 0:
                    e0 = time.monotonic()
                    eval_loss = float(lm.eval_loss(char_model.SplitMix(eval_seed),
                                                   args.eval_batches))
                    steps_log.eval_ms += (time.monotonic() - e0) * 1000
                steps_log.write(r, mean_loss, eval_loss, lm.numel, diloco.shard_numel)
                log("info", "outer_committed", step=r.step, quorum_id=r.quorum_id,
                    world=r.replica_world_size, loss=f"{mean_loss:.4f}", hash=r.state_hash)
            else:
                steps_log.discard()
            loss_sum.zero_()
            inner = 0
            t0 = time.monotonic()
    log("info", "trainer_done", step=diloco.outer_step)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except lightkeeper.Error as e:
        print(f"ERROR trainer_failed code={e.code} error={json.dumps(e.message)}",
              file=sys.stderr, flush=True)
        sys.exit(1)
