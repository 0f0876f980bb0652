"""How a GPU check runs its steps: each command in a process group of its own, under a timeout cut to
what is left of the whole check's budget, its output kept in a log file, its wall time measured."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Check", "Deadline", "Proc", "StepTimeout", "run_logged"]

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
GRACE_S = 10.0  # after SIGTERM, how long a timed-out command has to exit before SIGKILL


@dataclass
class Check:
    """One check of the report: what it proves, how it went, the figures it measured."""

    name: str
    title: str
    status: str = "pending"
    reason: str = ""
    wall_s: float = 0.0
    timeout_s: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)

    def passed(self, reason: str = "") -> None:
        self.status, self.reason = PASSED, reason

    def failed(self, reason: str) -> None:
        self.status, self.reason = FAILED, reason

    def skipped(self, reason: str) -> None:
        self.status, self.reason = SKIPPED, reason


class StepTimeout(Exception):
    """A command ran past its timeout (and was stopped)."""


@dataclass
class Deadline:
    """The budget of the whole check: every step's timeout is cut to what is left of it."""

    budget_s: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@dataclass
class Proc:
    """A finished command: its exit code, output and wall time."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float


def run_logged(
    cmd: list[str], timeout_s: float, log: Path, env: dict[str, str] | None = None
) -> Proc:
    """Run ``cmd`` in a new session (so that a timeout stops the processes it started too: a
    launcher's workers), its stdout and stderr kept and written to ``log``; ``StepTimeout`` when it
    runs past ``timeout_s``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        _write_log(log, cmd, out, err, None, time.perf_counter() - t0)
        raise StepTimeout(f"timed out after {timeout_s:.0f} s: {' '.join(cmd[:6])} ...") from None
    wall = time.perf_counter() - t0
    _write_log(log, cmd, out, err, proc.returncode, wall)
    return Proc(proc.returncode, out, err, wall)


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM to the command's whole process group, SIGKILL if it has not exited after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


def _write_log(
    log: Path, cmd: list[str], out: str, err: str, code: int | None, wall: float
) -> None:
    status = "timed out" if code is None else f"exit code {code}"
    log.write_text(
        f"$ {' '.join(cmd)}\n# {status}, {wall:.1f} s\n\n--- stdout\n{out}\n--- stderr\n{err}",
        encoding="utf-8",
    )


def python() -> str:
    """The interpreter this check runs in (its dtlab and torch are the ones checked)."""
    return sys.executable
