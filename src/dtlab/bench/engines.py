"""``dtlab bench --engine torch,mlx``: the same config trained by each engine, measured the same way.

Both engines run through ``dtlab train`` (so the same data, schedule and optimizer) with a metrics line
per step; the figures are medians over the steps after the warm-up, taken from those lines.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from dtlab.bench.report import plot_loss_curves, tail_phrase, tail_steps
from dtlab.bench.sweep import layout_of
from dtlab.errors import DtlabError

MIB = 2**20


BLAS_ENV = "DTLAB_MLX_BLAS"


def engine_env(engine: str) -> dict[str, str]:
    """The environment of one engine's runs: ``$DTLAB_MLX_BLAS`` (a BLAS library) preloaded for MLX only.

    MLX's Linux CPU wheel calls a reference BLAS; preloading an optimised one (OpenBLAS) speeds its matrix
    products up many times, but preloaded into torch it competes with torch's own threads.
    """
    env = dict(os.environ)
    blas = env.get(BLAS_ENV)
    if blas and engine == "mlx":
        env["LD_PRELOAD"] = f"{blas} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else blas
    return env


def engine_row(run_dir: Path, engine: str, nproc: int, warmup: int) -> dict[str, Any]:
    """One engine's figures from the run directory ``dtlab train`` wrote."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    timed = metrics[warmup:] or metrics
    times = [m["step_time_s"] for m in timed]
    tokens_per_step = summary["global_batch_size"] * summary["seq_len"]
    median = statistics.median(times)
    losses = [m["loss"] for m in metrics]
    return {
        "engine": engine,
        "strategy": summary["strategy"],
        "layout": summary["layout"],  # as the run named it (dtlab.dims.layout_name)
        "nproc": nproc,
        "precision": summary["precision"],
        "params": summary["params"],
        "step_time_s": median,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_s": tokens_per_step / median,
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "loss_final": statistics.fmean(losses[-tail_steps(losses) :]),
        "loss_final_steps": tail_steps(losses),
        "losses": losses,
        "timed_steps": len(timed),
    }


def run_engines(
    config_path: str | None,
    overrides: list[str],
    engines: list[str],
    combos: list[tuple[str, int, str]],
    steps: int,
    warmup: int,
    out: Path,
) -> dict[str, Any]:
    """Train each (strategy, nproc, precision) with each engine; write results.json, report.md, a plot."""
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    jobs = [(e, *c) for c in combos for e in engines]
    for i, (engine, strategy, nproc, precision) in enumerate(jobs):
        layout = layout_of(
            config_path,
            [*overrides, f"parallel.strategy={strategy}", f"train.precision={precision}"],
            nproc,
        )
        label = f"{engine} {layout} {precision}"
        print(f"[{i + 1}/{len(jobs)}] {label}", flush=True)
        run_dir = out / "runs" / f"{i:02d}-{engine}-{strategy}-{nproc}-{precision}"
        args = [
            sys.executable, "-m", "dtlab", "train", *([config_path] if config_path else []),
            "--engine", engine, "--nproc", str(nproc), "--set", *overrides,
            f"parallel.strategy={strategy}", f"train.precision={precision}",
            f"train.steps={warmup + steps}", "run.log_every=1", "run.progress=none",
            "run.plot=false", "run.tensorboard=false", "run.trackers=[]", "checkpoint.every=0",
            "checkpoint.final=false", "checkpoint.resume=never", f"run.dir={run_dir}",
        ]  # fmt: skip
        proc = subprocess.run(args, capture_output=True, text=True, env=engine_env(engine))
        if proc.returncode != 0 or not (run_dir / "summary.json").exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"  failed: {tail}", flush=True)
            failed.append({"label": label, "error": tail})
            continue
        row = engine_row(run_dir, engine, nproc, warmup)
        rows.append(row)
        print(
            f"  {row['step_time_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s, "
            f"peak {row['peak_memory_bytes'] / MIB:,.0f} MiB/rank",
            flush=True,
        )
    results = {"engine_rows": rows, "failed": failed, "steps": steps, "warmup": warmup}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plot = _plot(rows, out) if rows else None
    (out / "report.md").write_text(engine_report(results, plot), encoding="utf-8")
    return results


def engine_report(results: dict[str, Any], plot: Path | None) -> str:
    rows = results["engine_rows"]
    lines = [
        "# dtlab bench: engines side by side",
        "",
        f"Each row trains the same config with `dtlab train --engine E`: {results['warmup']} warm-up + "
        f"{results['steps']} timed steps; step time is the median (min-max) of the timed steps, tokens/s "
        "counts all ranks, peak memory is per rank (torch: peak RSS on CPU or the CUDA allocator's "
        "peak; mlx: MLX's allocator peak, mx.get_peak_memory), final loss "
        f"{tail_phrase([r.get('loss_final_steps', tail_steps(r['losses'])) for r in rows])}.",
        "",
        "| engine | run | step s (min-max) | tokens/s | vs torch | peak mem MiB | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        torch_row = next(
            (t for t in rows if t["engine"] == "torch" and _key(t) == _key(r)),
            None,
        )
        ratio = f"{r['tokens_per_s'] / torch_row['tokens_per_s']:.2f}x" if torch_row else "-"
        lines.append(
            f"| {r['engine']} | {r['layout']} {r['precision']} "
            f"| {r['step_time_s']:.3f} ({r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f}) "
            f"| {r['tokens_per_s']:,.0f} | {ratio} | {r['peak_memory_bytes'] / MIB:,.0f} "
            f"| {r['loss_final']:.4f} |"
        )
    if results["failed"]:
        lines += ["", "## Failed runs", ""] + [
            f"- {f['label']}: {f['error']}" for f in results["failed"]
        ]
    if plot is not None:
        lines += ["", f"![{plot.stem}]({plot.name})"]
    return "\n".join(lines) + "\n"


def _key(r: dict[str, Any]) -> tuple[str, int, str]:
    return r["strategy"], r["nproc"], r["precision"]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = engines_figure(rows)
    path = out / "engines.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def engines_figure(rows: list[dict[str, Any]]) -> Any:
    """Throughput bars (each with its value) and the loss curves (integer steps; curves that coincide
    named in the title and drawn in their own line styles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    names = [f"{r['engine']}\n{r['layout']} {r['precision']}" for r in rows]
    colors = ["#4477aa" if r["engine"] == "torch" else "#ee6677" for r in rows]
    bars = a.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    a.bar_label(bars, [f"{r['tokens_per_s']:,.0f}" for r in rows], fontsize=8)
    a.margins(y=0.12)  # room for the labels above the bars
    a.set_xticks(range(len(rows)), names, fontsize=8)
    a.set_ylabel("tokens/s (all ranks)")
    a.set_title("throughput, median of the timed steps")
    curves = {name.replace("\n", " "): r["losses"] for name, r in zip(names, rows, strict=True)}
    plot_loss_curves(b, curves, "loss curves")
    b.set_ylabel("loss")
    fig.tight_layout()
    return fig


def check_engines(engines: list[str]) -> None:
    if "mlx" in engines:
        from dtlab.mlx import require_mlx

        require_mlx()
    if not engines:
        raise DtlabError("--engine '': allowed: torch, mlx")
