"""The bytes a run sent, for its summary (``summary.json``'s ``communication``): measured where the
run counted its collectives (``run.comm_bytes``), otherwise the plan's figure for its layout,
labelled as such, or, where neither can be had, why.

- ``"measured"``: the sums of the counted step records of the whole run, rank 0's (every step of
  this start; of a resumed run's earlier starts, the records ``metrics.jsonl`` holds up to the
  step resumed from). ``per_step`` is their mean over the steps counted (``steps_counted``).
  The validation's and the checkpoint saves' collectives, counted apart from the steps', are
  summed apart (``apart``: ``evaluation``, ``checkpoint_saves``, where there were any).
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
]

# The step records' figures (run.comm_bytes), in the order the summary gives them.
FIGURES = ("comm_bytes", "wire_bytes", "cross_replica_bytes", "cross_replica_collectives")
MEASURED = "measured"
PREDICTED = "predicted (dtlab plan)"
NONE = "none"
# Counted apart from a step's own collectives, in the same records: name -> prefix of FIGURES.
_APART = {"evaluation": "eval_", "checkpoint_saves": "checkpoint_"}


def communication(
    records: Sequence[dict[str, Any]],
    steps: int,
    planned: Callable[[], dict[str, Any] | str],
    counting: bool,
    after_last_step: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary's ``communication`` section of a run of ``steps`` optimizer steps: measured from
    its step ``records`` (rank 0's, of the whole run) where they were counted, otherwise the plan's
    figures per step (``planned()``, called only then) times ``steps``, or, where ``planned()``
    gives a sentence (the plan does not model the run), that sentence. ``counting``: whether the
    run was asked to count (``run.comm_bytes``; an engine that does not count leaves no counted
    record). ``after_last_step``: what the saves after the last step's record sent (counted apart,
    like every save's)."""
    counted = [m for m in records if "comm_bytes" in m]
    if counted:
        total = {k: sum(m.get(k, 0) for m in counted) for k in FIGURES}
        out: dict[str, Any] = {
            "source": MEASURED,
            "steps": steps,
            "steps_counted": len(counted),
            "per_step": {k: v / len(counted) for k, v in total.items()},
            "total": total,
        }
        # Counted apart from the steps' (eval_*, checkpoint_*): summed apart, where there were any.
        apart = {
            name: {k: sum(m.get(f"{prefix}{k}", 0) for m in counted) for k in FIGURES}
            for name, prefix in _APART.items()
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
