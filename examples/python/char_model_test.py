"""The Python trainer's model, corpus and data stream against the C++ trainer's, bit for bit.

diloco_model_dump (model_dump.cc) runs the C++ trainer's LocalModel on a seed; the same steps
run here on char_model.py. Equal bits mean a Python group and a C++ group start from the same
weights, read the same batches and train alike, so mixed jobs and either trainer's runs compare.
Run by CTest (python_char_model_parity) with LK_BIN_DIR pointing at build/bin.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import pytest


def _pin_openblas_kernels():
    """Pins OpenBLAS's Haswell kernels on any AVX2+FMA machine, before torch loads OpenBLAS.

    OpenBLAS picks its kernels by CPU model; on one it does not recognise (a VM reporting a generic
    "Intel(R) Xeon(R) Processor", say) it falls back to its Prescott kernels, and with those the
    two processes' gemm results differed in the last bits (21,996 of 107,933 weights after two
    steps of the default shape) although both run the same operations in the same order; with the
    Haswell kernels, or on machines OpenBLAS recognises, they agree bit for bit. The subprocess
    inherits the pin.
    """
    try:
        flags = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        return
    if {"avx2", "fma"} <= flags:
        os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")


_pin_openblas_kernels()
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import char_model  # noqa: E402

torch.set_num_threads(1)

BIN_DIR = os.environ.get("LK_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
DUMP = os.path.join(BIN_DIR, "diloco_model_dump")

# (seed, group_id, group_rank, width, layers, heads, seq_len, batch, steps): the tests' tiny
# model, the default model's shape, group ids whose lengths cover std::hash's tail handling.
CASES = [
    (11, "g0", 0, 32, 1, 2, 32, 8, 4),
    (7, "jupiter-0", 1, 32, 1, 2, 32, 8, 3),
    (3, "a-group-id-of-23-chars!", 0, 64, 2, 4, 64, 4, 2),
]


def f32_hex(t):
    return "%08x" % struct.unpack("<I", struct.pack("<f", float(t)))[0]


def run_dump(seed, group_id, rank, width, layers, heads, seq_len, batch, steps, out):
    cmd = [DUMP, "--seed", str(seed), "--group-id", group_id, "--group-rank", str(rank),
           "--model-width", str(width), "--layers", str(layers), "--heads", str(heads),
           "--seq-len", str(seq_len), "--batch", str(batch), "--steps", str(steps),
           "--eval-batches", "2", "--corpus-bytes", "16384", "--out", out]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


@pytest.fixture(scope="module", autouse=True)
def need_dump():
    if not os.path.exists(DUMP):
        pytest.fail(f"{DUMP} is not built (ninja -C build diloco_model_dump)")


def test_splitmix_and_seeds_match_the_cpp_definitions():
    # Reference values of splitmix64 from seed 0 (Vigna's published sequence).
    rng = char_model.SplitMix(0)
    assert [rng.next() for _ in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert char_model.mix_seed() == 0x243F6A8885A308D3


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_python_model_matches_cpp_bit_for_bit(case):
    seed, group_id, rank, width, layers, heads, seq_len, batch, steps = case
    with tempfile.TemporaryDirectory(prefix="lk-parity-") as tmp:
        out = os.path.join(tmp, "flat.f32")
        ref = run_dump(*case, out)
        raw = open(out, "rb").read()
    text = char_model.make_corpus(16384)
    assert len(text) == ref["corpus_size"]
    vocab, tokens = char_model.encode(text)
    assert len(vocab) == ref["vocab_size"]
    assert str(char_model.std_hash(group_id)) == ref["group_key"]
    data_seed = char_model.mix_seed(seed, char_model.std_hash(group_id), rank)
    assert str(data_seed) == ref["data_seed"]
    eval_seed = char_model.mix_seed(seed, char_model.EVAL_TAG)
    assert str(eval_seed) == ref["eval_seed"]

    model = char_model.LocalModel(tokens, len(vocab), seed, width=width, layers=layers,
                                  heads=heads, seq_len=seq_len, batch=batch)
    assert model.numel == ref["params"]
    n = ref["params"]
    cpp_start = torch.frombuffer(bytearray(raw[:4 * n]), dtype=torch.float32)
    cpp_end = torch.frombuffer(bytearray(raw[4 * n:]), dtype=torch.float32)
    start = model.flatten()
    # The initial weights: the same generator draws in the same order give the same bits.
    assert torch.equal(start.view(torch.int32), cpp_start.view(torch.int32))
    assert char_model.state_hash(start) == ref["start_hash"]

    rng = char_model.SplitMix(data_seed)
    losses = []
    for _ in range(steps):
        loss, _ = model.inner_step(rng, lambda buf: None)
        model.optimizer.step()
        losses.append(f32_hex(loss))
    assert losses == ref["losses"]
    end = model.flatten()
    diff = (end != cpp_end).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} of {n} weights differ after {steps} inner steps"
    assert char_model.state_hash(end) == ref["end_hash"]
    assert f32_hex(model.eval_loss(char_model.SplitMix(eval_seed), 2)) == ref["eval_loss"]
