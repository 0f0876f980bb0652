"""A worker's last word, said once for all the ranks that say it.

Under dtlab's launcher (``dtlab train --nproc N``) every worker meets the same config error, and rank 0
says why the run stopped just before the launcher says it too. So a worker started by the launcher
leaves its final message (an error, or the stop after a signal) in a directory the launcher gives it
(:data:`MESSAGES_ENV`) instead of printing it; the launcher prints each distinct message once, with
the ranks that said it, when the workers have exited (or before it restarts them). A worker started
by anything else (torchrun, Slurm's srun, one process) prints its own, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["MESSAGES_ENV", "leave_message", "messages_directory", "take_messages"]

MESSAGES_ENV = "DTLAB_MESSAGES_DIR"
_PREFIX = "dtlab-messages-"


def messages_directory() -> Path:
    """A new directory for this launcher's workers' messages, named with its process id; and the
    directories of launchers that are gone (killed before they could remove theirs: ``kill -9``)
    removed first (this user's), so that none builds up in the temporary directory. A worker
    whose directory is gone prints its message itself (:func:`leave_message`)."""
    base = Path(tempfile.gettempdir())
    for stale in base.glob(f"{_PREFIX}*-*"):
        pid = stale.name.removeprefix(_PREFIX).split("-", 1)[0]
        try:
            mine = stale.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base))


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def leave_message(kind: str, text: str) -> bool:
    """Leave this rank's final message (``kind`` ``error`` or ``preempted``) for the launcher; False
    when no dtlab launcher waits for it (or it cannot be written): then the caller prints it."""
    directory, rank = os.environ.get(MESSAGES_ENV), os.environ.get("RANK")
    if not directory or rank is None or not rank.isdigit():
        return False
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(
            json.dumps({"rank": int(rank), "kind": kind, "text": text}), encoding="utf-8"
        )
        os.replace(tmp, path)  # whole or not at all: the launcher may read at any time
    except OSError:
        return False
    return True


def take_messages(directory: Path) -> list[dict[str, Any]]:
    """The messages the workers left in ``directory``, by rank; each is removed once read."""
    out = []
    for path in sorted(directory.glob("rank*.json")):
        try:
            message = json.loads(path.read_text(encoding="utf-8"))
            path.unlink()
        except (OSError, ValueError):
            continue
        if isinstance(message, dict) and {"rank", "kind", "text"} <= set(message):
            out.append(message)
    return sorted(out, key=lambda m: m["rank"])
