"""Every strategy trains exactly like one process on the same global batch (real gloo processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import CLIP, TOL, assert_same_training, train_run


def test_reference_trains(reference_run: list[dict[str, Any]]) -> None:
    assert len(reference_run) == 12
    assert reference_run[-1]["loss"] < reference_run[0]["loss"] - 0.3


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        ("single-accumulation", 1, ["train.micro_batch_size=2"]),
        ("ddp", 2, ["parallel.strategy=ddp"]),
        ("ddp-accumulation", 2, ["parallel.strategy=ddp", "train.micro_batch_size=2"]),
        ("fsdp-full", 2, ["parallel.strategy=fsdp", "parallel.sharding=full"]),
        ("fsdp-shard_grad_op", 2, ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"]),
        ("fsdp-no_shard", 2, ["parallel.strategy=fsdp", "parallel.sharding=no_shard"]),
        ("fsdp-accumulation", 2, ["parallel.strategy=fsdp", "train.micro_batch_size=1"]),
        ("hsdp", 4, ["parallel.strategy=hsdp", "parallel.replicate=2"]),
        # Each micro-batch reduce-scattered, the replica groups' all-reduce held to the last.
        (
            "hsdp-accumulation",
            4,
            ["parallel.strategy=hsdp", "parallel.replicate=2", "train.micro_batch_size=1"],
        ),
        # The tuning options change when collectives run, not what they compute.
        ("ddp-small-buckets", 2, ["parallel.strategy=ddp", "parallel.bucket_mb=0.05"]),
        ("fsdp-prefetch-2", 2, ["parallel.strategy=fsdp", "parallel.fsdp_prefetch=2"]),
    ],
)
def test_strategy_matches_single_process(
    tmp_path: Path, reference_run: list[dict[str, Any]], name: str, nproc: int, overrides: list[str]
) -> None:
    run = train_run(tmp_path / name, *overrides, nproc=nproc)
    assert_same_training(run, reference_run)


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        ("ddp", 2, ["parallel.strategy=ddp"]),
        ("fsdp", 2, ["parallel.strategy=fsdp", "train.micro_batch_size=2"]),
        ("hsdp", 4, ["parallel.strategy=hsdp", "parallel.replicate=2"]),
    ],
)
def test_fault11_clipping_is_exact_where_it_clips(
    tmp_path: Path,
    clipped_reference: list[dict[str, Any]],
    reference_run: list[dict[str, Any]],
    name: str,
    nproc: int,
    overrides: list[str],
) -> None:
    """The global norm is taken over every rank's (sharded) gradients, and the clipped step equals one
    process's: a norm taken over one shard would clip by another factor and drift from the reference."""
    run = train_run(tmp_path / name, f"train.grad_clip={CLIP}", *overrides, nproc=nproc)
    assert_same_training(run, clipped_reference)
    # Clipping changed the training (so this test sees it): the unclipped run differs.
    assert abs(run[-1]["loss"] - reference_run[-1]["loss"]) > 10 * TOL


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_tied_embeddings_match(tmp_path: Path, strategy: str, single_reference: Any) -> None:
    ref = single_reference("model.tie_embeddings=true")
    run = train_run(
        tmp_path / strategy, "model.tie_embeddings=true", f"parallel.strategy={strategy}", nproc=2
    )
    assert_same_training(run, ref)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_is_exact_under_fsdp(
    tmp_path: Path, reference_run: list[dict[str, Any]], mode: str
) -> None:
    run = train_run(
        tmp_path / mode, "parallel.strategy=fsdp", f"train.activation_checkpointing={mode}", nproc=2
    )
    assert_same_training(run, reference_run)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_without_nan(tmp_path: Path, precision: str) -> None:
    run = train_run(
        tmp_path / precision, "parallel.strategy=fsdp", f"train.precision={precision}", nproc=2
    )
    losses = [m["loss"] for m in run]
    assert all(loss is not None for loss in losses), losses  # null = NaN/inf in metrics.jsonl
    assert losses[-1] < losses[0] - 0.3
    if precision == "fp16":
        # The scale starts at 2^16 and halves exactly on the steps that overflowed (and were skipped).
        scales = [2.0**16] + [m["loss_scale"] for m in run]
        for prev, m in zip(scales, run, strict=False):
            assert m["loss_scale"] == (prev / 2 if m["skipped"] else prev), (m, prev)
        assert sum(not m["skipped"] for m in run) >= 10
