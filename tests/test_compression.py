"""Gradient compression: the DCT transform, error feedback, and the hooks on real gloo processes."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from conftest import run_worker, train_run
from dtlab.parallel.compression import (
    DCTState,
    dct_basis,
    dct_compress,
    dct_decompress,
    dequantize,
    pack_codes,
    quantize,
    unpack_codes,
)


@pytest.mark.parametrize("n", [2, 8, 64, 100])
def test_dct_basis_is_orthonormal(n: int) -> None:
    d = dct_basis(n, torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    x = torch.randn(5, n, dtype=torch.float64)
    torch.testing.assert_close((x @ d.T) @ d, x, atol=1e-12, rtol=0)  # round trip
    # Row k is cos(pi/n (i + 1/2) k), scaled: the DCT-II.
    row1 = torch.cos(torch.pi / n * (torch.arange(n, dtype=torch.float64) + 0.5))
    torch.testing.assert_close(d[1], row1 * (2 / n) ** 0.5, atol=1e-12, rtol=0)


def test_topk_equal_to_chunk_size_is_lossless() -> None:
    state = DCTState(chunk_size=16, topk=16, error_feedback=True)
    g = torch.randn(100)  # not a multiple of the chunk: padding
    idx, vals, chunks = dct_compress(g, state, 0)
    state.commit()
    out = dct_decompress(idx[None], vals[None], chunks, g.numel(), state, g.device)
    torch.testing.assert_close(out, g, atol=1e-5, rtol=0)
    assert state.residuals[0].abs().max() < 1e-5


def test_error_feedback_carries_what_was_not_sent() -> None:
    state = DCTState(chunk_size=16, topk=2, error_feedback=True)
    g = torch.randn(64)
    idx, vals, chunks = dct_compress(g, state, 3)
    state.commit()
    sent = dct_decompress(idx[None], vals[None], chunks, g.numel(), state, g.device)
    # Sent plus residual is exactly the gradient: nothing is lost, only delayed.
    torch.testing.assert_close(sent + state.residuals[3], g, atol=1e-5, rtol=0)
    assert state.residuals[3].norm() > 0.1 * g.norm()
    # The next step compresses gradient + residual.
    g2 = torch.randn(64)
    residual = state.residuals[3].clone()
    idx2, vals2, _ = dct_compress(g2, state, 3)
    assert torch.equal(state.residuals[3], residual)  # not kept before the step is committed
    state.commit()
    sent2 = dct_decompress(idx2[None], vals2[None], chunks, g.numel(), state, g.device)
    torch.testing.assert_close(sent2 + state.residuals[3], g2 + residual, atol=1e-5, rtol=0)
    # A skipped step (rolled back) keeps nothing of its gradient, even a non-finite one.
    kept = state.residuals[3].clone()
    dct_compress(torch.full((64,), float("nan")), state, 3)
    state.rollback()
    assert torch.equal(state.residuals[3], kept)
    # Under fp16 the hook sees scaled gradients; the residual is kept unscaled.
    scaled = DCTState(chunk_size=16, topk=2, error_feedback=True, scale=1024.0)
    dct_compress(g * 1024.0, scaled, 3)
    scaled.commit()
    torch.testing.assert_close(
        scaled.residuals[3], kept_unscaled := state_after(g), atol=1e-5, rtol=0
    )
    assert kept_unscaled.norm() > 0
    # Without error feedback nothing is kept.
    plain = DCTState(chunk_size=16, topk=2, error_feedback=False)
    dct_compress(g, plain, 0)
    assert not plain.residuals


def state_after(g: torch.Tensor) -> torch.Tensor:
    """The residual one unscaled step of ``g`` leaves (chunk 16, top 2)."""
    state = DCTState(chunk_size=16, topk=2, error_feedback=True)
    dct_compress(g, state, 0)
    state.commit()
    return state.residuals[0]


def test_dct_hook_with_every_coefficient_trains_like_plain_ddp(
    tmp_path: Path, reference_run: list[dict[str, float]]
) -> None:
    run = train_run(
        tmp_path / "dct",
        "parallel.strategy=ddp",
        "parallel.compression=dct",
        "parallel.compression_options.chunk_size=16",
        "parallel.compression_options.topk=16",
        "parallel.compression_options.error_feedback=false",
        nproc=2,
    )
    for m, r in zip(run, reference_run, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=1e-5)


def test_powersgd_at_full_rank_trains_like_plain_ddp(
    tmp_path: Path, reference_run: list[dict[str, float]]
) -> None:
    """Rank 64 on the debug model (dim 64): no matrix is worth compressing at that rank, so every
    gradient goes through PowerSGD's hook uncompressed, from its start step on: plain DDP."""
    run = train_run(
        tmp_path / "powersgd",
        "parallel.strategy=ddp",
        "parallel.compression=powersgd",
        "parallel.compression_options.rank=64",
        "parallel.compression_options.start_step=2",
        nproc=2,
    )
    for m, r in zip(run, reference_run, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=1e-5)
    # At rank 4 it does compress, and the training differs.
    low = train_run(
        tmp_path / "rank4", "parallel.strategy=ddp", "parallel.compression=powersgd",
        "parallel.compression_options.start_step=2", nproc=2,
    )  # fmt: skip
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(low, reference_run, strict=True)) > 1e-4


@pytest.mark.parametrize("compression", ["fp16", "bf16", "powersgd", "dct", "dct-quant"])
def test_compressed_runs_train(tmp_path: Path, compression: str) -> None:
    from dtlab.bench.sweep import compression_overrides

    run = train_run(
        tmp_path / compression,
        "parallel.strategy=ddp",
        *compression_overrides(compression),
        "parallel.compression_options.start_step=2",
        nproc=2,
    )
    assert run[-1]["loss"] < run[0]["loss"] - 0.3
    # JSON has no NaN: a non-finite loss is written as null.
    assert all(m["loss"] is not None and math.isfinite(m["loss"]) for m in run)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantised_codes_pack_and_unpack_exactly(bits: int) -> None:
    # Seeded: over random draws the 3- and 4-bit errors pass their bound in ~99% of cases, not all.
    d = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    codes, step = quantize(d, bits)
    payload = pack_codes(codes, step, bits)
    assert payload.dtype == torch.uint8 and payload.numel() == 5 * (bits * 64 // 8 + 2)
    back, back_step = unpack_codes(payload, 5, 64, bits)
    assert torch.equal(back, codes) and torch.equal(back_step, step)
    assert int(codes.max()) == 2**bits - 1 and int(codes.min()) == 0  # every level is used
    # More bits, smaller error; 3 bits keeps the error of a Gaussian chunk to a few percent.
    rel = (dequantize(codes, step, bits) - d).pow(2).sum() / d.pow(2).sum()
    assert rel < {2: 0.2, 3: 0.05, 4: 0.02}[bits]


def test_ef21_estimate_converges_to_a_repeated_gradient() -> None:
    """EF21: what is not sent now is sent later; sending the change makes the estimate converge."""
    g = torch.randn(4, 64) * torch.linspace(
        3, 0.01, 64
    )  # energy in the first coefficients, as in DCT
    own = torch.zeros_like(g)
    errors = []
    for _ in range(10):
        own += dequantize(*quantize(g - own, 3), 3)
        errors.append(float((own - g).norm() / g.norm()))
    assert errors[0] > 0.1  # one 3-bit message is far from the gradient ...
    assert errors[-1] < errors[0] / 10  # ... the tracked estimate gets close
    assert all(b < a for a, b in itertools.pairwise(errors))


def test_demo_pairs_pack_into_int32_and_back() -> None:
    from dtlab.train.demo import pack, unpack

    idx = torch.tensor([0, 1, 255, 256, 32767, 32768, 65535])
    vals = torch.tensor([1.0, -2.5, 3e-8, -7e5, 0.0, -0.0, 0.333]).to(torch.bfloat16).float()
    packed = pack(idx, vals)
    assert packed.dtype == torch.int32
    back_idx, back_vals = unpack(packed)
    assert back_idx.tolist() == idx.tolist()
    assert torch.equal(back_vals, vals)


def _demo_reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    """DeMo written out plainly (no packing, no collectives) for ``world`` simulated ranks."""
    torch.manual_seed(0)
    w, b = torch.randn(7, 9), torch.randn(5)
    params, wds = [w, b], [0.1, 0.0]
    lr, c, k, decay = 0.01, 16, 3, 0.9
    d = dct_basis(c)
    momenta = [[torch.zeros(-(-p.numel() // c) * c) for p in params] for _ in range(world)]
    for step in range(steps):
        sent_by_rank = []
        for r in range(world):
            gen = torch.Generator().manual_seed(100 * r + step)
            grads = [torch.randn(p.shape, generator=gen) for p in params]
            sent_by_rank.append([])
            for i, g in enumerate(grads):
                m = momenta[r][i] * decay
                m[: g.numel()] += lr * g.flatten()
                coeffs = m.view(-1, c) @ d.T
                q = torch.zeros_like(coeffs)
                for row in range(coeffs.shape[0]):
                    top = coeffs[row].abs().argsort(descending=True)[:k]
                    q[row, top] = coeffs[row, top].to(torch.bfloat16).float()
                momenta[r][i] = m - (q @ d).flatten()
                sent_by_rank[r].append(q)
        for i, p in enumerate(params):
            total = sum(sent_by_rank[r][i] for r in range(world))
            update = (total @ d).flatten()[: p.numel()].view_as(p).sign()
            p.mul_(1 - lr * wds[i]).sub_(lr * update)
    return {"w": w, "b": b, "m0": momenta[0][0], "m1": momenta[0][1]}


def test_demo_optimizer_on_two_gloo_ranks_matches_its_definition(tmp_path: Path) -> None:
    out = tmp_path / "demo.pt"
    run_worker("demo_worker.py", 2, str(out))
    got = torch.load(out)
    ref = _demo_reference(world=2, steps=3)
    torch.testing.assert_close(got["w"], ref["w"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["b"], ref["b"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["momenta"]["momentum.0"], ref["m0"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["momenta"]["momentum.1"], ref["m1"], atol=1e-6, rtol=0)
    # The other rank's gradients mattered: one rank alone steps differently.
    alone = _demo_reference(world=1, steps=3)
    assert not torch.allclose(alone["w"], ref["w"], atol=1e-4)


def test_the_quantised_dct_decodes_one_ranks_payload_at_a_time() -> None:
    """The quantised DCT hook's work on a bucket grows with the ranks by their gathered payloads
    alone (under a byte a value at 3 bits): it decodes one rank's payload at a time into a running
    sum, where decoding them all at once and stacking them held two float32 copies of the bucket
    per rank (8 bytes a value each)."""
    from dtlab.analysis.hook_memory import _played_bucket

    n = 1 << 16
    two, eight = (_played_bucket(n, "quant", 64, 4, 3, True, world) for world in (2, 8))
    assert 0 < eight - two <= (8 - 2) * n, (two, eight)
