"""A window of steps recorded with torch.profiler (Chrome trace / TensorBoard), and on CUDA a memory
snapshot of the same window."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from dtlab.metrics.logging import logger

__all__ = ["CudaMemoryHistory", "MemoryHistory", "StepProfiler"]


class MemoryHistory(Protocol):
    """Something that records the allocator's history from ``start()`` until ``dump(path)``."""

    def start(self) -> None: ...

    def dump(self, path: Path) -> None:
        """Write what was recorded since ``start()`` to ``path`` and stop recording."""


class CudaMemoryHistory:
    """The CUDA caching allocator's history (every allocation with its stack), for
    https://pytorch.org/memory_viz."""

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def dump(self, path: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


class StepProfiler:
    """Records steps ``wait+1 .. wait+active`` (after one more warm-up step) of this rank under ``directory``.

    Traces are ``<directory>/rank<R>.*.pt.trace.json`` (open in Perfetto / chrome://tracing, or
    ``tensorboard --logdir``); on CUDA also ``rank<R>-memory.pickle`` for https://pytorch.org/memory_viz,
    the allocator's history over the same recorded steps: it starts when the profiler's recording does
    and is written when the trace is (recording the whole run's history would slow every step and
    fill the snapshot with steps nobody asked for). ``memory``: the recorder (CUDA's by default on a
    GPU, none elsewhere).
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        device: torch.device,
        wait: int = 1,
        active: int = 2,
        memory: MemoryHistory | None = None,
    ) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.rank, self.cuda = directory, rank, device.type == "cuda"
        self.memory = memory if memory is not None else CudaMemoryHistory() if self.cuda else None
        self.memory_path = directory / f"rank{rank}-memory.pickle"
        self.recording = False  # the memory history
        self.steps = 0  # the profiler's step number (steps taken so far)
        self.schedule = schedule(wait=wait, warmup=1, active=active, repeat=1)
        write_trace = tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}")

        def trace_ready(prof: Any) -> None:  # the end of the recorded window
            write_trace(prof)
            self._dump_memory()

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof: Any = profile(
            activities=activities,
            schedule=self.schedule,
            on_trace_ready=trace_ready,
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
        )
        self.prof.start()
        self._start_memory()

    def _start_memory(self) -> None:
        """Start the memory history if the step about to run is the first the profiler records."""
        from torch.profiler import ProfilerAction

        recorded = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        if self.memory is not None and not self.recording and self.schedule(self.steps) in recorded:
            self.memory.start()
            self.recording = True

    def _dump_memory(self) -> None:
        if self.memory is not None and self.recording:
            self.memory.dump(self.memory_path)
            self.recording = False
            self.memory = None  # one window (repeat=1): nothing is recorded again

    def step(self) -> None:
        """After a training step: the profiler moves on (writing its trace and the memory snapshot
        at the end of its window), and the memory history starts with the window's first step."""
        self.prof.step()
        self.steps += 1
        self._start_memory()

    def close(self) -> None:
        """Stop; a window still open is written as far as it got."""
        self.prof.stop()
        self._dump_memory()
        if self.rank == 0:
            logger.info("profiler traces written to %s", self.directory)
