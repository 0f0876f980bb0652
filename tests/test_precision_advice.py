"""The warning for half precision that is slower than fp32 on a CPU."""

from __future__ import annotations

import time

import pytest
import torch

from dtlab.train.precision import check_cpu_half_precision, gemm_gflops, half_precision_advice


def test_advice_only_when_half_precision_is_slower() -> None:
    assert half_precision_advice("fp32", 100.0, 1.0) is None
    assert half_precision_advice("bf16", 100.0, 400.0) is None
    assert half_precision_advice("bf16", 100.0, 100.0) is None  # as fast: nothing to advise
    msg = half_precision_advice("bf16", 70.2, 1.4)
    assert msg is not None
    assert "train.precision = 'bf16'" in msg and "1.4 GFLOP/s in bf16" in msg
    assert "70.2 GFLOP/s in fp32" in msg and "50x slower" in msg and "fp32" in msg


def test_fault11_gemm_rate_agrees_with_an_independent_timing() -> None:
    # Independently: the CPU time this thread spends in one of the same products, 2 n^3 FLOPs; the
    # fastest of 50, taken in turns with the measurement (on a shared machine both see the same spells).
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    independent = measured = 0.0
    try:
        for _ in range(5):
            measured = max(measured, gemm_gflops(torch.float32, size=n, repeats=10))
            for _ in range(10):
                t0 = time.thread_time()
                a @ b
                spent = time.thread_time() - t0
                if spent > 0:
                    independent = max(independent, 2 * n**3 / spent / 1e9)
    finally:
        torch.set_num_threads(threads)
    # A wrong unit or FLOP count is off by 2x or more.
    assert independent / 1.6 < measured < independent * 1.6, (measured, independent)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fault11_check_advises_from_the_rates_it_is_given(precision: str) -> None:
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    asked: list[torch.dtype] = []

    def rates(table: dict[torch.dtype, float]) -> object:
        def rate(dtype: torch.dtype) -> float:
            asked.append(dtype)
            return table[dtype]

        return rate

    slow = check_cpu_half_precision(precision, rates({torch.float32: 80.0, half: 2.0}))  # type: ignore[arg-type]
    assert (
        slow is not None
        and f"2.0 GFLOP/s in {precision}" in slow
        and "80.0 GFLOP/s in fp32" in slow
    )
    assert set(asked) == {torch.float32, half}
    assert check_cpu_half_precision(precision, rates({torch.float32: 80.0, half: 80.0})) is None  # type: ignore[arg-type]
    assert check_cpu_half_precision(precision, rates({torch.float32: 80.0, half: 300.0})) is None  # type: ignore[arg-type]
    asked.clear()
    assert check_cpu_half_precision("fp32", rates({})) is None  # type: ignore[arg-type]
    assert asked == []  # fp32 measures nothing
