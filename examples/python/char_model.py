"""The C++ diloco_trainer's character model, corpus and data order, in PyTorch.

Everything here mirrors examples/diloco/ exactly, so that a group of Python trainers and a group
of C++ trainers can train one job together and a run of either replays the other:

- make_corpus / encode: corpus.cc's grammar, drawn from the same splitmix64 stream;
- SplitMix, mix_seed, std_hash: corpus.h's generator, its seed mixing, and libstdc++'s
  std::hash<std::string> (the C++ trainer seeds a group's data stream with it);
- Gpt: local_model.cc's model, with the same parameter names, shapes and order (so the flat
  parameter vector has one layout in both) and the same initialisation: LibTorch's C++ modules
  and PyTorch's Python modules draw their initial weights from the same CPU generator in the
  same order with the same formulas, so one seed gives the same bits;
- LocalModel: the inner step (forward, backward, the group's gradient average, clip, AdamW) and
  the evaluation, with the same operations in the same order.

examples/python/char_model_test.py checks all of it bit for bit against the C++ code
(diloco_model_dump). Only torch and the standard library are used; the state hash calls the
system's libxxhash through ctypes (the same XXH3-64 as outer.cc's StateHash).
"""
import ctypes
import ctypes.util
import math
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.clip_grad import clip_grad_norm_

MASK64 = (1 << 64) - 1

# corpus.cc's word lists, in the same order.
NOUNS = ["keeper", "lamp", "ship", "harbour", "sailor", "gull", "storm", "island", "rock",
         "wave", "signal", "tower", "fisher", "anchor", "lantern", "compass"]
ADJECTIVES = ["old", "bright", "quiet", "distant", "small", "grey", "brave", "cold", "tall",
              "silver", "tired", "patient"]
VERBS = ["watches", "guides", "passes", "finds", "calls", "follows", "warns", "reaches",
         "leaves", "lights", "carries", "answers"]
PLACES = ["at night", "before dawn", "in the fog", "near the rocks", "across the bay",
          "after the storm", "by the pier", "over the water"]
JOINERS = ["and", "while", "because", "so"]

# The evaluation batches' stream is seeded by (--seed, this tag), as in trainer.cc.
EVAL_TAG = 0x65766131


class SplitMix:
    """splitmix64, as corpus.h's SplitMix."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


def batch_hash(xs: torch.Tensor) -> int:
    """FNV-1a of a batch's input tokens, row-major: local_model.cc's LastBatchHash, so the
    trainers' logs name a batch the same way in both languages."""
    h = 0xCBF29CE484222325
    for token in xs.reshape(-1).tolist():
        h = ((h ^ (int(token) & MASK64)) * 0x100000001B3) & MASK64
    return h


def mix_seed(*parts: int) -> int:
    """corpus.cc's MixSeed."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = SplitMix(h ^ (p & MASK64)).next()
    return h


def std_hash(text: str) -> int:
    """libstdc++'s std::hash<std::string> on 64-bit targets (_Hash_bytes, seed 0xc70f6907)."""
    data = text.encode()
    mul = (0xC6A4A793 << 32) + 0x5BD1E995

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (0xC70F6907 ^ (n * mul)) & MASK64
    aligned = n & ~7
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h ^= (shift_mix((word * mul) & MASK64) * mul) & MASK64
        h = (h * mul) & MASK64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * mul) & MASK64
    h = (shift_mix(h) * mul) & MASK64
    return shift_mix(h)


def make_corpus(size_bytes: int) -> str:
    """About size_bytes characters of text, identical to corpus.cc's MakeCorpus."""
    rng = SplitMix(20240611)

    def pick(words: List[str]) -> str:
        return words[rng.below(len(words))]

    parts: List[str] = []
    length = 0
    while length < size_bytes:
        plural = rng.below(3) == 0
        clause = "the "
        if rng.below(2) == 0:
            clause += pick(ADJECTIVES) + " "
        clause += pick(NOUNS)
        if plural:
            clause += "s"
        verb = pick(VERBS)
        if plural:
            # Agreement: a plural subject drops the verb's final "s" ("watches" -> "watch").
            verb = verb[:-(2 if verb.endswith("es") and not verb.endswith("ves") else 1)]
        clause += " " + verb + " the " + pick(NOUNS)
        if rng.below(2) == 0:
            clause += " " + pick(PLACES)
        if rng.below(4) == 0:
            # corpus.cc builds this part in one expression of three picks, whose operands GCC
            # evaluates right to left (the order is unspecified in C++): the verb is drawn
            # first, then the noun, then the joiner.
            verb2 = pick(VERBS)
            noun2 = pick(NOUNS)
            clause += ", " + pick(JOINERS) + " the " + noun2 + " " + verb2
        clause = clause[0].upper() + clause[1:]
        clause += "!\n" if rng.below(8) == 0 else ".\n"
        parts.append(clause)
        length += len(clause)
    return "".join(parts)


def encode(text: str) -> Tuple[str, torch.Tensor]:
    """The sorted set of characters of text, and the text as indices into it (an int64 tensor)."""
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    return vocab, torch.tensor([index[c] for c in text], dtype=torch.int64)


class Attention(nn.Module):
    """Causal multi-head self-attention (local_model.cc's AttentionImpl)."""

    def __init__(self, width: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        # A buffer, not a parameter: it is not trained and not part of the flat vector.
        self.register_buffer("mask", torch.triu(torch.ones(seq_len, seq_len), 1).to(torch.bool))

    mask: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        att = att.masked_fill(self.mask[:t, :t], -math.inf).softmax(-1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.proj(y)
        return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, seq_len)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class Gpt(nn.Module):
    """local_model.cc's GptImpl: the modules are created (and so initialised) in its order."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.blocks = nn.Sequential(*[Block(width, heads, seq_len) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        out: torch.Tensor = self.head(self.ln(self.blocks(x)))
        return out


_Flag = TypeVar("_Flag")


class LocalModel:
    """The group's local model with its inner AdamW (local_model.cc's TorchLocalModel).

    `average` given to inner_step averages a flat float32 tensor over the group's trainers in
    place; the tensor holds the gradients, then [loss, flag], as in the C++ trainer (one
    collective per inner step; the last float is the caller's, to agree on something with the
    group in the same collective).
    """

    def __init__(self, tokens: torch.Tensor, vocab_size: int, seed: int, width: int = 64,
                 layers: int = 2, heads: int = 4, seq_len: int = 64, batch: int = 16,
                 inner_lr: float = 3e-3, weight_decay: float = 0.01,
                 grad_clip_norm: float = 1.0) -> None:
        torch.manual_seed(seed)
        self.model = Gpt(vocab_size, width, layers, heads, seq_len)
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.tokens = tokens
        self.seq_len, self.batch = seq_len, batch
        self.inner_lr, self.weight_decay = inner_lr, weight_decay
        self.grad_clip_norm = grad_clip_norm
        with torch.no_grad():
            # trainer.cc turns -0.0 into +0.0 in the initial weights (x + 0.0f): a copy by
            # summing with zeros, as the first start's state sync is, keeps every other bit.
            for p in self.params:
                p.add_(0.0)
        self.grads = torch.zeros(self.numel + 2, dtype=torch.float32)
        self.optimizer: torch.optim.Optimizer = self.make_optimizer()
        self.last_xs = torch.zeros(0, dtype=torch.int64)
        self.last_batch_hash = 0

    def make_optimizer(self) -> torch.optim.AdamW:
        # foreach=False: the per-tensor loop, the same operations as LibTorch's C++ AdamW.
        # torch 1.13's stub of AdamW lacks foreach (its constructor takes it).
        return torch.optim.AdamW(self.params, lr=self.inner_lr,  # type: ignore[call-arg]
                                 weight_decay=self.weight_decay, foreach=False)

    def flatten(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def batch_loss(self, rng: SplitMix) -> torch.Tensor:
        b, t = self.batch, self.seq_len
        n = self.tokens.numel()
        starts = [rng.below(n - t - 1) for _ in range(b)]
        xs = torch.stack([self.tokens[s:s + t] for s in starts])
        self.last_xs = xs
        ys = torch.stack([self.tokens[s + 1:s + 1 + t] for s in starts]).view(b * t)
        logits = self.model(xs)
        return F.cross_entropy(logits.view(b * t, logits.size(-1)), ys)

    def inner_step(self, rng: SplitMix, average: Callable[[torch.Tensor], _Flag]
                   ) -> Tuple[torch.Tensor, _Flag]:
        """Forward, backward, the group's average of the gradients, clip: everything of an inner
        step but the optimizer's step, which the training loop takes (then DiLoCo.step()).
        Returns (the group-mean loss as a float32 value, what `average` returned)."""
        self.optimizer.zero_grad()
        loss = self.batch_loss(rng)
        self.last_batch_hash = batch_hash(self.last_xs)
        torch.autograd.backward(loss)  # loss.backward(), which torch 1.13 leaves untyped
        at = 0
        for p in self.params:
            grad = p.grad
            assert grad is not None
            self.grads[at:at + p.numel()].copy_(grad.reshape(-1))
            at += p.numel()
        self.grads[self.numel] = loss.item()
        self.grads[self.numel + 1] = 0.0
        flag = average(self.grads)
        at = 0
        for p in self.params:
            grad = p.grad
            assert grad is not None
            grad.copy_(self.grads[at:at + p.numel()].view_as(p))
            at += p.numel()
        clip_grad_norm_(self.params, self.grad_clip_norm)
        return self.grads[self.numel].clone(), flag

    def eval_loss(self, rng: SplitMix, batches: int) -> torch.Tensor:
        """Mean loss of the current weights on `batches` batches from rng, as a float32 value."""
        if batches == 0:
            return torch.tensor(0.0)
        total = 0.0  # a double, as local_model.cc's sum
        with torch.no_grad():
            for _ in range(batches):
                total += self.batch_loss(rng).item()
        return torch.tensor(total / batches, dtype=torch.float32)


_xxhash: Optional[ctypes.CDLL] = None


def state_hash(values: torch.Tensor) -> str:
    """outer.cc's StateHash: XXH3-64 of a contiguous float32 tensor's bytes, 16 hex digits."""
    global _xxhash
    if _xxhash is None:
        lib = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
        lib.XXH3_64bits.restype = ctypes.c_uint64
        lib.XXH3_64bits.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _xxhash = lib
    values = values.detach().contiguous()
    assert values.dtype == torch.float32
    return "%016x" % int(_xxhash.XXH3_64bits(values.data_ptr(), values.numel() * 4))
