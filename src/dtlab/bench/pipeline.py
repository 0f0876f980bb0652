"""The pipeline bubble, measured: each schedule's idle time per rank, next to the textbook figure and
to the schedule's own order of work played out.

    python -m dtlab.bench.pipeline [--preset tiny] [--pp 2] [--schedules gpipe,1f1b,...]
        [--microbatches 4,8] [--steps 6] [--warmup 2] [--out bench-out/pipeline] [--set KEY=VALUE ...]

Each (schedule, micro-batch count) trains in ``--pp`` processes of its own (pipeline parallelism alone,
four blocks per stage at most as the preset has them). Every forward, backward, input-gradient and
weight-gradient computation of every stage is timed (:func:`dtlab.parallel.pipeline.record_timeline`);
a rank's bubble is the part of the schedule's wall time (one ``schedule.step``) in which it computed
nothing: waiting for a neighbour, and sending and receiving, which on CPU with gloo are copies.
Reported: the median over the timed steps of the mean over ranks, next to

- ``textbook``: :func:`dtlab.analysis.model.predicted_bubble` (GPipe, 1F1B, interleaved 1F1B, looped BFS);
- ``table``: each rank's computations in the order they ran, played out with equal forward,
  input-gradient and weight-gradient times and free communication
  (:func:`dtlab.analysis.schedule.simulate_schedule`): the figure the schedule itself promises, for
  every schedule, the zero-bubble ones included;
- ``table@t``: the same order played out with the median time measured for each kind of computation:
  the bubble that would be left if sends and receives cost nothing.

``pipeline-schedules.png`` draws the last timed step of each schedule as it ran: one row per rank,
F / B / I / W blocks over time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dtlab.analysis.model import predicted_bubble
from dtlab.bench.timing import synchronize, timed
from dtlab.cliargs import (
    int_from,
    int_list,
    non_negative_int,
    output_dir,
    parse_config_args,
    positive_int,
    run_command,
    script_parser,
)
from dtlab.config import SINGLE_STAGE_SCHEDULES, Config, load_config
from dtlab.errors import DtlabError

DEFAULT_SCHEDULES = "gpipe,1f1b,interleaved_1f1b,looped_bfs,interleaved_zb,zbv,dualpipev"


def _worker(config: Config, out: Path, warmup: int) -> None:
    """One rank: train, timing the schedule and every block; rank 0 writes every rank's timeline."""
    import torch.distributed as dist

    from dtlab.parallel import destroy_distributed, init_distributed
    from dtlab.parallel.pipeline import record_timeline
    from dtlab.train.loop import build_training
    from dtlab.train.optimizer_step import train_step

    d = init_distributed(config)
    try:
        tr = build_training(config, d)
        pipeline = tr.pm.pipeline
        assert pipeline is not None
        # On a GPU each block and the schedule are timed to the end of their kernels.
        blocks = record_timeline(pipeline, sync=lambda: synchronize(d.device))
        spans: list[tuple[float, float]] = []
        run_schedule = pipeline.step

        def timed_step(*args: Any) -> Any:
            with timed(d.device) as clock:
                result = run_schedule(*args)
            spans.append((clock.start, clock.end))
            return result

        pipeline.step = timed_step  # type: ignore[method-assign,assignment]
        steps = []
        for step in range(1, config.train.steps + 1):
            batch = next(tr.loader)
            dist.barrier()  # every rank starts the schedule together
            blocks.clear()
            train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)
            if step > warmup:
                start, end = spans[-1]
                steps.append({"start": start, "end": end, "blocks": [asdict(b) for b in blocks]})
        mine = {"rank": d.rank, "steps": steps}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        n_stages = pipeline.stages[0].num_stages
        tr.loader.close()
    finally:
        destroy_distributed()
    if d.rank == 0:
        run = {"timeline": everyone, "n_stages": n_stages}
        out.write_text(json.dumps(run) + "\n", encoding="utf-8")


def bubble_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """From every rank's timed steps: the schedule's median wall time, each rank's median bubble
    (idle fraction of the schedule's wall time) and their mean."""
    per_rank = []
    walls = []
    for r in ranks:
        fractions = []
        for s in r["steps"]:
            wall = s["end"] - s["start"]
            busy = sum(b["end"] - b["start"] for b in s["blocks"])
            fractions.append(max(0.0, 1 - busy / wall))
            walls.append(wall)
        per_rank.append(statistics.median(fractions))
    return {
        "schedule_s": statistics.median(walls),
        "bubble_per_rank": per_rank,
        "bubble": statistics.mean(per_rank),
    }


def _run_one(config: Config, pp: int, out: Path, warmup: int) -> dict[str, Any]:
    """One schedule in ``pp`` fresh processes; returns every rank's timeline
    (``timeline``) and the number of stages (``n_stages``)."""
    with tempfile.TemporaryDirectory(prefix="dtlab-pipeline-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(config.to_yaml(), encoding="utf-8")
        cmd = [
            sys.executable, "-m", "dtlab.bench.pipeline", "--worker", str(path), "--timeline",
            str(out), "--warmup", str(warmup), "--nproc", str(pp),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            raise DtlabError(f"the pipeline run failed (exit code {proc.returncode}):\n{tail}")
    data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return data


def table_figures(run: dict[str, Any]) -> dict[str, Any]:
    """The bubble of the schedule's own order of work (each rank's computations as they ran, in
    order) played out with free communication: with equal action times (``table``: F = I = W,
    B = 2 F), and with the median time this run measured for each kind (``table_at_measured``: the
    bubble that would be left if sends and receives cost nothing)."""
    from dtlab.analysis.schedule import UNIT_COSTS, Action, simulate_schedule

    order: dict[int, list[Action]] = {}
    durations: dict[str, list[float]] = {}
    for r, rank in enumerate(run["timeline"]):
        blocks = sorted(rank["steps"][-1]["blocks"], key=lambda b: b["start"])
        order[r] = [Action(b["stage"], b["kind"], b["microbatch"]) for b in blocks]
        for step in rank["steps"]:
            for b in step["blocks"]:
                durations.setdefault(b["kind"], []).append(b["end"] - b["start"])
    costs = dict(UNIT_COSTS)
    costs.update({k: statistics.median(v) for k, v in durations.items()})
    return {
        "table": statistics.mean(simulate_schedule(order, run["n_stages"])),
        "table_at_measured": statistics.mean(simulate_schedule(order, run["n_stages"], costs)),
        "action_ms": {k: round(v * 1e3, 3) for k, v in costs.items() if k in durations},
    }


def _row(schedule: str, m: int, figures: dict[str, Any], predicted: float | None) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    ranks = " ".join(f"{b:.0%}" for b in figures["bubble_per_rank"])
    return (
        f"{schedule:<18} {m:>13} {figures['schedule_s']:>10.3f} {figures['bubble']:>7.1%} "
        f"{pct(predicted):>8} {pct(figures['table']):>6} {pct(figures['table_at_measured']):>7}  {ranks}"
    )


def plot_timelines(runs: list[dict[str, Any]], path: Path) -> None:
    """One panel per run: its last timed step, one row per rank, F/B/W blocks over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.1 + 0.9 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        for row, rank in enumerate(run["timeline"]):
            step = rank["steps"][-1]
            for b in step["blocks"]:
                x = (b["start"] - step["start"]) * 1e3
                w = (b["end"] - b["start"]) * 1e3
                ax.barh(row, w, left=x, color=colors[b["kind"]], edgecolor="white", linewidth=0.4)
                ax.text(x + w / 2, row, str(b["microbatch"]), ha="center", va="center", fontsize=6)
        ax.set_yticks(
            range(len(run["timeline"])), [f"rank {i}" for i in range(len(run["timeline"]))]
        )
        ax.invert_yaxis()
        ax.set_title(
            f"{run['schedule']}, {run['microbatches']} micro-batches: bubble {run['bubble']:.0%} "
            "measured"
            + (f", {run['predicted']:.0%} textbook" if run["predicted"] is not None else "")
            + f", {run['table']:.0%} schedule table",
            fontsize=8,
            loc="left",
        )
    axes[-1, 0].set_xlabel(
        "ms since the schedule started (F forward, B backward, I input gradients, W weight gradients)"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = script_parser("dtlab.bench.pipeline", __doc__, "tiny")
    p.add_argument("--pp", type=int_from(2), default=2, help="pipeline ranks (default 2)")
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES, help="comma-separated")
    p.add_argument("--microbatches", default="4,8", help="comma-separated (default 4,8)")
    p.add_argument("--steps", type=positive_int, default=6)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--out", default="bench-out/pipeline")
    # Internal: one rank of one run.
    p.add_argument("--worker", default=None, help=argparse_hidden())
    p.add_argument("--timeline", default=None, help=argparse_hidden())
    p.add_argument("--nproc", type=positive_int, default=1, help=argparse_hidden())
    args = parse_config_args(p, argv)
    if args.worker is not None:
        return _worker_main(args)
    if args.steps <= args.warmup or args.pp < 2:
        p.error(
            f"--steps {args.steps} --warmup {args.warmup} --pp {args.pp}: need steps > warmup and pp >= 2"
        )
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    counts = int_list(args.microbatches, "--microbatches")
    out = output_dir(args.out, "--out")
    runs = []
    print(
        f"{'schedule':<18} {'micro-batches':>13} {'schedule s':>10} {'bubble':>7} {'textbook':>8} "
        f"{'table':>6} {'table@t':>7}  per rank"
    )
    for schedule in schedules:
        for m in counts:
            config = load_config(overrides=[
                f"model.preset={args.preset}", "data.source=synthetic", "data.seq_len=64",
                f"train.global_batch_size={m * 2}", f"train.steps={args.steps}", "parallel.strategy=single",
                f"parallel.pp={args.pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={m}",
                *args.overrides,
            ])  # fmt: skip
            per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else config.parallel.stages_per_rank
            run = _run_one(config, args.pp, out / f"{schedule}-{m}.json", args.warmup)
            figures = {**bubble_figures(run["timeline"]), **table_figures(run)}
            predicted = predicted_bubble(schedule, args.pp, m, per_rank)
            runs.append({"schedule": schedule, "microbatches": m, "pp": args.pp, **figures,
                         "predicted": predicted, "timeline": run["timeline"]})  # fmt: skip
            print(_row(schedule, m, figures, predicted), flush=True)
    summary = [{k: v for k, v in r.items() if k != "timeline"} for r in runs]
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    plot_timelines(
        [r for r in runs if r["microbatches"] == counts[0]], out / "pipeline-schedules.png"
    )
    print(f"plot: {out / 'pipeline-schedules.png'}")
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def _worker_main(args: Any) -> int:
    from dtlab.parallel.dist import is_worker_env

    config = load_config(args.worker)
    if not is_worker_env():
        from dtlab.launcher import LaunchSpec, launch

        return launch(LaunchSpec(args.nproc), sys.argv[1:], module="dtlab.bench.pipeline")
    _worker(config, Path(args.timeline), args.warmup)
    from dtlab.runtime.status import leave_worker

    leave_worker(0)


if __name__ == "__main__":
    raise SystemExit(run_command(main))
