"""16-bit models under lightkeeper.DiLoCo: the library's rounding against torch's, bit for bit;
parameters of a mix of dtypes or of a dtype the library does not take refused with
InvalidArgument before anything is sent; and a job of a C++ and a Python example trainer with
bf16 weights whose members hold the same float32 global weights and bf16 model weights after
every commit."""

import ctypes
import json
import os
from pathlib import Path

import pytest
import torch

import lightkeeper
from lightkeeper import _native
from conftest import BIN_DIR, HERE, PYTHON

EXAMPLE = HERE.parents[1] / "examples" / "python" / "diloco_trainer.py"
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def library_round(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 -> dtype by the library's rounding (lk_dtype_convert)."""
    out = torch.empty(values.numel(), dtype=TORCH_DTYPE[dtype])
    _native.convert_dtype(values.data_ptr(), "float32", out.data_ptr(), dtype, values.numel())
    return out


def library_widen(values: torch.Tensor, dtype: str) -> torch.Tensor:
    out = torch.empty(values.numel(), dtype=torch.float32)
    _native.convert_dtype(values.data_ptr(), dtype, out.data_ptr(), "float32", values.numel())
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def edge_values() -> torch.Tensor:
    """Ties, near-ties, overflow, subnormals of both formats, signed zeros, infinities, NaN."""
    words = []
    for base in (0x3F800000, 0x3F810000, 0xBF800000, 0x477FE000, 0x38800000, 0x33800000,
                 0x00010000, 0x7F7F0000):
        for low in (0x0000, 0x0FFF, 0x1000, 0x1001, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            words.append((base & 0xFFFF0000) | low)
    words += [0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000, 0x7F7FFFFF, 0xFF7FFFFF,
              0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x80000001,
              0x007FFFFF, 0x33000000, 0x33000001, 0x33C00000, 0x34200000, 0x387FE000,
              0x387FA000, 0x7FC00000, 0xFFC00000, 0x7F800001]
    as_int = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                          dtype=torch.int32)
    return as_int.view(torch.float32)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_library_rounds_as_torch_does_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    random = torch.cat([torch.randn(200_000, generator=gen) * scale
                        for scale in (1e-8, 1e-5, 1e-2, 1.0, 1e3, 1e5)])
    # Random bit patterns cover every exponent, subnormals and NaNs included.
    raw = torch.randint(-(1 << 31), (1 << 31) - 1, (200_000,), dtype=torch.int64,
                        generator=gen).to(torch.int32).view(torch.float32)
    values = torch.cat([edge_values(), random, raw]).contiguous()
    ours = library_round(values, dtype)
    theirs = values.to(TORCH_DTYPE[dtype])
    nan = torch.isnan(values)
    # NaN: both give a NaN (torch's own scalar and vector paths differ in the payload).
    assert torch.isnan(ours[nan].float()).all()
    same = bits(ours)[~nan] == bits(theirs)[~nan]
    bad = (~same).nonzero().flatten()[:5]
    assert bool(same.all()), [(hex(int(values[~nan][i].view(torch.int32))),
                               hex(int(bits(ours)[~nan][i])), hex(int(bits(theirs)[~nan][i])))
                              for i in bad]
    # Widening is exact and is torch's.
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    half = every.view(TORCH_DTYPE[dtype])
    wide = library_widen(half, dtype)
    finite = ~torch.isnan(half.float())
    assert torch.equal(wide[finite].view(torch.int32), half.float()[finite].view(torch.int32))
    assert torch.isnan(wide[~finite]).all()


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)


@pytest.mark.parametrize("setup, named", [
    (lambda m: m.b.to(torch.bfloat16), "parameter b.weight is torch.bfloat16 but a.weight is "
                                       "torch.float32"),
    (lambda m: m.to(torch.float64), "parameter a.weight is torch.float64"),
    (lambda m: m.b.to(torch.float16), "parameter b.weight is torch.float16"),
])
def test_a_mix_of_dtypes_or_an_unsupported_one_is_refused_naming_the_parameter(
        cluster_factory, setup, named):
    c = cluster_factory()
    c.agent("g0")
    with lightkeeper.Manager(0, 1, socket=c.sockets["g0"]) as m:
        model = Two()
        setup(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(lightkeeper.InvalidArgument) as e:
            with lightkeeper.DiLoCo(m, model, opt, sync_every=1):
                pass
        assert named in str(e.value)
        assert isinstance(e.value, ValueError)
        # Nothing was sent: the same Manager then joins the job at step 0 with a model of
        # one dtype, as the first join of the job.
        model.to(torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with lightkeeper.DiLoCo(m, model, opt, sync_every=1) as d:
            assert d.outer_step == 0 and d.last_result is not None
            assert d.last_result.kind == "joined"
            assert d.param_dtype == "float32"
            assert d.model_bytes == 4 * sum(p.numel() for p in model.parameters())
            assert d.outer_state_bytes >= 2 * d.model_bytes


def test_an_unknown_param_dtype_is_refused_by_the_binding():
    with pytest.raises(lightkeeper.Error) as e:
        _native.convert_dtype(0, "float64", 0, "float32", 0)
    assert "unknown param_dtype 'float64'" in str(e.value)


def example(c, group, tmp_dir, steps, log, cpp, extra=()):
    env = {"LK_AGENT_SOCKET": c.sockets[group], "LK_GROUP_ID": group,
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    program = [str(BIN_DIR / "diloco_trainer")] if cpp else [PYTHON, str(EXAMPLE)]
    argv = [*program, "--group-rank", "0", "--group-size", "1", "--inner-steps", "4",
            "--outer-steps", str(steps), "--seed", "7", "--group-id", group,
            "--log", str(log), "--model-width", "16", "--layers", "1", "--heads", "2",
            "--seq-len", "16", "--batch", "4", "--corpus-bytes", "8192",
            "--live-dir", c.live_dirs[group], *extra]
    return c._spawn(argv, log.with_suffix(".stderr"), env)


def test_a_cpp_and_a_python_trainer_with_bf16_weights_agree_bitwise_at_every_commit(
        cluster_factory, tmp_dir):
    c = cluster_factory(("--min-replicas", "2", "--join-timeout-ms", "300",
                         "--heartbeat-timeout-ms", "3000"))
    steps = 4
    logs = {"g0": tmp_dir / "cpp.jsonl", "g1": tmp_dir / "py.jsonl"}
    procs = []
    for g, cpp in (("g0", True), ("g1", False)):
        c.agent(g)
        procs.append(example(c, g, tmp_dir, steps, logs[g], cpp, ["--param-dtype", "bf16"]))
    for p in procs:
        assert p.wait(180) == 0, p.log()
    rows = {g: {json.loads(line)["step"]: json.loads(line)
                for line in Path(path).read_text().splitlines()} for g, path in logs.items()}
    for g in rows:
        assert sorted(rows[g]) == list(range(1, steps + 1)), rows[g]
    for step in range(1, steps + 1):
        a, b = rows["g0"][step], rows["g1"][step]
        assert a["global_hash"] and a["global_hash"] == b["global_hash"], step
        assert a["model_hash"] == b["model_hash"], step  # the same bf16 bits
        assert a["param_dtype"] == b["param_dtype"] == "bf16"
        assert a["model_bytes"] == b["model_bytes"] == 2 * a["params"]
        assert a["outer_state_bytes"] >= 3 * 4 * a["params"]
