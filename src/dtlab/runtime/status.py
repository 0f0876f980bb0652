"""Status files a rank leaves for the launcher that started it (dtlab's MLX launcher).

``mlx.launch`` does not report the ranks' exit codes, so each rank writes its own (and its pid, so that
signals can reach it) into the status directory the launcher names in ``DTLAB_MLX_STATUS_DIR``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

STATUS_ENV = "DTLAB_MLX_STATUS_DIR"

# True in a process that ends with :func:`leave_worker` (``python -m dtlab`` sets it): one whose
# finished process groups may be kept to the end (see ``parallel.dist.destroy_distributed``).
ENDS_WITHOUT_TEARDOWN = False
WORKER_ENVS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def is_worker_env() -> bool:
    """True when a launcher (torchrun, dtlab's elastic launcher) started this process as a torch worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def leave_worker(code: int) -> NoReturn:
    """End a torch worker that finished (its process group destroyed, its files closed) without the
    interpreter's teardown: destroying torch's C++ objects there (gloo's threads, pending pipeline
    receives) can abort the process ("terminate called without an active exception", SIGABRT) after a
    run that succeeded, and the launcher would report a failure that did not happen."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_mlx_worker() -> bool:
    """True in a process that ``mlx.launch`` (ring) or ``mpirun`` started as one rank."""
    return any(k in os.environ for k in WORKER_ENVS)


def worker_rank() -> int:
    """This rank's number as ``mlx.launch`` or ``mpirun`` gave it (0 outside them)."""
    for k in WORKER_ENVS:
        if k in os.environ:
            return int(os.environ[k])
    return 0


def record_exit(code: int) -> None:
    """In a rank started by dtlab's MLX launcher: leave this rank's exit code for the launcher."""
    status = os.environ.get(STATUS_ENV)
    if status and is_mlx_worker():
        Path(status, f"rank{worker_rank()}.exit").write_text(str(code), encoding="utf-8")


def record_pid() -> None:
    """In a rank started by dtlab's MLX launcher: leave this rank's pid, so signals can reach it."""
    status = os.environ.get(STATUS_ENV)
    if status and is_mlx_worker():
        Path(status, f"rank{worker_rank()}.pid").write_text(str(os.getpid()), encoding="utf-8")
