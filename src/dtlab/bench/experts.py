"""The routed experts' forward and backward, by kernel: torch's grouped matmul (what dtlab runs in
bf16 where it can, :func:`dtlab.models.moe.grouped_kernel_runs`) against the loop over experts, on
one MoE block of a preset (its width, experts and top-k; ``--experts`` overrides the count), in
this process.

    python -m dtlab.bench.experts [--presets tiny-moe] [--experts 8,64] [--tokens 2048]
                                  [--repeats 12] [--threads 2]

Each kernel runs the block's routed experts on ``--tokens`` tokens routed at random (bf16 under
autocast on float32 weights, as a one-process bf16 run does), forward and backward, alternately,
``--repeats`` times after a warm-up; the median time of each and the loop's over the grouped
kernel's, measured side by side in one run. Both give the same values (tests/test_moe_kernel.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtlab.cliargs import int_list, positive_int, run_command
from dtlab.config import load_config
from dtlab.models.moe import (
    GroupedExperts,
    compute_dtype,
    grouped_kernel_runs,
    grouped_swiglu,
    loop_swiglu,
)

KERNELS = ("grouped", "loop")


def _step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, kernel: str) -> float:
    """Seconds of one forward and backward of ``experts``' SwiGLUs on ``x`` with ``kernel``."""
    weights = (experts.w1, experts.w2, experts.w3)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if kernel == "grouped":
            y = grouped_swiglu(x, counts, *weights, compute_dtype(x))
        else:
            y = loop_swiglu(x, counts, *weights)
    y.float().sum().backward()
    return time.perf_counter() - t0


def measure(preset: str, n_experts: int | None, tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds of each kernel on one routed-experts block of ``preset``."""
    m = load_config(overrides=[f"model.preset={preset}"]).model
    n = n_experts or m.moe.experts
    dim, hidden, k = m.dim, m.moe.expert_dim or m.hidden_dim, m.moe.top_k
    torch.manual_seed(0)
    experts = GroupedExperts(n, dim, hidden)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, n, (tokens * k,))
    counts = torch.bincount(ids, minlength=n)
    x = torch.randn(tokens * k, dim, requires_grad=True)
    times: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
    for r in range(repeats + 1):
        for kernel in KERNELS:
            s = _step(experts, x, counts, kernel)
            if r:  # the first round warms both up
                times[kernel].append(s)
    return {kernel: statistics.median(v) for kernel, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.experts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--presets", default="tiny-moe", help="comma-separated (default tiny-moe)")
    p.add_argument("--experts", default="0,64", help="expert counts, 0 the preset's (default 0,64)")
    p.add_argument("--tokens", type=positive_int, default=2048)
    p.add_argument("--repeats", type=positive_int, default=12)
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    counts = int_list(args.experts, "--experts", low=0)
    presets = args.presets.split(",")
    for preset in presets:
        m = load_config(overrides=[f"model.preset={preset}"]).model
        if not m.moe.experts:
            p.error(f"--presets {preset}: not a mixture of experts (model.moe.experts = 0)")
        hidden = m.moe.expert_dim or m.hidden_dim
        if not grouped_kernel_runs("cpu", None, torch.bfloat16, m.dim, hidden):
            p.error(f"--presets {preset}: the grouped kernel does not take its widths "
                    f"({m.dim}, {hidden}: multiples of 8 needed)")  # fmt: skip
    torch.set_num_threads(args.threads)
    print(f"routed experts, forward + backward, bf16 autocast, {args.tokens} tokens, "
          f"{args.threads} threads, median of {args.repeats}")  # fmt: skip
    print(f"{'preset':<10} {'experts':>7} {'grouped ms':>11} {'loop ms':>9}   loop / grouped")
    for preset in presets:
        for n in counts:
            t = measure(preset, n or None, args.tokens, args.repeats)
            n_shown = n or load_config(overrides=[f"model.preset={preset}"]).model.moe.experts
            print(f"{preset:<10} {n_shown:>7} {t['grouped'] * 1e3:>11.2f} "
                  f"{t['loop'] * 1e3:>9.2f}   {t['loop'] / t['grouped']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
