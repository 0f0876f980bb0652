"""``dtlab bench``: run every combination of strategy, process count, compression and precision in its own
processes, then write results.json, results.csv, report.md and PNG plots."""

from __future__ import annotations

import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.bench.report import disturbances, format_mfu, peak_spread_flag, scaling_baseline
from dtlab.dims import DPWrapper
from dtlab.errors import DtlabError

CSV_COLUMNS = [
    "strategy", "sharding", "nproc", "compression", "precision", "step_time_s", "step_time_min_s",
    "step_time_max_s", "tokens_per_s", "samples_per_s", "mfu", "peak_memory_bytes", "params_bytes",
    "grads_bytes", "optimizer_bytes", "activation_bytes", "activation_bytes_predicted",
    "comm_bytes_per_step", "comm_bytes_per_step_predicted", "comm_bus_bytes_per_step", "comm_time_s",
    "compute_time_s", "overlap_fraction", "overlap_disturbed", "cpu_util", "loss_final", "disturbed",
]  # fmt: skip


def compression_overrides(compression: str) -> list[str]:
    """Config overrides for a ``--compression`` name; ``demo`` is the DeMo optimizer (no all-reduce),
    ``dct-quant`` the dct hook with quantised coefficients."""
    if compression == "demo":
        return ["parallel.compression=none", "train.optimizer=demo"]
    if compression == "dct-quant":
        return ["parallel.compression=dct", "parallel.compression_options.coding=quant"]
    return [f"parallel.compression={compression}"]


Combo = tuple[str, int, str, str]  # (strategy, nproc, compression, precision)


def plan_combinations(
    strategies: list[str],
    nprocs: list[int],
    compressions: list[str],
    precisions: list[str],
    model_parallel: int = 1,
) -> tuple[list[Combo], list[str]]:
    """Every (strategy, nproc, compression, precision) to run, and a note for each one not run or
    run elsewhere than ``--nproc`` says.

    ``single`` is the baseline: it runs once per precision, on ``model_parallel`` = tp x pp processes
    (one model, no data parallelism), whatever ``--nproc`` lists. The other strategies run on every
    listed count that ``model_parallel`` divides; the one whose data-parallel degree is 1 is single's
    layout with a wrapper, left out only where single runs as the baseline beside it. What train
    refuses (:func:`train_refusal`) is judged later, with each run's whole config."""
    out: list[Combo] = []
    notes: list[str] = []
    baseline = any(DPWrapper.of(s) is DPWrapper.NONE for s in strategies)
    for s, n, c, p in itertools.product(strategies, nprocs, compressions, precisions):
        if DPWrapper.of(s) is DPWrapper.NONE:
            if c == "none":  # nothing to compress without data parallelism
                out.append((s, model_parallel, c, p))
                if model_parallel not in nprocs:
                    noun = "process" if model_parallel == 1 else "processes"
                    notes.append(
                        f"{s} runs on {model_parallel} {noun} (the baseline), whatever --nproc lists"
                    )
            elif "none" not in compressions:
                notes.append(f"{s} not run: it has no data parallelism to compress")
            continue
        if n == model_parallel and baseline:
            notes.append(
                f"{s} on {_processes(n)} not run: one data-parallel rank is single's layout, run "
                "as the baseline"
            )
            continue
        out.append((s, n, c, p))
    return list(dict.fromkeys(out)), list(dict.fromkeys(notes))


def combinations(
    strategies: list[str],
    nprocs: list[int],
    compressions: list[str],
    precisions: list[str],
    model_parallel: int = 1,
) -> list[Combo]:
    """:func:`plan_combinations`'s runs; a DtlabError when there are none."""
    combos, _ = plan_combinations(strategies, nprocs, compressions, precisions, model_parallel)
    if not combos:
        raise DtlabError(
            f"--strategies {','.join(strategies)} with --nproc {','.join(map(str, nprocs))} and "
            f"--compression {','.join(compressions)} gives nothing to run: 'single' runs without "
            "compression"
        )
    return combos


def run_overrides(strategy: str, compression: str, precision: str) -> list[str]:
    """The config overrides of one run of the sweep, after the user's own."""
    return [
        f"parallel.strategy={strategy}",
        *compression_overrides(compression),
        f"train.precision={precision}",
    ]


def train_refusal(config_path: str | None, overrides: list[str], nproc: int) -> str | None:
    """Why ``dtlab train`` would refuse this config on ``nproc`` processes (its own message), or None
    when it runs it: the same loading and world checks train makes before it launches."""
    from dtlab.config import check_world, load_config

    try:
        check_world(load_config(config_path, overrides), nproc)
    except DtlabError as e:
        return str(e)
    return None


def runnable(
    config_path: str | None, overrides: list[str], combos: list[Combo]
) -> tuple[list[Combo], list[str]]:
    """The combinations train would run, and a note for each it refuses, with train's reason; a
    DtlabError naming every reason when it refuses them all."""
    keep, notes = [], []
    for s, n, c, p in combos:
        reason = train_refusal(config_path, [*overrides, *run_overrides(s, c, p)], n)
        if reason is None:
            keep.append((s, n, c, p))
        else:
            what = " ".join([f"{s} on {_processes(n)}", *([c] if c != "none" else []), p])
            notes.append(f"{what} not run: dtlab train refuses it: {reason}")
    if not keep:
        raise DtlabError("nothing to run:\n" + "\n".join(f"  {note}" for note in notes))
    return keep, notes


# The bench's one peak per precision (CPU): GEMM runs timed before the first row, each the fastest of
# PEAK_INNER matmuls of PEAK_SIZE^3 (smaller where one would take longer than
# devices.CPU_GEMM_BUDGET_S: a CPU's slow half-precision path); the fastest run is the peak (another
# load slows a run, never speeds it up) and the spread of the runs is printed with it.
PEAK_RUNS = 5
PEAK_INNER = 4
PEAK_SIZE = 1024


def measure_peaks(
    config_path: str | None, overrides: list[str], precisions: list[str]
) -> dict[str, Any]:
    """The peak FLOP/s every row's MFU is computed against, per precision, measured once in this
    process on all its threads (the cores the rows' ranks share): ``{precision: {"flops", "runs",
    "min", "median", "max", "threads", "source"}}``. Empty on a GPU, whose peak is the datasheet's
    figure for the exact device (the same for every row)."""
    import torch

    from dtlab.analysis.devices import cpu_gemm_size, measure_matmul_tflops
    from dtlab.config import load_config
    from dtlab.parallel.dist import resolve_device

    if resolve_device(load_config(config_path, overrides), 0).type != "cpu":
        return {}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    threads = torch.get_num_threads()
    peaks = {}
    for precision in precisions:
        size = cpu_gemm_size(dtypes[precision], PEAK_SIZE)
        runs = [
            measure_matmul_tflops(
                dtypes[precision], torch.device("cpu"), size, PEAK_INNER, best=True
            )
            * 1e12
            for _ in range(PEAK_RUNS)
        ]
        peaks[precision] = {
            "flops": max(runs),
            "runs": runs,
            "min": min(runs),
            "median": statistics.median(runs),
            "max": max(runs),
            "threads": threads,
            "size": size,
            "source": f"measured {precision} GEMM {size}^3 once for the bench, {threads} thread(s)",
        }
    return peaks


def layout_of(config_path: str | None, overrides: list[str], nproc: int) -> str:
    """The layout ``dtlab train`` would run on ``nproc`` processes, named by its degrees as the run
    names it (:func:`dtlab.dims.layout_name`), e.g. ``ddp 2`` or ``fsdp 1 x tp 2``: what the console
    says before a row runs. A config train refuses gets its strategy and process count."""
    from dtlab.config import load_config
    from dtlab.dims import ParallelDims, layout_name

    try:
        config = load_config(config_path, overrides)
        return layout_name(ParallelDims.from_config(config, nproc), config.parallel)
    except (DtlabError, ValueError):
        strategy = next(
            (o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("parallel.strategy=")),
            "?",
        )
        return f"{strategy} on {_processes(nproc)}"


def _processes(n: int) -> str:
    return f"{n} process" + ("es" if n > 1 else "")


def peak_args(peak: dict[str, Any] | None) -> list[str]:
    """The worker's arguments that hand it the bench's peak (none: it finds its own)."""
    if peak is None:
        return []
    return ["--peak-flops", repr(peak["flops"]), "--peak-source", peak["source"]]


@dataclass
class _Sweep:
    """What every run of the sweep shares: the user's config and settings, where the rows go, and
    the peaks their MFU is computed against."""

    config_path: str | None
    overrides: list[str]
    steps: int
    warmup: int
    out: Path
    profile: bool
    peaks: dict[str, Any]


def run_sweep(
    config_path: str | None,
    overrides: list[str],
    combos: list[tuple[str, int, str, str]],
    steps: int,
    warmup: int,
    out: Path,
    profile: bool = False,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """Run each combination in fresh processes, every row's MFU against one peak measured first
    (:func:`measure_peaks`); returns ``{"rows": [...], "failed": [...], "peaks": {...}, ...}``, with
    ``notes`` (what was not run, and why) for the report."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    peaks = measure_peaks(config_path, overrides, list(dict.fromkeys(c[3] for c in combos)))
    _print_peaks(peaks)
    sweep = _Sweep(config_path, overrides, steps, warmup, out, profile, peaks)
    for i in range(len(combos)):
        _run_combo(sweep, i, combos, rows, failed)
    results = {
        "rows": rows, "failed": failed, "steps": steps, "warmup": warmup, "peaks": peaks,
        "notes": notes or [],
    }  # fmt: skip
    write_outputs(results, out)
    return results


def _print_peaks(peaks: dict[str, Any]) -> None:
    """Each precision's measured peak, with its runs' spread (and why it is disturbed, if it is)."""
    for precision, peak in peaks.items():
        print(
            f"peak {precision}: {peak['max'] / 1e9:,.1f} GFLOP/s (fastest of {PEAK_RUNS} GEMM runs; "
            f"min-median-max {peak['min'] / 1e9:,.1f}-{peak['median'] / 1e9:,.1f}-"
            f"{peak['max'] / 1e9:,.1f})",
            flush=True,
        )
        spread = peak_spread_flag(peak)
        if spread:
            print(f"  disturbed: {spread}", flush=True)


def _run_combo(
    sweep: _Sweep,
    i: int,
    combos: list[Combo],
    rows: list[dict[str, Any]],
    failed: list[dict[str, str]],
) -> None:
    """Run combination ``i`` of ``combos`` in its own worker, adding its row to ``rows`` (printed,
    judged against the rows so far) or its error to ``failed``."""
    strategy, nproc, compression, precision = combos[i]
    run = run_overrides(strategy, compression, precision)
    layout = layout_of(sweep.config_path, [*sweep.overrides, *run], nproc)
    label = " ".join([layout, *([compression] if compression != "none" else []), precision])
    print(f"[{i + 1}/{len(combos)}] {label}", flush=True)
    row_path = sweep.out / "rows" / f"{i:02d}-{strategy}-{nproc}-{compression}-{precision}.json"
    args = [
        sys.executable, "-m", "dtlab.bench.worker",
        *([sweep.config_path] if sweep.config_path else []),
        "--out", str(row_path), "--nproc", str(nproc), "--warmup", str(sweep.warmup),
        *(["--profile", str(sweep.out / "profile" / row_path.stem)] if sweep.profile else []),
        *peak_args(sweep.peaks.get(precision)),
        "--set", *sweep.overrides, *run, f"train.steps={sweep.steps}", "run.progress=none",
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0 or not row_path.exists():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  failed: {tail}", flush=True)
        failed.append({"label": label, "error": tail})
        return
    row = json.loads(row_path.read_text())
    if row["device"] == "cpu":  # what the report judges the row's CPU use and speed-up against
        row.update(cpu_threads=rank_threads(nproc), cpu_cores=os.cpu_count() or 1)
    rows.append(row)
    _print_row(row, rows)


def _print_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """A measured row's figures, and what disturbed it by the report's judge on the rows so far."""
    print(
        f"  {row['step_time_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {format_mfu(row['mfu'], row['peak_flops_source'])}, "
        f"comm {row['comm_bytes_per_step'] / 2**20:.1f} MiB/step",
        flush=True,
    )
    flags = disturbances(row, scaling_baseline(row, rows))
    if flags:
        print(f"  disturbed: {'; '.join(flags)}", flush=True)


def rank_threads(nproc: int) -> int:
    """The threads each of ``nproc`` CPU ranks on this machine computes on: ``$OMP_NUM_THREADS``, or
    the cores shared among them (the rule of :func:`dtlab.parallel.dist.init_distributed`)."""
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env else max(1, (os.cpu_count() or 1) // nproc)


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """results.json, results.csv, report.md and the plots."""
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    with (out / "results.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in results["rows"]:
            cells = {k: r.get(k, r.get("state_bytes", {}).get(k)) for k in CSV_COLUMNS}
            # The report's judge of figures no undisturbed measurement gives, on the same rows.
            flags = disturbances(r, scaling_baseline(r, results["rows"]))
            w.writerow({**cells, "disturbed": "; ".join(flags)})
    from dtlab.bench.report import plots, report_markdown

    paths = plots(results["rows"], out) if results["rows"] else []
    (out / "report.md").write_text(report_markdown(results, paths), encoding="utf-8")
