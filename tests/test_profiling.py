"""The profiler's window: the memory history is recorded over the steps the profiler traces, not the
whole run."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from dtlab.metrics.profiling import StepProfiler


class Recorder:
    """A memory history that notes after which training step it was started and dumped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.events: list[tuple[str, int]] = []
        self.step = 0  # the training step that ran last
        self.traces_at_dump: list[Path] = []

    def start(self) -> None:
        self.events.append(("start", self.step))

    def dump(self, path: Path) -> None:
        self.events.append(("dump", self.step))
        self.traces_at_dump = list(self.directory.glob("rank0.*.pt.trace.json"))


def _train(profiler: StepProfiler, recorder: Recorder, steps: int) -> None:
    x = torch.randn(64, 64)
    for step in range(1, steps + 1):
        (x @ x).sum()
        recorder.step = step
        profiler.step()


def test_memory_history_covers_the_traced_steps_only(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), wait=1, active=2, memory=recorder)
    _train(profiler, recorder, 6)
    profiler.close()
    # Step 1 waits, step 2 warms up, steps 3 and 4 are recorded: the history starts once step 2 is
    # done and is written once step 4 is, with the trace (written first, so both are on disk).
    assert recorder.events == [("start", 2), ("dump", 4)]
    assert len(recorder.traces_at_dump) == 1
    trace = json.loads(recorder.traces_at_dump[0].read_text())
    steps = {
        e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")
    }
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # the 3rd and 4th steps (numbered from 0)


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), wait=1, active=3, memory=recorder)
    _train(profiler, recorder, 3)
    profiler.close()
    assert recorder.events == [("start", 2), ("dump", 3)]
    short = Recorder(tmp_path)  # a run over before the window: nothing started, nothing written
    profiler = StepProfiler(tmp_path, 0, torch.device("cpu"), wait=2, active=2, memory=short)
    _train(profiler, short, 1)
    profiler.close()
    assert short.events == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_snapshot_holds_the_window_s_allocations_only(tmp_path: Path) -> None:
    """On a GPU the snapshot (CUDA's allocator history) exists once the window ends and holds an
    allocation made in a recorded step, not one made in a step before the window."""
    device = torch.device("cuda", torch.cuda.current_device())
    profiler = StepProfiler(tmp_path, 0, device, wait=1, active=2)
    before, inside = 3 << 20, 5 << 20  # bytes: sizes the allocator keeps as they are
    sizes = {1: before, 3: inside}
    path = tmp_path / "rank0-memory.pickle"
    for step in range(1, 6):
        if step in sizes:
            torch.empty(sizes[step], dtype=torch.uint8, device=device).fill_(1)
        torch.cuda.synchronize(device)
        profiler.step()
        assert path.exists() == (step >= 4), step  # written at the window's end
    profiler.close()
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    allocated = {
        e["size"]
        for trace in snapshot["device_traces"]
        for e in trace
        if e.get("action") == "alloc"
    }
    assert inside in allocated and before not in allocated, sorted(allocated)
