"""The fit rule of ``dtlab plan``: the share of a device's memory a predicted peak may take and still fit.

The plan predicts tensors (parameters, gradients, optimizer state, activations, temporaries); a real
process holds more: its allocator's cache and fragmentation, and on a GPU the CUDA context and the
communication library's buffers. A layout "fits" when its predicted peak is at most a margin of the
memory, and the margins are measured by ``python -m dtlab.bench.fitrule`` (docs/planning.md, "Fit
rule"): real ``dtlab train`` runs under a cgroup memory cap set from the prediction (the measured
baseline of the process added), the margin being the highest predicted / cap ratio at and below which
no run of the grid ran out of memory. The grid runs twice:

- malloc ``default``, as ``dtlab train`` runs on a CPU: glibc keeps freed memory in its heaps, the
  CPU's allocator cache. Its margin is the CPU's.
- malloc ``exact``: freed memory goes back to the kernel at once, so the process holds what its
  tensors hold. Its margin measures the analytic model alone, without any allocator.

A GPU has another allocator (CUDA's caching allocator, its own fragmentation), the CUDA context and
NCCL's buffers, none of which a CPU grid can see. Its margin is the tighter of the model's measured
margin and the published GPU rule, Fujii et al. (arXiv:2411.06465): over 454 runs on A100 and H100,
no run whose estimate was under 80% of the GPU's memory ran out. (Their estimator counts temporary
buffers and fragmentation; ours leaves fragmentation to the margin, which the CPU grid cannot size
for a GPU: say so where the rule is printed.)
"""

from __future__ import annotations

# Measured on 2026-11-26 by ``python -m dtlab.bench.fitrule`` (the default grid) on a 2-core x86-64
# Linux machine, gloo, torch 2.13 (CPU build), glibc malloc, a cgroup v1 memory cap: the table in
# docs/planning.md. Each margin: the highest predicted / cap at and below which no run ran out of
# memory; beside it the lowest ratio at which one did, and the capped runs behind it.
CPU_MARGIN = 0.4  # malloc default
CPU_LOWEST_OOM = 0.5
CPU_RUNS = 25
MODEL_MARGIN = 0.8  # malloc exact: the analytic model alone
MODEL_LOWEST_OOM = 0.9
MODEL_RUNS = 15
BENCH = "python -m dtlab.bench.fitrule"
# The published GPU rule (Fujii, Watanabe, Yokota 2024, arXiv:2411.06465).
GPU_PUBLISHED_MARGIN = 0.8
GPU_SOURCE = "Fujii et al. 2024, arXiv:2411.06465: no run estimated under 80% of memory ran out, 454 runs on A100 and H100"


def usable_fraction(kind: str) -> float:
    """The share of a device's memory a predicted peak may take and still fit, for a device ``kind``
    (``"cpu"`` or ``"cuda"``): the CPU grid's margin on a CPU; on a GPU the tighter of the analytic
    model's measured margin and the published GPU rule."""
    if kind == "cpu":
        return CPU_MARGIN
    if kind == "cuda":
        return min(MODEL_MARGIN, GPU_PUBLISHED_MARGIN)
    raise ValueError(f"device kind {kind!r}: expected 'cpu' or 'cuda'")


def explain(kind: str) -> str:
    """One sentence: the rule for a device ``kind``, and where its margin comes from."""
    head = f"fits = predicted peak <= {usable_fraction(kind):.0%} of device memory"
    if kind == "cpu":
        return (
            f"{head} (margin measured by {BENCH}: no run under {CPU_MARGIN:.0%} ran out, "
            f"{CPU_RUNS} runs; the lowest that did, {CPU_LOWEST_OOM:.0%}: glibc's heaps keep what "
            "torch frees)"
        )
    return (
        f"{head} (the tighter of the analytic model's margin measured by {BENCH} on CPU with freed "
        f"memory returned at once, no run under {MODEL_MARGIN:.0%} ran out, {MODEL_RUNS} runs, and "
        f"{GPU_SOURCE}; a CPU grid cannot see the CUDA allocator's fragmentation, the CUDA context "
        "or NCCL's buffers)"
    )
