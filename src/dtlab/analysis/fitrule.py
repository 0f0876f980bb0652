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
NCCL's buffers, none of which a CPU grid can see. Its margin is the tightest of three: the model's
measured margin; that margin with a GPU's own overheads modelled (:func:`gpu_modelled_fraction`:
the allocator's reserved over allocated, the CUDA context and libraries' workspaces, NCCL's buffers,
each an assumption with its source until a GPU measures them); and the published GPU rule, Fujii et
al. (arXiv:2411.06465): over 454 runs on A100 and H100, no run whose estimate was under 80% of the
GPU's memory ran out (their estimator, like ours, counts temporary buffers).
"""

from __future__ import annotations

# Measured on 2026-11-29 by ``python -m dtlab.bench.fitrule`` (the default grid) on a 2-core x86-64
# Linux machine, gloo, torch 2.13 (CPU build), glibc malloc, a cgroup v1 memory cap, the plan's
# peak being the largest moment of the step's timeline: the table in docs/planning.md. Each margin:
# the highest predicted / cap at and below which no run ran out of memory; beside it the lowest
# ratio at which one did, and the capped runs behind it (the default malloc's over two runs of the
# grid, at 0.5 to 0.9 and at 0.3 and 0.4). With the peak as the parts added up, on 2026-11-26: 40%
# and 80%.
CPU_MARGIN = 0.4  # malloc default
CPU_LOWEST_OOM = 0.5
CPU_RUNS = 35
MODEL_MARGIN = 0.95  # malloc exact: the analytic model alone
MODEL_LOWEST_OOM = 1.0
MODEL_RUNS = 25
BENCH = "python -m dtlab.bench.fitrule"
# The published GPU rule (Fujii, Watanabe, Yokota 2024, arXiv:2411.06465).
GPU_PUBLISHED_MARGIN = 0.8
GPU_SOURCE = "Fujii et al. 2024, arXiv:2411.06465: no run estimated under 80% of memory ran out, 454 runs on A100 and H100"
# A GPU's overheads beside the tensors. Measured on one H200 (torch 2.11, CUDA 13.0, 26 trainings
# of llama3.2-1b and -3b, python -m dtlab.bench.gputruth; docs/planning.md): the device memory
# outside the caching allocator once a run has trained (the CUDA context with lazy loading,
# cuBLAS's and cuDNN's handles, compiled kernels' modules) 767 to 771 MiB; the allocator's reserved
# over its allocated peak 0.6% to 24.1%, what it kept when nothing pressed it, not what it needs
# (it frees its cache and retries before running out), so 10% stays assumed until runs under a cap
# on a GPU measure it. NCCL's buffers for a rank's few communicators (NCCL_BUFFSIZE, 4 MiB by
# default, per channel and peer) are assumed 1.2 GiB: one GPU cannot measure them. On the 80 GiB
# reference GPU.
GPU_CONTEXT_BYTES = 771 * 2**20
GPU_LIBRARIES_BYTES = int(1.2 * 2**30)
GPU_ALLOCATOR_OVERHEAD = 0.10
GPU_REFERENCE_BYTES = 80 * 2**30
GPU_MODEL_SOURCE = (
    "the CUDA context and libraries 771 MiB (measured on an H200), NCCL's buffers 1.2 GiB and the "
    "caching allocator's reserved over allocated 10% assumed (0.6-24.1% kept in unpressed runs "
    "on the H200), on 80 GiB"
)


def gpu_modelled_fraction(memory_bytes: int = GPU_REFERENCE_BYTES) -> float:
    """The analytic model's margin on a GPU of ``memory_bytes`` once its overheads are modelled:
    what is left after the context, libraries and NCCL, over the allocator's overhead."""
    left = 1 - (GPU_CONTEXT_BYTES + GPU_LIBRARIES_BYTES) / memory_bytes
    return MODEL_MARGIN * left / (1 + GPU_ALLOCATOR_OVERHEAD)


def usable_fraction(kind: str) -> float:
    """The share of a device's memory a predicted peak may take and still fit, for a device ``kind``
    (``"cpu"`` or ``"cuda"``): the CPU grid's margin on a CPU; on a GPU the tightest of the analytic
    model's measured margin, that margin with the GPU's overheads modelled, and the published GPU
    rule."""
    if kind == "cpu":
        return CPU_MARGIN
    if kind == "cuda":
        return min(MODEL_MARGIN, gpu_modelled_fraction(), GPU_PUBLISHED_MARGIN)
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
        f"{head} (the tightest of the analytic model's margin measured by {BENCH} on CPU with freed "
        f"memory returned at once, no run under {MODEL_MARGIN:.0%} ran out, {MODEL_RUNS} runs; "
        f"that margin with a GPU's overheads modelled, {gpu_modelled_fraction():.0%}: "
        f"{GPU_MODEL_SOURCE}; and {GPU_SOURCE}; not yet measured under a cap on a GPU)"
    )
