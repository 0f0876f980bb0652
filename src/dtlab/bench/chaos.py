"""A kill storm, measured: ``python -m dtlab.bench.chaos``.

R replica groups train on this machine while a process is killed (SIGKILL), or hung (SIGSTOP, woken
after ``--hang-s``), every ``--every`` seconds for ``--storm-s`` seconds (then the run finishes in
peace), round robin over the groups; the same storm is then
run against today's behaviour without fault tolerance: one DDP world of R ranks whose elastic agent
restarts every rank (``--max-restarts``) from the last checkpoint (``checkpoint.every``). Each run
is a real ``dtlab train --nproc R`` (real processes, gloo, signals), beside its fault-free twin:

    ft-clean      fault tolerance, no fault             (the baseline of ft-kill and ft-hang)
    ft-kill       fault tolerance, SIGKILL storm
    ft-hang       fault tolerance, SIGSTOP storm
    plain-clean   plain DDP + checkpoints, no fault     (the baseline of restart-kill)
    restart-kill  plain DDP + checkpoints + agent restarts, SIGKILL storm

Reported (``report.json``, ``report.md``, ``chaos.png`` in ``--out``), all measured:

- goodput: useful samples per second of wall time (the run's whole life, start-up included) over the
  fault-free twin's. Useful: with fault tolerance, each committed step's samples of the groups that
  took part (a missing group's slice is not trained); without, the final steps' samples (steps
  trained again after a restart from a checkpoint count once);
- from each fault to the others going on (the next quorum: without the group, or with its new
  process where that was back first; and to the first quorum that leaves it out), from the killed
  group's new process starting to its joining a quorum again (and the restart
  delay before that: the agent and the interpreter), the recovery's seconds;
- steps lost: with fault tolerance, the steps taken again (a step that did not commit) and the
  samples not trained in step equivalents; without, the steps between the last checkpoint and each
  fault, trained again;
- the final loss against the fault-free twin's.

``--diloco`` runs another bench instead: DiLoCo replicas that drop out and rejoin every N outer
rounds, their loss against clean runs' seed-to-seed spread (:mod:`dtlab.bench.chaos_diloco`).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
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

MODES = ("ft-clean", "ft-kill", "ft-hang", "plain-clean", "restart-kill")
# Each faulty run's fault-free twin.
TWIN = {"ft-kill": "ft-clean", "ft-hang": "ft-clean", "restart-kill": "plain-clean"}


@dataclass
class Run:
    """One run of the storm: what was done to it and what it left."""

    mode: str
    run_dir: Path
    wall_s: float = 0.0
    exit_code: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""
    started: float = 0.0  # its wall time at the start
    # (seconds since the start, the last step any of its metrics files logged), sampled as it ran
    timeline: list[tuple[float, int]] = field(default_factory=list)


def _max_step(run_dir: Path, replicas: int | None) -> int:
    """The last step any of the run's metrics files logged."""
    files = (
        [run_dir / f"replica-{i}" / "metrics.jsonl" for i in range(replicas)]
        if replicas
        else [run_dir / "metrics.jsonl"]
    )
    return max((_last_step(f) for f in files), default=0)


def _train_command(
    mode: str, args: argparse.Namespace, run_dir: Path, python: str, extra: tuple[str, ...]
) -> list[str]:
    """The ``dtlab train`` command line of ``mode``: fault tolerance's settings for the ft runs,
    the agent's restarts for the plain ones."""
    ft = mode.startswith("ft")
    overrides = [
        *BASE,
        f"train.steps={args.steps}",
        f"train.global_batch_size={2 * args.replicas}",
        f"checkpoint.every={args.checkpoint_every}",
        f"run.dir={run_dir}",
        *(
            [
                "parallel.fault_tolerance.enabled=true",
                f"parallel.fault_tolerance.timeout_s={args.timeout_s}",
                f"parallel.fault_tolerance.heartbeat_timeout_s={args.heartbeat_s}",
                f"parallel.fault_tolerance.max_restarts={args.max_restarts}",
            ]
            if ft
            else []
        ),
        *args.overrides,
        *extra,
    ]
    cmd = [python, "-m", "dtlab", "train", "--nproc", str(args.replicas)]
    if not ft:
        cmd += ["--max-restarts", str(args.max_restarts)]
    cmd += ["--set", *overrides]
    return cmd


def run_storm(
    mode: str,
    args: argparse.Namespace,
    out: Path,
    python: str = sys.executable,
    extra: tuple[str, ...] = (),
) -> Run:
    """Run ``mode`` to its end, with its faults (and ``extra`` config overrides); returns what
    happened, with its progress sampled every half second."""
    ft = mode.startswith("ft")
    run_dir = out / mode
    cmd = _train_command(mode, args, run_dir, python, extra)
    log = (out / f"{mode}.log").open("w")
    r = Run(mode, run_dir)
    t0 = r.started = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    storm = mode.endswith("kill") or mode.endswith("hang")
    replicas = args.replicas if ft else None
    stopped = _storm(proc, r, args, storm, replicas)
    for _, pids in stopped:
        for pid in pids:
            _signal(pid, signal.SIGCONT)
    r.timeline.append((round(time.time() - t0, 2), _max_step(run_dir, replicas)))
    r.wall_s, r.exit_code = time.time() - t0, proc.returncode
    log.close()
    r.log = (out / f"{mode}.log").read_text(errors="replace")
    return r


# (when to wake them, the processes) of each hang not yet woken
_Stopped = list[tuple[float, list[int]]]


def _sample(r: Run, replicas: int | None) -> int:
    """The run's last logged step now, noted in its timeline at most every half second."""
    now, step = time.time() - r.started, _max_step(r.run_dir, replicas)
    if not r.timeline or now - r.timeline[-1][0] >= 0.5:
        r.timeline.append((round(now, 2), step))
    return step


def _storm(
    proc: subprocess.Popen[bytes],
    r: Run,
    args: argparse.Namespace,
    storm: bool,
    replicas: int | None,
) -> _Stopped:
    """Sample the run until it ends and, in a storm, fault it: the first fault once training runs,
    then one every --every seconds, round robin. Returns the hangs still to wake."""
    while storm and proc.poll() is None and _sample(r, replicas) < 2:
        time.sleep(0.2)
    storm_start = time.time()
    next_fault, victim = storm_start + args.every, 1
    stopped: _Stopped = []
    while proc.poll() is None:
        now = time.time()
        _wake_due(stopped, now)
        storming = storm and now - storm_start < args.storm_s
        step = _sample(r, replicas)
        if storming and now >= next_fault and step < args.steps - 5:
            _strike(r, args, victim % args.replicas, now, step, stopped)
            victim += 1
            next_fault = now + args.every
        time.sleep(0.1)
    return stopped


def _wake_due(stopped: _Stopped, now: float) -> None:
    """Wake (SIGCONT) the hung processes whose --hang-s is over, and forget them."""
    for when, pids in list(stopped):
        if now >= when:
            for pid in pids:
                _signal(pid, signal.SIGCONT)
            stopped.remove((when, pids))


def _strike(
    r: Run, args: argparse.Namespace, target: int, now: float, step: int, stopped: _Stopped
) -> None:
    """Kill or hang replica group ``target`` (one rank of the world without fault tolerance),
    noting the fault in ``r`` and a hang in ``stopped``, to be woken."""
    ft = r.mode.startswith("ft")
    pids = _pids(r.run_dir, target if ft else None)
    if not ft:  # one rank of the world: its agent restarts them all
        pids = pids[target : target + 1] if len(pids) > target else pids[:1]
    if pids:
        sig = signal.SIGSTOP if r.mode.endswith("hang") else signal.SIGKILL
        for pid in pids:
            _signal(pid, sig)
        r.faults.append({"time": now, "replica": target, "signal": sig.name, "step": step})
        if sig == signal.SIGSTOP:
            stopped.append((now + args.hang_s, pids))


# -- what the runs left ----------------------------------------------------------------------------


def _summary(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / "summary.json").read_text()))
    except (OSError, ValueError):
        return {}


def useful_each(events: list[dict[str, Any]], steps: int, replicas: int, batch: int) -> list[int]:
    """The samples each step 1..``steps`` trained: its quorum's groups' slices."""
    # quorum id -> (step it formed after, members): the same from every member
    quorums: dict[int, tuple[int, list[int]]] = {}
    for e in events:
        if e["event"] == "quorum":
            quorums.setdefault(e["quorum"], (e["step"], e["members"]))
    # The quorum a step committed under: the newest formed after the step before it.
    after = sorted((s, q) for q, (s, _) in quorums.items())
    out, i, current = [], 0, None
    for k in range(1, steps + 1):
        while i < len(after) and after[i][0] <= k - 1:
            current = after[i][1] if current is None else max(current, after[i][1])
            i += 1
        members = len(quorums[current][1]) if current is not None else replicas
        out.append(members * batch // replicas)
    return out


def throughput(
    timeline: list[tuple[float, int]], useful: list[int], bin_s: float = 5.0
) -> list[tuple[float, float]]:
    """Useful samples per second in bins of ``bin_s`` seconds, from a run's sampled progress
    (seconds, last step logged) and the samples each step trained (``useful[k - 1]`` for step k): a
    step counts once, when it is first logged (steps trained again after a restart from a
    checkpoint add nothing). Returns (bin middle, samples/s)."""
    cum = [0]
    for u in useful:
        cum.append(cum[-1] + u)
    out: list[tuple[float, float]] = []
    if not timeline:
        return out
    frontier, edge, at_edge = 0, bin_s, 0
    for t, step in timeline:
        while t > edge:
            out.append((edge - bin_s / 2, (cum[frontier] - cum[at_edge]) / bin_s))
            at_edge, edge = frontier, edge + bin_s
        frontier = max(frontier, min(step, len(useful)))
    start, last = edge - bin_s, timeline[-1][0]
    if last > start:  # the last bin, as long as the run went on in it
        out.append(((start + last) / 2, (cum[frontier] - cum[at_edge]) / (last - start)))
    return out


def _steps_taken_again(events: list[dict[str, Any]]) -> int:
    """The steps that did not commit: taken again by every group of its quorum, counted once."""
    again: dict[int, dict[int, int]] = {}
    for e in events:
        if e["event"] == "again":
            per = again.setdefault(e["step"], {})
            per[e["replica"]] = per.get(e["replica"], 0) + 1
    return sum(max(per.values()) for per in again.values())


@dataclass
class _Recoveries:
    """The seconds each fault's recovery took, by stage (a list per stage, a value per fault that
    reached it)."""

    drops: list[float] = field(default_factory=list)  # to the first quorum without the group
    go_on: list[float] = field(default_factory=list)  # to the next quorum
    restarts: list[float] = field(default_factory=list)  # to the new process's start
    startups: list[float] = field(default_factory=list)  # the new process's start to its manager
    rejoins: list[float] = field(default_factory=list)  # the process back to its next quorum
    joins: list[float] = field(default_factory=list)  # its manager up to its next quorum


def _others_go_on(rec: _Recoveries, f: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Add the seconds from fault ``f`` to the others going on to ``rec``: to the next quorum
    (without the group, or with its new process where that was back first: a warm restart within
    the lighthouse's heartbeat timeout), and to the first quorum without the group."""
    after = [e["time"] for e in events if e["event"] == "quorum" and e["time"] > f["time"]]
    if after:
        rec.go_on.append(min(after) - f["time"])
    gone = [
        e["time"]
        for e in events
        if e["event"] == "quorum" and e["time"] > f["time"] and f["replica"] not in e["members"]
    ]
    if gone:
        rec.drops.append(gone[0] - f["time"])


def _group_back(
    rec: _Recoveries, f: dict[str, Any], events: list[dict[str, Any]], hang_s: float
) -> None:
    """Add the seconds from fault ``f``'s group being back (woken, or its new process started) to
    its rejoining a quorum to ``rec``, and a new process's restart delay and start-up."""
    i = f["replica"]
    back = [
        e for e in events if e["event"] == "start" and e["replica"] == i and e["time"] > f["time"]
    ]
    hung = f.get("signal") == "SIGSTOP"
    if hung or not back:
        started, manager_up = f["time"] + (hang_s if hung else 0.0), None
    else:
        started, manager_up = back[0].get("process_started") or back[0]["time"], back[0]["time"]
        rec.restarts.append(started - f["time"])
        rec.startups.append(manager_up - started)
    joined = [
        e["time"]
        for e in events
        if e["event"] == "quorum" and e["time"] > max(started, f["time"]) and i in e["members"]
    ]
    if joined:
        rec.rejoins.append(joined[0] - started)
        if manager_up is not None:
            rec.joins.append(joined[0] - manager_up)


def ft_figures(
    r: Run, steps: int, replicas: int, batch: int, hang_s: float = 0.0
) -> dict[str, Any]:
    """Goodput inputs, the fault-to-quorum and rejoin times, steps lost, the final loss. A hung
    process is back when it is woken (``hang_s`` after its fault); a killed one when its new process
    starts, whose start-up (interpreter, imports, model, its own checkpoint) is reported apart from
    the rejoin proper (its manager up to its first quorum)."""
    events = _events(r.run_dir, replicas)
    useful = sum(useful_each(events, steps, replicas, batch))
    retried = _steps_taken_again(events)
    rec = _Recoveries()
    for f in r.faults:
        _others_go_on(rec, f, events)
        _group_back(rec, f, events, hang_s)
    recoveries = [e["seconds"] for e in events if e["event"] == "recovered"]
    finals = [_summary(r.run_dir / f"replica-{i}").get("final_loss") for i in range(replicas)]
    finished = [x for x in finals if x is not None]
    return {
        "useful_samples": useful,
        "steps_taken_again": retried,
        "samples_not_trained": steps * batch - useful,
        "steps_lost": retried + (steps * batch - useful) / batch,
        "fault_to_quorum_without_s": rec.drops,
        "fault_to_next_quorum_s": rec.go_on,
        "restart_delay_s": rec.restarts,
        "process_back_to_rejoin_s": rec.rejoins,
        "process_start_to_manager_s": rec.startups,
        "manager_to_rejoin_s": rec.joins,
        "recovery_s": recoveries,
        "final_loss": finished[0] if finished else None,
        "final_losses_agree": len(set(finished)) <= 1,
    }


def plain_figures(r: Run, steps: int, batch: int) -> dict[str, Any]:
    """Goodput inputs and the steps trained again after each restart from a checkpoint."""
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \(step (\d+)\)", r.log)]
    # Every rank logs its resume; rank 0's line is the one without a rank tag or with [rank0].
    starts = len(re.findall(r"restarting the workers", r.log))
    per_restart = resumed[-starts:] if starts and len(resumed) >= starts else resumed
    lost = [max(0, f["step"] - s) for f, s in zip(r.faults, per_restart, strict=False)]
    summary = _summary(r.run_dir)
    return {
        "useful_samples": steps * batch if r.exit_code == 0 else 0,
        "restarts": starts,
        "steps_lost": sum(lost),
        "steps_lost_each": lost,
        "final_loss": summary.get("final_loss"),
    }


# A log line's time: "HH:MM:SS" (or "YYYY-MM-DD HH:MM:SS,mmm"), as dtlab's loggers write it.
_STAMP = re.compile(r"^(?:\d{4}-\d\d-\d\d )?(\d\d):(\d\d):(\d\d)(?:,(\d{3}))? ")


def training_span(log: str) -> float | None:
    """Seconds from the first rank's first start line (``training ...``, after its imports and
    model build) to the last timestamped line: the run's training time, without the first start-up
    (a restart's start-up is inside it). Lines carry the time of day: a run past midnight wraps."""
    times: list[float] = []
    started = False
    for line in log.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        started = started or " INFO training " in line
        if started:
            t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) + int(m[4] or 0) / 1000
            while times and t < times[-1] - 3600:
                t += 86400
            times.append(t)
    return times[-1] - times[0] if len(times) > 1 else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def report(
    runs: dict[str, Run], figures: dict[str, dict[str, Any]], args: argparse.Namespace
) -> str:
    """The markdown table of the storm, each faulty run beside its fault-free twin."""
    lines = [
        f"{args.replicas} replica groups, {args.steps} steps of {2 * args.replicas} samples, "
        f"a fault every {args.every:g} s (hangs woken after {args.hang_s:g} s), "
        f"checkpoint.every={args.checkpoint_every}, fault_tolerance.timeout_s={args.timeout_s:g}, "
        f"heartbeat_timeout_s={args.heartbeat_s:g}",
        "",
        "| run | faults | wall s (training s) | goodput vs fault-free: training (whole life) "
        "| fault -> the others go on (next quorum), s (median, max) "
        "| process back -> rejoined, s (median, max) "
        "| of which start-up, s (median) | steps lost | final loss (fault-free) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mm(xs: list[float]) -> str:
        return f"{_median(xs):.1f}, {max(xs):.1f}" if xs else "-"

    def med(xs: list[float]) -> str:
        return f"{_median(xs):.1f}" if xs else "-"

    for mode, r in runs.items():
        f = figures[mode]
        base = runs.get(TWIN.get(mode, mode))
        good = "-"
        span, base_span = training_span(r.log), training_span(base.log) if base else None
        if base is not None and base.wall_s and r.wall_s:
            rate = f["useful_samples"] / r.wall_s
            ref = figures[base.mode]["useful_samples"] / base.wall_s
            good = f"({rate / ref:.1%})" if ref else "-"
            if span and base_span and figures[base.mode]["useful_samples"]:
                ratio = (f["useful_samples"] / span) / (
                    figures[base.mode]["useful_samples"] / base_span
                )
                good = f"{ratio:.1%} {good}"
        ref_loss = (
            figures[TWIN.get(mode, mode)].get("final_loss") if TWIN.get(mode) in figures else None
        )
        loss = f.get("final_loss")
        loss_s = "-" if loss is None else f"{loss:.4f}"
        if ref_loss is not None and loss is not None and mode in TWIN:
            loss_s += f" ({ref_loss:.4f})"
        lines.append(
            f"| {mode} | {len(r.faults)} | {r.wall_s:.0f} ({span or 0:.0f}) | {good} | "
            f"{mm(f.get('fault_to_next_quorum_s', f.get('fault_to_quorum_without_s', [])))} | "
            f"{mm(f.get('process_back_to_rejoin_s', []))} | "
            f"{med(f.get('process_start_to_manager_s', []))} | {f.get('steps_lost', 0):.1f} | "
            f"{loss_s} |"
        )
    return "\n".join(lines) + "\n"


def noise(figures: dict[str, dict[str, Any]], seeds: list[str]) -> str:
    """The fault-free final loss over seeds (the clean runs' seed 0 and ``seeds``), and each faulty
    run's final loss against its twin's, in that spread ('' without other seeds)."""
    # Seed 0's: plain-clean's, or ft-clean's (the same training) without it.
    zero = next((m for m in ("plain-clean", "ft-clean") if m in figures), None)
    clean = [figures[m].get("final_loss") for m in ([zero] if zero else []) + seeds]
    losses = [x for x in clean if x is not None]
    if not seeds or len(losses) < 2:
        return ""
    spread = max(losses) - min(losses)
    sd = statistics.stdev(losses)
    lines = [
        "",
        f"Fault-free final loss over {len(losses)} seeds: {min(losses):.4f} to {max(losses):.4f} "
        f"(spread {spread:.4f}, standard deviation {sd:.4f}).",
    ]
    for mode, twin in TWIN.items():
        a, b = figures.get(mode, {}).get("final_loss"), figures.get(twin, {}).get("final_loss")
        if a is not None and b is not None:
            within = "within" if abs(a - b) <= sd else "outside"
            lines.append(
                f"- {mode}: {a:.4f}, {a - b:+.4f} from {twin} ({within} one standard deviation)"
            )
    return "\n".join(lines) + "\n"


def plot(figures: dict[str, dict[str, Any]], runs: dict[str, Run], path: Path) -> None:
    """Useful samples per second over each faulty run's life, its fault-free twin's beside it and
    its faults marked (a kill red, a hang orange); the seconds from each fault to the others going
    on (the next quorum), and from its process being back to its rejoining, beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stormy = [m for m in runs if m in TWIN]
    rows = max(1, len(stormy))
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.2 * rows), squeeze=False)
    for row, mode in enumerate(stormy):
        a, b = axes[row]
        twin = TWIN[mode]
        for m, color in ((twin, "0.6"), (mode, "C0" if mode.startswith("ft") else "C1")):
            series = figures.get(m, {}).get("throughput", [])
            if series:
                a.plot([t for t, _ in series], [v for _, v in series], color=color, label=m)
        for f in runs[mode].faults:
            color = "C3" if f.get("signal") == "SIGKILL" else "orange"
            a.axvline(f["time"] - runs[mode].started, color=color, lw=0.8, ls="--")
        a.set_xlabel("seconds since the run started")
        a.set_ylabel("useful samples / s")
        a.set_title(f"{mode}: {len(runs[mode].faults)} faults (dashed), beside {twin}")
        if a.lines:
            a.legend(fontsize=7, loc="lower right")
        f = figures[mode]
        if not mode.startswith("ft"):  # no quorum: what each restart from a checkpoint cost
            lost = f.get("steps_lost_each", [])
            b.bar(range(1, len(lost) + 1), lost, color="C1")
            b.set_xlabel("restart")
            b.set_ylabel("steps trained again")
            b.set_title(f"{mode}: each restart from the last checkpoint")
            continue
        for i, (key, color) in enumerate(
            (("fault_to_next_quorum_s", "C3"), ("process_back_to_rejoin_s", "C2"))
        ):
            xs = f.get(key, [])
            b.scatter([i] * len(xs), xs, color=color, s=14)
        b.set_xticks([0, 1], ["fault -> the others go on", "process back -> rejoined"])
        b.set_xlim(-0.5, 1.5)
        b.set_ylabel("seconds")
        b.set_title(f"{mode}: each fault")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dtlab.bench.chaos``."""
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.chaos",
        description="A kill storm against fault-tolerant replica groups, beside restart-everything.",
    )
    ap.add_argument("--replicas", type=int_from(2), default=4, help="replica groups (DDP ranks)")
    ap.add_argument("--steps", type=positive_int, default=1500, help="optimizer steps of each run")
    ap.add_argument("--every", type=positive_float, default=30.0, help="seconds between faults")
    ap.add_argument(
        "--storm-s",
        type=positive_float,
        default=180.0,
        help="seconds the storm lasts (then the run ends)",
    )
    ap.add_argument(
        "--hang-s", type=positive_float, default=10.0, help="how long a hung process stays stopped"
    )
    ap.add_argument(
        "--timeout-s", type=positive_float, default=5.0, help="parallel.fault_tolerance.timeout_s"
    )
    ap.add_argument(
        "--heartbeat-s",
        type=positive_float,
        default=1.0,
        help="parallel.fault_tolerance.heartbeat_timeout_s",
    )
    ap.add_argument(
        "--checkpoint-every", type=positive_int, default=20, help="checkpoint.every (every run)"
    )
    ap.add_argument(
        "--max-restarts", type=non_negative_int, default=100, help="restarts each agent may make"
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"runs, of {', '.join(MODES)}")
    ap.add_argument("--out", default="bench-out/chaos", help="output directory")
    ap.add_argument(
        "--seeds",
        type=non_negative_int,
        default=0,
        help="fault-free plain runs at train.seed 1..N more: the final loss's run-to-run noise",
    )
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="more config overrides")
    ap.add_argument(
        "--diloco",
        action="store_true",
        help="DiLoCo replicas that drop out and rejoin, against clean runs' seeds (its own options: "
        "python -m dtlab.bench.chaos --diloco --help; dtlab.bench.chaos_diloco)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild report.md and chaos.png from --out's report.json and logs (no run)",
    )
    return ap


def _saved_run(mode: str, out: Path, saved: dict[str, Any]) -> Run:
    """Run ``mode`` as report.json (its entry ``saved``) and its log in ``out`` recorded it."""
    r = Run(mode, out / mode, saved["wall_s"], saved["exit_code"])
    r.faults, r.log = saved["faults"], (out / f"{mode}.log").read_text(errors="replace")
    r.started = saved.get("started", 0.0)
    r.timeline = [(t, step) for t, step in saved.get("timeline", [])]
    return r


def _fresh_run(mode: str, args: argparse.Namespace, out: Path, seeds: list[str]) -> Run:
    """Run ``mode`` now, in an emptied directory (a seed's run at its own train.seed)."""
    print(f"chaos: {mode} ...", file=sys.stderr, flush=True)
    if (out / mode).exists():
        import shutil

        shutil.rmtree(out / mode)
    extra = (f"train.seed={mode.removeprefix('seed-')}",) if mode in seeds else ()
    r = run_storm(mode, args, out, extra=extra)
    print(
        f"chaos: {mode}: exit {r.exit_code}, {r.wall_s:.0f} s, {len(r.faults)} faults",
        file=sys.stderr,
        flush=True,
    )
    return r


def _figures(r: Run, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """A run's figures (fault tolerance's or the plain run's), with its throughput over its life."""
    if r.mode.startswith("ft"):
        figures = ft_figures(r, args.steps, args.replicas, batch, args.hang_s)
        each = useful_each(_events(r.run_dir, args.replicas), args.steps, args.replicas, batch)
    else:
        figures = plain_figures(r, args.steps, batch)
        each = [batch] * args.steps
    figures["throughput"] = throughput(r.timeline, each)
    return figures


def _record(
    args: argparse.Namespace, runs: dict[str, Run], figures: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """report.json's content: the arguments, and each run with its figures."""
    return {
        "args": {k: v for k, v in vars(args).items()},
        "runs": {
            m: {
                "wall_s": r.wall_s,
                "training_s": training_span(r.log),
                "exit_code": r.exit_code,
                "faults": r.faults,
                "started": r.started,
                "timeline": r.timeline,
                **figures[m],
            }
            for m, r in runs.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--diloco" in argv:  # DiLoCo replicas that drop out and rejoin: its own bench
        from dtlab.bench import chaos_diloco

        return chaos_diloco.main([a for a in argv if a != "--diloco"])
    args = _parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: --modes {','.join(bad)}: allowed: {', '.join(MODES)}", file=sys.stderr)
        return 2
    try:
        out = output_dir(args.out, "--out")
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs: dict[str, Run] = {}
    figures: dict[str, dict[str, Any]] = {}
    batch = 2 * args.replicas
    # Fault-free runs at other seeds: the run-to-run noise the faulty runs' final losses are read
    # against (plain DDP: with no fault, the fault-tolerant run is the same training).
    seeds = [f"seed-{k}" for k in range(1, args.seeds + 1)]
    if args.report_only:
        try:
            saved = json.loads((out / "report.json").read_text())["runs"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --report-only: no report to rebuild in {out} ({e!r})", file=sys.stderr)
            return 2
        modes = [m for m in (*modes, *seeds) if m in saved]
    else:
        modes += seeds
    for mode in modes:
        if args.report_only:
            r = _saved_run(mode, out, saved[mode])
        else:
            r = _fresh_run(mode, args, out, seeds)
        runs[mode] = r
        figures[mode] = _figures(r, args, batch)
    table = report({m: r for m, r in runs.items() if m not in seeds}, figures, args)
    table += noise(figures, seeds)
    record = _record(args, runs, figures)
    (out / "report.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    (out / "report.md").write_text(table, encoding="utf-8")
    plot(figures, runs, out / "chaos.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))  # a DtlabError anywhere: one line, never a traceback
