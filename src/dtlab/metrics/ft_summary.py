"""One end summary for a fault-tolerant run of several replica groups, said by the run's process.

Each group writes its own summary (``replica-<i>/summary.json``) and its events
(``replica-<i>/ft_events.jsonl``: each process start, each quorum, each recovery from a live peer);
the run's process (:func:`dtlab.fault_tolerance.launch_replicas`) reads them once every group has
ended and says the run's figures once, where each group would have said its own (one of them
"resumed from" the checkpoint it started again from, though it recovered a later step from a peer):

- faults: the processes that died and were started again by their group's agent;
- recoveries: from a live peer (the group took the state of a later step from another group), or
  from the group's own checkpoint alone (no peer's state followed its restart);
- steps lost: the steps taken again (a step that did not commit) and the samples not trained (a
  group's slice missing from a step), as the group that saw the most of them counted;
- goodput: the samples trained by committed steps per second of the run's wall time, start-up and
  recoveries included.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

# Set by the run's process for its groups' workers: the run says the end summary, not each group.
RUN_SUMMARY_ENV = "DTLAB_FT_RUN_SUMMARY"


def _events(group_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (group_dir / "ft_events.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return out


def _group_summary(group_dir: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((group_dir / "summary.json").read_text()))
    except (OSError, ValueError):
        return None


def _recoveries(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]], int]:
    """(restarts, recoveries from a peer, restarts that took no peer's state) of one group: a
    restarted process that took no peer's state before the next start (or the end) went on from
    its own checkpoint."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    peers = [e for e in events if e["event"] == "recovered"]
    bounds = [*starts[1:], len(events)]  # each restarted process's events
    alone = sum(
        not any(e["event"] == "recovered" for e in events[a:b])
        for a, b in itertools.pairwise(bounds)
    )
    return max(0, len(starts) - 1), peers, alone


def run_summary(
    run_dir: Path, codes: dict[int, int], wall_s: float, dirs: list[Path]
) -> dict[str, Any]:
    """The run's figures from its groups' outputs (``dirs``, by group), their exit ``codes`` and
    the run's ``wall_s``: the finished group's summary (``group``), and the fault tolerance's."""
    finished = sorted(i for i, c in codes.items() if c == 0)
    summaries = {i: _group_summary(d) for i, d in enumerate(dirs)}
    main = next((summaries[i] for i in finished if summaries[i] is not None), None)
    faults, peers, from_ckpt = [], [], 0
    for i, d in enumerate(dirs):
        restarts, recovered, alone = _recoveries(_events(d))
        faults += [i] * restarts
        keep = ("after_step", "to_step", "seconds")
        peers += [{"replica": i, **{k: e.get(k) for k in keep}} for e in recovered]
        from_ckpt += alone
    ft = [s["fault_tolerance"] for s in summaries.values() if s and "fault_tolerance" in s]
    samples_lost = max((f.get("samples_lost", 0) for f in ft), default=0)
    useful = None
    if main is not None:
        useful = main["steps"] * main["global_batch_size"] - samples_lost
    return {
        "group": main,
        "replicas": len(dirs),
        "finished": finished,
        "exit_codes": {str(i): c for i, c in codes.items()},
        "faults": len(faults),
        "faults_by_group": {str(i): faults.count(i) for i in range(len(dirs))},
        "recoveries_from_peers": peers,
        "recoveries_from_checkpoints": from_ckpt,
        "steps_taken_again": max((f.get("steps_taken_again", 0) for f in ft), default=0),
        "samples_lost": samples_lost,
        "wall_s": wall_s,
        "goodput_samples_per_s": None if useful is None or wall_s <= 0 else useful / wall_s,
        "run_dir": str(run_dir),
    }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def run_summary_rows(s: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The fault tolerance's rows of the run's end summary (:func:`run_summary`)."""
    codes = s["exit_codes"]
    groups = f"{s['replicas']}, {len(s['finished'])} finished the run"
    if len(s["finished"]) < s["replicas"]:
        groups += " (" + ", ".join(
            f"replica {i}: exit code {c}" for i, c in codes.items() if c != 0
        ) + ")"  # fmt: skip
    by_group = [
        f"replica {i}: {_plural(n, 'restart')}" for i, n in s["faults_by_group"].items() if n
    ]
    faults = f"{s['faults']} ({', '.join(by_group)})" if by_group else "none"
    peers = s["recoveries_from_peers"]
    said = [
        f"replica {r['replica']}: step {r['after_step']} -> {r['to_step']}"
        + (f" in {r['seconds']:.1f} s" if r.get("seconds") is not None else "")
        for r in peers
    ]
    recoveries = f"{len(peers)} from a live peer" + (f" ({', '.join(said)})" if said else "")
    recoveries += f", {s['recoveries_from_checkpoints']} from a checkpoint alone"
    lost = (
        f"{_plural(s['steps_taken_again'], 'step')} taken again, "
        f"{s['samples_lost']} samples not trained (a group missing from a step)"
    )
    rows = [("replica groups", groups), ("faults", faults), ("recoveries", recoveries)]
    rows.append(("steps lost", lost))
    if s["goodput_samples_per_s"] is not None:
        rows.append((
            "goodput",
            f"{s['goodput_samples_per_s']:,.1f} samples/s over {s['wall_s']:.1f} s of wall time "
            "(committed steps' samples; start-up and recoveries included)",
        ))  # fmt: skip
    return tuple(rows)


def run_summary_table(s: dict[str, Any]) -> str:
    """The run's end summary: the finished group's training figures (its layout, loss, speed),
    then the fault tolerance's, then the run directory (each group's in ``replica-<i>``)."""
    from dtlab.metrics.report import summary_table

    group = {k: v for k, v in (s["group"] or {}).items() if k not in ("resumed_from", "run_dir")}
    run_dir = f"{s['run_dir']} (each group's in replica-<i>)"
    if not group:
        rows = [*run_summary_rows(s), ("run dir", run_dir)]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
    return summary_table({**group, "run_dir": run_dir}, extra=run_summary_rows(s))
