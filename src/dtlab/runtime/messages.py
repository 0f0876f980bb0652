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
from pathlib import Path
from typing import Any

__all__ = ["MESSAGES_ENV", "leave_message", "take_messages"]

MESSAGES_ENV = "DTLAB_MESSAGES_DIR"


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
