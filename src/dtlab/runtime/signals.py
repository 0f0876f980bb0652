"""Stop signals: SIGTERM or SIGUSR1 (what Slurm and Kubernetes send before they stop a job) and Ctrl-C.

A signal only sets a flag. At the next step boundary the ranks agree on it inside the step's one small
reduction (:func:`stop_votes` is what a rank adds to it, :func:`agreed_stop` reads the sum), and all of
them save a checkpoint and exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from dtlab.errors import CollectiveError
from dtlab.runtime.status import worker_rank

__all__ = ["STOP_SIGNALS", "StopSignals", "agreed_stop", "stop_votes"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def stop_votes(received: int) -> list[float]:
    """This rank's vote, one slot per stop signal (1.0 where it caught that signal): summed over the
    ranks, the votes say which signals any rank caught, whatever the world size."""
    return [1.0 if received == s else 0.0 for s in STOP_SIGNALS]


def agreed_stop(votes: Sequence[float], world_size: int) -> str | None:
    """The stop signal the ranks agree on from their summed ``votes`` (the first caught, in the order
    of :data:`STOP_SIGNALS`), as a name; None when no rank caught one."""
    for count in votes:
        if count != int(count) or not 0 <= count <= world_size:
            # Another rank's collective of the same size met this one (gloo matches bytes, not
            # meanings): the ranks' collectives are out of step.
            raise CollectiveError(
                f"the stop signal votes summed to {list(votes)}, which {world_size} ranks cannot "
                "send: another rank issued a different collective"
            )
    for s, count in zip(STOP_SIGNALS, votes, strict=True):
        if count:
            return s.name
    return None


class StopSignals:
    """Catches SIGTERM, SIGUSR1 and SIGINT during training; ``received`` is the first one caught.

    A signal only sets a flag: at the next step boundary every rank saves a checkpoint and stops. A
    second SIGINT (Ctrl-C pressed again) stops the process at once, without saving (exit 130).
    """

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.received = 0
        self.interrupts = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                # At once: an exception raised here could land inside a write and be reported as a
                # failed save. What is half-written is never committed; the kernel drops the locks.
                print(
                    "aborted by Ctrl-C: stopped at once, without saving",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(130)
            # RANK under torch's launchers; MLX's name the rank otherwise (MLX_RANK, ...).
            if (os.environ.get("RANK") or str(worker_rank())) != "0":
                return self._set(signum)
            # Straight to the terminal: the logger may be in the middle of a line.
            print(
                "\nCtrl-C: saving a checkpoint after this step, then stopping "
                "(Ctrl-C again to stop at once without saving)",
                file=sys.stderr,
                flush=True,
            )
        self._set(signum)

    def _set(self, signum: int) -> None:
        self.received = self.received or signum

    def ignore_from_now(self) -> None:
        """After a stop whose checkpoint is committed: this process ignores the stop signals until it
        exits. A launcher that stops the remaining ranks once one has left (mlx.launch sends them
        SIGTERM) must not kill a rank that saved and is on its way out, also one that caught no signal
        itself (it learned of the stop from the others' votes). A Python handler would not protect it
        to the end: the interpreter's teardown puts the default action back before the process
        exits; SIG_IGN stays."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        self._previous.clear()

    def close(self) -> None:
        for s, handler in self._previous.items():
            # Restore only our own: a rank reporting a failed collective has set its signals aside.
            if signal.getsignal(s) == self._handle:
                # A stop is under way (saved, now exiting): a late signal must not turn it into a crash.
                signal.signal(s, signal.SIG_IGN if self.received else handler)
        self._previous.clear()
