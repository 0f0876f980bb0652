"""A pipeline schedule's own bubble: its order of work played out with given action times.

A pipeline schedule gives each rank its computations in order: ``F`` (forward of a stage on a
micro-batch), ``B`` (its full backward), ``I`` and ``W`` (the backward split into input gradients
and weight gradients, as the zero-bubble schedules do). :func:`simulate_schedule` plays that order
out: each rank takes its actions in turn, an action starts when the rank is free and its inputs exist
(a forward needs the previous stage's forward of the micro-batch, a backward the next stage's
backward of it, a weight gradient its own input gradient), and communication costs nothing. Each
rank's idle share of the span is the bubble the schedule itself promises. With equal forward,
input-gradient and weight-gradient times (``F = I = W = 1``, ``B = 2``, the zero-bubble paper's
assumption) it is (p - 1) / (m + p - 1) for GPipe and 1F1B, and the published figures for the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

UNIT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    """One computation of a schedule: ``kind`` (F, B, I or W) of stage ``stage`` on micro-batch
    ``microbatch``."""

    stage: int
    kind: str
    microbatch: int


def simulate_schedule(
    order: Mapping[int, Sequence[Action]],
    n_stages: int,
    costs: Mapping[str, float] = UNIT_COSTS,
) -> list[float]:
    """Each rank's idle fraction of the schedule's span when ``order`` (rank -> its actions in order)
    runs with action times ``costs`` (by kind) and free communication.

    Raises ValueError when the table cannot run (an action waits on one that never comes before it).
    """
    # When each (what, stage, micro-batch) became available: "fwd" its forward output, "grad" the
    # gradient of its input (from a full backward or an input-gradient step).
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                a = actions[position[rank]]
                ready = _ready(a, n_stages, done)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + costs[a.kind]
                free[rank] = end
                busy[rank] += costs[a.kind]
                if a.kind == "F":
                    done["fwd", a.stage, a.microbatch] = end
                if a.kind in ("B", "I"):
                    done["grad", a.stage, a.microbatch] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(order[r][position[r]]) for r in order if position[r] < len(order[r])}
            raise ValueError(f"the schedule cannot proceed: each rank waits at {stuck}")
    span = max(free.values())
    return [1 - busy[r] / span for r in sorted(order)]


def _ready(a: Action, n_stages: int, done: Mapping[tuple[str, int, int], float]) -> float | None:
    """When ``a``'s inputs exist, or None while one of them does not yet."""
    if a.kind == "F":
        needs = [("fwd", a.stage - 1, a.microbatch)] if a.stage > 0 else []
    elif a.kind in ("B", "I"):
        needs = [("fwd", a.stage, a.microbatch)]
        if a.stage < n_stages - 1:
            needs.append(("grad", a.stage + 1, a.microbatch))
    else:  # W: its own input gradient
        needs = [("grad", a.stage, a.microbatch)]
    times = [done.get(k) for k in needs]
    if any(t is None for t in times):
        return None
    return max([0.0, *(t for t in times if t is not None)])
