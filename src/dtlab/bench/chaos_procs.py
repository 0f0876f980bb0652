"""What the chaos benches share: the common run's settings, the training processes of a run
(found from /proc, signalled), and what the runs left (the last step logged, the fault-tolerance
events of each replica group)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from dtlab.runtime import forkserver

BASE = [
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=64",
    "train.warmup_steps=10",
    "train.lr=3e-3",
    "run.log_every=1",
    "run.tensorboard=false",
    "run.plot=false",
    "run.progress=none",
    "parallel.strategy=ddp",
]


def _pids(run_dir: Path, replica: int | None) -> list[int]:
    """The training processes of ``run_dir`` (of replica group ``replica`` with fault tolerance):
    those its agents started, not the launchers."""
    want = str(run_dir if replica is None else run_dir / f"replica-{replica}")
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"TORCHELASTIC_RUN_ID=" not in env or "dtlab.fault_tolerance" in cmd:
            continue
        if any(a.startswith("run.dir=") and a[len("run.dir=") :] == want for a in cmd):
            out.append(forkserver.real_pid(int(proc.name)))  # warm_restart: the shim's child
    return out


def _last_step(path: Path) -> int:
    """The step of the last complete line of a metrics file (0 if none): its tail only, so that
    sampling a long run's files often costs the training nothing."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)


def _events(run_dir: Path, replicas: int) -> list[dict[str, Any]]:
    out = []
    for i in range(replicas):
        path = run_dir / f"replica-{i}" / "ft_events.jsonl"
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["time"])
