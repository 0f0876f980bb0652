"""``dtlab bench``: run every combination of strategy, process count, compression and precision in its own
processes, then write results.json, results.csv, report.md and PNG plots."""

from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from dtlab.bench.report import format_mfu
from dtlab.dims import DPWrapper
from dtlab.errors import DtlabError

CSV_COLUMNS = [
    "strategy", "sharding", "nproc", "compression", "precision", "step_time_s", "step_time_min_s",
    "step_time_max_s", "tokens_per_s", "samples_per_s", "mfu", "peak_memory_bytes", "params_bytes",
    "grads_bytes", "optimizer_bytes", "activation_bytes", "activation_bytes_predicted",
    "comm_bytes_per_step", "comm_bytes_per_step_predicted", "comm_bus_bytes_per_step", "comm_time_s",
    "compute_time_s", "overlap_fraction", "overlap_disturbed", "cpu_util", "loss_final",
]  # fmt: skip


def compression_overrides(compression: str) -> list[str]:
    """Config overrides for a ``--compression`` name; ``demo`` is the DeMo optimizer (no all-reduce),
    ``dct-quant`` the dct hook with quantised coefficients."""
    if compression == "demo":
        return ["parallel.compression=none", "train.optimizer=demo"]
    if compression == "dct-quant":
        return ["parallel.compression=dct", "parallel.compression_options.coding=quant"]
    return [f"parallel.compression={compression}"]


def combinations(
    strategies: list[str],
    nprocs: list[int],
    compressions: list[str],
    precisions: list[str],
    model_parallel: int = 1,
) -> list[tuple[str, int, str, str]]:
    """Every (strategy, nproc, compression, precision) worth running: ``single`` only without data
    parallelism (on ``model_parallel`` = tp x pp processes), the others with it."""
    out = []
    for s, n, c, p in itertools.product(strategies, nprocs, compressions, precisions):
        alone = DPWrapper.of(s) is DPWrapper.NONE  # no data parallelism
        if n % model_parallel or alone != (n == model_parallel):
            continue
        if alone and c != "none":
            continue
        out.append((s, n, c, p))
    if not out:
        each = "" if model_parallel == 1 else f" (tp x pp = {model_parallel} of them per model)"
        raise DtlabError(
            f"--strategies {','.join(strategies)} with --nproc {','.join(map(str, nprocs))} gives nothing "
            f"to run: 'single' runs on {model_parallel} process(es), the others on more{each}"
        )
    return list(dict.fromkeys(out))


def run_sweep(
    config_path: str | None,
    overrides: list[str],
    combos: list[tuple[str, int, str, str]],
    steps: int,
    warmup: int,
    out: Path,
    profile: bool = False,
) -> dict[str, Any]:
    """Run each combination in fresh processes; returns ``{"rows": [...], "failed": [...]}``."""
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    for i, (strategy, nproc, compression, precision) in enumerate(combos):
        label = f"{strategy} x{nproc} {compression} {precision}"
        print(f"[{i + 1}/{len(combos)}] {label}", flush=True)
        row_path = out / "rows" / f"{i:02d}-{strategy}-{nproc}-{compression}-{precision}.json"
        args = [
            sys.executable, "-m", "dtlab.bench.worker", *([config_path] if config_path else []),
            "--out", str(row_path), "--nproc", str(nproc), "--warmup", str(warmup),
            *(["--profile", str(out / "profile" / row_path.stem)] if profile else []),
            "--set", *overrides, f"parallel.strategy={strategy}", *compression_overrides(compression),
            f"train.precision={precision}", f"train.steps={steps}", "run.progress=none",
        ]  # fmt: skip
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0 or not row_path.exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"  failed: {tail}", flush=True)
            failed.append({"label": label, "error": tail})
            continue
        row = json.loads(row_path.read_text())
        rows.append(row)
        print(
            f"  {row['step_time_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {format_mfu(row['mfu'], row['peak_flops_source'])}, "
            f"comm {row['comm_bytes_per_step'] / 2**20:.1f} MiB/step",
            flush=True,
        )
    results = {"rows": rows, "failed": failed, "steps": steps, "warmup": warmup}
    write_outputs(results, out)
    return results


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """results.json, results.csv, report.md and the plots."""
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    with (out / "results.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in results["rows"]:
            w.writerow({k: r.get(k, r.get("state_bytes", {}).get(k)) for k in CSV_COLUMNS})
    from dtlab.bench.report import plots, report_markdown

    paths = plots(results["rows"], out) if results["rows"] else []
    (out / "report.md").write_text(report_markdown(results, paths), encoding="utf-8")
