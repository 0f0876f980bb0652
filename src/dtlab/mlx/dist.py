"""The MLX engine's distributed plumbing: the group, a watchdog for collectives that never return,
and choices rank 0 makes for every rank (the checkpoint coordinator)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from dtlab.config import Config
from dtlab.errors import CollectiveError, DtlabError
from dtlab.parallel.ledger import LEDGER_ENV, FileChannel, Ledger
from dtlab.runtime.faults import Faults
from dtlab.runtime.status import STATUS_ENV, record_exit

__all__ = ["MlxGroup", "Watchdog", "from_rank0", "init_group", "scalar"]


def init_group(config: Config) -> Any:
    """The global group: the one ``mlx.launch`` set up (ring or MPI), or a group of one."""
    if config.train.device == "cpu":
        mx.set_default_device(mx.cpu)
    backend = rank_backend(config.parallel.backend, os.environ)
    if backend is None:
        return mx.distributed.init(strict=False, backend="ring")
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise DtlabError(
            f"could not join the MLX process group (parallel.backend = {config.parallel.backend!r}): {e}"
        ) from None


def rank_backend(backend: str, environ: Mapping[str, str]) -> str | None:
    """The backend this process joins its group with: None when no launcher started it (a group of
    one); for ``auto``, the launcher's: mpirun's ranks see their MPI rank, ``mlx.launch``'s JACCL
    ranks their RDMA devices (``MLX_IBV_DEVICES``), its ring ranks only ``MLX_RANK``."""
    if "MLX_RANK" not in environ and "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    if backend != "auto":
        return backend
    if "OMPI_COMM_WORLD_RANK" in environ:
        return "mpi"
    return "jaccl" if "MLX_IBV_DEVICES" in environ else "ring"


class Watchdog:
    """Turns a collective that never returns into an error that names the rank, and an exit.

    A rank whose peer died (or a ring ``all_sum`` that deadlocked) blocks inside MLX, where no Python
    signal handler runs; a daemon thread watches the deadline and ends the process. With a ledger,
    every collective is recorded, and the message says which rank is behind or how the ranks differ.
    """

    def __init__(self, rank: int, timeout_s: float, ledger: Ledger | None = None) -> None:
        self.rank, self.timeout_s, self.ledger = rank, timeout_s, ledger
        self._step = 0
        self._deadline: float | None = None
        self._what = ""
        self._cv = threading.Condition()
        threading.Thread(target=self._watch, name="dtlab-watchdog", daemon=True).start()

    @property
    def step(self) -> int:
        """The optimizer step under way, for the message and the ledger."""
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        if self.ledger is not None:
            self.ledger.step = step

    def _explain(self, cause: str, fallback: str) -> str:
        """``cause``, and what the ranks' ledgers say about it (or ``fallback`` without a ledger)."""
        if self.ledger is None:
            return f"{cause}: {fallback}"
        return self.ledger.report(cause)

    def _watch(self) -> None:
        with self._cv:
            while True:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                message = self._explain(
                    f"{self._what} of step {self.step} did not finish within {self.timeout_s:g} s "
                    "(parallel.collective_timeout_s)",
                    "another rank died or the collective hung",
                )
                print(
                    f"[rank{self.rank}] error: {message}; stopping this rank",
                    file=sys.stderr,
                    flush=True,
                )
                record_exit(1)
                os._exit(1)

    def run(self, what: str, fn: Callable[[], Any], op: str = "", *arrays: mx.array) -> Any:
        """``fn()`` (which waits on a collective), ended by the watchdog if it takes too long.

        ``op`` and ``arrays`` (what the collective sends) are for the ledger.
        """
        entry = self.ledger.begin(what.removeprefix("the "), op, arrays) if self.ledger else None
        with self._cv:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
            self._cv.notify()
        try:
            result = fn()
        except RuntimeError as e:  # e.g. "[ring] connection to a peer was lost"
            failed: RuntimeError | None = e
        else:
            failed = None
        finally:
            with self._cv:
                self._deadline = None
        if failed is not None:
            raise CollectiveError(
                self._explain(
                    f"{what} failed on rank {self.rank}: {failed}", "another rank died or left"
                )
            ) from None
        if self.ledger is not None and entry is not None:
            self.ledger.end(entry)
        return result


def scalar(x: mx.array) -> float:
    value = x.item()
    assert isinstance(value, (int, float))
    return float(value)


def from_rank0(
    group: Any, watchdog: Watchdog, what: str, decide: Callable[[], str | None]
) -> str | None:
    """``decide()`` on rank 0 only; every rank gets its result (text or None) or its DtlabError.

    For choices made once and agreed on (the run directory, the checkpoint to resume from), like the
    torch engine's ``decide_on_rank0``: the text travels in one all_sum, zeros from the other ranks.
    """
    result: str | None = None
    error: DtlabError | None = None
    if group.rank() == 0:
        try:
            result = decide()
        except DtlabError as e:
            error = e
    if group.size() > 1:
        limit = 8192
        code = np.zeros(limit + 1, dtype=np.int32)
        if group.rank() == 0:
            payload = (f"E{error}" if error else "N" if result is None else f"T{result}").encode()
            data = np.frombuffer(payload[:limit], dtype=np.uint8)
            code[0], code[1 : 1 + len(data)] = len(data), data
        total = mx.distributed.all_sum(mx.array(code), group=group)
        watchdog.run(what, lambda: mx.eval(total))
        got = np.array(total)
        text = bytes(got[1 : 1 + int(got[0])].astype(np.uint8)).decode()
        kind, body = text[:1], text[1:]
        error = DtlabError(body) if kind == "E" else None
        result = body if kind == "T" else None
    if error is not None:
        raise error
    return result


class MlxGroup:
    """The MLX group as a checkpoint :class:`~dtlab.checkpoint.manager.Coordinator`: its ranks, and
    choices made on rank 0 and shared with one all_sum (:func:`from_rank0`)."""

    def __init__(self, group: Any, watchdog: Watchdog) -> None:
        self.group, self.watchdog = group, watchdog
        self.rank, self.world_size = group.rank(), group.size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def decide(self, fn: Callable[[], str | None]) -> str | None:
        return from_rank0(self.group, self.watchdog, "rank 0's decision", fn)


def start_ledger(
    rank: int, world: int, run_dir: Path, faults: Faults, timeout_s: float
) -> Ledger | None:
    """This rank's ledger of collectives (several ranks; ``DTLAB_LEDGER=0`` turns it off). The ranks
    publish their newest entries as files: in the launcher's status directory (new for each launch)
    or, when mlx.launch started the ranks directly, in the run directory."""
    if world == 1 or os.environ.get(LEDGER_ENV, "1").lower() in ("0", "off", "false", "no"):
        return None
    status = os.environ.get(STATUS_ENV)
    live = Path(status) if status else run_dir / "ledger" / "live"
    return Ledger(rank, world, FileChannel(live, rank), run_dir / "ledger", faults=faults,
                  timeout_s=timeout_s)  # fmt: skip
