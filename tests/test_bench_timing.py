"""The benchmark's clocks wait for the device, and its compute-only model computes the real model's
step without a second copy of its weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import PYTHON, cli_env
from dtlab.bench.timing import synchronize, timed
from dtlab.bench.worker import compute_model
from dtlab.config import load_config
from dtlab.models import build_model, count_params
from dtlab.parallel.apply import apply_ac


def test_the_clock_waits_for_the_device_before_it_starts_and_before_it_stops() -> None:
    events: list[str] = []
    device = torch.device("cuda", 3)  # only named: the waiting is recorded, not done

    def sync(d: torch.device) -> None:
        assert d == device
        events.append("sync")

    with timed(device, sync=sync) as t:
        events.append("work")
        torch.randn(200, 200) @ torch.randn(200, 200)
    assert events == ["sync", "work", "sync"]
    assert 0 < t.seconds == t.end - t.start
    with pytest.raises(RuntimeError), timed(device, sync=sync):
        raise RuntimeError("a failed region")
    assert events[-2:] == ["sync", "sync"]  # waited for on the way out too
    with timed(torch.device("cpu")) as cpu:  # the default: nothing to wait for on CPU
        synchronize(torch.device("cpu"))
    assert cpu.seconds >= 0


@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_compute_only_model_does_the_real_models_work_with_one_blocks_weights(ac: str) -> None:
    config = load_config(
        overrides=["model.preset=debug", "model.n_layers=3", f"train.activation_checkpointing={ac}"]
    )
    real = build_model(config.model, device="cpu")
    apply_ac(real, ac)  # as training wraps it: full checkpointing recomputes the blocks in backward
    compute = compute_model(config, torch.device("cpu"))
    block = count_params(real.layers["0"])
    assert count_params(compute) == count_params(real) - 2 * block
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def flops(model: torch.nn.Module) -> int:
        with FlopCounterMode(display=False) as counter:
            model(tokens).float().pow(2).mean().backward()
        return int(counter.get_total_flops())

    assert flops(compute) == flops(real) > 0  # the same matmuls, forward and backward


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_timed_region_on_the_gpu_lasts_as_long_as_its_kernels() -> None:
    """A queued matmul returns at once; the timed region still holds the kernels' time as CUDA's
    own events measure it."""
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=device)
    a @ a  # warm-up (cuBLAS's handle and workspace)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with timed(device) as t:
        start.record()
        for _ in range(5):
            a @ a
        end.record()
    kernels = start.elapsed_time(end) / 1e3  # seconds (the events are done: the region waited)
    assert t.seconds >= 0.95 * kernels > 0


def _bench_row(tmp_path: Path, nproc: int, *overrides: str) -> dict[str, Any]:
    out = tmp_path / "row.json"
    proc = subprocess.run(
        [
            PYTHON, "-m", "dtlab.bench.worker", "--out", str(out), "--nproc", str(nproc),
            "--warmup", "1", "--set", "model.preset=debug", "data.source=synthetic",
            "data.seq_len=64", "train.global_batch_size=8", "train.steps=3", *overrides,
        ],
        capture_output=True, text=True, env=cli_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    row: dict[str, Any] = json.loads(out.read_text())
    return row


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bench_gpu_row_leaves_the_gemm_probe_out_of_its_peaks(tmp_path: Path) -> None:
    """The debug model trains in a few MiB; the 8192 x 8192 GEMM probe before it took 768 MiB. The
    row's peaks are the training's; its fp32 grouped-query attention ran on the memory-efficient
    kernel with expanded heads, and the prediction holds that kernel's bytes."""
    row = _bench_row(tmp_path, 1)
    probe = 3 * 8192 * 8192 * 4
    assert 0 < row["peak_memory_bytes"] <= row["peak_memory_reserved_bytes"] < probe / 4, row
    assert row["attention_kernel"] == "efficient" and row["activation_kernel_bytes"] > 0
    measured, predicted = row["activation_bytes"], row["activation_bytes_predicted"]
    assert abs(predicted - measured) < 0.01 * measured, (measured, predicted)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_the_bench_gpu_replay_compute_only_and_hand_loop_run_on_nccl(tmp_path: Path) -> None:
    """On two GPUs: the collectives' replay and the compute-only step (its shared-block model) are
    timed to the end of their kernels, and the interleaved hand loop's DDP model is on the GPUs."""
    row = _bench_row(tmp_path, 2, "parallel.strategy=ddp")
    assert row["comm_time_s"] > 0 and row["compute_time_s"] > 0, row
    assert row["compute_time_s"] < row["step_time_s"] * 2, row
    config = tmp_path / "ddp.yaml"
    config.write_text(
        "model: {preset: debug}\ndata: {source: synthetic, seq_len: 64}\n"
        "train: {global_batch_size: 8, micro_batch_size: 2, steps: 3}\nparallel: {strategy: ddp}\n",
        encoding="utf-8",
    )
    out = tmp_path / "interleaved.json"
    proc = subprocess.run(
        [
            PYTHON, "-m", "dtlab.bench.handloop", str(config), "--out", str(out),
            "--nproc", "2", "--interleaved",
        ],
        capture_output=True, text=True, env=cli_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    times = json.loads(out.read_text())
    assert len(times["hand"]) == len(times["dtlab"]) == 2 and min(times["hand"]) > 0, times
