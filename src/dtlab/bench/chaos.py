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
- from each fault to the quorum going on without the group (the first quorum that leaves it out),
  from the killed group's new process starting to its joining a quorum again (and the restart
  delay before that: the agent and the interpreter), the recovery's seconds;
- steps lost: with fault tolerance, the steps taken again (a step that did not commit) and the
  samples not trained in step equivalents; without, the steps between the last checkpoint and each
  fault, trained again;
- the final loss against the fault-free twin's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("ft-clean", "ft-kill", "ft-hang", "plain-clean", "restart-kill")

BASE = [
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=64",
    "train.warmup_steps=10",
    "train.lr=3e-3",
    "run.log_every=1",
    "run.tensorboard=false",
    "run.plot=false",
    "run.progress=none",
    "parallel.strategy=ddp",
]


@dataclass
class Run:
    """One run of the storm: what was done to it and what it left."""

    mode: str
    run_dir: Path
    wall_s: float = 0.0
    exit_code: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""


def _pids(run_dir: Path, replica: int | None) -> list[int]:
    """The training processes of ``run_dir`` (of replica group ``replica`` with fault tolerance):
    those its agents started, not the launchers."""
    want = str(run_dir if replica is None else run_dir / f"replica-{replica}")
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"TORCHELASTIC_RUN_ID=" not in env or "dtlab.fault_tolerance" in cmd:
            continue
        if any(a.startswith("run.dir=") and a[len("run.dir=") :] == want for a in cmd):
            out.append(int(proc.name))
    return out


def _max_step(run_dir: Path, replicas: int | None) -> int:
    """The last step any of the run's metrics files logged."""
    files = (
        [run_dir / f"replica-{i}" / "metrics.jsonl" for i in range(replicas)]
        if replicas
        else [run_dir / "metrics.jsonl"]
    )
    best = 0
    for f in files:
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                best = max(best, int(json.loads(line)["step"]))
                break
            except (ValueError, KeyError):
                continue
    return best


def run_storm(mode: str, args: argparse.Namespace, out: Path, python: str = sys.executable) -> Run:
    """Run ``mode`` to its end, with its faults; returns what happened."""
    ft = mode.startswith("ft")
    run_dir = out / mode
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
                "parallel.fault_tolerance.heartbeat_timeout_s=1",
                f"parallel.fault_tolerance.max_restarts={args.max_restarts}",
            ]
            if ft
            else []
        ),
        *args.overrides,
    ]
    cmd = [python, "-m", "dtlab", "train", "--nproc", str(args.replicas)]
    if not ft:
        cmd += ["--max-restarts", str(args.max_restarts)]
    cmd += ["--set", *overrides]
    log = (out / f"{mode}.log").open("w")
    r = Run(mode, run_dir)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    storm = mode.endswith("kill") or mode.endswith("hang")
    replicas = args.replicas if ft else None
    # The first fault once training runs, then one every --every seconds, round robin.
    while storm and proc.poll() is None and _max_step(run_dir, replicas) < 2:
        time.sleep(0.2)
    storm_start = time.time()
    next_fault, victim = storm_start + args.every, 1
    stopped: list[tuple[float, list[int]]] = []
    while proc.poll() is None:
        now = time.time()
        for when, pids in list(stopped):
            if now >= when:
                for pid in pids:
                    _signal(pid, signal.SIGCONT)
                stopped.remove((when, pids))
        storming = storm and now - storm_start < args.storm_s
        if storming and now >= next_fault and _max_step(run_dir, replicas) < args.steps - 5:
            target = victim % args.replicas
            pids = _pids(run_dir, target if ft else None)
            if not ft:  # one rank of the world: its agent restarts them all
                pids = pids[target : target + 1] if len(pids) > target else pids[:1]
            if pids:
                sig = signal.SIGSTOP if mode.endswith("hang") else signal.SIGKILL
                step = _max_step(run_dir, replicas)
                for pid in pids:
                    _signal(pid, sig)
                r.faults.append({"time": now, "replica": target, "signal": sig.name, "step": step})
                if sig == signal.SIGSTOP:
                    stopped.append((now + args.hang_s, pids))
            victim += 1
            next_fault = now + args.every
        time.sleep(0.1)
    for _, pids in stopped:
        for pid in pids:
            _signal(pid, signal.SIGCONT)
    r.wall_s, r.exit_code = time.time() - t0, proc.returncode
    log.close()
    r.log = (out / f"{mode}.log").read_text(errors="replace")
    return r


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)


# -- what the runs left ----------------------------------------------------------------------------


def _events(run_dir: Path, replicas: int) -> list[dict[str, Any]]:
    out = []
    for i in range(replicas):
        path = run_dir / f"replica-{i}" / "ft_events.jsonl"
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["time"])


def _summary(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / "summary.json").read_text()))
    except (OSError, ValueError):
        return {}


def ft_figures(
    r: Run, steps: int, replicas: int, batch: int, hang_s: float = 0.0
) -> dict[str, Any]:
    """Goodput inputs, the fault-to-quorum and rejoin times, steps lost, the final loss. A hung
    process is back when it is woken (``hang_s`` after its fault); a killed one when its new process
    starts, whose start-up (interpreter, imports, model, its own checkpoint) is reported apart from
    the rejoin proper (its manager up to its first quorum)."""
    events = _events(r.run_dir, replicas)
    # quorum id -> (step it formed after, members, time): the same from every member
    quorums: dict[int, tuple[int, list[int], float]] = {}
    for e in events:
        if e["event"] == "quorum":
            quorums.setdefault(e["quorum"], (e["step"], e["members"], e["time"]))
    # The quorum a step committed under: the newest formed after the step before it.
    participants = []
    for k in range(1, steps + 1):
        formed = [q for q, (s, _, _) in quorums.items() if s <= k - 1]
        participants.append(len(quorums[max(formed)][1]) if formed else replicas)
    useful = sum(p * batch // replicas for p in participants)
    # A step that did not commit is taken again by every group of its quorum: count it once.
    again: dict[int, dict[int, int]] = {}
    for e in events:
        if e["event"] == "again":
            per = again.setdefault(e["step"], {})
            per[e["replica"]] = per.get(e["replica"], 0) + 1
    retried = sum(max(per.values()) for per in again.values())
    drops, rejoins, restarts, startups, joins = [], [], [], [], []
    for f in r.faults:
        i = f["replica"]
        gone = [
            e["time"]
            for e in events
            if e["event"] == "quorum" and e["time"] > f["time"] and i not in e["members"]
        ]
        if gone:
            drops.append(gone[0] - f["time"])
        back = [
            e
            for e in events
            if e["event"] == "start" and e["replica"] == i and e["time"] > f["time"]
        ]
        hung = f.get("signal") == "SIGSTOP"
        if hung or not back:
            started, manager_up = f["time"] + (hang_s if hung else 0.0), None
        else:
            started, manager_up = back[0].get("process_started") or back[0]["time"], back[0]["time"]
            restarts.append(started - f["time"])
            startups.append(manager_up - started)
        joined = [
            e["time"]
            for e in events
            if e["event"] == "quorum" and e["time"] > max(started, f["time"]) and i in e["members"]
        ]
        if joined:
            rejoins.append(joined[0] - started)
            if manager_up is not None:
                joins.append(joined[0] - manager_up)
    recoveries = [e["seconds"] for e in events if e["event"] == "recovered"]
    finals = [_summary(r.run_dir / f"replica-{i}").get("final_loss") for i in range(replicas)]
    finished = [x for x in finals if x is not None]
    return {
        "useful_samples": useful,
        "steps_taken_again": retried,
        "samples_not_trained": steps * batch - useful,
        "steps_lost": retried + (steps * batch - useful) / batch,
        "fault_to_quorum_without_s": drops,
        "restart_delay_s": restarts,
        "process_back_to_rejoin_s": rejoins,
        "process_start_to_manager_s": startups,
        "manager_to_rejoin_s": joins,
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
    twin = {"ft-kill": "ft-clean", "ft-hang": "ft-clean", "restart-kill": "plain-clean"}
    lines = [
        f"{args.replicas} replica groups, {args.steps} steps of {2 * args.replicas} samples, "
        f"a fault every {args.every:g} s (hangs woken after {args.hang_s:g} s), "
        f"checkpoint.every={args.checkpoint_every}, fault_tolerance.timeout_s={args.timeout_s:g}",
        "",
        "| run | faults | wall s (training s) | goodput vs fault-free: training (whole life) "
        "| fault -> quorum without it, s (median, max) | process back -> rejoined, s (median, max) "
        "| of which start-up, s (median) | steps lost | final loss (fault-free) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mm(xs: list[float]) -> str:
        return f"{_median(xs):.1f}, {max(xs):.1f}" if xs else "-"

    def med(xs: list[float]) -> str:
        return f"{_median(xs):.1f}" if xs else "-"

    for mode, r in runs.items():
        f = figures[mode]
        base = runs.get(twin.get(mode, mode))
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
            figures[twin.get(mode, mode)].get("final_loss") if twin.get(mode) in figures else None
        )
        loss = f.get("final_loss")
        loss_s = "-" if loss is None else f"{loss:.4f}"
        if ref_loss is not None and loss is not None and mode in twin:
            loss_s += f" ({ref_loss:.4f})"
        lines.append(
            f"| {mode} | {len(r.faults)} | {r.wall_s:.0f} ({span or 0:.0f}) | {good} | "
            f"{mm(f.get('fault_to_quorum_without_s', []))} | "
            f"{mm(f.get('process_back_to_rejoin_s', []))} | "
            f"{med(f.get('process_start_to_manager_s', []))} | {f.get('steps_lost', 0):.1f} | "
            f"{loss_s} |"
        )
    return "\n".join(lines) + "\n"


def plot(figures: dict[str, dict[str, Any]], runs: dict[str, Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    modes = list(runs)
    rates = [figures[m]["useful_samples"] / runs[m].wall_s if runs[m].wall_s else 0 for m in modes]
    a.bar(modes, rates, color=["C0" if m.startswith("ft") else "C1" for m in modes])
    a.set_ylabel("useful samples / s (wall)")
    a.set_title("goodput")
    a.tick_params(axis="x", rotation=20)
    for i, m in enumerate(modes):
        f = figures[m]
        for key, color in (("fault_to_quorum_without_s", "C3"), ("process_back_to_rejoin_s", "C2")):
            xs = f.get(key, [])
            b.scatter([i] * len(xs), xs, color=color, s=12, label=key if i == 1 else None)
    b.set_xticks(range(len(modes)), modes, rotation=20)
    b.set_ylabel("seconds")
    b.set_title("fault -> quorum without it (red), new process -> rejoined (green)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.chaos",
        description="A kill storm against fault-tolerant replica groups, beside restart-everything.",
    )
    ap.add_argument("--replicas", type=int, default=4, help="replica groups (DDP ranks)")
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps of each run")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    ap.add_argument(
        "--storm-s", type=float, default=180.0, help="seconds the storm lasts (then the run ends)"
    )
    ap.add_argument(
        "--hang-s", type=float, default=10.0, help="how long a hung process stays stopped"
    )
    ap.add_argument(
        "--timeout-s", type=float, default=5.0, help="parallel.fault_tolerance.timeout_s"
    )
    ap.add_argument("--checkpoint-every", type=int, default=20, help="checkpoint.every (every run)")
    ap.add_argument("--max-restarts", type=int, default=100, help="restarts each agent may make")
    ap.add_argument("--modes", default=",".join(MODES), help=f"runs, of {', '.join(MODES)}")
    ap.add_argument("--out", default="bench-out/chaos", help="output directory")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="more config overrides")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild report.md and chaos.png from --out's report.json and logs (no run)",
    )
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: --modes {','.join(bad)}: allowed: {', '.join(MODES)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    figures: dict[str, dict[str, Any]] = {}
    batch = 2 * args.replicas
    if args.report_only:
        saved = json.loads((out / "report.json").read_text())["runs"]
        modes = [m for m in modes if m in saved]
    for mode in modes:
        if args.report_only:
            r = Run(mode, out / mode, saved[mode]["wall_s"], saved[mode]["exit_code"])
            r.faults, r.log = (
                saved[mode]["faults"],
                (out / f"{mode}.log").read_text(errors="replace"),
            )
            runs[mode] = r
            figures[mode] = (
                ft_figures(r, args.steps, args.replicas, batch, args.hang_s)
                if mode.startswith("ft")
                else plain_figures(r, args.steps, batch)
            )
            continue
        print(f"chaos: {mode} ...", file=sys.stderr, flush=True)
        if (out / mode).exists():
            import shutil

            shutil.rmtree(out / mode)
        r = run_storm(mode, args, out)
        runs[mode] = r
        if mode.startswith("ft"):
            figures[mode] = ft_figures(r, args.steps, args.replicas, batch, args.hang_s)
        else:
            figures[mode] = plain_figures(r, args.steps, batch)
        print(
            f"chaos: {mode}: exit {r.exit_code}, {r.wall_s:.0f} s, {len(r.faults)} faults",
            file=sys.stderr,
            flush=True,
        )
    table = report(runs, figures, args)
    record = {
        "args": {k: v for k, v in vars(args).items()},
        "runs": {
            m: {
                "wall_s": r.wall_s,
                "training_s": training_span(r.log),
                "exit_code": r.exit_code,
                "faults": r.faults,
                **figures[m],
            }
            for m, r in runs.items()
        },
    }
    (out / "report.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    (out / "report.md").write_text(table, encoding="utf-8")
    plot(figures, runs, out / "chaos.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
