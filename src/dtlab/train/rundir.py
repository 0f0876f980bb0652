"""The run directory: one run at a time, and nothing in it that says more than happened.

- A run holds an exclusive lock on ``<run dir>/.lock`` (rank 0, ``flock``) from the moment it picks the
  directory until it has written its summary; a second run pointed at the same directory is refused with
  the holder named. The kernel drops the lock when the process dies, also on ``kill -9``.
- A run either continues the run the directory holds (it resumes from one of its checkpoints, the newest)
  or starts in a directory that holds no run: a new run never mixes its checkpoints or metrics with
  another's.
- ``config.yaml`` is written only once the resume checks passed, so a refused resume leaves the directory
  as it was; the summary and the loss plot of a resumed run cover its whole history.
- A run stopped by a signal writes ``stopped.json`` once its checkpoint is committed: the launcher exits 75
  ("saved, start me again") only when this attempt wrote one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from dtlab.checkpoint.store import Tier, find_resumable_run
from dtlab.config import Config
from dtlab.errors import DtlabError, OutputError
from dtlab.metrics.logging import logger

LOCK = ".lock"
STOPPED = "stopped.json"
SUMMARY = "summary.json"  # written by rank 0 when a run reaches its end, and only then


def default_run_dir(config: Config) -> Path:
    """Where a run without ``run.dir`` writes: the unfinished run it resumes, or a new timestamped directory."""
    if config.checkpoint.resume == "auto":
        found = find_resumable_run(config)
        if found is not None:
            return found
    base = Path("runs") / f"{config.run.name}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def create_run_dir(config: Config) -> tuple[Path, RunDirLock]:
    """Rank 0: pick the run directory (``run.dir`` or :func:`default_run_dir`), create it and lock it."""
    path = Path(config.run.dir) if config.run.dir else default_run_dir(config)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DtlabError(f"run.dir = {str(path)!r} cannot be created: {e.strerror or e}") from None
    lock = RunDirLock(path, created)
    lock.acquire()
    return path, lock


class RunDirLock:
    """An exclusive, advisory lock on a run directory, held by the process that trains in it."""

    def __init__(self, run_dir: Path, created: bool = False) -> None:
        self.run_dir = run_dir
        self.created = created  # this run made the directory (so may remove it when it stays empty)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a DtlabError naming the process that holds it."""
        fd = os.open(self.run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DtlabError(
                f"run.dir = '{self.run_dir}' is in use by another run ({holder}); wait until it "
                "has finished, or give this run another run.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            ).encode(),
        )
        self.fd = fd

    def release(self) -> None:
        """Unlock; a directory this run created and left with nothing in it (it failed before writing
        anything, e.g. on bad data) is removed, so that failed starts leave no empty run directories."""
        if self.fd is None:
            return
        try:
            if self.created and not any(
                p.is_file() and p.name != LOCK for p in self.run_dir.rglob("*")
            ):
                shutil.rmtree(self.run_dir, ignore_errors=True)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = datetime.fromtimestamp(float(info["since"])).strftime("%Y-%m-%d %H:%M:%S")
        return f"pid {info['pid']} on {info['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said which"


def check_free(run_dir: Path) -> None:
    """Refuse now (before any process starts) if a run holds ``run_dir``; takes no lock."""
    if (run_dir / LOCK).exists():
        lock = RunDirLock(run_dir)
        lock.acquire()
        lock.release()


def logged_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (a line torn by a crash is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def check_start(run_dir: Path, chosen: Path | None, own_step: int | None, config: Config) -> None:
    """A run either continues the run ``run_dir`` holds, from its newest checkpoint, or starts in a
    directory that holds no run. Raises a DtlabError naming what the directory holds otherwise.

    ``chosen`` is the checkpoint the run resumes from (None: none); ``own_step`` its step when it is
    one of this run directory's own checkpoints (local or durable tier), else None.
    """
    local = Tier(run_dir / "checkpoints", "local").committed()
    if own_step is not None:
        newer = [s for s in local if s > own_step]
        if newer:
            raise DtlabError(
                f"checkpoint.resume = '{config.checkpoint.resume}' resumes run.dir = '{run_dir}' at "
                f"step {own_step}, but the run there went on to step {newer[-1]}: its later checkpoints "
                "and metrics would be mixed with the new ones. Resume into another run.dir instead"
            )
        return
    held = []
    if local:
        held.append(f"checkpoints up to step {local[-1]}")
    logged = logged_steps(run_dir)
    if logged:
        held.append(f"metrics up to step {logged[-1]['step']}")
    if (run_dir / SUMMARY).is_file():
        held.append("a summary (it finished)")
    if not held:
        return
    # The same run started again before its first checkpoint: it starts over (nothing to mix with).
    restart = (
        config.checkpoint.resume == "auto" and not local and "a summary (it finished)" not in held
    )
    if restart:
        logger.warning(
            "run.dir = '%s' holds %s of an earlier start that left no checkpoint to resume from: "
            "starting over from step 0",
            run_dir,
            " and ".join(held),
        )
        return
    why = (
        "checkpoint.resume = 'never' starts a new run"
        if config.checkpoint.resume == "never"
        else f"checkpoint.resume = '{config.checkpoint.resume}' starts this run from another run's checkpoint"
        if chosen is not None
        else "none of its checkpoints could be resumed (see the warnings above)"
        if local
        else "it finished without a checkpoint to continue from"
    )
    raise DtlabError(
        f"run.dir = '{run_dir}' already holds a run ({', '.join(held)}) and {why}; a new run needs "
        "a run.dir of its own (or delete that directory)"
    )


def record_stop(run_dir: Path, step: int, signal_name: str, checkpoint: Path) -> None:
    """Say that this attempt stopped on a signal with ``checkpoint`` committed (rank 0)."""
    marker = {
        # The launcher's rendezvous id and the time tell a launcher whether this attempt wrote it.
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "time": time.time(),
        "step": step,
        "signal": signal_name,
        "checkpoint": str(checkpoint),
    }
    tmp = run_dir / (STOPPED + ".tmp")
    tmp.write_text(json.dumps(marker), encoding="utf-8")
    os.replace(tmp, run_dir / STOPPED)


def finished_since(run_dir: Path, since: float) -> bool:
    """Whether a run in ``run_dir`` reached its end after ``since``: rank 0 writes ``summary.json``
    only then (a stopped or failed run writes none)."""
    try:
        return (run_dir / SUMMARY).stat().st_mtime >= since
    except OSError:
        return False


def stopped_with_checkpoint(run_dir: Path, run_id: str, since: float) -> dict[str, Any] | None:
    """The stop marker that workers of the launch ``run_id`` wrote in ``run_dir`` after ``since``."""
    try:
        marker = json.loads((run_dir / STOPPED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(marker, dict)
        or marker.get("run_id") != run_id
        or not isinstance(marker.get("time"), (int, float))
        or marker["time"] < since
    ):
        return None
    return marker


def write_outputs(
    run_dir: Path, summary: dict[str, Any], curve: list[dict[str, Any]], title: str, plot: bool
) -> None:
    """Rank 0 at the end of a run: the loss plot (when asked for) and ``summary.json`` (atomically).

    A plot that cannot be drawn is reported and left out; a summary that cannot be written is an
    OutputError (exit 1): a finished run without its record is not a success.
    """
    from dtlab.metrics.report import plot_loss, plot_routing
    from dtlab.metrics.sinks import json_safe

    summary["run_dir"] = str(run_dir)
    if plot and curve:
        try:
            summary["loss_plot"] = str(plot_loss(curve, run_dir / "loss.png", title))
        except OSError as e:
            logger.error("loss.png could not be written: %s", e.strerror or e)
    if plot and any(m.get("moe_load") for m in curve):
        try:
            summary["routing_plot"] = str(plot_routing(curve, run_dir / "routing.png", title))
        except OSError as e:
            logger.error("routing.png could not be written: %s", e.strerror or e)
    path = run_dir / SUMMARY
    tmp = path.with_name(".summary.json.tmp")
    try:
        tmp.write_text(json.dumps(json_safe(summary), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(
            f"training finished (step {summary.get('steps')}), but {path} could not be written: "
            f"{e.strerror or e}"
        ) from None


def check_final_checkpoint(run_dir: Path, config: Config, step: int) -> None:
    """A run that keeps its final weights (``checkpoint.final``, or an ``every`` that falls on the
    last step) must end with that checkpoint committed (what generate, export and a restart use);
    otherwise an OutputError naming the newest one it has."""
    c = config.checkpoint
    if step != config.train.steps or not (c.final or (c.every and step % c.every == 0)):
        return
    committed = Tier(run_dir / "checkpoints", "local").committed()
    if step not in committed:
        newest = f"step {committed[-1]}" if committed else "none"
        raise OutputError(
            f"training finished at step {step}, but its final checkpoint could not be saved (see "
            f"the errors above); the newest committed checkpoint is {newest}"
        )
