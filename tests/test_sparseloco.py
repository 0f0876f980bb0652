"""SparseLoCo: chunk-wise top-k outer gradients in a few bits, against their degenerate case (every
value, float32, H = 1, SGD: DDP), the payload against its predicted size, error feedback, and the bytes
each step moves against the plan, on real gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TOL, run_worker, train_run
from dtlab.analysis.model import param_shapes
from dtlab.config import DiLoCoOptions, load_config
from dtlab.train.outer_codec import outer_payload_bytes
from dtlab.train.sparseloco import (
    decode,
    encode,
    index_bits,
    payload_bytes,
    values_per_chunk,
)

QUANTS = ["none", "int8", "int4", "int2", "int1"]


def _signal(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.linspace(0.01, 3, n)


@pytest.mark.parametrize("quantize", QUANTS)
@pytest.mark.parametrize(("numel", "chunk", "topk"), [(1000, 64, 0.05), (5000, 512, 0.02)])
def test_payload_is_its_predicted_size_and_decodes_to_what_was_sent(
    numel: int, chunk: int, topk: float, quantize: str
) -> None:
    x = _signal(numel)
    payload, sent = encode(x, topk, chunk, quantize)
    assert payload.dtype == torch.uint8
    assert payload.numel() == payload_bytes(numel, topk, chunk, quantize)
    # Every replica decodes exactly what the sender took as sent (so its error feedback is right).
    assert torch.equal(decode(payload, numel, topk, chunk, quantize), sent)
    # k values of each chunk at most are sent, and they are each chunk's largest in magnitude.
    k = values_per_chunk(topk, chunk)
    rows = torch.nn.functional.pad(x, (0, (-numel) % chunk)).view(-1, chunk)
    out = torch.nn.functional.pad(sent, (0, (-numel) % chunk)).view(-1, chunk)
    for row, got in zip(rows, out, strict=True):
        chosen = got != 0
        assert int(chosen.sum()) <= k
        if quantize == "none":
            assert torch.equal(got[chosen], row[chosen])
        smallest_sent = row[chosen].abs().min()
        assert row[~chosen].abs().max() <= smallest_sent + 1e-7
        # Signs survive any quantisation.
        assert torch.equal(torch.sign(got[chosen]), torch.sign(row[chosen]))


def test_every_value_goes_without_indices() -> None:
    """topk 1: every value in order, no index bytes; 1 bit per value and a scale per 4,096."""
    x = _signal(10_000)
    payload, sent = encode(x, 1.0, 64, "int1")
    assert (
        payload.numel() == payload_bytes(10_000, 1.0, 64, "int1") == 157 * 64 // 8 + 4 * 3
    )  # 157 chunks of 64, padded
    assert torch.equal(torch.sign(sent), torch.sign(x))
    assert torch.equal(decode(payload, 10_000, 1.0, 64, "int1"), sent)


@pytest.mark.parametrize("numel", [10_000, 12_288, 7])
def test_one_bit_values_are_their_signs_times_their_groups_mean_magnitude(numel: int) -> None:
    """The 1-bit payload read independently of the codec: bit j of byte b (little-endian) is value
    8 b + j, 1 for a negative value; each 4,096 values' float32 scale is their mean magnitude."""
    import numpy as np

    x = _signal(numel, seed=3)
    x[::7] = 0.0  # zeros go as positive
    payload, sent = encode(x, 1.0, 64, "int1")
    code_bytes = -(-numel // 64) * 64 // 8
    bits = np.unpackbits(payload[:code_bytes].numpy(), bitorder="little")[:numel]
    scales = payload[code_bytes:].clone().view(torch.float32)
    groups = x.abs().split(4096)
    assert torch.allclose(scales, torch.stack([g.mean() for g in groups]), rtol=1e-6)
    assert np.array_equal(bits, (x < 0).numpy())
    per_value = scales.repeat_interleave(4096)[:numel]
    expected = torch.where(torch.from_numpy(bits.astype(bool)), -per_value, per_value)
    assert torch.equal(sent, expected)
    assert torch.equal(decode(payload, numel, 1.0, 64, "int1"), expected)


def test_sizes_are_counted_from_their_parts() -> None:
    # 10,000 values in chunks of 4,096: 3 chunks, 41 values each (1%), 12-bit indices, 2-bit values.
    assert index_bits(4096) == 12 and values_per_chunk(0.01, 4096) == 41
    assert payload_bytes(10_000, 0.01, 4096, "int2") == (
        -(-3 * 41 * 12 // 8) + -(-3 * 41 * 2 // 8) + 3 * 4
    )
    assert payload_bytes(10_000, 0.01, 4096, "none") == -(-3 * 41 * 12 // 8) + 3 * 41 * 4
    o = DiLoCoOptions(inner_steps=4, topk=0.01, quantize="int2")
    assert outer_payload_bytes(10_000, o) == payload_bytes(10_000, 0.01, 4096, "int2")


# int1 sends each value as its sign times the mean magnitude of its scale's group: a chunk whose values
# are far above its group's mean drains slowly, so it is tested with a scale per chunk.
@pytest.mark.parametrize(("quantize", "chunk"), [("none", 256), ("int2", 256), ("int1", 4096)])
def test_error_feedback_keeps_what_was_not_sent(quantize: str, chunk: int) -> None:
    """What was not sent stays in the error feedback to the last bit, and sending the same gradient
    again and again delivers all of it: the error stays bounded (K syncs of x deliver K x less the
    error), where dropping the unsent values would lose 97% of x at every sync."""
    x = _signal(2048, seed=3)
    error, total = torch.zeros_like(x), torch.zeros_like(x)
    peaks = []
    for _ in range(400):
        target = x + error
        _, sent = encode(target, 0.03, chunk, quantize)
        error, total = target - sent, total + sent
        # Where nothing was sent, the whole target is kept, to the last bit; where a float32 value
        # was sent, nothing is.
        unsent = sent == 0
        assert torch.equal(error[unsent], target[unsent])
        if quantize == "none":
            assert not error[~unsent].any()
        peaks.append(float(error.abs().max()))
    # Bounded: no larger over the last 200 syncs than over the 100 before them (a lost remainder
    # would grow without bound), so the mean delivered per sync tends to x.
    assert max(peaks[200:]) < 1.2 * max(peaks[100:200])
    assert (total / 400 - x).abs().max() < 0.25 * x.abs().max()


def test_int1_needs_topk() -> None:
    with pytest.raises(Exception, match="int1"):
        load_config(overrides=["parallel.diloco.inner_steps=2", "parallel.diloco.quantize=int1"])


SPARSE_DDP = [
    "parallel.strategy=ddp", "train.grad_clip=0", "train.optimizer=sgd", "train.lr=0.1",
]  # fmt: skip


def test_every_value_in_float32_at_h1_with_outer_sgd_lr1_is_ddp(tmp_path: Path) -> None:
    """k = 100%, no quantisation, H = 1, inner SGD, outer SGD at lr 1 without momentum, no error
    decay: the mean of the replicas' sparse parts is their mean, DDP's SGD step, to float32 noise."""
    ddp = train_run(tmp_path / "ddp", *SPARSE_DDP, nproc=2)
    sparse = train_run(
        tmp_path / "sparse", *SPARSE_DDP,
        "parallel.diloco.inner_steps=1", "parallel.diloco.outer_lr=1",
        "parallel.diloco.outer_momentum=0", "parallel.diloco.topk=1", "parallel.diloco.chunk=64",
        nproc=2,
    )  # fmt: skip
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(sparse, ddp, strict=True))
    assert worst < TOL, worst
    assert sparse[-1]["loss"] < sparse[0]["loss"] - 0.02  # it trains


@pytest.mark.parametrize("quantize", ["int2", "int1"])
def test_bytes_per_step_are_predicted_to_the_byte(tmp_path: Path, quantize: str) -> None:
    """Streaming SparseLoCo (2 fragments, delay 1): every step's counted bytes are the plan's, and
    between syncs the replicas exchange nothing."""
    out = tmp_path / "bytes.json"
    run_worker(
        "diloco_worker.py", 2, str(out),
        "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2", "parallel.diloco.delay=1",
        "parallel.diloco.topk=0.02", "parallel.diloco.chunk=1024", f"parallel.diloco.quantize={quantize}",
        "parallel.diloco.error_decay=0.95",
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["measured"] == result["predicted"], result
    assert result["measured_wire"] == result["predicted_wire"], result
    syncs = [b for b in result["measured"] if b > 0]
    assert len(syncs) >= 4
    between = [b for s, b in enumerate(result["measured"], 1) if s not in result["sync_steps"]]
    assert between and all(b == 0 for b in between), result
    # A sparse 2-bit sync is far smaller than the dense float32 one of the same fragments.
    n = sum(s.numel for s in param_shapes(load_config(overrides=["model.preset=debug"]).model))
    assert sum(syncs) < 0.1 * 2 * 4 * n
