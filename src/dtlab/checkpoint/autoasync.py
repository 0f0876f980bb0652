"""``checkpoint.async: auto``: measure what each kind of save costs training, then keep the cheaper.

What a save costs training is the time the training thread waited for it (the call, and for an async
save the wait for it when the next save or the end of the run comes) plus how much longer the steps it
overlapped took than a usual step (the median of the steps that overlapped no save, the run's first
step left out: it carries the warm-up). A sync save overlaps no step; an async one overlaps the steps
that began before its background write ended.

The first save of a run is synchronous and the next two asynchronous: the first of those allocates the
staging buffers the later ones reuse, a one-off, so the second is the one judged. At the fourth save the
two costs are compared and the cheaper kind is kept for the rest of the run (a tie goes to sync, which
holds no staging buffers); the log says which, and the figures it was decided on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = ["TRIAL", "AutoAsync", "Choice", "SaveCost", "choose"]

TRIAL = (False, True, True)  # whether each of the first saves is async
JUDGED = (0, 2)  # the saves compared: the sync one, and the async one after the one that allocated


@dataclass
class SaveCost:
    """One save of the trial, and what it cost training."""

    step: int
    use_async: bool
    blocked_s: float = 0.0  # the training thread waited for it
    overlapped_s: list[float] = field(default_factory=list)  # the steps it overlapped: their times
    finished_at: float | None = None  # time.perf_counter() when its background write ended


@dataclass(frozen=True)
class Choice:
    """The decision of ``checkpoint.async: auto`` and the figures it was made on."""

    use_async: bool
    sync_s: float  # training time the sync save cost
    async_s: float  # training time the judged async save cost: blocked + slowed
    async_blocked_s: float
    async_slowed_s: float  # its overlapped steps' time beyond as many usual steps
    overlapped: int  # steps it overlapped
    usual_step_s: float | None  # None: no step without a save to compare with
    sync_step: int = 0
    async_step: int = 0

    def message(self) -> str:
        """The log line: the choice, then the figures."""
        kind = "async" if self.use_async else "sync"
        if self.usual_step_s is None:
            return (
                f"checkpoint.async auto: {kind} saves from here on (no step ran without a save "
                "in flight to judge the async save by)"
            )
        return (
            f"checkpoint.async auto: {kind} saves from here on; training time a save cost: "
            f"sync {self.sync_s:.3f} s (step {self.sync_step}), async {self.async_s:.3f} s "
            f"(step {self.async_step}: blocked {self.async_blocked_s:.3f} s + steps slower by "
            f"{self.async_slowed_s:.3f} s, {self.overlapped} overlapped; a usual step "
            f"{self.usual_step_s:.3f} s)"
        )


def choose(
    sync_s: float,
    async_blocked_s: float,
    async_steps_s: Sequence[float],
    usual_step_s: float | None,
) -> Choice:
    """Whether to keep async saves, from what a sync save cost training (``sync_s``) and what an async
    one did: ``async_blocked_s`` waited for, and the steps it overlapped (``async_steps_s``) against a
    usual step. Async only when it cost less; without a usual step to compare with, sync."""
    if usual_step_s is None:
        return Choice(False, sync_s, float("nan"), async_blocked_s, float("nan"), 0, None)
    slowed = sum(async_steps_s) - len(async_steps_s) * usual_step_s
    async_s = async_blocked_s + slowed
    return Choice(
        async_s < sync_s, sync_s, async_s, async_blocked_s, slowed, len(async_steps_s), usual_step_s
    )


class AutoAsync:
    """The trial of ``checkpoint.async: auto`` on one rank: which kind each save is, and the figures
    (saves, steps) the choice is made on. Times come from the caller, so the bookkeeping needs no
    clock of its own."""

    def __init__(self) -> None:
        self.saves: list[SaveCost] = []
        self.usual: list[float] = []  # times of the steps that overlapped no save
        self.choice: Choice | None = None
        self._steps = 0

    def next_is_async(self) -> bool | None:
        """Whether the next save is async; None when the trial is over and :meth:`decide` is due."""
        if self.choice is not None:
            return self.choice.use_async
        if len(self.saves) < len(TRIAL):
            return TRIAL[len(self.saves)]
        return None

    def decide(self) -> Choice:
        """The choice by this rank's figures (the caller makes it everyone's and records it)."""
        sync, judged = (self.saves[i] for i in JUDGED)
        usual = statistics.median(self.usual) if self.usual else None
        c = choose(sync.blocked_s, judged.blocked_s, judged.overlapped_s, usual)
        return replace(c, sync_step=sync.step, async_step=judged.step)

    def saved(self, step: int, use_async: bool, blocked_s: float) -> None:
        """A save of the trial returned to the training thread after ``blocked_s``."""
        if self.choice is None:
            self.saves.append(SaveCost(step, use_async, blocked_s))

    def waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for the last save's background write."""
        if self.choice is None and self.saves and self.saves[-1].use_async:
            self.saves[-1].blocked_s += seconds

    def finished(self, when: float) -> None:
        """The last save's background write ended at ``when`` (from its own thread)."""
        if self.saves:
            self.saves[-1].finished_at = when

    def step_done(self, seconds: float, end: float) -> None:
        """A training step took ``seconds`` and ended at ``end``: it overlapped the last save if that
        is async and had not finished when the step began."""
        self._steps += 1
        if self.choice is not None:
            return
        last = self.saves[-1] if self.saves else None
        running = last is not None and (
            last.finished_at is None or last.finished_at > end - seconds
        )
        if last is not None and last.use_async and running:
            last.overlapped_s.append(seconds)
        elif self._steps > 1:
            self.usual.append(seconds)
