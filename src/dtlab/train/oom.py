"""Out-of-memory recovery that keeps the training identical (``train.oom_retry``).

A step whose forward or backward runs out of memory on any rank is taken again on every rank with
smaller micro-batches: more accumulation steps over the same samples, so the same global batch and the
same mathematics (the loss of a step is the mean over its tokens however they are split). Libraries
that halve the *global* batch on an OOM change the training; this does not.

For the ranks to agree before any of them has synchronised a gradient, a step under ``oom_retry`` runs
every micro-batch without gradient sync, agrees on who ran out in one small all-reduce, and only then
averages the gradients (:meth:`dtlab.parallel.ParallelModel.sync_gradients`). That gives up the
overlap of DDP's gradient all-reduce with backward: the price of a step every rank can take back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtlab.data.loader import MicroBatch
from dtlab.parallel.ledger import recorded

__all__ = [
    "StepOutOfMemory",
    "agree_out_of_memory",
    "is_out_of_memory",
    "smaller_micro_batch",
    "split_micro_batches",
]

# What torch's allocators say when an allocation fails: CUDA raises torch.OutOfMemoryError; the CPU
# allocator (a failed malloc, e.g. under an address-space limit) and MPS a RuntimeError.
_MESSAGES = ("can't allocate memory", "out of memory", "Cannot allocate memory")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure of some device's allocator."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _MESSAGES)


class StepOutOfMemory(Exception):
    """The step ran out of memory on ``ranks`` (agreed by every rank); no state was changed."""

    def __init__(self, ranks: list[int], micro: int, detail: str) -> None:
        super().__init__(
            f"out of memory on rank(s) {ranks} with micro-batches of {micro}: {detail}"
        )
        self.ranks, self.micro, self.detail = ranks, micro, detail


def agree_out_of_memory(failed: bool, device: torch.device | None = None) -> list[int]:
    """The ranks that ran out of memory in this step, the same list on every rank (one all-reduce of a
    float per rank; nothing without a process group). NCCL's votes are made on ``device`` (the GPU;
    made there, not copied there), gloo's on the host; reading them back is the one host sync it
    needs (every rank decides on it before any gradient is synchronised)."""
    if not dist.is_initialized():
        return [0] if failed else []
    world, rank = dist.get_world_size(), dist.get_rank()
    nccl = dist.get_backend() == "nccl"
    votes = torch.zeros(world, device=device if nccl else "cpu")
    votes[rank].fill_(float(failed))
    with recorded("out-of-memory agreement", "all_reduce", votes):
        dist.all_reduce(votes)
    return [r for r, v in enumerate(votes.tolist()) if v > 0]


def smaller_micro_batch(size: int) -> int | None:
    """The micro-batch size to retry with: the largest divisor of ``size`` up to half of it (equal
    micro-batches keep every token's weight in the mean loss); None for one sample."""
    return next((d for d in range(size // 2, 0, -1) if size % d == 0), None)


def split_micro_batches(micro_batches: list[MicroBatch], size: int) -> list[MicroBatch]:
    """Every micro-batch cut into micro-batches of ``size`` samples, in order."""
    out: list[MicroBatch] = []
    for inputs, targets in micro_batches:
        out.extend(zip(inputs.split(size), targets.split(size), strict=True))
    return out
