"""A context-parallel run resumed at the same cp degree is the uninterrupted run exactly, and at other
degrees (cp 4 -> cp 2 -> one process) the same training: the checkpoint holds whole tensors, whatever
the ranks that split each sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import train_run

# FSDP over the data x cp ranks (its checkpoints are DCP's, resharded on load); a constant learning
# rate so that runs of different lengths follow the same schedule; clipping active.
COMMON = [
    "parallel.strategy=fsdp", "checkpoint.every=1", "train.schedule=constant",
    "train.warmup_steps=0", "train.grad_clip=0.05",
]  # fmt: skip


def test_resume_across_context_parallel_degrees(tmp_path: Path) -> None:
    whole = train_run(tmp_path / "whole", *COMMON, "parallel.cp=4", nproc=4, steps=5)
    run = tmp_path / "run"
    train_run(run, *COMMON, "parallel.cp=4", nproc=4, steps=2)
    # The same degree: exactly the uninterrupted run.
    again = train_run(run, *COMMON, "parallel.cp=4", "checkpoint.resume=auto", nproc=4, steps=3)
    assert [m["loss"] for m in again] == [m["loss"] for m in whole[:3]]
    assert [m["grad_norm"] for m in again] == [m["grad_norm"] for m in whole[:3]]
    # cp 4 -> cp 2 (2 processes) -> one process (FSDP on one rank), each resuming the one before.
    for overrides, nproc, steps in ((["parallel.cp=2"], 2, 4), (["parallel.cp=1"], 1, 5)):
        resumed = train_run(run, *COMMON, *overrides, "checkpoint.resume=auto", nproc=nproc,
                            steps=steps)  # fmt: skip
        assert len(resumed) == steps
        for got, want in zip(resumed, whole, strict=False):
            assert got["loss"] == pytest.approx(want["loss"], abs=2e-6), (overrides, got, want)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got, want)
