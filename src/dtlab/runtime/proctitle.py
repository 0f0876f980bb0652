"""Process titles that ``ps`` and ``top`` show, without a dependency (Linux only; elsewhere nothing).

Two names, as the kernel keeps them:

- the command name (``ps -o comm``, ``ps``'s and ``top``'s default column, ``pgrep``): at most 15
  bytes, set with ``prctl(PR_SET_NAME)``;
- the command line (``ps -o args``, ``ps aux``, ``/proc/PID/cmdline``): rewritten in place, in the
  memory that held the process's arguments, only in a fork server's child, and only as long as
  they were. A fork server's child (:mod:`dtlab.runtime.forkserver`) shows the server's command line
  (``python .../forkserver.py SOCKET``), which says nothing of it; a fresh process keeps its own,
  which tools read (``run.dir=...``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

PR_SET_NAME = 15  # linux/prctl.h
COMM_BYTES = 15  # the kernel's TASK_COMM_LEN (16) less the terminating NUL


def set_process_title(title: str, comm: str, argv: bool = True) -> bool:
    """Name this process ``comm`` (cut to 15 bytes) and, with ``argv`` where it is a fork server's
    child, show ``title`` as its command line (cut to the length of the server's); returns whether
    the name was set."""
    from dtlab.runtime import forkserver

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        name = comm.encode()[:COMM_BYTES]
        if libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) != 0:
            return False
    except OSError:
        return False
    if argv and forkserver.forked():
        _rewrite_argv(title)
    return True


def _rewrite_argv(title: str) -> None:
    """Write ``title`` over this process's arguments, where the kernel reads its command line
    (``arg_start`` .. ``arg_end`` of ``/proc/self/stat``), and NULs after it: the last byte stays a
    NUL, so the kernel reads that area alone (not the environment beyond it)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
    except (OSError, ValueError, IndexError):
        return
    size = end - start
    if start <= 0 or size < 2:
        return
    text = title.encode()[: size - 1]
    ctypes.memmove(start, text + b"\0" * (size - len(text)), size)


def name_process(what: str, short: str) -> bool:
    """Name this training process as ``ps`` shows it: ``dtlab <short>`` (``short`` alone past 15
    bytes) as its name, ``dtlab train: <what>`` as a fork server's child's command line; e.g.
    ``replica 1 rank 0`` and ``r1 rank0``."""
    comm = f"dtlab {short}"
    return set_process_title(f"dtlab train: {what}", comm if len(comm) <= COMM_BYTES else short)
