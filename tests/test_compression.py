"""Gradient compression: the DCT transform, error feedback, and the hooks on real gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import train_run
from dtlab.parallel.compression import DCTState, dct_basis, dct_compress, dct_decompress


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
    out = dct_decompress(idx[None], vals[None], chunks, g.numel(), state, g.device)
    torch.testing.assert_close(out, g, atol=1e-5, rtol=0)
    assert state.residuals[0].abs().max() < 1e-5


def test_error_feedback_carries_what_was_not_sent() -> None:
    state = DCTState(chunk_size=16, topk=2, error_feedback=True)
    g = torch.randn(64)
    idx, vals, chunks = dct_compress(g, state, 3)
    sent = dct_decompress(idx[None], vals[None], chunks, g.numel(), state, g.device)
    # Sent plus residual is exactly the gradient: nothing is lost, only delayed.
    torch.testing.assert_close(sent + state.residuals[3], g, atol=1e-5, rtol=0)
    assert state.residuals[3].norm() > 0.1 * g.norm()
    # The next step compresses gradient + residual.
    g2 = torch.randn(64)
    residual = state.residuals[3].clone()
    idx2, vals2, _ = dct_compress(g2, state, 3)
    sent2 = dct_decompress(idx2[None], vals2[None], chunks, g.numel(), state, g.device)
    torch.testing.assert_close(sent2 + state.residuals[3], g2 + residual, atol=1e-5, rtol=0)
    # Without error feedback nothing is kept.
    plain = DCTState(chunk_size=16, topk=2, error_feedback=False)
    dct_compress(g, plain, 0)
    assert not plain.residuals


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


@pytest.mark.parametrize("compression", ["fp16", "bf16", "powersgd", "dct"])
def test_compressed_runs_train(tmp_path: Path, compression: str) -> None:
    run = train_run(
        tmp_path / compression,
        "parallel.strategy=ddp",
        f"parallel.compression={compression}",
        "parallel.compression_options.start_step=2",
        nproc=2,
    )
    assert run[-1]["loss"] < run[0]["loss"] - 0.3
    assert all(m["loss"] == m["loss"] for m in run)  # no NaN
