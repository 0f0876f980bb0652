"""Tensor and sequence parallelism train exactly like one process (real gloo processes).

Each layout is compared, step by step, with the session's single-process reference runs; tensor
parallelism splits sums over ranks (row-wise layers, the vocabulary-parallel loss), so the losses agree
to float32 reduction-order noise, well inside 1e-5 here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import CLIP, FAST, assert_close_losses, cli_env, run_cli, train_run


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        # Tensor parallelism alone, with gradient accumulation and selective recomputation.
        ("tp2-accumulation-ac", 2,
         ["parallel.tp=2", "train.micro_batch_size=2", "train.activation_checkpointing=selective"]),
        # FSDP over two ranks x TP over two (2-D mesh), sequence parallel, accumulation.
        ("fsdp2xtp2-sp-accumulation", 4,
         ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true",
          "train.micro_batch_size=2"]),
    ],
)  # fmt: skip
def test_tensor_parallel_matches_single_process(
    tmp_path: Path, reference_run: list[dict[str, Any]], name: str, nproc: int, overrides: list[str]
) -> None:
    run = train_run(tmp_path / name, *overrides, nproc=nproc)
    assert_close_losses(run, reference_run)


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        # Sequence parallel leaves the norms' gradients as partial sums: the norm must see them whole.
        ("tp2-sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("ddp2xtp2", 4, ["parallel.strategy=ddp", "parallel.tp=2"]),
    ],
)
def test_tensor_parallel_clips_like_one_process(
    tmp_path: Path,
    clipped_reference: list[dict[str, Any]],
    name: str,
    nproc: int,
    overrides: list[str],
) -> None:
    run = train_run(tmp_path / name, f"train.grad_clip={CLIP}", *overrides, nproc=nproc)
    assert_close_losses(run, clipped_reference)


def test_tensor_parallel_checkpoint_resumes_as_one_process(
    tmp_path: Path, reference_run: list[dict[str, Any]]
) -> None:
    """Saved by FSDP2 x TP2 with sequence parallelism (stopped by SIGTERM after step 6), resumed by one
    process: DCP reshards the DTensors, and the run continues exactly."""
    run_dir = tmp_path / "run"
    args = ["train", "--nproc", "4", "--set", *FAST, "train.steps=12", f"run.dir={run_dir}",
            "parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true"]  # fmt: skip
    first = run_cli(*args, env={"DTLAB_FAULTS": "sigterm@6"})
    assert first.returncode == 75, first.stderr
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")] == ["step-00000006"]
    # The tensor-parallel checkpoint exports whole tensors, the plain model's names and shapes.
    export = run_cli("export", str(run_dir / "checkpoints" / "step-00000006"), "--format",
                     "safetensors", "--out", str(tmp_path / "export"))  # fmt: skip
    assert export.returncode == 0, export.stderr
    from safetensors.torch import load_file

    from dtlab.config import load_config
    from dtlab.models.llama import build_model

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    whole = build_model(load_config(overrides=FAST).model)
    assert {k: tuple(v.shape) for k, v in exported.items()} == {
        k: tuple(v.shape) for k, v in whole.named_parameters()
    }
    run = train_run(run_dir)  # the same run directory, one process: resumes
    assert_close_losses(run, reference_run)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000006")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tp=4"], "model.n_kv_heads = 2 is not divisible by parallel.tp = 4"),
        (["parallel.sequence_parallel=true"], "it needs parallel.tp > 1 (got 1)"),
        (["parallel.tp=2", "parallel.strategy=ddp", "parallel.compression=powersgd"],
         "parallel.compression = 'powersgd' is not supported with parallel.tp = 2"),
    ],
)  # fmt: skip
def test_tensor_parallel_config_errors(overrides: list[str], message: str) -> None:
    proc = run_cli("config", "--set", *FAST, *overrides)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_tp_must_divide_the_world(tmp_path: Path) -> None:
    proc = run_cli("train", "--nproc", "3", "--set", *FAST, "parallel.tp=2",
                   "parallel.strategy=ddp", f"run.dir={tmp_path / 'r'}", env=cli_env())  # fmt: skip
    assert proc.returncode == 2
    assert "parallel.tp = 2 x parallel.pp = 1 does not divide the world size 3" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("overrides", "nproc", "collective"),
    [
        (["parallel.tp=2"], 2, "all_reduce"),  # tp over the whole world: the default group
        (["parallel.tp=2", "parallel.strategy=fsdp"], 4, "tp all_reduce"),
        (["parallel.pp=2", "model.n_layers=4", "parallel.pp_microbatches=2",
          "parallel.strategy=fsdp"], 4, "send/recv"),
    ],
)  # fmt: skip
def test_bench_measures_model_parallel_collectives_next_to_the_plan(
    tmp_path: Path, overrides: list[str], nproc: int, collective: str
) -> None:
    """dtlab bench counts tensor and pipeline parallelism's collectives (tensor parallelism's by its
    group) and they agree with the plan's prediction, every collective to the byte (the
    vocabulary-parallel loss's three float all-reduces, issued inside DTensor's dispatch, too)."""
    strategy = "single" if "parallel.strategy=fsdp" not in overrides else "fsdp"
    proc = run_cli("bench", "--strategies", strategy, "--nproc", str(nproc), "--steps", "2",
                   "--warmup", "1", "--out", str(tmp_path / "out"), "--set", *FAST, *overrides)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    measured, predicted = row["comm_by_collective"], row["comm_by_collective_predicted"]
    assert collective in measured, measured
    assert set(measured) == set(predicted), (measured, predicted)
    for name, c in measured.items():
        assert c["bytes"] == predicted[name], (name, c, predicted)
