"""DiLoCo replicas that drop out and rejoin, measured: ``python -m dtlab.bench.chaos --diloco``.

R DiLoCo replicas train as fault-tolerant replica groups (one rank each, H inner steps between outer
syncs, ``min_replicas`` 1 so that the others go on without a missing group). For each seed
(``train.seed`` 0..S-1) two real ``dtlab train --nproc R`` runs:

    clean   no fault
    churn   one group's process SIGKILLed every ``--every-rounds`` outer rounds (counted on group
            0, which is never killed), round robin over groups 1..R-1; its elastic agent restarts
            it and it rejoins at a cycle start, taking a live peer's state

The loss compared is group 0's record at each outer sync: the mean over the replicas that took part
(``"outer_sync"`` records, with ``replicas``), smoothed by a centred moving average over
``--smooth`` syncs. The seed-to-seed spread is, at each sync step, the standard deviation (n - 1)
of the clean runs' smoothed losses over the seeds; its median over the run is the spread the
spikes are read against. A spike: for one drop/rejoin event, the largest excess of the churn run's
smoothed loss over its own seed's clean run at the syncs from the last sync before the kill to
``--after-rounds`` rounds after the rejoin (the killed group's first quorum). An event passes when
its spike is at most ``--factor`` times the spread.

A fault that did not happen (no process of the group to kill, a kill before the group had rejoined
from the last one, or a run that ended before it rejoined) is reported as such and is not a pass:
the verdict is ``pass`` only when every scheduled event happened and passed.

``report.json``, ``report.md`` and ``diloco_churn.png`` land in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.bench.chaos_procs import BASE, _events, _last_step, _pids, _signal
from dtlab.cliargs import (
    int_from,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
    run_command,
)
from dtlab.errors import DtlabError

__all__ = [
    "Event",
    "event_figures",
    "kill_schedule",
    "main",
    "smooth",
    "spike",
    "spread",
    "sync_losses",
    "verdict",
]


def kill_schedule(
    replicas: int, every_rounds: int, rounds: int, events: int | None = None
) -> list[tuple[int, int]]:
    """The kills of a churn run of ``rounds`` outer rounds: (outer round after which it strikes,
    group), one every ``every_rounds`` rounds strictly before the run's last round (the first
    ``events`` of them, when given), round robin over groups 1..``replicas``-1 (group 0, whose
    rounds are counted, is never killed)."""
    if replicas < 2:
        raise ValueError(
            f"replicas = {replicas}: a churn run needs at least 2 (one is never killed)"
        )
    if every_rounds < 1:
        raise ValueError(f"every_rounds = {every_rounds}: allowed: 1 or more")
    out = []
    for k, at in enumerate(range(every_rounds, rounds, every_rounds)):
        out.append((at, 1 + k % (replicas - 1)))
    return out if events is None else out[:events]


@dataclass
class Event:
    """One scheduled drop (a SIGKILL) of a churn run, and what became of it."""

    round: int  # the outer round after which it was due
    group: int
    time: float = 0.0  # wall time of the kill (0: not done)
    step: int = 0  # group 0's last logged step at the kill
    done: bool = False  # a process of the group was killed
    note: str = ""  # why not done, when not
    rejoin_step: int | None = None  # the step of the group's first quorum after the kill
    restarted: bool = False  # a new process of the group started after the kill


# -- the runs ----------------------------------------------------------------------------------------


def train_command(args: argparse.Namespace, run_dir: Path, seed: int, python: str) -> list[str]:
    """The ``dtlab train`` command line of one run (clean and churn runs alike)."""
    overrides = [
        *BASE,
        f"data.seq_len={args.seq_len}",
        f"train.steps={args.steps}",
        f"train.seed={seed}",
        f"train.global_batch_size={args.batch * args.replicas}",
        f"train.warmup_steps={args.warmup}",
        f"parallel.diloco.inner_steps={args.inner_steps}",
        f"checkpoint.every={args.steps}",
        f"run.dir={run_dir}",
        "parallel.fault_tolerance.enabled=true",
        f"parallel.fault_tolerance.min_replicas={args.min_replicas}",
        f"parallel.fault_tolerance.timeout_s={args.timeout_s}",
        f"parallel.fault_tolerance.heartbeat_timeout_s={args.heartbeat_s}",
        f"parallel.fault_tolerance.max_restarts={args.max_restarts}",
        *args.overrides,
    ]
    return [python, "-m", "dtlab", "train", "--nproc", str(args.replicas), "--set", *overrides]


def run_one(
    name: str, args: argparse.Namespace, out: Path, seed: int, churn: bool, python: str
) -> dict[str, Any]:
    """Run ``name`` to its end (a churn run with its kills); returns its exit code, wall seconds and
    events (each scheduled kill, done or not)."""
    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    print(f"chaos --diloco: {name} ...", file=sys.stderr, flush=True)
    t0 = time.time()
    with (out / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(
            train_command(args, run_dir, seed, python), stdout=log, stderr=subprocess.STDOUT
        )
        rounds = args.steps // args.inner_steps
        schedule = (
            kill_schedule(args.replicas, args.every_rounds, rounds, args.events) if churn else []
        )
        events = [Event(r, g) for r, g in schedule]
        pending = list(events)
        while proc.poll() is None:
            if pending:
                step = _last_step(run_dir / "replica-0" / "metrics.jsonl")
                if step >= pending[0].round * args.inner_steps:
                    _kill(pending.pop(0), run_dir, events, step)
            time.sleep(0.05)
    for e in events:
        if not e.done and not e.note:
            e.note = "the run ended before it was due"
    wall = time.time() - t0
    print(f"chaos --diloco: {name}: exit {proc.returncode}, {wall:.0f} s", file=sys.stderr)
    return {"exit_code": proc.returncode, "wall_s": wall, "events": [vars(e) for e in events]}


def _kill(e: Event, run_dir: Path, events: list[Event], step: int) -> None:
    """SIGKILL group ``e.group``'s process, noting it in ``e`` (or why not)."""
    e.time, e.step = time.time(), step
    earlier = [
        x for x in events if x.group == e.group and x.done and x is not e and x.time < e.time
    ]
    if earlier and not _rejoined_since(run_dir, e.group, earlier[-1].time):
        e.note = "not done: the group had not rejoined since its last kill"
        return
    pids = _pids(run_dir, e.group)
    if not pids:
        e.note = "not done: no process of the group (already dead)"
        return
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    e.done = True


def _rejoined_since(run_dir: Path, group: int, since: float) -> bool:
    path = run_dir / f"replica-{group}" / "ft_events.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            x = json.loads(line)
        except ValueError:
            continue
        if x.get("event") == "quorum" and x["time"] > since and group in x["members"]:
            return True
    return False


def _rejoins(events: list[Event], ft_events: list[dict[str, Any]]) -> None:
    """Fill each done event's restart and rejoin (the step of the group's first quorum after the
    kill) from the groups' ft_events."""
    for e in events:
        if not e.done:
            continue
        e.restarted = any(
            x["event"] == "start" and x["replica"] == e.group and x["time"] > e.time
            for x in ft_events
        )
        back = [
            x
            for x in ft_events
            if x["event"] == "quorum"
            and x["replica"] == e.group
            and x["time"] > e.time
            and e.group in x["members"]
        ]
        if not back:
            e.rejoin_step = None
            continue
        # The restarted process offers step 0: the quorum's step is its peers' (the cycle start
        # it took their state at).
        q = back[0]["quorum"]
        e.rejoin_step = max(
            x["step"] for x in ft_events if x["event"] == "quorum" and x["quorum"] == q
        )


# -- the figures ---------------------------------------------------------------------------------------


def sync_losses(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> loss of each outer sync record (the mean over the replicas that took part)."""
    return {int(m["step"]): float(m["loss"]) for m in metrics if "outer_sync" in m}


def smooth(losses: dict[int, float], window: int) -> dict[int, float]:
    """A centred moving average over ``window`` syncs (fewer at the ends); 1 = none."""
    steps = sorted(losses)
    half = window // 2
    out = {}
    for i, s in enumerate(steps):
        part = [losses[t] for t in steps[max(0, i - half) : i + half + 1]]
        out[s] = sum(part) / len(part)
    return out


def spread(clean: list[dict[int, float]]) -> tuple[float, dict[int, float]]:
    """The seed-to-seed spread of the clean runs: the standard deviation (n - 1) over the seeds at
    each sync step they all logged, and its median over the run."""
    if len(clean) < 2:
        raise ValueError(f"{len(clean)} clean run(s): the spread needs at least 2 seeds")
    steps = sorted(set.intersection(*(set(c) for c in clean)))
    if not steps:
        raise ValueError("the clean runs have no sync step in common (did one of them fail?)")
    each = {s: statistics.stdev([c[s] for c in clean]) for s in steps}
    return statistics.median(each.values()), each


def spike(
    churn: dict[int, float], clean: dict[int, float], first: int, last: int
) -> tuple[float, int] | None:
    """The largest excess of ``churn`` over ``clean`` at the sync steps both logged from ``first``
    to ``last`` (inclusive), and its step; None without such a step."""
    excess = [(churn[s] - clean[s], s) for s in sorted(churn) if first <= s <= last and s in clean]
    return max(excess) if excess else None


def event_figures(
    e: dict[str, Any],
    churn: dict[int, float],
    clean: dict[int, float],
    h: int,
    after_rounds: int,
    sd: float | None,
    factor: float,
) -> dict[str, Any]:
    """One event's row: its drop and rejoin steps, spike, ratio to the spread and outcome (``pass``,
    ``fail``, or what kept it from happening)."""
    row: dict[str, Any] = {
        "group": e["group"],
        "round": e["round"],
        "drop_step": e["step"] if e["done"] else None,
        "rejoin_step": e.get("rejoin_step"),
        "spike": None,
        "spike_step": None,
        "spread": sd,
        "ratio": None,
    }
    if not e["done"]:
        row["outcome"] = e["note"] or "not done"
        return row
    if e.get("rejoin_step") is None:
        row["outcome"] = "not rejoined before the run ended"
        return row
    first = e["step"] // h * h  # the last sync at or before the kill
    got = spike(churn, clean, first, e["rejoin_step"] + after_rounds * h)
    if got is None:
        row["outcome"] = "no sync logged in its window"
        return row
    row["spike"], row["spike_step"] = got
    if sd is None:
        row["outcome"] = "no spread to read it against (one seed, or no clean run)"
        return row
    row["ratio"] = got[0] / sd if sd > 0 else None
    row["outcome"] = "pass" if got[0] <= factor * sd else "fail"
    return row


def verdict(rows: list[dict[str, Any]]) -> str:
    """``fail`` if any event failed; ``pass`` if every event happened and passed; else
    ``incomplete`` (some did not happen, none failed)."""
    outcomes = [r["outcome"] for r in rows]
    if "fail" in outcomes:
        return "fail"
    if outcomes and all(o == "pass" for o in outcomes):
        return "pass"
    return "incomplete"


# -- the report -------------------------------------------------------------------------------------


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "replica-0" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analyse(args: argparse.Namespace, runs: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    """The figures of every seed's clean and churn run: per event rows, per seed, the verdict."""
    curves = {name: smooth(sync_losses(_read_metrics(out / name)), args.smooth) for name in runs}
    seeds = list(range(args.seeds))
    sd: float | None = None
    each: dict[int, float] = {}
    if len(seeds) > 1:
        try:
            sd, each = spread([curves[f"clean-s{s}"] for s in seeds])
        except ValueError as e:  # no spread: every event says so, the verdict is incomplete
            print(f"chaos --diloco: {e}", file=sys.stderr)
    rows = []
    per_seed = {}
    for s in seeds:
        churn, clean = curves[f"churn-s{s}"], curves[f"clean-s{s}"]
        mine = [
            {"seed": s}
            | event_figures(e, churn, clean, args.inner_steps, args.after_rounds, sd, args.factor)
            for e in runs[f"churn-s{s}"]["events"]
        ]
        # Before the first kill the churn run is its clean twin's training: the same losses.
        first = min((e["step"] for e in runs[f"churn-s{s}"]["events"] if e["done"]), default=0)
        quiet = first - args.smooth * args.inner_steps  # before the drop, smoothing included
        before = [abs(churn[k] - clean[k]) for k in churn if k in clean and k < quiet]
        per_seed[s] = {
            "verdict": verdict(mine),
            "clean_exit": runs[f"clean-s{s}"]["exit_code"],
            "churn_exit": runs[f"churn-s{s}"]["exit_code"],
            "largest_gap_before_first_drop": max(before, default=None),
            "final_clean": clean[max(clean)] if clean else None,
            "final_churn": churn[max(churn)] if churn else None,
        }
        rows += mine
    return {
        "spread_median": sd,
        "spread_each": each,
        "rows": rows,
        "per_seed": per_seed,
        "verdict": verdict(rows),
        "curves": {k: sorted(v.items()) for k, v in curves.items()},
    }


def report(args: argparse.Namespace, fig: dict[str, Any]) -> str:
    """report.md: the settings, one row per event, per seed, the verdict."""

    def f(x: float | None, fmt: str = ".4f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{args.replicas} DiLoCo replica groups (min_replicas {args.min_replicas}), H {args.inner_steps}, "
        f"{args.steps} steps ({args.steps // args.inner_steps} outer rounds), {args.batch} samples per "
        f"group and step of {args.seq_len} tokens, {args.seeds} seeds; a group SIGKILLed every "
        f"{args.every_rounds} outer rounds (round robin over groups 1..{args.replicas - 1}); loss: "
        f"group 0's sync records, moving average over {args.smooth} syncs; spread: median over the "
        f"run of the clean runs' standard deviation over the seeds at each sync = "
        f"{f(fig['spread_median'])}; spike window: the last sync before the kill to "
        f"{args.after_rounds} rounds after the rejoin; pass: spike <= {args.factor:g} x spread.",
        "",
        "| seed | group | due after round | drop step | rejoin step | spike (at step) | spread "
        "| spike / spread | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fig["rows"]:
        at = f" ({r['spike_step']})" if r["spike_step"] is not None else ""
        lines.append(
            f"| {r['seed']} | {r['group']} | {r['round']} | {f(r['drop_step'], 'd')} | "
            f"{f(r['rejoin_step'], 'd')} | {f(r['spike'])}{at} | {f(r['spread'])} | "
            f"{f(r['ratio'], '.2f')} | {r['outcome']} |"
        )
    lines += [
        "",
        "| seed | verdict | exit codes (clean, churn) | largest gap before the first drop "
        "| final loss clean | final loss churn |",
        "|---|---|---|---|---|---|",
    ]
    for s, p in fig["per_seed"].items():
        lines.append(
            f"| {s} | {p['verdict']} | {p['clean_exit']}, {p['churn_exit']} | "
            f"{f(p['largest_gap_before_first_drop'], '.2g')} | {f(p['final_clean'])} | "
            f"{f(p['final_churn'])} |"
        )
    lines += ["", f"Verdict: {fig['verdict']}."]
    return "\n".join(lines) + "\n"


def plot(
    fig: dict[str, Any], runs: dict[str, dict[str, Any]], seeds: int, factor: float, path: Path
) -> None:
    """One row per seed. Left: every clean run (grey), this seed's clean run (black) and churn run
    (blue), from an eighth of the run on (the first fall hides the rest). Right: the churn run's
    excess over its clean twin, and ``factor`` x the spread. Each drop (red dashed) and rejoin
    (green dotted) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(seeds, 2, figsize=(9.5, 2.1 * seeds), squeeze=False, sharex=True)
    last = max((a for xs in fig["curves"].values() for a, _ in xs), default=0)
    for s in range(seeds):
        left, right = axes[s]
        for k in range(seeds):
            xs = [(a, b) for a, b in fig["curves"][f"clean-s{k}"] if a >= last / 8]
            left.plot([a for a, _ in xs], [b for _, b in xs], color="0.75", lw=0.7)
        for name, color in ((f"clean-s{s}", "k"), (f"churn-s{s}", "C0")):
            xs = [(a, b) for a, b in fig["curves"][name] if a >= last / 8]
            left.plot([a for a, _ in xs], [b for _, b in xs], color=color, lw=0.9, label=name)
        clean = dict(fig["curves"][f"clean-s{s}"])
        gap = [(a, b - clean[a]) for a, b in fig["curves"][f"churn-s{s}"] if a in clean]
        right.plot([a for a, _ in gap], [b for _, b in gap], color="C0", lw=0.8)
        right.axhline(0, color="0.6", lw=0.6)
        if fig["spread_median"] is not None:
            right.axhline(
                factor * fig["spread_median"], color="C1", lw=0.8, label=f"{factor:g} x spread"
            )
            right.legend(fontsize=7, loc="upper right")
        for ax in (left, right):
            for e in runs[f"churn-s{s}"]["events"]:
                if e["done"]:
                    ax.axvline(e["step"], color="C3", lw=0.7, ls="--")
                if e.get("rejoin_step") is not None:
                    ax.axvline(e["rejoin_step"], color="C2", lw=0.7, ls=":")
        left.set_ylabel("loss at syncs")
        left.legend(fontsize=7, loc="upper right")
        left.set_title(f"seed {s}: drops (red dashed), rejoins (green dotted)", fontsize=8)
        right.set_title(f"seed {s}: churn - clean", fontsize=8)
    axes[-1][0].set_xlabel("step")
    axes[-1][1].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=60, pil_kwargs={"optimize": True})
    plt.close(figure)


# -- the command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.chaos --diloco",
        description="DiLoCo replicas that drop out and rejoin: the loss beside clean runs' seeds.",
    )
    ap.add_argument("--replicas", type=int_from(2), default=2, help="DiLoCo replica groups (>= 2)")
    ap.add_argument(
        "--inner-steps", type=positive_int, default=8, help="H: inner steps between syncs"
    )
    ap.add_argument(
        "--every-rounds", type=positive_int, default=30, help="outer rounds between kills"
    )
    ap.add_argument(
        "--events",
        type=positive_int,
        default=3,
        help="kills per churn run, at most (and the default --steps)",
    )
    ap.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="steps of each run (default: (events + 1) x every-rounds x H)",
    )
    ap.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        help="seeds (train.seed 0..N-1; the spread needs 2)",
    )
    ap.add_argument("--batch", type=positive_int, default=4, help="samples per group and step")
    ap.add_argument("--seq-len", type=positive_int, default=64, help="data.seq_len")
    ap.add_argument("--warmup", type=non_negative_int, default=20, help="train.warmup_steps")
    ap.add_argument(
        "--min-replicas", type=positive_int, default=1, help="fault_tolerance.min_replicas"
    )
    ap.add_argument(
        "--timeout-s", type=positive_float, default=5.0, help="fault_tolerance.timeout_s"
    )
    ap.add_argument("--heartbeat-s", type=positive_float, default=1.0, help="heartbeat_timeout_s")
    ap.add_argument(
        "--max-restarts", type=non_negative_int, default=100, help="restarts of each group"
    )
    ap.add_argument(
        "--smooth", type=positive_int, default=3, help="syncs in the moving average (1: none)"
    )
    ap.add_argument(
        "--after-rounds",
        type=non_negative_int,
        default=3,
        help="rounds after the rejoin in a spike's window",
    )
    ap.add_argument(
        "--factor", type=positive_float, default=2.0, help="pass: spike <= factor x spread"
    )
    ap.add_argument("--out", default="bench-out/chaos-diloco", help="output directory")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="more config overrides")
    ap.add_argument(
        "--report-only", action="store_true", help="rebuild the report from --out's report.json"
    )
    return ap


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, as an error line (None: nothing)."""
    # The counts' ranges are their argparse types'; what is left relates two of them.
    if args.steps % args.inner_steps:
        return f"--steps = {args.steps}: allowed: a multiple of --inner-steps ({args.inner_steps})"
    return None


def main(argv: list[str] | None = None, python: str = sys.executable) -> int:
    """Run (or, with --report-only, re-read) every seed's clean and churn run and write the
    report; returns the exit status (0 whatever the verdict, 2 for bad arguments)."""
    args = _parser().parse_args(argv)
    if args.steps is None:
        args.steps = (args.events + 1) * args.every_rounds * args.inner_steps
    bad = _check(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        out = output_dir(args.out, "--out")
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report_only:
        try:
            runs = json.loads((out / "report.json").read_text())["runs"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --report-only: no report to rebuild in {out} ({e!r})", file=sys.stderr)
            return 2
    else:
        runs = {}
        for s in range(args.seeds):
            for churn in (False, True):
                name = f"{'churn' if churn else 'clean'}-s{s}"
                runs[name] = run_one(name, args, out, s, churn, python)
    for name, run in runs.items():  # the rejoins, from the groups' events (as they are now)
        events = [Event(**e) for e in run["events"]]
        _rejoins(events, _events(out / name, args.replicas))
        run["events"] = [vars(e) for e in events]
    fig = analyse(args, runs, out)
    record = {"args": vars(args), "runs": runs, **{k: v for k, v in fig.items()}}
    (out / "report.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    table = report(args, fig)
    (out / "report.md").write_text(table, encoding="utf-8")
    plot(fig, runs, args.seeds, args.factor, out / "diloco_churn.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))  # a DtlabError anywhere: one line, never a traceback
