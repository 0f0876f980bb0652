"""Time-to-loss over slow links: every low-communication method trained on the same tokens, on each link,
measured next to the cost model.

    python -m dtlab.bench.lowcomm --links 100mbit,1gbit [--methods ddp,diloco-int4,...] [--steps 160]
    python -m dtlab.bench.lowcomm --links none,none+20ms,100mbit+100ms --seeds 3 --json OUT

For each link (a network namespace whose loopback is rate-limited with ``tc``: :mod:`dtlab.bench.link`)
and each method, ``dtlab train`` runs on 2 processes inside the namespace with ``run.comm_bytes`` on, so
every step's collectives are counted from the dispatcher. Per run: bytes per step (whole buffers and what
one rank puts on the wire), the median step time, the wall time until the smoothed training loss first
reaches the target, the final validation loss after the same tokens, and the step time the cost model
predicts: the method's compute time plus its wire bytes at the link's measured rate. The compute time is
the method's step time on the unlimited loopback less its wire bytes at the loopback's measured rate (or
the method's own step time, without a ``none`` link). A link's round-trip time (``+20ms``) is injected
before every collective that crosses replicas, and the model adds one round trip per such collective
(:func:`predict`). ``--seeds N`` repeats every method with ``train.seed`` 0 to N - 1.

Every loss is compared fairly (:mod:`dtlab.bench.lowcomm_fair`): with DDP trained with the method's
own ``train.*`` settings (``ddp`` for AdamW, ``ddp-muon`` for Muon at its learning rate, or a DDP
twin of its own), and a compressing DiLoCo method also with its dense twin (``<method>-dense``);
the bench adds these runs, each once per seed and link. Bytes are against plain DDP's. Writes
``results.json``, ``report.md`` and three plots: final loss against bytes moved (the Pareto front,
means over the seeds), the loss curves with each method's gap to its baseline, and time-to-target
against link rate; ``--json OUT`` the per-method, per-seed figures (:func:`results_json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dtlab.analysis.latency import cross_replica_collectives
from dtlab.bench import lowcomm_fair, lowcomm_reuse
from dtlab.bench.link import Link, link_namespace, measure_link, parse_links
from dtlab.cliargs import output_dir, output_file, positive_int, run_command
from dtlab.config import load_config
from dtlab.errors import DtlabError
from dtlab.metrics.comm import RTT_ENV, bench_rtt_s

# The outer step of the DiLoCo runs: the replicas' average (outer lr 1, no momentum). Over runs of a
# few hundred steps with H of 4 to 16 it beat the paper's Nesterov (lr 0.7, momentum 0.9), whose
# effective step lr / (1 - momentum) overshoots when there are many outer steps (docs/compression.md).
_AVG = ["parallel.diloco.outer_lr=1", "parallel.diloco.outer_momentum=0"]

_SPARSE = [
    *_AVG, "parallel.diloco.topk=0.015", "parallel.diloco.quantize=int2",
    "parallel.diloco.error_decay=0.95",
]  # fmt: skip

_INT1 = [
    *_AVG, "parallel.diloco.fragments=4", "parallel.diloco.topk=1", "parallel.diloco.chunk=64",
    "parallel.diloco.quantize=int1",
]  # fmt: skip
_INT1_MUON = [*_INT1, "train.optimizer=muon", "train.lr=8e-3"]

# Each method as config overrides on top of the common run.
METHODS: dict[str, list[str]] = {
    "ddp": [],
    "bf16": ["parallel.compression=bf16"],
    "powersgd": ["parallel.compression=powersgd", "parallel.compression_options.start_step=10"],
    "dct-quant": [
        "parallel.compression=dct", "parallel.compression_options.coding=quant",
        "parallel.compression_options.bits=3",
    ],
    "demo": ["train.optimizer=demo"],
    "diloco": [*_AVG, "parallel.diloco.inner_steps=4"],
    # H = 1: every step, the replicas' AdamW updates in 2 bits (12.8x fewer bytes than DDP).
    "diloco-h1-int2": [*_AVG, "parallel.diloco.inner_steps=1", "parallel.diloco.quantize=int2"],
    "diloco-int2": [*_AVG, "parallel.diloco.inner_steps=4", "parallel.diloco.quantize=int2"],
    # Streaming: one fragment per block of the tiny model, each synced once per 4 steps, staggered.
    "streaming-int2": [
        *_AVG, "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=4",
        "parallel.diloco.quantize=int2",
    ],
    "streaming-int4": [
        *_AVG, "parallel.diloco.inner_steps=8", "parallel.diloco.fragments=2",
        "parallel.diloco.delay=2", "parallel.diloco.quantize=int4",
    ],
    # SparseLoCo: every 2 steps each chunk of 4,096 values sends its top 3% in 2 bits with 12-bit
    # indices, the rest kept in the error feedback (149x fewer bytes than DDP).
    "sparseloco": [
        *_AVG, "parallel.diloco.inner_steps=2", "parallel.diloco.topk=0.03",
        "parallel.diloco.quantize=int2",
    ],
    # The paper's setting: the top 1.5% of each chunk, error feedback decayed by 0.95 (which stands
    # in for outer momentum), at H = 1, 2 and 4.
    "sparseloco-paper": [*_SPARSE, "parallel.diloco.inner_steps=1"],
    "sparseloco-paper-h2": [*_SPARSE, "parallel.diloco.inner_steps=2"],
    "sparseloco-paper-h4": [*_SPARSE, "parallel.diloco.inner_steps=4"],
    # Streaming, every value in 1 bit (its sign times the mean magnitude of its 4,096), no indices:
    # each of 4 fragments synced once per 5 steps (159x fewer bytes than DDP).
    "streaming-int1": [
        *_AVG, "parallel.diloco.inner_steps=5", "parallel.diloco.fragments=4",
        "parallel.diloco.topk=1", "parallel.diloco.chunk=64", "parallel.diloco.quantize=int1",
    ],
    # Muon as the inner optimizer (MuLoCo) of the streaming 1-bit method, and of DDP, at Muon's own
    # learning rate (at AdamW's 2e-3 it trains worse than AdamW; at 8e-3 better).
    # The same with AdamW inside at H = 7 and 10, the candidates for >= 200x: 222x and 317x fewer
    # bytes than DDP (tiny, 20 steps, the whole periods' mean).
    "streaming-int1-h7": [*_INT1, "parallel.diloco.inner_steps=7"],
    "streaming-int1-h10": [*_INT1, "parallel.diloco.inner_steps=10"],
    "streaming-int1-muon": [*_INT1_MUON, "parallel.diloco.inner_steps=5"],
    "streaming-int1-muon-h10": [*_INT1_MUON, "parallel.diloco.inner_steps=10"],
    "ddp-muon": ["train.optimizer=muon", "train.lr=8e-3"],
}  # fmt: skip

# The common run: the tiny model on the stdlib corpus with a held-out split, as make demo trains it.
COMMON = [
    "model.preset=tiny", "data.source=stdlib", "data.seq_len=256", "data.val_fraction=0.02",
    "train.global_batch_size=16", "train.lr=2e-3", "train.min_lr=2e-4", "train.warmup_steps=20",
    "parallel.strategy=ddp", "run.comm_bytes=true", "run.log_every=1", "run.progress=none",
    "run.plot=false", "run.trackers=[]", "checkpoint.every=0", "checkpoint.final=false",
]  # fmt: skip
NPROC = 2  # processes of every run, sharing the link
BASELINE = "ddp"  # the method every other one is measured against: plain DDP, no compression
SMOOTH = 10  # steps in the moving average the target is judged on (a step's loss is noisy)
WITHIN = 0.01  # a method is "within 1%" of DDP when its mean final validation loss is
# What the JSON's byte figures are.
BYTES_NOTE = (
    "bytes_per_step: the bytes one rank puts on the wire per optimizer step (ring algorithms over the "
    "collectives counted from the dispatcher), the mean over every step of the run, outer syncs "
    "included; comm_bytes_per_step: the same steps' whole buffers (each collective's tensor, the "
    "collective counter's convention); ddp_*: the plain DDP run of the same seed on the same link "
    "(the bytes' reference: bytes_reduction is its wire bytes over the method's); loss_cost: "
    "final_val_loss over baseline_final_val_loss, the run of baseline (DDP with the same train "
    "settings, same seed and link), less 1; dense_loss_cost: over dense_final_val_loss, the run of "
    "dense_method (the same DiLoCo, outer gradients sent whole)"
)


def smoothed(losses: list[float], n: int = SMOOTH) -> list[float]:
    """The mean of the last ``n`` losses at each step (fewer at the start)."""
    return [statistics.fmean(losses[max(0, i + 1 - n) : i + 1]) for i in range(len(losses))]


def time_to(records: list[dict[str, Any]], target: float) -> float | None:
    """Training wall time (the steps' own, without evaluation) until the smoothed loss first reaches
    ``target``; None if it never does."""
    curve = smoothed([m["loss"] for m in records])
    elapsed = 0.0
    for m, loss in zip(records, curve, strict=True):
        elapsed += m["step_time_s"]
        if loss <= target:
            return elapsed
    return None


def run_env(link: Link) -> dict[str, str]:
    """The environment of a run on ``link``: this one, with the link's round-trip time injected
    (:data:`RTT_ENV`) or, without one, none (whatever this environment says)."""
    env = {k: v for k, v in os.environ.items() if k != RTT_ENV}
    if link.rtt_s:
        env[RTT_ENV] = f"{link.rtt_s * 1000:g}"
    return env


def _settings(steps: int, overrides: list[str]) -> list[str]:
    """Every ``--set`` of a run of ``steps`` with ``overrides`` (its run directory aside)."""
    return [*COMMON, f"train.steps={steps}", f"eval.every={steps}", "eval.batches=8", *overrides]


def _run(
    prefix: list[str],
    run_dir: Path,
    steps: int,
    overrides: list[str],
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    cmd = [
        *prefix, sys.executable, "-m", "dtlab", "train", "--nproc", str(NPROC), "--set",
        *_settings(steps, overrides), f"run.dir={run_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise DtlabError(f"{run_dir.name}: dtlab train failed ({proc.returncode}):\n{tail}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def inner_steps(overrides: list[str]) -> int:
    """DiLoCo's H in a run's overrides (the last one given wins); 0 without DiLoCo."""
    values = [o.split("=", 1)[1] for o in overrides if o.startswith("parallel.diloco.inner_steps=")]
    return int(values[-1]) if values else 0


def counted_records(records: list[dict[str, Any]], period: int) -> list[dict[str, Any]]:
    """The steps whose bytes are averaged: with DiLoCo's outer period ``period`` > 1, all steps of
    the run's whole periods (each holds every fragment's sync once; a window of other steps reads
    more or fewer syncs than a period has); otherwise every step after the first."""
    if period > 1 and len(records) >= period:
        return records[: len(records) // period * period]
    return records[1:]


def planned_round_trips(overrides: list[str], steps: int) -> float | None:
    """The collectives across replicas per step that the plan predicts for a run with ``overrides``
    (:func:`dtlab.analysis.latency.cross_replica_collectives`); None where it predicts none."""
    config = load_config(overrides=[*COMMON, f"train.steps={steps}", *overrides])
    return cross_replica_collectives(config, NPROC)


def _row(
    method: str,
    link: Link,
    measured_bps: float,
    records: list[dict[str, Any]],
    period: int = 0,
    seed: int | None = None,
) -> dict[str, Any]:
    steps = records[1:]  # the first step compiles and warms up
    counted = counted_records(records, period)
    return {
        "method": method,
        "seed": seed,
        "link": link.name,
        "link_rate_bps": link.rate_bps,
        "link_measured_bps": measured_bps,
        "link_rtt_s": link.rtt_s,
        # The latency is the benchmark's own sleep before each collective across replicas.
        "latency": "injected" if link.rtt_s else None,
        "comm_bytes_per_step": statistics.fmean(m["comm_bytes"] for m in counted),
        "wire_bytes_per_step": statistics.fmean(m["wire_bytes"] for m in counted),
        # Over every step, outer syncs and the first step included (the JSON's bytes_per_step).
        "bytes_per_step": statistics.fmean(m["wire_bytes"] for m in records),
        "comm_bytes_all_steps": statistics.fmean(m["comm_bytes"] for m in records),
        "round_trips_per_step": statistics.fmean(
            m.get("cross_replica_collectives", 0) for m in counted
        ),
        "round_trips_all_steps": statistics.fmean(
            m.get("cross_replica_collectives", 0) for m in records
        ),
        "step_time_s": statistics.median(m["step_time_s"] for m in steps),
        "mean_step_time_s": statistics.fmean(m["step_time_s"] for m in steps),
        "final_loss": records[-1]["loss"],
        "final_val_loss": records[-1].get("val_loss"),
        "losses": [m["loss"] for m in records],
        "step_times": [m["step_time_s"] for m in records],
    }


def predict(rows: list[dict[str, Any]]) -> None:
    """``predicted_step_time_s`` of every row: compute + wire time + round trips x RTT, the compute
    time from the method's run (same seed) on the unlimited loopback: its step less its wire time
    and injected round trips there.

    The wire time is every rank's wire bytes at the link's measured rate: the ranks share the
    namespace's one rate-limited loopback, like machines on one shared medium, so the NPROC ranks
    sending at once each get 1/NPROC of it (measured: plain DDP's all-reduce at 100 Mbit/s took 2.08 s
    a step for 98.6 Mbit per rank, 47 Mbit/s each).

    The latency term is a model: each collective that crosses replicas (counted per step,
    ``cross_replica_collectives``) costs one round trip, in series with everything else. A ring
    all-reduce on n ranks takes more hops (2(n - 1)); with NPROC = 2 one all-reduce is about one round
    trip. DDP issues its bucket all-reduces while backward still runs, which a real network overlaps
    with the latency; the model does not (nor does the injected delay, a sleep before the issue)."""
    base = {(r["method"], r.get("seed")): r for r in rows if r["link"] == "none"}
    for r in rows:
        ref = base.get((r["method"], r.get("seed")), r)
        compute = ref["mean_step_time_s"]
        if ref["link_measured_bps"]:
            compute -= 8 * NPROC * ref["wire_bytes_per_step"] / ref["link_measured_bps"]
        compute -= ref.get("round_trips_per_step", 0.0) * ref.get("link_rtt_s", 0.0)
        r["compute_time_s"] = max(compute, 0.0)
        rate = r["link_measured_bps"]
        r["predicted_step_time_s"] = (
            r["compute_time_s"]
            + (8 * NPROC * r["wire_bytes_per_step"] / rate if rate else 0.0)
            + r.get("round_trips_per_step", 0.0) * r.get("link_rtt_s", 0.0)
        )


def figures(rows: list[dict[str, Any]], target: float | None = None) -> float:
    """Fill in each row's time to the target loss, its bytes relative to plain DDP's run of the same
    seed (bytes do not depend on the optimizer), and its loss costs over its fair baseline's and its
    dense twin's runs of the same seed (:func:`dtlab.bench.lowcomm_fair.fill_costs`); returns the
    first seed's target: the smoothed loss plain DDP reaches at 3/4 of its steps on the first link
    (all methods of a seed train the same tokens, so each is timed to the same point; each seed has
    its own, in every row's ``target``)."""
    first: float | None = None
    for seed in dict.fromkeys(r.get("seed") for r in rows):
        t = _seed_figures([r for r in rows if r.get("seed") == seed], target)
        first = t if first is None else first
    assert first is not None, "no rows"
    lowcomm_fair.fill_costs(rows)
    return first


def _seed_figures(rows: list[dict[str, Any]], target: float | None) -> float:
    if target is None:
        ddp = next((r for r in rows if r["method"] == BASELINE), rows[0])
        curve = smoothed(ddp["losses"])
        target = curve[(3 * len(curve)) // 4]
    base = {r["link"]: r for r in rows if r["method"] == BASELINE}
    for r in rows:
        records = [
            {"loss": x, "step_time_s": t} for x, t in zip(r["losses"], r["step_times"], strict=True)
        ]
        r["target"] = target
        r["time_to_target_s"] = time_to(records, target)
        r["predicted_time_to_target_s"] = _predicted_time_to(r, target)
        same = base.get(r["link"])
        if same is None:
            continue
        r["ddp_bytes_per_step"] = same.get("bytes_per_step")
        r["ddp_final_val_loss"] = same["final_val_loss"]
        if r["wire_bytes_per_step"]:
            r["bytes_reduction"] = same["wire_bytes_per_step"] / r["wire_bytes_per_step"]
    return target


def _predicted_time_to(r: dict[str, Any], target: float) -> float | None:
    """The steps the run needed to reach the target, at the predicted step time."""
    curve = smoothed(r["losses"])
    reached = next((i + 1 for i, x in enumerate(curve) if x <= target), None)
    return None if reached is None else reached * r["predicted_step_time_s"]


def _link_title(r: dict[str, Any]) -> str:
    rate, rtt = r["link_measured_bps"], r.get("link_rtt_s", 0.0)
    parts = [f"measured {rate / 1e6:.0f} Mbit/s"] if rate else []
    if rtt:
        parts.append(f"round trip {rtt * 1000:g} ms, injected")
    return f"## Link {r['link']}" + (f" ({'; '.join(parts)})" if parts else "")


def _trips(r: dict[str, Any]) -> str:
    return f"{r.get('round_trips_per_step', 0.0):.2f} / {_num(r.get('planned_round_trips'), '.2f')}"


def report(rows: list[dict[str, Any]], target: float, steps: int) -> str:
    """report.md: one table per link (with several seeds, each method's mean and spread)."""
    seeds = list(dict.fromkeys(r.get("seed") for r in rows))
    if len(seeds) > 1:
        return _seeds_report(rows, seeds, steps)
    lines = [
        "# Time to loss over slow links",
        "",
        f"{NPROC} processes, {steps} steps of the same tokens for every method; target: smoothed training "
        f"loss {target:.4f} (plain DDP's at 3/4 of its steps). Bytes: what one rank puts on the wire per "
        f"step (ring algorithms). {lowcomm_fair.FAIR_NOTE} {_TRIPS_NOTE} {_PLOTS_NOTE}",
        "",
    ]
    for link in dict.fromkeys(r["link"] for r in rows):
        sub = [r for r in rows if r["link"] == link]
        lines += [
            _link_title(sub[0]),
            "",
            "| method | wire MiB/step | x DDP | step s (measured) | step s (predicted) | time to target s "
            f"(measured) | (predicted) | final val loss | {lowcomm_fair.COST_COLUMNS} | round trips/step "
            "(counted / plan) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sub:
            lines.append(
                f"| {r['method']} | {r['wire_bytes_per_step'] / 2**20:.3f} | "
                f"{_num(r.get('bytes_reduction'), '.1f')} | {r['step_time_s']:.3f} | "
                f"{r['predicted_step_time_s']:.3f} | {_num(r['time_to_target_s'], '.1f')} | "
                f"{_num(r['predicted_time_to_target_s'], '.1f')} | {_num(r['final_val_loss'], '.4f')} | "
                f"{lowcomm_fair.cost_cells([r], seeds=False)} | {_trips(r)} |"
            )
        lines.append("")
    return "\n".join(lines)


_PLOTS_NOTE = (
    "Plots: pareto.png (final loss against bytes), time_to_target.png (with capped links) and "
    "loss_curves.png (every method's training loss over the run, a moving mean over a fiftieth of "
    "the run or at least 10 steps, first link, mean over the "
    "seeds, and its gap to its baseline in percent, step by step)."
)
_TRIPS_NOTE = (
    "Round trips: the collectives that cross replicas per step (counted in the runs / predicted by "
    "the plan); the predicted step adds one round-trip time for each (a model: in series, one round "
    "trip per collective). A link's round trip is injected: every rank sleeps that long before each "
    "such collective."
)


def _spread(values: list[float], fmt: str, scale: float = 1.0) -> str:
    """``mean (min to max)`` of ``values``."""
    if not values:
        return "-"
    v = [x * scale for x in values]
    return f"{format(statistics.fmean(v), fmt)} ({format(min(v), fmt)} to {format(max(v), fmt)})"


def summarise(rows: list[dict[str, Any]], link: str) -> dict[str, dict[str, Any]]:
    """Per method, over the seeds of ``link``: the mean and spread of the final validation loss, the
    mean time to target, whether it is within 1% of its baseline (its mean loss cost is), and the
    costs against its baseline and dense twin (:func:`dtlab.bench.lowcomm_fair.cost_summary`)."""
    out: dict[str, dict[str, Any]] = {}
    sub = [r for r in rows if r["link"] == link]
    for method in dict.fromkeys(r["method"] for r in sub):
        runs = [r for r in sub if r["method"] == method]
        losses = [r["final_val_loss"] for r in runs if r["final_val_loss"] is not None]
        costs = [r["loss_cost"] for r in runs if "loss_cost" in r]
        reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
        mean_cost = statistics.fmean(costs) if costs else None
        out[method] = {
            "seeds": len(runs),
            "mean_final_val_loss": statistics.fmean(losses) if losses else None,
            "min_final_val_loss": min(losses) if losses else None,
            "max_final_val_loss": max(losses) if losses else None,
            "std_final_val_loss": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "mean_loss_cost": mean_cost,
            "within_1_percent": mean_cost is not None and mean_cost <= WITHIN,
            "reached_target": len(reached),
            "mean_time_to_target_s": statistics.fmean(reached) if reached else None,
            **lowcomm_fair.cost_summary(runs),
        }
    return out


def _seeds_report(rows: list[dict[str, Any]], seeds: list[Any], steps: int) -> str:
    targets = ", ".join(
        f"{next(r['target'] for r in rows if r.get('seed') == s):.4f}" for s in seeds
    )
    lines = [
        "# Time to loss over slow links",
        "",
        f"{NPROC} processes, {steps} steps, seeds {', '.join(str(s) for s in seeds)} (train.seed: the "
        "initial weights and the data order); every method trains the tokens of each seed, and is "
        f"compared with runs of the same seed. Targets: each seed's plain DDP smoothed training loss "
        f"at 3/4 of its steps ({targets}). Bytes: what one rank puts on the wire per step, mean over "
        f"the seeds. {lowcomm_fair.FAIR_NOTE} Final val loss and costs: mean (min to max) over the "
        "seeds; within 2% of DDP: the mean loss cost is at most 2%; within 1% of dense: the mean "
        f"dense loss cost at most 1%. {_TRIPS_NOTE} {_PLOTS_NOTE}",
        "",
    ]
    for link in dict.fromkeys(r["link"] for r in rows):
        sub = [r for r in rows if r["link"] == link]
        summary = summarise(rows, link)
        lines += [
            _link_title(sub[0]),
            "",
            "| method | wire MiB/step | x DDP | step s (measured) | step s (predicted) | time to target s "
            "(measured, mean) | (predicted, mean) | final val loss | "
            f"{lowcomm_fair.SEEDS_COST_COLUMNS} | round trips/step (counted / plan) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, s in summary.items():
            runs = [r for r in sub if r["method"] == method]
            reduction = [r["bytes_reduction"] for r in runs if "bytes_reduction" in r]
            predicted = [
                r["predicted_time_to_target_s"]
                for r in runs
                if r["predicted_time_to_target_s"] is not None
            ]
            reached = (
                f" ({s['reached_target']} of {s['seeds']})"
                if s["reached_target"] < s["seeds"]
                else ""
            )
            lines.append(
                f"| {method} | {statistics.fmean(r['wire_bytes_per_step'] for r in runs) / 2**20:.3f} | "
                f"{_num(statistics.fmean(reduction) if reduction else None, '.1f')} | "
                f"{statistics.fmean(r['step_time_s'] for r in runs):.3f} | "
                f"{statistics.fmean(r['predicted_step_time_s'] for r in runs):.3f} | "
                f"{_num(s['mean_time_to_target_s'], '.1f')}{reached} | "
                f"{_num(statistics.fmean(predicted) if predicted else None, '.1f')} | "
                f"{_spread([r['final_val_loss'] for r in runs if r['final_val_loss'] is not None], '.4f')} | "
                f"{lowcomm_fair.cost_cells(runs, seeds=True)} | {_trips(runs[0])} |"
            )
        lines.append("")
    return "\n".join(lines)


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def results_json(rows: list[dict[str, Any]], seeds: list[Any]) -> dict[str, Any]:
    """What ``--json OUT`` writes: per method and seed (on the first link) the bytes per step, the
    final validation loss and DDP's of the same seed; every run's figures on every link (``runs``);
    and per method the mean and spread over the seeds (``summary``)."""
    first = rows[0]["link"]
    keep = (
        "bytes_per_step", "ddp_bytes_per_step", "final_val_loss", "ddp_final_val_loss",
        "comm_bytes_all_steps", "wire_bytes_per_step", "loss_cost", "round_trips_all_steps",
        "round_trips_per_step", "planned_round_trips", "step_time_s", "predicted_step_time_s",
        "time_to_target_s", "predicted_time_to_target_s", "target", "baseline",
        "baseline_final_val_loss", "dense_method", "dense_final_val_loss", "dense_loss_cost",
        "bytes_reduction", "reused",
    )  # fmt: skip
    rename = {"comm_bytes_all_steps": "comm_bytes_per_step"}

    def entry(r: dict[str, Any]) -> dict[str, Any]:
        return {rename.get(k, k): r.get(k) for k in keep}

    methods: dict[str, Any] = {}
    for r in rows:
        if r["link"] == first:
            methods.setdefault(r["method"], {})[str(r["seed"])] = entry(r)
    runs = [
        {"method": r["method"], "seed": r["seed"], "link": r["link"], "link_rtt_s": r["link_rtt_s"],
         "latency": r["latency"], "link_measured_bps": r["link_measured_bps"], **entry(r)}
        for r in rows
    ]  # fmt: skip
    return {
        "bytes": BYTES_NOTE,
        "seeds": seeds,
        "link": first,
        "methods": methods,
        "summary": {link: summarise(rows, link) for link in dict.fromkeys(r["link"] for r in rows)},
        "runs": runs,
    }


def plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """final loss against wire bytes per step (log; the mean over the seeds, bars from the lowest to
    the highest), the loss curves and each method's gap to its baseline, and the mean time-to-target
    against link rate."""
    import matplotlib

    matplotlib.use("Agg")

    paths = [
        _pareto_plot(rows, out / "pareto.png"),
        # Over a long run a 10-step mean leaves the noise of one replica's half batch between
        # syncs: the curves are smoothed over a fiftieth of the run (at least SMOOTH steps).
        lowcomm_fair.loss_curves_plot(
            rows, out / "loss_curves.png", max(SMOOTH, len(rows[0]["losses"]) // 50)
        ),
    ]
    capped = [r for r in rows if r["link_rate_bps"]]
    if capped:
        paths.append(_time_to_target_plot(capped, out / "time_to_target.png"))
    return paths


def _pareto_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Each method's final loss against its wire bytes per step on the first link, to ``path``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    first = rows[0]["link"]
    for method, s in summarise(rows, first).items():
        if s["mean_final_val_loss"] is None:
            continue
        runs = [r for r in rows if r["link"] == first and r["method"] == method]
        x = statistics.fmean(r["wire_bytes_per_step"] for r in runs)
        y = s["mean_final_val_loss"]
        err = [[y - s["min_final_val_loss"]], [s["max_final_val_loss"] - y]]
        ax.errorbar([x], [y], yerr=err, fmt="o", capsize=3)
        ax.annotate(method, (x, y), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes one rank sends per step")
    seeds = len(dict.fromkeys(r.get("seed") for r in rows))
    ax.set_ylabel(
        "final validation loss (same tokens)" + (f", mean of {seeds} seeds" if seeds > 1 else "")
    )
    ax.set_title("loss against bytes moved")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _time_to_target_points(
    capped: list[dict[str, Any]], method: str, rtt: float
) -> list[tuple[float, float]]:
    """(link rate, mean time to the target) of ``method`` on each capped link of round trip
    ``rtt``, where some seed reached the target, by rate."""
    pts = []
    for link in dict.fromkeys(r["link"] for r in capped):
        runs = [
            r
            for r in capped
            if r["method"] == method
            and r["link"] == link
            and r.get("link_rtt_s", 0.0) == rtt
            and r["time_to_target_s"] is not None
        ]
        if runs:
            mean = statistics.fmean(r["time_to_target_s"] for r in runs)
            pts.append((runs[0]["link_rate_bps"], mean))
    pts.sort()
    return pts


def _time_to_target_plot(capped: list[dict[str, Any]], path: Path) -> Path:
    """Each method's mean time to the target against the capped links' rates (a line per round
    trip), to ``path``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for method in dict.fromkeys(r["method"] for r in capped):
        for rtt in sorted({r.get("link_rtt_s", 0.0) for r in capped}):
            pts = _time_to_target_points(capped, method, rtt)
            if pts:
                label = method + (f" +{rtt * 1000:g} ms" if rtt else "")
                ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("wall time to the target loss (s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _methods(text: str) -> list[str]:
    """``--methods``: known names, DDP first (the bytes are relative to it: added if left out)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise DtlabError(
            f"--methods: {', '.join(unknown)} not known; allowed: {', '.join(METHODS)}"
        )
    return [BASELINE, *(m for m in dict.fromkeys(methods) if m != BASELINE)]


def _seeds(n: int | None, overrides: list[str]) -> list[int | None]:
    """The seeds to run (``train.seed`` 0 to n - 1); without --seeds, the run's own (None)."""
    if n is None:
        return [None]
    if n < 1:
        raise DtlabError(f"--seeds {n}: allowed a number of seeds of 1 or more")
    given = [o for o in overrides if o.startswith("train.seed=")]
    if given:
        raise DtlabError(
            f"--set {given[-1]} and --seeds {n}: --seeds sets train.seed (0 to {n - 1}) for every "
            "run; give one or the other"
        )
    return list(range(n))


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dtlab.bench.lowcomm``."""
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.lowcomm", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--links",
        default="none,1gbit,100mbit",
        help="comma-separated links, each a rate or none, optionally with an injected round-trip "
        "time: none,1gbit+20ms,100mbit+100ms (default none,1gbit,100mbit)",
    )
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of: {', '.join(METHODS)} (ddp always runs: the bytes' baseline; "
        "so does each method's DDP of the same train settings, and a compressing DiLoCo method's "
        "dense twin)",
    )
    ap.add_argument(
        "--steps", type=positive_int, default=160, help="optimizer steps of every run (default 160)"
    )
    ap.add_argument(
        "--seeds",
        type=positive_int,
        default=None,
        help="run every method with train.seed 0 to N-1 (weights and data order), each compared "
        "with DDP's run of the same seed; the report gives the mean and spread",
    )
    ap.add_argument(
        "--json",
        dest="json_out",
        default=None,
        help="also write per method and seed bytes_per_step, ddp_bytes_per_step, final_val_loss "
        "and ddp_final_val_loss (and more) to this JSON file",
    )
    ap.add_argument("--out", default="bench-out/lowcomm", help="output directory")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="read back a run that an earlier invocation finished in --out with the same settings "
        "instead of training it again (uncapped links without an injected round trip only: their "
        "losses and bytes; the report names the runs reused)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        nargs="*",
        default=[],
        help="more config overrides, for every run (e.g. a smaller shape: model.dim=128 "
        "model.n_layers=2)",
    )
    return ap


def _measure_all(
    links: list[Link],
    seeds: list[int | None],
    methods: list[str],
    args: argparse.Namespace,
    out: Path,
) -> list[dict[str, Any]]:
    """Every method, with the fair baselines and dense twins it needs (:func:`run_plan`), at every
    seed on every link (each link's rate measured in its namespace), as rows with the round trips
    the plan expects."""
    rows = []
    runs = run_plan(methods, args.overrides, args.steps)
    planned = {m: planned_round_trips(p.overrides, args.steps) for m, p in runs.items()}
    for link in links:
        with link_namespace(link) as prefix:
            rate = measure_link(prefix, 16 << 20) if link.rate_bps else 0.0
            for seed in seeds:
                for method, p in runs.items():
                    rows.append(_measure(prefix, link, rate, p, seed, args, out))
                    rows[-1]["planned_round_trips"] = planned[method]
    return rows


def run_plan(
    methods: list[str], overrides: list[str], steps: int
) -> dict[str, lowcomm_fair.Planned]:
    """The runs ``methods`` need with the user's ``overrides``: plain DDP, each method's DDP twin
    (same train settings) and, for a compressing DiLoCo method, its dense twin
    (:func:`dtlab.bench.lowcomm_fair.plan`)."""
    return lowcomm_fair.plan(methods, METHODS, overrides, [*COMMON, f"train.steps={steps}"])


def _write_outputs(
    rows: list[dict[str, Any]], seeds: list[int | None], args: argparse.Namespace, out: Path
) -> None:
    """The rows' predictions and figures, written: results.json, report.md, --json's file and the
    plots; the report printed."""
    predict(rows)
    target = figures(rows)
    (out / "results.json").write_text(json.dumps({"target": target, "rows": rows}, indent=1))
    text = report(rows, target, args.steps) + lowcomm_reuse.reused_note(rows)
    (out / "report.md").write_text(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results_json(rows, seeds), indent=1))
    plots(rows, out)
    print(text)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        links = parse_links(args.links)
        methods = _methods(args.methods)
        seeds = _seeds(args.seeds, args.overrides)
        bench_rtt_s()  # a bad DTLAB_BENCH_RTT_MS in this environment is named before any run
        out = output_dir(args.out, "--out")
        if args.json_out:
            output_file(args.json_out, "--json")
        rows = _measure_all(links, seeds, methods, args, out)
        _write_outputs(rows, seeds, args, out)
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _measure(
    prefix: list[str],
    link: Link,
    rate: float,
    planned: lowcomm_fair.Planned,
    seed: int | None,
    args: argparse.Namespace,
    out: Path,
) -> dict[str, Any]:
    """One run of a planned method (with ``seed``) on ``link``, as a row naming its baseline and
    dense twin, with its train settings."""
    t0 = time.perf_counter()
    method = planned.name
    name = f"{link.name}-{lowcomm_fair.dir_name(method)}" + (
        f"-seed{seed}" if seed is not None else ""
    )
    run_dir = out / "runs" / name
    overrides = [*planned.overrides] + ([f"train.seed={seed}"] if seed is not None else [])
    settings = _settings(args.steps, overrides)
    records = lowcomm_reuse.reusable(run_dir, settings, link) if args.reuse else None
    reused = records is not None
    if records is None:
        lowcomm_reuse.forget(run_dir)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        records = _run(prefix, run_dir, args.steps, overrides, run_env(link))
        lowcomm_reuse.mark_done(run_dir, settings, link)
    r = _row(method, link, rate, records, inner_steps(overrides), seed)
    r.update(baseline=planned.baseline, dense_method=planned.dense, train_settings=planned.train)
    r["reused"] = reused
    print(
        f"{link.name:>8} {method:<15} {'' if seed is None else f'seed {seed} '}"
        f"{r['wire_bytes_per_step'] / 2**20:8.3f} MiB/step {r['step_time_s']:.3f} s/step  "
        f"{r['round_trips_per_step']:.2f} round trips/step  val {_num(r['final_val_loss'], '.4f')}  "
        + ("(reused)" if reused else f"({time.perf_counter() - t0:.0f} s)"),
        flush=True,
    )
    return r


if __name__ == "__main__":
    sys.exit(run_command(main))  # a DtlabError anywhere: one line, never a traceback
