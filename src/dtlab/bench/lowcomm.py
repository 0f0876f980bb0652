"""Time-to-loss over slow links: every low-communication method trained on the same tokens, on each link,
measured next to the cost model.

    python -m dtlab.bench.lowcomm --links 100mbit,1gbit [--methods ddp,diloco-int4,...] [--steps 160]

For each link (a network namespace whose loopback is rate-limited with ``tc``: :mod:`dtlab.bench.link`)
and each method, ``dtlab train`` runs on 2 processes inside the namespace with ``run.comm_bytes`` on, so
every step's collectives are counted from the dispatcher. Per run: bytes per step (whole buffers and what
one rank puts on the wire), the median step time, the wall time until the smoothed training loss first
reaches the target, the final validation loss after the same tokens, and the step time the cost model
predicts: the method's compute time plus its wire bytes at the link's measured rate. The compute time is
the method's step time on the unlimited loopback less its wire bytes at the loopback's measured rate (or
the method's own step time, without a ``none`` link). Writes ``results.json``, ``report.md`` and two
plots: final loss against bytes moved (the Pareto front) and time-to-target against link rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dtlab.bench.link import Link, link_namespace, measure_link, parse_links
from dtlab.errors import DtlabError

# The outer step of the DiLoCo runs: the replicas' average (outer lr 1, no momentum). Over runs of a
# few hundred steps with H of 4 to 16 it beat the paper's Nesterov (lr 0.7, momentum 0.9), whose
# effective step lr / (1 - momentum) overshoots when there are many outer steps (docs/compression.md).
_AVG = ["parallel.diloco.outer_lr=1", "parallel.diloco.outer_momentum=0"]

_SPARSE = [
    *_AVG, "parallel.diloco.topk=0.015", "parallel.diloco.quantize=int2",
    "parallel.diloco.error_decay=0.95",
]  # fmt: skip

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
    # SparseLoCo: each chunk of 4,096 values sends its top 1.5% in 2 bits with 12-bit indices,
    # the rest kept in an error feedback decayed by 0.95 (which stands in for outer momentum).
    "sparseloco": [*_SPARSE, "parallel.diloco.inner_steps=1"],
    "sparseloco-h2": [*_SPARSE, "parallel.diloco.inner_steps=2"],
    "sparseloco-h4": [*_SPARSE, "parallel.diloco.inner_steps=4"],
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


def _run(
    prefix: list[str], run_dir: Path, steps: int, overrides: list[str]
) -> list[dict[str, Any]]:
    cmd = [
        *prefix, sys.executable, "-m", "dtlab", "train", "--nproc", str(NPROC), "--set", *COMMON,
        f"train.steps={steps}", f"eval.every={steps}", "eval.batches=8", f"run.dir={run_dir}",
        *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
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


def _row(
    method: str,
    link: Link,
    measured_bps: float,
    records: list[dict[str, Any]],
    period: int = 0,
) -> dict[str, Any]:
    steps = records[1:]  # the first step compiles and warms up
    counted = counted_records(records, period)
    return {
        "method": method,
        "link": link.name,
        "link_rate_bps": link.rate_bps,
        "link_measured_bps": measured_bps,
        "comm_bytes_per_step": statistics.fmean(m["comm_bytes"] for m in counted),
        "wire_bytes_per_step": statistics.fmean(m["wire_bytes"] for m in counted),
        "step_time_s": statistics.median(m["step_time_s"] for m in steps),
        "mean_step_time_s": statistics.fmean(m["step_time_s"] for m in steps),
        "final_loss": records[-1]["loss"],
        "final_val_loss": records[-1].get("val_loss"),
        "losses": [m["loss"] for m in records],
        "step_times": [m["step_time_s"] for m in records],
    }


def predict(rows: list[dict[str, Any]]) -> None:
    """``predicted_step_time_s`` of every row: compute + wire time, the compute time from the method's
    run on the unlimited loopback (its step less its wire time there).

    The wire time is every rank's wire bytes at the link's measured rate: the ranks share the
    namespace's one rate-limited loopback, like machines on one shared medium, so the NPROC ranks
    sending at once each get 1/NPROC of it (measured: plain DDP's all-reduce at 100 Mbit/s took 2.08 s
    a step for 98.6 Mbit per rank, 47 Mbit/s each)."""
    base = {r["method"]: r for r in rows if r["link"] == "none"}
    for r in rows:
        ref = base.get(r["method"], r)
        compute = ref["mean_step_time_s"]
        if ref["link_measured_bps"]:
            compute -= 8 * NPROC * ref["wire_bytes_per_step"] / ref["link_measured_bps"]
        r["compute_time_s"] = max(compute, 0.0)
        rate = r["link_measured_bps"]
        r["predicted_step_time_s"] = r["compute_time_s"] + (
            8 * NPROC * r["wire_bytes_per_step"] / rate if rate else 0.0
        )


def figures(rows: list[dict[str, Any]], target: float | None = None) -> float:
    """Fill in each row's time to the target loss and bytes relative to DDP; returns the target: the
    smoothed loss DDP reaches at 3/4 of its steps on the first link (all methods train the same
    tokens, so each is timed to the same point)."""
    if target is None:
        ddp = next((r for r in rows if r["method"] == BASELINE), rows[0])
        curve = smoothed(ddp["losses"])
        target = curve[(3 * len(curve)) // 4]
    ddp_bytes = {r["link"]: r["wire_bytes_per_step"] for r in rows if r["method"] == BASELINE}
    ddp_loss = {r["link"]: r["final_val_loss"] for r in rows if r["method"] == BASELINE}
    for r in rows:
        records = [
            {"loss": x, "step_time_s": t} for x, t in zip(r["losses"], r["step_times"], strict=True)
        ]
        r["time_to_target_s"] = time_to(records, target)
        r["predicted_time_to_target_s"] = _predicted_time_to(r, target)
        if r["link"] in ddp_bytes and r["wire_bytes_per_step"]:
            r["bytes_reduction"] = ddp_bytes[r["link"]] / r["wire_bytes_per_step"]
        if ddp_loss.get(r["link"]) and r["final_val_loss"] is not None:
            r["loss_cost"] = r["final_val_loss"] / ddp_loss[r["link"]] - 1
    return target


def _predicted_time_to(r: dict[str, Any], target: float) -> float | None:
    """The steps the run needed to reach the target, at the predicted step time."""
    curve = smoothed(r["losses"])
    reached = next((i + 1 for i, x in enumerate(curve) if x <= target), None)
    return None if reached is None else reached * r["predicted_step_time_s"]


def report(rows: list[dict[str, Any]], target: float, steps: int) -> str:
    """report.md: one table per link."""
    lines = [
        "# Time to loss over slow links",
        "",
        f"{NPROC} processes, {steps} steps of the same tokens for every method; target: smoothed training "
        f"loss {target:.4f} (DDP's at 3/4 of its steps). Bytes: what one rank puts on the wire per step "
        "(ring algorithms); x DDP: DDP's bytes over the method's. Loss cost: final validation loss over "
        "DDP's, less 1.",
        "",
    ]
    for link in dict.fromkeys(r["link"] for r in rows):
        sub = [r for r in rows if r["link"] == link]
        rate = sub[0]["link_measured_bps"]
        lines += [
            f"## Link {link}" + (f" (measured {rate / 1e6:.0f} Mbit/s)" if rate else ""),
            "",
            "| method | wire MiB/step | x DDP | step s (measured) | step s (predicted) | time to target s "
            "(measured) | (predicted) | final val loss | loss cost |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sub:
            lines.append(
                f"| {r['method']} | {r['wire_bytes_per_step'] / 2**20:.3f} | "
                f"{_num(r.get('bytes_reduction'), '.1f')} | {r['step_time_s']:.3f} | "
                f"{r['predicted_step_time_s']:.3f} | {_num(r['time_to_target_s'], '.1f')} | "
                f"{_num(r['predicted_time_to_target_s'], '.1f')} | {_num(r['final_val_loss'], '.4f')} | "
                f"{_num(100 * r['loss_cost'] if 'loss_cost' in r else None, '+.2f')}% |"
            )
        lines.append("")
    return "\n".join(lines)


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """final loss against wire bytes per step (log), and time-to-target against link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    first = rows[0]["link"]
    for r in (r for r in rows if r["link"] == first and r["final_val_loss"] is not None):
        ax.scatter(r["wire_bytes_per_step"], r["final_val_loss"])
        ax.annotate(r["method"], (r["wire_bytes_per_step"], r["final_val_loss"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes one rank sends per step")
    ax.set_ylabel("final validation loss (same tokens)")
    ax.set_title("loss against bytes moved")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "pareto.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    capped = [r for r in rows if r["link_rate_bps"]]
    if capped:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        for method in dict.fromkeys(r["method"] for r in capped):
            pts = sorted(
                (r["link_rate_bps"], r["time_to_target_s"])
                for r in capped
                if r["method"] == method and r["time_to_target_s"] is not None
            )
            if pts:
                ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-", label=method)
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Mbit/s)")
        ax.set_ylabel("wall time to the target loss (s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "time_to_target.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.lowcomm", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--links",
        default="none,1gbit,100mbit",
        help="comma-separated links (default none,1gbit,100mbit)",
    )
    ap.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}"
    )
    ap.add_argument(
        "--steps", type=int, default=160, help="optimizer steps of every run (default 160)"
    )
    ap.add_argument("--out", default="bench-out/lowcomm", help="output directory")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="more config overrides")
    args = ap.parse_args(argv)
    try:
        links = parse_links(args.links)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise DtlabError(
                f"--methods: {', '.join(unknown)} not known; allowed: {', '.join(METHODS)}"
            )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for link in links:
            with link_namespace(link) as prefix:
                rate = measure_link(prefix, 16 << 20) if link.rate_bps else 0.0
                for method in methods:
                    t0 = time.perf_counter()
                    run_dir = out / "runs" / f"{link.name}-{method}"
                    if run_dir.exists():
                        import shutil

                        shutil.rmtree(run_dir)
                    overrides = [*METHODS[method], *args.overrides]
                    records = _run(prefix, run_dir, args.steps, overrides)
                    rows.append(_row(method, link, rate, records, inner_steps(overrides)))
                    r = rows[-1]
                    print(
                        f"{link.name:>8} {method:<15} {r['wire_bytes_per_step'] / 2**20:8.3f} MiB/step "
                        f"{r['step_time_s']:.3f} s/step  val {_num(r['final_val_loss'], '.4f')}  "
                        f"({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
        predict(rows)
        target = figures(rows)
        (out / "results.json").write_text(json.dumps({"target": target, "rows": rows}, indent=1))
        (out / "report.md").write_text(report(rows, target, args.steps))
        plots(rows, out)
        print(report(rows, target, args.steps))
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
