"""Wall-clock timing of work that may run on a GPU: the device is synchronised around the timed region.

A CUDA kernel, an NCCL collective or a pipeline stage's forward returns to Python once it is queued;
a clock read right after it measures the launch, not the work. Every timed region in ``dtlab.bench``
goes through :func:`timed` (or :func:`synchronize`), which waits for the device before the clock
starts (so earlier queued work is not charged to the region) and before it stops. On CPU nothing is
queued and nothing is waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["Timing", "synchronize", "timed"]


def synchronize(device: torch.device) -> None:
    """Wait until everything queued on CUDA ``device`` has run; nothing on other devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """What :func:`timed` measured: ``start`` and ``end`` on :func:`time.perf_counter`'s clock."""

    start: float = 0.0
    end: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@contextmanager
def timed(
    device: torch.device, sync: Callable[[torch.device], None] = synchronize
) -> Iterator[Timing]:
    """Time the ``with`` body's work on ``device``: ``with timed(device) as t: ...``, then
    ``t.seconds``. ``sync`` waits for the device (:func:`synchronize`, the one thing a test swaps)."""
    timing = Timing()
    sync(device)
    timing.start = time.perf_counter()
    try:
        yield timing
    finally:
        sync(device)
        timing.end = time.perf_counter()
