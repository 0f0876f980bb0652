"""The bytes a run sent, for its summary (``summary.json``'s ``communication``): measured where the
run counted its collectives (``run.comm_bytes``), otherwise the plan's figure for its layout,
labelled as such, or, where neither can be had, why.

- ``"measured"``: the counted step records of the whole run summed, rank 0's: each step's record
  is added to running totals (:func:`count_step`) that the checkpoints carry (the train state),
  so a resumed run's totals hold its earlier starts' steps whatever ``run.log_every`` logged (a
  checkpoint written before the totals were kept: the records ``metrics.jsonl`` holds up to the
  step resumed from). ``per_step`` is their mean over the steps counted (``steps_counted``). The
  validation's and the checkpoint saves' collectives, counted apart from the steps', are summed
  apart (``apart``: ``evaluation``, ``checkpoint_saves``, where there were any).
- ``"predicted (dtlab plan)"``: the plan's figures per step for this layout
  (:func:`dtlab.analysis.run_comm.planned_step_comm`), times the run's steps.
- ``"none"``: neither; ``why`` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "FIGURES",
    "MEASURED",
    "NONE",
    "PREDICTED",
    "communication",
    "count_step",
    "count_steps",
]

# The step records' figures (run.comm_bytes), in the order the summary gives them.
FIGURES = ("comm_bytes", "wire_bytes", "cross_replica_bytes", "cross_replica_collectives")
MEASURED = "measured"
PREDICTED = "predicted (dtlab plan)"
NONE = "none"
# Counted apart from a step's own collectives, in the same records: name -> prefix of FIGURES.
_APART = {"evaluation": "eval_", "checkpoint_saves": "checkpoint_"}


def count_step(totals: dict[str, Any] | None, m: dict[str, Any]) -> dict[str, Any] | None:
    """``totals`` (running sums of counted step records; None: none yet) with step record ``m``
    added when it was counted (it has ``comm_bytes``): ``steps_counted``, and each of
    :data:`FIGURES` as the step's own and as counted apart (``eval_*``, ``checkpoint_*``)."""
    if "comm_bytes" not in m:
        return totals
    out = dict(totals or {})
    out["steps_counted"] = out.get("steps_counted", 0) + 1
    for prefix in ("", *_APART.values()):
        for k in FIGURES:
            out[prefix + k] = out.get(prefix + k, 0) + m.get(prefix + k, 0)
    return out


def count_steps(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The running sums (:func:`count_step`) of step ``records``; None when none was counted."""
    totals: dict[str, Any] | None = None
    for m in records:
        totals = count_step(totals, m)
    return totals


def communication(
    totals: dict[str, Any] | None,
    steps: int,
    planned: Callable[[], dict[str, Any] | str],
    counting: bool,
    after_last_step: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary's ``communication`` section of a run of ``steps`` optimizer steps: measured from
    ``totals`` (:func:`count_step`'s sums of its counted step records, rank 0's, of the whole run)
    where steps were counted, otherwise the plan's figures per step (``planned()``, called only
    then) times ``steps``, or, where ``planned()`` gives a sentence (the plan does not model the
    run), that sentence. ``counting``: whether the run was asked to count (``run.comm_bytes``; an
    engine that does not count leaves no counted record). ``after_last_step``: what the saves after
    the last step's record sent (counted apart, like every save's)."""
    counted = int((totals or {}).get("steps_counted", 0))
    if totals and counted:
        total = {k: totals.get(k, 0) for k in FIGURES}
        out: dict[str, Any] = {
            "source": MEASURED,
            "steps": steps,
            "steps_counted": counted,
            "per_step": {k: v / counted for k, v in total.items()},
            "total": total,
        }
        # Counted apart from the steps' (eval_*, checkpoint_*): summed apart, where there were any.
        apart = {
            name: {k: totals.get(prefix + k, 0) for k in FIGURES} for name, prefix in _APART.items()
        }
        for k, v in (after_last_step or {}).items():
            if k in apart["checkpoint_saves"]:
                apart["checkpoint_saves"][k] += v
        apart = {name: figures for name, figures in apart.items() if any(figures.values())}
        if apart:
            out["apart"] = apart
        return out
    plan = planned()
    if isinstance(plan, str):
        why = "this engine does not count its collectives" if counting else "run.comm_bytes is off"
        return {
            "source": NONE,
            "steps": steps,
            "why": f"not counted ({why}); not predicted: {plan}",
        }
    per_step = {k: plan.get(k) for k in FIGURES}
    return {
        "source": PREDICTED,
        "steps": steps,
        "per_step": per_step,
        "total": {k: None if v is None else v * steps for k, v in per_step.items()},
    }
