"""A device allocator's peak memory, read window by window without losing the run's peak.

The CUDA allocator keeps one peak counter per device. The memory alert wants the peak of each step
(reset after every read); the run's summary and the benchmark want the peak of the whole run. Resetting
the counter for the one would destroy the other, so the peak of every window is folded into the
run's before the counter is reset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PeakMemory", "cuda_peaks"]


class PeakMemory:
    """Peaks of one allocator: ``read_peak()`` gives its peak since the last ``reset_peak()``."""

    def __init__(self, read_peak: Callable[[], int], reset_peak: Callable[[], None]) -> None:
        self.read_peak, self.reset_peak = read_peak, reset_peak
        self.earlier = 0  # the largest peak of the windows already closed

    def window(self) -> int:
        """The peak since the last call (or the start), in bytes; the next window starts now."""
        peak = int(self.read_peak())
        self.earlier = max(self.earlier, peak)
        self.reset_peak()
        return peak

    def run(self) -> int:
        """The peak since the start, in bytes: the closed windows' and the open one's."""
        return max(self.earlier, int(self.read_peak()))


_cuda: dict[int, PeakMemory] = {}


def cuda_peaks(device: Any) -> PeakMemory:
    """The peaks of CUDA ``device``'s caching allocator (bytes allocated to tensors), one per device
    for the whole process."""
    import torch

    index = torch.cuda._get_device_index(device, optional=True)
    if index not in _cuda:
        _cuda[index] = PeakMemory(
            lambda: int(torch.cuda.max_memory_allocated(index)),
            lambda: torch.cuda.reset_peak_memory_stats(index),
        )
    return _cuda[index]
