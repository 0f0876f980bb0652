"""A ``kill -9`` of ``dtlab train`` takes every process it started with it (dtlab.runtime.lifeline):
its ranks, under fault tolerance its groups' agents and their ranks, and their fork server's
children, which would otherwise train on as orphans (on a GPU node, holding the GPUs)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import FAST, Watched, real_pid


def _tree(root: int) -> set[int]:
    """``root`` and every process below it, a shim's fork server child with it (its real work)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree = {root}
    while True:
        below = {p for p, parent in parents.items() if parent in tree} - tree
        below |= {real_pid(p) for p in tree} - tree
        if not below:
            return tree
        tree |= below


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent (the test's fork server) reaps it later


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.strategy=ddp"],
        ["parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true"],
        [
            "parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true",
            "parallel.fault_tolerance.warm_restart=true",
        ],
    ],
    ids=["ddp", "fault-tolerant", "fault-tolerant-fork-server"],
)  # fmt: skip
def test_kill_9_of_dtlab_train_ends_every_process_it_started(
    tmp_path: Path, layout: list[str]
) -> None:
    if "parallel.fault_tolerance.enabled=true" in layout:
        pytest.importorskip("torchft")
    run_dir = tmp_path / "run"
    job = Watched(
        "train", "--nproc", "2", "--set", *FAST, "train.steps=100000", f"run.dir={run_dir}",
        *layout,
    )  # fmt: skip
    started: set[int] = set()
    try:
        metrics = run_dir / "metrics.jsonl"
        if "parallel.fault_tolerance.enabled=true" in layout:
            metrics = run_dir / "replica-0" / "metrics.jsonl"
        job.wait_for_file(metrics, timeout=180)  # the ranks train
        launcher = real_pid(job.proc.pid)
        started = _tree(launcher) - {launcher}
        ranks = [p for p in started if "TORCHELASTIC_RUN_ID=" in _environ(p)]
        assert len(ranks) >= 2, sorted(started)
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {p: _cmdline(p) for p in started if _alive(p)}
        assert not left, f"still running 20 s after the launcher was killed: {left}"
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            job.proc.kill()
        job.proc.wait()


def _environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return ""
