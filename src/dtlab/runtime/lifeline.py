"""A process dtlab starts dies with the process that started it, even when that one is killed -9.

``dtlab train`` is an elastic agent that starts the ranks (or, with fault tolerance, one agent per
replica group, each starting its ranks). A ``kill -9`` of it runs none of its cleanup: its children
would train on as orphans, on a GPU node holding the GPUs. So the starter names itself in the
environment of what it starts (:func:`started_here`), and each child, first thing, asks the kernel
for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux) and checks that the parent it was
started by is still the one it has (:func:`die_with_parent`): if it already died, the child ends
there. The name is taken out of the child's environment, so that what the child starts in turn
(with a parent of its own) is not bound to its grandparent.

A fork server's child (``dtlab.runtime.forkserver``) is bound to its shim instead, which is the
starter's child; the shim (``forkshim.py``, standard library only) does the same as here itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# The pid of the process that started this one, set by that process for its children.
PARENT_ENV = "DTLAB_PARENT_PID"
# prctl(2): deliver a signal to this process when its parent thread ends.
_PR_SET_PDEATHSIG = 1

__all__ = ["PARENT_ENV", "die_with_parent", "started_here"]


def started_here(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment when None), changed in place, naming this process as
    the parent of what it starts with it: those processes die with this one
    (:func:`die_with_parent`). Call from the thread that starts them (the kernel ties the signal
    to the parent thread): dtlab starts its ranks and agents from the main thread."""
    target = os.environ if env is None else env
    target[PARENT_ENV] = str(os.getpid())
    return target  # type: ignore[return-value]


def die_with_parent() -> None:
    """If this process was started by a dtlab process that named itself (:func:`started_here`): be
    killed when it dies, and end now if it already has. A no-op elsewhere (no name, not Linux, a
    fork server's child: bound to its shim)."""
    raw = os.environ.pop(PARENT_ENV, None)
    if raw is None or not sys.platform.startswith("linux") or not raw.isdigit():
        return
    from dtlab.runtime.forkserver import forked

    if forked():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): nothing else to do
    if os.getppid() != int(raw):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)
