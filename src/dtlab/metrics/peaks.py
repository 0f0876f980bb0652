"""A device allocator's peak memory, read window by window without losing the run's peak.

The CUDA allocator keeps peak counters per device: of the bytes allocated to tensors and of the bytes
it reserved from the device (its cache: freed blocks it keeps for reuse, fragmentation included). One
call resets both. The memory alert wants the peak of each step (reset after every read); the run's
summary and the benchmark want the peak of the whole run. Resetting the counters for the one would
destroy the other, so the peaks of every window are folded into the run's before the counters are
reset.

Which figure is for what:

- ``allocated`` (``torch.cuda.max_memory_allocated``): what the tensors themselves took, the figure
  ``dtlab plan`` and the benchmark's predictions model; the summary's ``peak_memory_bytes``.
- ``reserved`` (``torch.cuda.max_memory_reserved``): what the allocator held from the device. Beside
  it the device also holds the CUDA context, NCCL's buffers and other processes' memory (see
  :func:`dtlab.metrics.alerts.memory_use`): the memory alert judges reserved plus those, the memory
  that is really gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PeakMemory", "cuda_peaks"]


class PeakMemory:
    """Peaks of one allocator's counters (name -> bytes): ``read_peaks()`` gives each counter's peak
    since the last ``reset_peaks()``, which resets them all."""

    def __init__(
        self, read_peaks: Callable[[], dict[str, int]], reset_peaks: Callable[[], None]
    ) -> None:
        self.read_peaks, self.reset_peaks = read_peaks, reset_peaks
        self.earlier: dict[str, int] = {}  # the largest peaks of the windows already closed

    def window(self) -> dict[str, int]:
        """The peaks since the last call (or the start), in bytes; the next window starts now."""
        peaks = {k: int(v) for k, v in self.read_peaks().items()}
        self.earlier = {k: max(self.earlier.get(k, 0), v) for k, v in peaks.items()}
        self.reset_peaks()
        return peaks

    def run(self) -> dict[str, int]:
        """The peaks since the start (or the last :meth:`restart`), in bytes: the closed windows' and
        the open one's."""
        return {k: max(self.earlier.get(k, 0), int(v)) for k, v in self.read_peaks().items()}

    def restart(self) -> None:
        """Forget every peak so far: the run's peak starts now (after a probe that is not part of
        what is measured, such as the benchmark's GEMM)."""
        self.earlier = {}
        self.reset_peaks()


_cuda: dict[int, PeakMemory] = {}


def cuda_peaks(device: Any) -> PeakMemory:
    """The peaks of CUDA ``device``'s caching allocator, ``allocated`` (to tensors) and ``reserved``
    (from the device), one tracker per device for the whole process."""
    import torch

    index = torch.cuda._get_device_index(device, optional=True)
    if index not in _cuda:
        _cuda[index] = PeakMemory(
            lambda: {
                "allocated": int(torch.cuda.max_memory_allocated(index)),
                "reserved": int(torch.cuda.max_memory_reserved(index)),
            },
            lambda: torch.cuda.reset_peak_memory_stats(index),
        )
    return _cuda[index]
