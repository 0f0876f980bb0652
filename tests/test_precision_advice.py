"""The warning for half precision that is slower than fp32 on a CPU."""

from __future__ import annotations

import pytest
import torch

from dtlab.train.precision import check_cpu_half_precision, gemm_gflops, half_precision_advice


def test_advice_only_when_half_precision_is_slower() -> None:
    assert half_precision_advice("fp32", 100.0, 1.0) is None
    assert half_precision_advice("bf16", 100.0, 400.0) is None
    msg = half_precision_advice("bf16", 70.2, 1.4)
    assert msg is not None
    assert "train.precision = 'bf16'" in msg and "1.4 GFLOP/s in bf16" in msg
    assert "70.2 GFLOP/s in fp32" in msg and "50x slower" in msg and "fp32" in msg


def test_gemm_rate_is_measured() -> None:
    fast = gemm_gflops(torch.float32, size=128)
    assert 0 < fast < 1e5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_check_follows_the_measured_rates(precision: str) -> None:
    # Whatever this CPU is, the check must agree with its own two measurements' order (up to noise:
    # only decided cases are checked).
    fp32, half = (
        gemm_gflops(torch.float32),
        gemm_gflops({"bf16": torch.bfloat16, "fp16": torch.float16}[precision]),
    )
    advice = check_cpu_half_precision(precision)
    if half < fp32 / 4:
        assert advice is not None and f"in {precision}" in advice
    elif half > fp32 * 4:
        assert advice is None
