"""A window of steps recorded with torch.profiler (Chrome trace / TensorBoard), and on CUDA a memory snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dtlab.metrics.logging import logger


class StepProfiler:
    """Records steps ``wait+1 .. wait+active`` (after one more warm-up step) of this rank under ``directory``.

    Traces are ``<directory>/rank<R>.*.pt.trace.json`` (open in Perfetto / chrome://tracing, or
    ``tensorboard --logdir``); on CUDA also ``rank<R>-memory.pickle`` for https://pytorch.org/memory_viz.
    """

    def __init__(
        self, directory: Path, rank: int, device: torch.device, wait: int = 1, active: int = 2
    ) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.rank, self.cuda = directory, rank, device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof: Any = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}"),
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
        )
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof.start()

    def step(self) -> None:
        self.prof.step()

    def close(self) -> None:
        self.prof.stop()
        if self.cuda:
            path = self.directory / f"rank{self.rank}-memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            logger.info("profiler traces written to %s", self.directory)
