"""Tensor or pipeline parallelism with a data-parallel degree of 1 (``--nproc 2`` with ``parallel.pp=2``
or ``parallel.tp=2`` and a data-parallel strategy): there is nothing to average gradients over, so the
run issues no data-parallel collective, and what the bench and train count is what the plan predicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST, run_cli, train_run
from dtlab.analysis.model import plan_step
from dtlab.config import load_config
from dtlab.dims import DPWrapper, ParallelDims, layout_name


@pytest.mark.parametrize(
    ("strategy", "overrides", "layout"),
    [
        ("ddp", ["parallel.pp=2"], "ddp 1 x pp 2 (1f1b)"),
        ("fsdp", ["parallel.pp=2"], "fsdp 1 x pp 2 (1f1b)"),
        ("fsdp", ["parallel.pp=2", "parallel.sharding=no_shard"], "fsdp 1 (no_shard) x pp 2 (1f1b)"),
        ("hsdp", ["parallel.pp=2", "parallel.replicate=1"], "hsdp 1x1 x pp 2 (1f1b)"),
        # Under autocast the residual stream the stages send stays float32 (FSDP's bf16 gathers
        # make it bf16): the plan must not halve it.
        ("ddp", ["parallel.pp=2", "train.precision=bf16"], "ddp 1 x pp 2 (1f1b)"),
        ("fsdp", ["parallel.pp=2", "train.precision=bf16"], "fsdp 1 x pp 2 (1f1b)"),
    ],
)  # fmt: skip
def test_bench_of_a_pipeline_without_data_parallel_ranks_measures_the_prediction(
    tmp_path: Path, strategy: str, overrides: list[str], layout: str
) -> None:
    """Every collective's bytes per step as predicted, to the byte: the stages' point-to-point
    activations and the step's one small reduction, and no gradient all-reduce over a group of one."""
    proc = run_cli("bench", "--strategies", strategy, "--nproc", "2", "--steps", "2", "--warmup",
                   "1", "--out", str(tmp_path / "out"), "--set", *FAST, *overrides)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    config = load_config(overrides=[*FAST, f"parallel.strategy={strategy}", *overrides])
    assert row["layout"] == layout_name(ParallelDims.from_config(config, 2), config.parallel)
    assert row["layout"] == layout
    measured = {k: c["bytes"] for k, c in row["comm_by_collective"].items()}
    assert measured == row["comm_by_collective_predicted"], row["comm_by_collective"]
    assert row["comm_bytes_per_step"] == row["comm_bytes_per_step_predicted"]
    # The report's table says the same: measured next to predicted, row for row.
    report = (tmp_path / "out" / "report.md").read_text()
    for name, nbytes in measured.items():
        mib = f"{nbytes / 2**20:.3f}"
        label = f"| {layout} {config.train.precision} | {name} |"
        (line,) = [x for x in report.splitlines() if x.startswith(label)]
        assert line.endswith(f"| {mib} | {mib} |"), line


@pytest.mark.parametrize(
    ("strategy", "overrides"),
    [("fsdp", ["parallel.sharding=no_shard"]), ("hsdp", ["parallel.replicate=1"])],
)
def test_fsdp_of_one_process_sends_nothing(
    tmp_path: Path, strategy: str, overrides: list[str]
) -> None:
    """FSDP2 of one rank, also unsharded or as one replica group of one: no all-reduce of every
    gradient to itself, as the plan predicts (nothing)."""
    proc = run_cli("bench", "--strategies", strategy, "--nproc", "1", "--steps", "2", "--warmup",
                   "1", "--out", str(tmp_path / "out"), "--set", *FAST, *overrides)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert row["comm_by_collective"] == row["comm_by_collective_predicted"] == {}, row


def test_tensor_parallel_without_data_parallel_ranks_sends_no_gradients(tmp_path: Path) -> None:
    """``ddp`` with ``tp`` = the world: the tensor-parallel all-reduces alone, to the byte (the
    vocabulary-parallel loss's, issued inside DTensor's dispatch, too); a gradient all-reduce over
    a group of one would add half the parameters' bytes again."""
    proc = run_cli("bench", "--strategies", "ddp", "--nproc", "2", "--steps", "2", "--warmup", "1",
                   "--out", str(tmp_path / "out"), "--set", *FAST, "parallel.tp=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert row["layout"] == "ddp 1 x tp 2"
    measured, predicted = row["comm_by_collective"], row["comm_by_collective_predicted"]
    assert set(measured) == set(predicted), (measured, predicted)
    for name, c in measured.items():
        assert c["bytes"] == predicted[name], (name, c, predicted)


def test_train_of_a_pipeline_without_data_parallel_ranks_counts_the_prediction(
    tmp_path: Path,
) -> None:
    """``dtlab train`` counts (``run.comm_bytes``) what the plan predicts for rank 0 on every step after
    the first (which also carries the run's start-up agreement), and names the layout as the bench."""
    overrides = ["parallel.strategy=ddp", "parallel.pp=2", "run.comm_bytes=true"]
    metrics = train_run(tmp_path / "run", *overrides, nproc=2, steps=3)
    config = load_config(overrides=[*FAST, *overrides])
    predicted = sum(plan_step(config, 2, pp_rank=0).comm_bytes.values())
    assert [m["comm_bytes"] for m in metrics[1:]] == [predicted, predicted], metrics
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layout"] == "ddp 1 x pp 2 (1f1b)"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(
    ("strategy", "precision"), [("ddp", "bf16"), ("fsdp", "bf16"), ("hsdp", "bf16")]
)
def test_pipeline_without_data_parallel_ranks_sends_no_gradients_over_nccl(
    tmp_path: Path, strategy: str, precision: str
) -> None:
    """Two GPUs over NCCL, one pipeline stage each, bf16: the stages' activations as predicted (float32
    under DDP's autocast, bf16 where FSDP2 of one rank gathers bf16 weights), and no gradient
    all-reduce."""
    out = tmp_path / "out"
    proc = run_cli("bench", "--strategies", strategy, "--nproc", "2", "--steps", "2", "--warmup",
                   "1", "--precision", precision, "--out", str(out), "--set", *FAST,
                   "parallel.pp=2", "parallel.replicate=1", timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["device"] != "cpu"
    measured = {k: c["bytes"] for k, c in row["comm_by_collective"].items()}
    predicted = row["comm_by_collective_predicted"]
    assert set(measured) == {"send/recv", "all_reduce"}, measured
    assert measured == predicted


@pytest.mark.parametrize(
    ("strategy", "overrides", "wrapper", "mesh_dims"),
    [
        # One replica: nothing to replicate over, the stages stay plain (as with strategy single).
        ("ddp", ["parallel.pp=2"], DPWrapper.NONE, ("pp",)),
        ("ddp", ["parallel.tp=2"], DPWrapper.NONE, ("tp",)),
        # FSDP of one rank stays for its mixed precision (bf16 gathers over float32 master weights);
        # on a one-dimensional mesh of one rank it sends nothing (no all-reduce across one replica).
        ("fsdp", ["parallel.pp=2"], DPWrapper.FSDP, ("pp", "dp_shard")),
        ("fsdp", ["parallel.pp=2", "parallel.sharding=no_shard"], DPWrapper.FSDP, ("pp", "dp_shard")),
        ("hsdp", ["parallel.tp=2", "parallel.replicate=1"], DPWrapper.FSDP, ("dp_shard", "tp")),
        ("fsdp", ["parallel.sharding=no_shard"], DPWrapper.FSDP, ("dp_shard",)),
        # Data-parallel ranks beside the pipeline: FSDP2 replicates for DDP, as before.
        ("ddp", ["parallel.pp=2", "train.global_batch_size=8"], DPWrapper.FSDP,
         ("pp", "dp_replicate", "dp_shard")),
    ],
)  # fmt: skip
def test_a_data_parallel_degree_of_one_wraps_for_nothing_but_mixed_precision(
    strategy: str, overrides: list[str], wrapper: DPWrapper, mesh_dims: tuple[str, ...]
) -> None:
    config = load_config(overrides=[*FAST, f"parallel.strategy={strategy}", *overrides])
    model_parallel = any(o.startswith(("parallel.tp=", "parallel.pp=")) for o in overrides)
    world = 4 if "train.global_batch_size=8" in overrides else 2 if model_parallel else 1
    dims = ParallelDims.from_config(config, world)
    assert (dims.wrapper, dims.mesh_dims) == (wrapper, mesh_dims)
