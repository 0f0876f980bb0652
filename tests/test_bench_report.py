"""The bench's report and plots, from rows written by hand: what they say, and the data each plot draws."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dtlab.bench.engines import engine_report, engine_row, engines_figure
from dtlab.bench.report import (
    UNMODELLED,
    coinciding,
    disturbances,
    format_mfu,
    label,
    memory_segments,
    plot_loss_curves,
    plots,
    report_markdown,
)

MIB = 2**20
LOSSES = [5.5, 5.2, 4.9, 4.7, 4.6]


def bench_row(strategy: str, losses: list[float], **changes: Any) -> dict[str, Any]:
    """A row as ``dtlab.bench.worker`` writes it, with round figures."""
    nproc = changes.get("nproc", 2)
    row = {
        "strategy": strategy,
        "layout": "single" if strategy == "single" else f"{strategy} {nproc}",
        "sharding": "full" if strategy == "fsdp" else "-",
        "nproc": nproc,
        "compression": "none",
        "precision": "fp32",
        "device": "cpu",
        "params": 131392,
        "global_batch_size": 8,
        "seq_len": 64,
        "step_time_s": 0.1,
        "step_time_min_s": 0.09,
        "step_time_max_s": 0.12,
        "tokens_per_s": 5120.0,
        "mfu": 0.4,
        "peak_flops_source": "measured fp32 GEMM (1024^3, fastest of 20)",
        "peak_memory_bytes": 1237 * MIB,
        "state_bytes": {
            "params_bytes": 100 * MIB,
            "grads_bytes": 100 * MIB,
            "optimizer_bytes": 120 * MIB,
        },
        "activation_bytes": 63 * MIB,
        "activation_bytes_predicted": 63 * MIB,
        "comm_bytes_per_step": 1 * MIB,
        "comm_bytes_per_step_predicted": 1 * MIB,
        "comm_bus_bytes_per_step": 1 * MIB,
        "comm_by_collective": {"all_reduce": {"count": 1, "bytes": 1 * MIB}},
        "comm_by_collective_predicted": {"all_reduce": 1 * MIB},
        "comm_time_s": 0.01,
        "cpu_util": 1.5,
        "loss_final": losses[-1],
        "losses": losses,
    }
    row.update(changes)
    return row


def test_memory_plot_stacks_the_unmodelled_rest_of_the_peak() -> None:
    # The parts add up to 383 MiB of a 1,237 MiB peak: the rest is its own segment, up to the peak.
    rows = [bench_row("ddp", LOSSES), bench_row("fsdp", LOSSES, peak_memory_bytes=300 * MIB)]
    segments = dict(memory_segments(rows))
    assert list(segments) == ["params", "grads", "optimizer", "activations", UNMODELLED]
    assert segments[UNMODELLED][0] == 1237 - 383
    assert sum(v[0] for v in segments.values()) == 1237
    # Parts that add up to more than the peak (not all live at once) leave no negative segment.
    assert segments[UNMODELLED][1] == 0
    report = report_markdown({"rows": rows, "failed": [], "warmup": 1, "steps": 3}, [])
    assert f"| {UNMODELLED} MiB | peak MiB |" in report
    assert "| 854.00 | 1,237 |" in report


def test_coinciding_loss_curves_are_named_and_drawn_apart() -> None:
    curves = {
        "ddp 2 fp32": LOSSES,
        "fsdp 2 fp32": list(LOSSES),
        "single fp32": [5.5, 5.0, 4.0, 3.5, 3.0],
    }
    assert coinciding(curves) == [["ddp 2 fp32", "fsdp 2 fp32"]]
    assert coinciding({k: v for k, v in curves.items() if k != "fsdp 2 fp32"}) == []
    fig, ax = plt.subplots()
    plot_loss_curves(ax, curves, "Loss curves")
    assert ax.get_title() == "Loss curves (ddp 2 fp32, fsdp 2 fp32 coincide)"
    lines = ax.get_lines()
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == len(lines) == 3
    plt.close(fig)
    report = report_markdown(
        {
            "rows": [bench_row("ddp", LOSSES), bench_row("fsdp", list(LOSSES))],
            "failed": [],
            "warmup": 1,
            "steps": 3,
        },
        [],
    )
    assert "The loss curves of ddp 2 fp32, fsdp 2 fp32 coincide" in report


def test_bench_plots_label_their_bars(tmp_path: Path) -> None:
    rows = [bench_row("ddp", LOSSES), bench_row("fsdp", LOSSES, tokens_per_s=4321.0)]
    paths = plots(rows, tmp_path)
    assert [p.name for p in paths] == [
        "throughput.png",
        "overlap.png",
        "memory.png",
        "communication.png",
        "loss.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mfu_above_the_peak_is_flagged() -> None:
    assert format_mfu(0.42) == "42.0%"
    assert format_mfu(None) == "unknown"
    flagged = format_mfu(1.234, "measured fp32 GEMM")
    assert flagged == "123.4% (exceeds the measured peak: the peak measurement is low)"
    assert "exceeds the H100 datasheet peak" in format_mfu(1.1, "H100 datasheet")
    rows = [bench_row("ddp", LOSSES, mfu=1.234), bench_row("fsdp", LOSSES)]
    report = report_markdown({"rows": rows, "failed": [], "warmup": 1, "steps": 3}, [])
    table = next(line for line in report.splitlines() if line.startswith("| ddp 2 fp32 | 0.100"))
    assert "| 123.4% (exceeds the measured peak: the peak measurement is low) |" in table
    assert "| 40.0% |" in report and "- ddp 2 fp32: MFU 123.4% (exceeds" in report


def test_compression_table_says_how_many_steps_the_final_loss_averages() -> None:
    rows = [
        bench_row("ddp", LOSSES),
        bench_row("ddp", [5.0, 4.0, 3.0, 2.0, 1.0], compression="powersgd"),
    ]
    report = report_markdown({"rows": rows, "failed": [], "warmup": 1, "steps": 3}, [])
    assert "final loss (the mean of the last 5 steps)" in report and "last 10" not in report
    assert "| ddp 2 fp32 powersgd | 1.000 MiB | 1.0x | 3.0000 | -39.76% |" in report


def engine_run(tmp_path: Path, engine: str, losses: list[float]) -> dict[str, Any]:
    run = tmp_path / engine
    run.mkdir()
    lines = [
        json.dumps({"step": i + 1, "loss": v, "step_time_s": 0.1}) for i, v in enumerate(losses)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"strategy": "single", "layout": "single", "precision": "fp32", "params": 131392, "global_batch_size": 8,
               "seq_len": 64, "peak_memory_bytes": 100 * MIB}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    return engine_row(run, engine, 1, warmup=1)


def test_engines_report_and_plot(tmp_path: Path) -> None:
    rows = [engine_run(tmp_path, "torch", LOSSES), engine_run(tmp_path, "mlx", LOSSES)]
    assert rows[0]["loss_final_steps"] == 5 and rows[0]["loss_final"] == sum(LOSSES) / 5
    report = engine_report({"engine_rows": rows, "failed": [], "warmup": 1, "steps": 4}, None)
    assert "final loss the mean of the last 5 steps" in report and "last 10" not in report
    fig = engines_figure(rows)
    bars, curves = fig.axes
    # Every bar carries its value; steps are whole numbers; the identical curves say so.
    assert [t.get_text() for t in bars.texts] == ["5,120", "5,120"]
    ticks = [t for t in curves.get_xticks() if 1 <= t <= len(LOSSES)]
    assert ticks and all(t == int(t) for t in ticks), ticks
    assert "torch single fp32, mlx single fp32 coincide" in curves.get_title()
    plt.close(fig)


def test_overlap_is_the_hidden_share_of_the_collectives() -> None:
    from dtlab.bench.worker import _overlap_figures

    # 80 ms of compute and 40 ms of collectives in a 100 ms step: 20 ms of them were hidden.
    fig = _overlap_figures(0.1, 0.08, 0.04)
    assert fig["overlap_fraction"] == pytest.approx(0.5) and fig["overlap_disturbed"] is None
    assert _overlap_figures(0.13, 0.08, 0.04)["overlap_fraction"] == 0.0  # slower than both
    all_hidden = _overlap_figures(0.08, 0.08, 0.04)["overlap_fraction"]
    assert all_hidden == pytest.approx(1.0)
    assert _overlap_figures(0.1, None, 0.04)["overlap_fraction"] is None


@pytest.mark.parametrize(
    ("step", "compute", "comm", "longer"),
    [
        # HSDP in docs/performance.md before: collectives replayed alone longer than the step.
        (1.430, 0.565, 1.551, "the collectives alone (1.551 s)"),
        (0.07, 0.08, 0.04, "the compute-only step (0.080 s)"),
    ],
)
def test_a_baseline_longer_than_the_step_gives_no_overlap_but_a_flag(
    step: float, compute: float, comm: float, longer: str
) -> None:
    from dtlab.bench.worker import _overlap_figures

    fig = _overlap_figures(step, compute, comm)
    assert fig["overlap_fraction"] is None
    assert fig["overlap_disturbed"] == (
        f"{longer} took longer than the whole step ({step:.3f} s): not a baseline, no overlap computed"
    )
    rows = [
        bench_row("ddp", LOSSES, step_time_s=step, comm_time_s=comm, **fig),
        bench_row("fsdp", LOSSES, compute_time_s=0.08, comm_time_s=0.04, overlap_fraction=0.5),
    ]
    report = report_markdown({"rows": rows, "failed": [], "warmup": 1, "steps": 3}, [])
    ddp = next(line for line in report.splitlines() if line.startswith("| ddp 2 fp32 |"))
    assert "| disturbed |" in ddp
    assert "| 50% |" in next(line for line in report.splitlines() if line.startswith("| fsdp 2 "))
    assert f"- ddp 2 fp32: {longer} took longer than the whole step" in report


def test_figures_outside_the_possible_are_flagged_in_the_table_and_the_report(
    tmp_path: Path,
) -> None:
    from dtlab.bench.sweep import write_outputs

    single = bench_row("single", LOSSES, nproc=1, tokens_per_s=1000.0, comm_time_s=None)
    # 3.70x the single process on 2 processes: 185% scaling efficiency, more than the cores give.
    ddp = bench_row("ddp", LOSSES, tokens_per_s=3700.0, compute_time_s=0.05)
    # A compute-only step longer than the whole step; collectives replayed alone longer still.
    fsdp = bench_row("fsdp", LOSSES, tokens_per_s=1800.0, compute_time_s=0.15, comm_time_s=0.2)
    fine = bench_row("ddp", LOSSES, nproc=4, tokens_per_s=3000.0, compute_time_s=0.08)
    assert disturbances(single, single) == [] and disturbances(fine, single) == []
    assert disturbances(ddp, single) == ["scaling efficiency 185% (over 100%)"]
    assert disturbances(fsdp, single) == [
        "compute-only step 0.150 s longer than the step 0.100 s",
        "collectives alone 0.200 s longer than the step 0.100 s",
    ]
    assert disturbances(ddp, None) == []  # no baseline, no scaling to judge
    rows = [single, ddp, fsdp, fine]
    results = {"rows": rows, "failed": [], "warmup": 1, "steps": 3, "peaks": {}, "notes": []}
    report = report_markdown(results, [])
    table: dict[str, str] = {}
    for line in report.splitlines():  # each run's first row: the runs table's
        if line.startswith("| "):
            table.setdefault(line.split(" | ")[0], line)
    assert table[f"| {label(ddp)}"].endswith("| disturbed: scaling efficiency 185% (over 100%) |")
    assert "| disturbed: compute-only step 0.150 s longer" in table[f"| {label(fsdp)}"]
    assert table[f"| {label(fine)}"].endswith("| - |")
    assert (
        f"- {label(ddp)}: 3.70x the single-process throughput on 2 processes (185% scaling "
        "efficiency): not physically possible, a measurement disturbed by other load on a shared "
        "machine." in report
    )
    # The CSV carries the same flags.
    write_outputs(results, tmp_path)
    csv_rows = (tmp_path / "results.csv").read_text().splitlines()
    assert csv_rows[0].endswith(",disturbed")
    assert csv_rows[2].endswith(",scaling efficiency 185% (over 100%)")


def test_the_report_prints_the_benchs_one_peak_and_its_spread() -> None:
    peak = {"flops": 40e9, "runs": [30e9, 38e9, 40e9], "min": 30e9, "median": 38e9, "max": 40e9,
            "threads": 2, "source": "measured fp32 GEMM once for the bench, 2 thread(s)"}  # fmt: skip
    rows = [bench_row("ddp", LOSSES, peak_flops=40e9, peak_flops_source=peak["source"])]
    results = {"rows": rows, "failed": [], "warmup": 1, "steps": 3, "peaks": {"fp32": peak},
               "notes": ["single runs on 1 process (the baseline), whatever --nproc lists"]}  # fmt: skip
    report = report_markdown(results, [])
    assert (
        "- fp32: 40.0 GFLOP/s, the fastest of 3 GEMM runs before the first row on 2 thread(s); "
        "min-median-max 30.0-38.0-40.0 GFLOP/s (every row's MFU is against it); disturbed: its "
        "GEMM runs differ by 33% (fastest over slowest), other load on a shared machine; every MFU "
        "here is uncertain by as much" in report
    )
    assert "- single runs on 1 process (the baseline), whatever --nproc lists" in report
    # Runs within a few percent of each other: nothing to flag.
    steady = {**peak, "runs": [39e9, 40e9, 40e9], "min": 39e9, "median": 40e9}
    report = report_markdown({**results, "peaks": {"fp32": steady}}, [])
    assert "min-median-max 39.0-40.0-40.0 GFLOP/s (every row's MFU is against it)\n" in report


def test_on_a_gpu_the_report_names_the_datasheet_peak_every_row_shares() -> None:
    source = "NVIDIA H100 80GB HBM3 datasheet"
    rows = [
        bench_row(s, LOSSES, device="NVIDIA H100 80GB HBM3", peak_flops_source=source)
        for s in ("ddp", "fsdp")
    ]
    report = report_markdown({"rows": rows, "failed": [], "warmup": 1, "steps": 3, "peaks": {}}, [])
    assert f"Peak FLOP/s, the same for every row: {source} (per GPU)." in report


def test_lowcomm_averages_diloco_bytes_over_whole_outer_periods() -> None:
    from dtlab.bench.link import Link
    from dtlab.bench.lowcomm import METHODS, _row, inner_steps

    # H = 4 over 10 steps: the outer sync (1000 bytes) after steps 4 and 8, 10 bytes on the others.
    records = [
        {"loss": 5.0, "step_time_s": 0.1, "comm_bytes": 1000 if s % 4 == 0 else 10,
         "wire_bytes": 500 if s % 4 == 0 else 5}
        for s in range(1, 11)
    ]  # fmt: skip
    assert inner_steps(METHODS["diloco"]) == 4
    assert inner_steps([*METHODS["diloco"], "parallel.diloco.inner_steps=8"]) == 8
    row = _row("diloco", Link("none", None), 0.0, records, inner_steps(METHODS["diloco"]))
    # Two whole periods, steps 1-8: a period's bytes / 4, not steps 2-10's (two syncs in 9 steps).
    assert row["comm_bytes_per_step"] == (1000 + 3 * 10) / 4
    assert row["wire_bytes_per_step"] == (500 + 3 * 5) / 4
    # Without DiLoCo every step after the first counts, as before.
    assert _row("ddp", Link("none", None), 0.0, records)["comm_bytes_per_step"] == 2070 / 9


def test_a_starved_baseline_and_an_impossible_speed_up_are_flagged() -> None:
    # A 2-core machine: single computes on both cores' threads, each of 4 ranks on one.
    cores = {"cpu_cores": 2}
    single = bench_row(
        "single", LOSSES, nproc=1, tokens_per_s=1000.0, comm_time_s=None, cpu_util=0.49,
        cpu_threads=2, **cores,
    )  # fmt: skip
    # 3.79x on 4 processes (95%): under 100%, yet 2 cores cannot run anything 3.79x faster than
    # a process that already had both of them.
    ddp = bench_row("ddp", LOSSES, nproc=4, tokens_per_s=3790.0, cpu_threads=1, **cores)
    starved = "CPU use 49% of its 2 thread(s): other load took the cores"
    assert disturbances(single, single) == [starved]
    assert disturbances(ddp, single) == [
        "speed-up 3.79x physically impossible: 2 core(s) give a baseline on 2 thread(s) at most "
        "1.00x (1.50x with a 1.5x margin)",
        f"against a disturbed baseline: single fp32 ({starved})",
    ]
    # An undisturbed baseline (91% of its threads, as on an idle machine) and a speed-up the cores
    # allow: nothing to flag, whatever the ranks' own CPU use (they wait for each other's collectives).
    quiet = {**single, "cpu_util": 0.91}
    fine = bench_row("ddp", LOSSES, tokens_per_s=1200.0, cpu_util=0.2, cpu_threads=1, **cores)
    assert disturbances(quiet, quiet) == [] and disturbances(fine, quiet) == []
    # Against a disturbed baseline even a plausible figure is flagged.
    assert disturbances(fine, single) == [f"against a disturbed baseline: single fp32 ({starved})"]
    # On a GPU cpu_util says nothing of the compute: neither rule applies.
    gpu = {**single, "device": "cuda:0"}
    assert disturbances(gpu, gpu) == []
    assert disturbances({**ddp, "device": "cuda:0"}, gpu) == []
    report = report_markdown(
        {"rows": [single, ddp], "failed": [], "warmup": 1, "steps": 3, "peaks": {}, "notes": []}, []
    )
    assert (
        "- ddp 4 fp32: 3.79x the single-process throughput on 4 processes (95% scaling efficiency): "
        "a measurement disturbed by other load on a shared machine (speed-up 3.79x physically "
        "impossible" in report
    )
    assert f"against a disturbed baseline: single fp32 ({starved}) |" in report
    assert f"| disturbed: {starved} |" in report


def test_the_bench_records_each_ranks_threads_as_the_workers_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from dtlab.bench.sweep import rank_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert rank_threads(1) == cores and rank_threads(2 * cores) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_threads(1) == rank_threads(4) == 3
