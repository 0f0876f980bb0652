"""``checkpoint.async: auto``: measure what each kind of save costs training, then keep the cheaper.

What a save costs training is the time the training thread waited for it (the call, and for an async
save the wait for it when the next save or the end of the run comes) plus how much longer the steps it
overlapped took than a usual step (the median of the steps that overlapped no save, the run's first
step left out: it carries the warm-up). A sync save overlaps no step; an async one overlaps the steps
that began before its background write ended.

The first five saves of a run take turns: sync, async, async, sync, async. The first async save
allocates the staging buffers the later ones reuse, a one-off, so it is not judged; the two sync saves
and the two other async ones are (one save of each would be at the mercy of one noisy moment). At the
sixth save the mean costs are compared and the cheaper kind is kept for the rest of the run (a tie goes
to sync, which holds no staging buffers); the log says which, and the figures it was decided on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = ["TRIAL", "AutoAsync", "Choice", "SaveCost", "choose"]

TRIAL = (False, True, True, False, True)  # whether each of the first saves is async
JUDGED_SYNC, JUDGED_ASYNC = (0, 3), (2, 4)  # the saves compared (not the async one that allocated)


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
    sync_s: float  # training time a sync save cost (the mean of the judged ones)
    async_s: float  # training time an async save cost: blocked + slowed (mean)
    async_blocked_s: float
    async_slowed_s: float  # its overlapped steps' time beyond as many usual steps (mean)
    overlapped: int  # steps the judged async saves overlapped, in all
    usual_step_s: float | None  # None: no step without a save to compare with
    sync_steps: tuple[int, ...] = ()  # the steps of the judged saves
    async_steps: tuple[int, ...] = ()

    def message(self) -> str:
        """The log line: the choice, then the figures."""
        kind = "async" if self.use_async else "sync"
        if self.usual_step_s is None:
            return (
                f"checkpoint.async auto: {kind} saves from here on (no step ran without a save "
                "in flight to judge the async save by)"
            )
        return (
            f"checkpoint.async auto: {kind} saves from here on; training time a save cost "
            f"(mean): sync {self.sync_s:.3f} s (steps {_steps(self.sync_steps)}), async "
            f"{self.async_s:.3f} s (steps {_steps(self.async_steps)}: blocked "
            f"{self.async_blocked_s:.3f} s + steps slower by {self.async_slowed_s:.3f} s, "
            f"{self.overlapped} overlapped; a usual step {self.usual_step_s:.3f} s)"
        )


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps)


def choose(
    sync_s: Sequence[float],
    async_blocked_s: Sequence[float],
    async_steps_s: Sequence[Sequence[float]],
    usual_step_s: float | None,
) -> Choice:
    """Whether to keep async saves, from what sync saves cost training (``sync_s``, one figure per
    save) and what async ones did: what each blocked (``async_blocked_s``) and the times of the steps
    each overlapped (``async_steps_s``), against a usual step. Async only when its mean cost is less
    than sync's; without a usual step to compare with, sync."""
    sync = statistics.fmean(sync_s)
    blocked = statistics.fmean(async_blocked_s)
    overlapped = sum(len(steps) for steps in async_steps_s)
    if usual_step_s is None:
        return Choice(False, sync, math.nan, blocked, math.nan, overlapped, None)
    slowed = statistics.fmean(sum(steps) - len(steps) * usual_step_s for steps in async_steps_s)
    cost = blocked + slowed
    return Choice(cost < sync, sync, cost, blocked, slowed, overlapped, usual_step_s)


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
        syncs = [self.saves[i] for i in JUDGED_SYNC]
        asyncs = [self.saves[i] for i in JUDGED_ASYNC]
        usual = statistics.median(self.usual) if self.usual else None
        c = choose(
            [s.blocked_s for s in syncs],
            [s.blocked_s for s in asyncs],
            [s.overlapped_s for s in asyncs],
            usual,
        )
        return replace(
            c, sync_steps=tuple(s.step for s in syncs), async_steps=tuple(s.step for s in asyncs)
        )

    def started(self, step: int, use_async: bool) -> SaveCost | None:
        """A save begins: its record while the trial runs (the caller adds the time it blocked, and
        its background thread sets ``finished_at``), else None."""
        if self.choice is not None:
            return None
        self.saves.append(SaveCost(step, use_async))
        return self.saves[-1]

    def waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for the last save's background write."""
        if self.choice is None and self.saves and self.saves[-1].use_async:
            self.saves[-1].blocked_s += seconds

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
