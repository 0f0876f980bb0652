"""Which of the search's rows ``dtlab plan`` recommends, and the words that say why.

The rule, each step deciding only among the rows the one before could not tell apart:

1. **Step time**, as the plan predicts it: the fastest row that fits, and the rows within the tie
   margin of it (10%: closer than the estimate can tell apart). Only these can be recommended.
2. **Memory margin**: how far the predicted peak stays under the fit limit. A row that leaves less
   than ``MEMORY_MARGIN`` of the limit free is tight (a peak that much above its estimate would not
   fit), and a tie prefers the rows that are not. Beyond that, more headroom does not decide: the fit
   rule already keeps its own margin, and preferring ever more headroom prefers the most sharding,
   recompute and parallel dimensions whatever they cost (an 8B model on 16 H100s went to a 3-D
   pipeline that way, docs/choosing.md).
3. **Exposed communication**: what of its communication the step waits for, not what hides behind
   compute; the least, and what is within the tie margin of the fastest step of it, are alike. A
   step that waits for the links pays for every shortfall of their assumed rates. So does one whose
   hidden communication takes nearly all the compute that hides it (more than 1 - the tie margin of
   it: network-bound on paper, hidden only by a perfect overlap at the assumed rates): all of its
   communication counts as exposed here.
4. **Simplicity** (:func:`simplicity`): the fewest parallel dimensions beside data parallelism, then
   the plainest data parallelism.
5. The step time again: the fastest of what is left.

So the fastest row is recommended unless it is tight on memory and a tied row is not, or a tied row
as tight or not waits for clearly less communication, or (all of that alike) is simpler; the
recommendation says which. Memory margins are "alike" when both are tight or neither is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlab.analysis.plan_format import format_bytes, format_seconds
from dtlab.config import Config
from dtlab.dims import DPWrapper, needs_replica_groups


@dataclass
class Found:
    """One costed candidate: the open keys' values, its config and its plan row."""

    values: dict[str, Any]
    config: Config
    row: Any  # PlanRow
    label: str

    @property
    def step_time_s(self) -> float:
        return float(self.row.step_time_s)


# A row whose predicted peak leaves less than this share of the fit limit free is tight (on an 80 GiB
# GPU under the 80% fit rule, 6.4 GiB): the same share as the step time's tie margin.
MEMORY_MARGIN = 0.10
CRITERIA = ("memory margin", "exposed communication", "simplicity", "step time")


@dataclass
class Choice:
    """The recommended row of the tied ones, and what decided it against the row it is compared with:
    the fastest, or (when it is the fastest) the runner-up of the tie."""

    pick: Found
    fastest: Found
    tied: list[Found]  # every row within the tie margin of the fastest, fastest first
    usable: float  # bytes: the fit limit
    margin: float  # the tie margin
    other: Found | None  # the fastest, or the runner-up; None when nothing else is tied
    decided_by: str | None  # one of CRITERIA: the step that set ``other`` aside
    dropped: dict[int, str]  # id of each tied row but the pick -> the step that set it aside


def memory_margin(found: Found, usable: float) -> float:
    """Bytes between the row's predicted peak and the fit limit."""
    return usable - float(found.row.step.total_bytes)


def tight(found: Found, usable: float) -> bool:
    """Whether the row leaves less than ``MEMORY_MARGIN`` of the fit limit free."""
    return memory_margin(found, usable) < MEMORY_MARGIN * usable


def cover(found: Found) -> float:
    """Of the compute that hides the row's hidden communication, the share that communication takes
    (0 when nothing hides)."""
    row = found.row
    waited = row.comm_s if row.exposed_s is None else row.exposed_s
    compute = row.compute_s + row.recompute_s
    return float((row.comm_s - waited) / compute) if compute > 0 else 0.0


def exposed(found: Found, margin: float) -> float:
    """Seconds of the row's communication its step waits for; all of it where what hides takes more
    than ``1 - margin`` of the compute that hides it (:func:`cover`)."""
    row = found.row
    if cover(found) > 1 - margin:
        return float(row.comm_s)
    return float(row.comm_s if row.exposed_s is None else row.exposed_s)


def choose(tied: list[Found], usable: float, margin: float) -> Choice:
    """The recommended row of ``tied`` (the rows within ``margin`` of the fastest step, fastest
    first; not empty), by the module's rule, with the step that set the compared row aside."""
    fastest = tied[0]
    dropped: dict[int, str] = {}  # id of a row -> the criterion that set it aside
    rows = list(tied)

    def keep(ok: list[Found], criterion: str) -> list[Found]:
        for f in rows:
            if all(f is not g for g in ok):
                dropped[id(f)] = criterion
        return ok

    rows = keep([f for f in rows if not tight(f, usable)] or rows, "memory margin")
    least = min(exposed(f, margin) for f in rows)
    rows = keep(
        [f for f in rows if exposed(f, margin) <= least + margin * fastest.step_time_s],
        "exposed communication",
    )
    plainest = min(simplicity(f.config) for f in rows)
    rows = keep([f for f in rows if simplicity(f.config) == plainest], "simplicity")
    pick = min(rows, key=lambda f: (f.step_time_s, f.row.step.total_bytes))
    keep([pick], "step time")
    if pick is not fastest:
        other: Found | None = fastest
    else:
        other = next((f for f in tied if f is not pick), None)
    decided = dropped[id(other)] if other is not None else None
    return Choice(pick, fastest, tied, usable, margin, other, decided, dropped)


def simplicity(config: Config) -> tuple[int, int]:
    """What a user has to understand, run and debug, least first: parallel dimensions beside data
    parallelism (each a mesh dimension, its collectives and its failure modes), then how the
    data-parallel ranks share the model (plain replicas, ZeRO-1, FSDP's shardings, HSDP)."""
    p = config.parallel
    wrapper = DPWrapper.of(p.strategy)
    if wrapper is DPWrapper.NONE:
        sharing = 0
    elif wrapper is DPWrapper.DDP:
        sharing = 2 if p.sharding == "optimizer" else 1
    else:
        sharing = 3 + ("no_shard", "shard_grad_op", "full").index(p.sharding)
        sharing += 1 if needs_replica_groups(p.strategy) else 0
    # Expert parallelism is a dimension of its own too (its all-to-alls, its experts' groups).
    return ((p.tp > 1) + (p.pp > 1) + (p.ep > 1), sharing)


def _sharing(config: Config) -> str:
    """How the data-parallel ranks share the model, in the words of :func:`simplicity`'s order."""
    p = config.parallel
    wrapper = DPWrapper.of(p.strategy)
    if wrapper is DPWrapper.NONE:
        return "no data parallelism"
    if wrapper is DPWrapper.DDP:
        return "ZeRO-1" if p.sharding == "optimizer" else "plain DDP"
    return f"{p.strategy} {p.sharding}"


def _dimensions(n: int) -> str:
    return f"{n} parallel dimension{'' if n == 1 else 's'} beside data parallelism"


def reason(choice: Choice) -> str:
    """Why ``choice.pick`` won, against the fastest (when it is not the fastest) or the runner-up:
    the criterion that decided and both rows' figures for it. Empty when nothing else was tied."""
    pick, other, usable = choice.pick, choice.other, choice.usable
    if other is None or choice.decided_by is None:
        return ""
    criterion = choice.decided_by
    rest = [f for f in choice.tied if choice.dropped.get(id(f)) != "memory margin"]
    if criterion == "memory margin":
        return (
            f"the memory margin decided: {format_bytes(memory_margin(pick, usable))} under the fit "
            f"limit against {format_bytes(memory_margin(other, usable))}, less than the "
            f"{MEMORY_MARGIN:.0%} of the limit ({format_bytes(MEMORY_MARGIN * usable)}) a tie asks for"
        )
    if criterion == "exposed communication":
        m = choice.margin
        least = min(exposed(f, m) for f in rest)
        bound = (
            f" (all of its communication: what it hides takes {cover(other):.0%} of the compute "
            f"that hides it, more than {1 - m:.0%})"
            if cover(other) > 1 - m
            else ""
        )
        return (
            f"with memory margins alike, the exposed communication decided: the step waits for "
            f"{format_seconds(exposed(pick, m))} of it against {format_seconds(exposed(other, m))}"
            f"{bound}, more than {format_seconds(m * choice.fastest.step_time_s)} ({m:.0%} of the "
            f"fastest step) over the least of those, {format_seconds(least)}"
        )
    if criterion == "simplicity":
        a, b = simplicity(pick.config), simplicity(other.config)
        if a[0] != b[0]:
            detail = f"{_dimensions(a[0])} against {b[0]}"
        else:
            detail = (
                f"{_sharing(pick.config)} against {_sharing(other.config)} (plain DDP, ZeRO-1, "
                "then FSDP no_shard, shard_grad_op, full, then HSDP)"
            )
        return "with memory margins and exposed communication alike, simplicity decided: " + detail
    alike = "memory margins, exposed communication and simplicity alike"
    if pick.step_time_s == other.step_time_s:
        return (
            f"{alike} and the same step time, the smaller predicted peak decided: "
            f"{format_bytes(pick.row.step.total_bytes)} against "
            f"{format_bytes(other.row.step.total_bytes)}"
        )
    return (
        f"{alike}, the step time decided: {format_seconds(pick.step_time_s)} against "
        f"{format_seconds(other.step_time_s)}"
    )
