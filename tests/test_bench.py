"""dtlab bench: every output file exists and parses; measured figures sit next to the predicted ones."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from dtlab.analysis.devices import lookup_cuda
from dtlab.analysis.model import plan_step
from dtlab.bench.sweep import plan_combinations, runnable, train_refusal
from dtlab.config import load_config

SMALL = [
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=64",
    "train.global_batch_size=8",
]


def test_bench_writes_results_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = run_cli(
        "bench", "--strategies", "single,ddp,fsdp", "--nproc", "1,2", "--steps", "3",
        "--warmup", "1", "--out", str(out), "--set", *SMALL, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    rows = {r["strategy"]: r for r in results["rows"]}
    assert set(rows) == {"single", "ddp", "fsdp"} and not results["failed"]
    # The console names each row's layout by its degrees before it runs, as the row itself does.
    started = re.findall(r"^\[\d/3\] (.+)$", proc.stdout, re.MULTILINE)
    assert started == [f"{rows[s]['layout']} fp32" for s in ("single", "ddp", "fsdp")], proc.stdout
    assert started == ["single fp32", "ddp 2 fp32", "fsdp 2 fp32"]
    for r in rows.values():
        for key in (
            "step_time_s",
            "tokens_per_s",
            "samples_per_s",
            "peak_memory_bytes",
            "cpu_util",
            "loss_final",
        ):
            assert r[key] > 0, (key, r[key])
        assert r["step_time_min_s"] <= r["step_time_s"] <= r["step_time_max_s"]
        # 1 warm-up + 3 timed + 1 counted step ran; each step is the global batch, 8 x 64 tokens, of
        # all ranks together.
        assert len(r["losses"]) == 5
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(8 * 64)
        # The peak is measured here and says so; MFU is against it.
        assert r["peak_flops_source"].startswith("measured fp32 GEMM") and 0 < r["mfu"] < 1
        # Gradients as held after a backward (measured), parameters and optimizer state, as predicted.
        assert r["state_bytes"] == r["state_bytes_predicted"]
        # Activations: what forward keeps (measured from the storages still allocated), within 0.1%.
        assert (
            abs(r["activation_bytes_predicted"] - r["activation_bytes"])
            < 1e-3 * r["activation_bytes"]
        ), (r["strategy"], r["activation_bytes"], r["activation_bytes_predicted"])
    ddp = rows["ddp"]
    # fp32 DDP: the gradients' all-reduce is 4 bytes per parameter, plus the step's one reduction of 5
    # floats (the loss, the overflow flag, one vote per stop signal).
    assert ddp["comm_by_collective"]["all_reduce"] == {"count": 2, "bytes": 4 * ddp["params"] + 20}
    fsdp = rows["fsdp"]
    # FSDP's one all-reduce is the step's reduction, with the sharded gradients' squared norm (6 floats).
    assert fsdp["comm_by_collective"]["all_reduce"] == {"count": 1, "bytes": 24}
    for r in (ddp, fsdp):
        assert r["comm_bytes_per_step"] == r["comm_bytes_per_step_predicted"], r["strategy"]
    # The debug model has 131392 parameters, every dim 0 even: FSDP on 2 ranks holds half of each.
    assert ddp["params"] == 131392
    assert ddp["state_bytes"]["grads_bytes"] == 4 * 131392
    assert fsdp["state_bytes"]["grads_bytes"] == 2 * 131392
    assert fsdp["state_bytes"]["params_bytes"] * 2 == ddp["state_bytes"]["params_bytes"]
    with (out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [t["strategy"] for t in table] == ["single", "ddp", "fsdp"]
    report = (out / "report.md").read_text()
    assert "| ddp 2 fp32 |" in report and "## What it says" in report
    for png in ("throughput", "memory", "communication", "loss"):
        assert (out / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mfu_peak_is_never_a_silent_default() -> None:
    assert lookup_cuda("NVIDIA H100 80GB HBM3") is not None
    assert lookup_cuda("Some Future GPU") is None  # unknown: the bench reports MFU as unknown


def test_bench_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    for args, needle in (
        (["--strategies", "zero"], "--strategies 'zero'"),
        (["--nproc", "two"], "--nproc 'two'"),
        # What train refuses, bench refuses with train's reason.
        (["--strategies", "ddp", "--nproc", "3"], "cannot be split over 3 ranks"),
    ):
        proc = run_cli("bench", *args, "--out", str(tmp_path / "b"), "--set", *SMALL)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert needle in proc.stderr, proc.stderr


def test_train_profile_writes_a_chrome_trace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_cli(
        "train", "--profile", "--set", *SMALL, "train.steps=6", f"run.dir={run}", "run.progress=none",
        "run.tensorboard=false", "run.plot=false",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    traces = list((run / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") for e in events)  # the step's matmuls were recorded


def test_bench_compares_compressions(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = run_cli(
        "bench", "--strategies", "ddp", "--nproc", "2", "--compression", "none,powersgd,dct,dct-quant,demo",
        "--steps", "3", "--warmup", "1", "--out", str(out), "--set", *SMALL,
        "parallel.compression_options.start_step=2", timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["compression"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    plain = rows["none"]["comm_bus_bytes_per_step"]
    for c in ("powersgd", "dct", "dct-quant", "demo"):
        assert rows[c]["comm_bus_bytes_per_step"] < plain / 4, (
            c,
            rows[c]["comm_bus_bytes_per_step"],
            plain,
        )
        assert abs(rows[c]["comm_bytes_per_step"] - rows[c]["comm_bytes_per_step_predicted"]) <= 8
    report = (out / "report.md").read_text()
    assert "## Compression" in report and "| ddp 2 fp32 dct |" in report
    assert (out / "loss_vs_bytes.png").read_bytes()[:4] == b"\x89PNG"


def test_single_runs_as_the_baseline_whatever_nproc_lists() -> None:
    combos, notes = plan_combinations(["single", "ddp", "fsdp"], [2], ["none"], ["fp32"])
    assert combos == [("single", 1, "none", "fp32"), ("ddp", 2, "none", "fp32"),
                      ("fsdp", 2, "none", "fp32")]  # fmt: skip
    assert notes == ["single runs on 1 process (the baseline), whatever --nproc lists"]
    # Data parallelism of degree 1 is single's layout with a wrapper: said, not run twice.
    combos, notes = plan_combinations(["single", "ddp"], [1, 2], ["none"], ["fp32"])
    assert combos == [("single", 1, "none", "fp32"), ("ddp", 2, "none", "fp32")]
    assert notes == [
        "ddp on 1 process not run: one data-parallel rank is single's layout, run as the baseline"
    ]


def test_bench_runs_the_layouts_train_runs() -> None:
    # Pipeline parallelism over both processes with DDP's (one-rank) data parallelism: train runs it.
    combos, notes = plan_combinations(["ddp"], [2], ["none"], ["fp32"], model_parallel=2)
    assert combos == [("ddp", 2, "none", "fp32")] and notes == []
    assert train_refusal(None, [*SMALL, "parallel.pp=2", "parallel.strategy=ddp"], 2) is None
    # What train refuses is refused with train's own reason.
    reason = train_refusal(None, [*SMALL, "parallel.strategy=ddp"], 3)
    assert reason is not None and "train.global_batch_size = 8 samples cannot be split" in reason
    # A refused row is named as the console names rows, with train's reason.
    keep, notes = runnable(None, SMALL, [("ddp", 2, "none", "fp32"), ("hsdp", 2, "none", "fp32")])
    assert keep == [("ddp", 2, "none", "fp32")] and len(notes) == 1
    assert notes[0].startswith("hsdp on 2 processes fp32 not run: dtlab train refuses it: "), notes


def test_bench_rows_share_one_peak_and_count_whole_diloco_periods(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    diloco = ["parallel.diloco.inner_steps=4", "parallel.diloco.outer_lr=1"]
    proc = run_cli(
        "bench", "--strategies", "single,ddp", "--nproc", "2", "--steps", "3", "--warmup", "1",
        "--out", str(out), "--set", *SMALL, *diloco, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    rows = {r["strategy"]: r for r in results["rows"]}
    # single ran on one process as the baseline though --nproc says 2.
    assert rows["single"]["nproc"] == 1 and rows["ddp"]["nproc"] == 2
    # One peak, measured once before the first row, for every row's MFU.
    peak = results["peaks"]["fp32"]
    assert {r["peak_flops"] for r in rows.values()} == {peak["flops"]}
    assert peak["min"] <= peak["median"] <= peak["max"] == peak["flops"]
    report = (out / "report.md").read_text()
    assert "GEMM runs before the first row" in report and "min-median-max" in report
    # DiLoCo's bytes over whole outer periods: the plan's average per step (its syncs once per 4).
    ddp = rows["ddp"]
    plan = plan_step(load_config(None, [*SMALL, *diloco, "parallel.strategy=ddp"]), 2, pp_rank=0)
    assert "diloco all_reduce" in ddp["comm_by_collective"]
    assert ddp["comm_bytes_per_step"] == pytest.approx(sum(plan.comm_bytes.values()), abs=2)
    # One float32 all-reduce of every parameter per 4 steps: a parameter's byte per step, and more.
    assert ddp["comm_bytes_per_step"] > ddp["params"]
    # The outer syncs (on DiLoCo's own group, gone when the run ends) are replayed on the default
    # group, which has the same ranks here.
    assert ddp["comm_time_s"] is not None and ddp["comm_time_s"] > 0


def test_bench_runs_a_pipeline_layout_train_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = run_cli(
        "bench", "--strategies", "ddp", "--nproc", "2", "--steps", "2", "--warmup", "1",
        "--out", str(out), "--set", *SMALL, "parallel.pp=2", timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads((out / "results.json").read_text())["rows"]
    assert (row["strategy"], row["nproc"], row["pp"]) == ("ddp", 2, 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_on_a_gpu_takes_every_rows_peak_from_the_datasheet(tmp_path: Path) -> None:
    """No GEMM is timed for the peak on a GPU: every row's MFU is against the exact device's
    datasheet figure, which the report names once."""
    out = tmp_path / "bench"
    proc = run_cli(
        "bench", "--strategies", "single", "--nproc", "1", "--steps", "2", "--warmup", "1",
        "--out", str(out), "--set", *SMALL, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    [row] = results["rows"]
    assert results["peaks"] == {} and row["device"] != "cpu"
    source = row["peak_flops_source"]
    assert source == f"{row['device']} datasheet" or source.startswith("unknown"), source
    assert "Peak FLOP/s, the same for every row:" in (out / "report.md").read_text()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_bench_counts_whole_diloco_periods_over_nccl(tmp_path: Path) -> None:
    """DiLoCo on 2 GPUs over NCCL: the bytes per step are the plan's average over an outer period
    (the outer all-reduce once per 4 steps), counted on NCCL's collectives as on gloo's."""
    out = tmp_path / "bench"
    diloco = ["parallel.diloco.inner_steps=4", "parallel.diloco.outer_lr=1"]
    proc = run_cli(
        "bench", "--strategies", "ddp", "--nproc", "2", "--steps", "3", "--warmup", "1",
        "--out", str(out), "--set", *SMALL, *diloco, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads((out / "results.json").read_text())["rows"]
    plan = plan_step(load_config(None, [*SMALL, *diloco, "parallel.strategy=ddp"]), 2, pp_rank=0)
    assert row["comm_bytes_per_step"] == pytest.approx(sum(plan.comm_bytes.values()), abs=2)
    assert row["comm_bytes_per_step"] > row["params"]
