"""DiLoCo's copies from a GPU into its outer state's pinned host memory, off the compute stream.

Every outer sync writes float32 values back to host memory: the snapshot of the weights and the error
feedback at a send, θ_global and the outer momentum at a landing (up to 4 x 4 B a parameter of the
fragment). Issued on the compute stream, each copy would hold every kernel queued after it until it
has crossed the host link, the next inner step's included. :class:`HostCopies` runs them on a stream
of their own, through two staging buffers on the device:

- each copy first copies its source into a staging buffer on the compute stream (device memory's
  bandwidth: a small part of the link's time), ordered after the kernels that made the source and
  before any that change it, so a live parameter may be the source;
- the side stream waits for that, then copies the staging buffer to host memory;
- the compute stream writes a staging buffer again only after the side stream has read it out
  (a wait on the device, never on the host): with two buffers, one is copied out while the compute
  stream fills the other and goes on with what comes after (the next parameter's copies to the
  device, its arithmetic, the next inner step);
- before the compute stream reads an outer-state tensor back to the device, it waits for the last
  copy written into it (:meth:`HostCopies.before_read`); before the host reads the outer state (a
  checkpoint), it waits for every copy (:meth:`HostCopies.synchronize`).

The staging buffers live for one outer operation (:meth:`HostCopies.staged`), each the size of the
rank's largest parameter up to :data:`STAGE_VALUES` values (a larger parameter goes in pieces): the
device holds ``2 x 4 B x`` :func:`stage_values` more during an outer sync, which the plan counts
(:func:`dtlab.analysis.diloco_memory.with_outer_sync`). When the operation ends they are handed to the
side stream's last copies (``record_stream``): the allocator reuses them once those copies are done,
a few milliseconds into the next inner step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["STAGE_VALUES", "HostCopies", "copies_off_compute_stream", "stage_values"]

# The most float32 values a staging buffer holds (128 MiB): every block parameter of an 8B model
# whole (its largest, 4,096 x 14,336, in two pieces), a vocabulary's table in pieces of this size.
STAGE_VALUES = 1 << 25


def copies_off_compute_stream(device: torch.device) -> bool:
    """Whether a replica on ``device`` copies its outer state to host memory on a side stream: on a
    CUDA device (whose outer state is pinned host memory); on the CPU the outer state is updated in
    place and nothing is copied."""
    return device.type == "cuda"


def stage_values(numels: Sequence[int]) -> int:
    """The values of one staging buffer for parameters of ``numels`` elements (as this rank holds
    them): the largest, up to :data:`STAGE_VALUES`; at least 1."""
    return max(1, min(STAGE_VALUES, max(numels, default=1)))


class HostCopies:
    """Copies into pinned host memory from CUDA ``device`` on a side stream through two staging
    buffers of ``values`` float32 values each (module docstring). Made and used on the training
    thread."""

    def __init__(self, device: torch.device, values: int) -> None:
        self.device, self.values = device, values
        # On the rank's own GPU (a stream made without the device would be on the current one).
        self.stream = torch.cuda.Stream(device)
        self._stages: list[torch.Tensor] | None = None
        self._free: list[Any] = [
            None,
            None,
        ]  # the side stream's event after each buffer's last read
        self._turn = 0
        # The side stream's event after the last copy into each host tensor (by its address).
        self._written: dict[int, Any] = {}

    @contextmanager
    def staged(self) -> Iterator[None]:
        """The staging buffers for one outer operation (nested: the outer one's)."""
        if self._stages is not None:
            yield
            return
        self._stages = [
            torch.empty(self.values, dtype=torch.float32, device=self.device) for _ in range(2)
        ]
        try:
            yield
        finally:
            for stage in self._stages:
                # Freed on the host now, reused by the allocator once the side stream read them.
                stage.record_stream(self.stream)
            self._stages, self._free, self._turn = None, [None, None], 0
            self._written = {k: e for k, e in self._written.items() if not e.query()}

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (pinned host memory, float32) = ``src`` (on the device, as many values), without
        holding the compute stream behind the copy."""
        with self.staged():
            assert self._stages is not None
            compute = torch.cuda.current_stream(self.device)
            flat, out = src.detach().reshape(-1), dst.view(-1)
            done = None
            for start in range(0, flat.numel(), self.values):
                part = flat[start : start + self.values]
                b = self._turn
                self._turn ^= 1
                if self._free[b] is not None:  # the side stream's last read of this buffer
                    compute.wait_event(self._free[b])
                stage = self._stages[b][: part.numel()]
                stage.copy_(part)
                self.stream.wait_stream(compute)
                with torch.cuda.stream(self.stream):
                    out[start : start + part.numel()].copy_(stage, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
                self._free[b] = done
            if done is not None:
                self._written[dst.data_ptr()] = done

    def before_read(self, host: torch.Tensor) -> None:
        """Before the compute stream reads outer-state tensor ``host``: it waits for the last copy
        written into it (on the device: the host goes on)."""
        if (done := self._written.pop(host.data_ptr(), None)) is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def synchronize(self) -> None:
        """Before the host reads the outer state: every copy issued so far has landed."""
        self.stream.synchronize()
        self._written.clear()
