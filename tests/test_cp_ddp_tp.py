"""Context parallelism where every rank holds whole parameters beside tensor or pipeline parallelism:
``ddp`` with ``parallel.tp`` or ``parallel.pp`` > 1, and FSDP's ``no_shard``. FSDP2 replicates over
the data x cp ranks (the mesh's cp dimension next to dp_replicate, flattened with it) in shard
groups of one rank, so that the gradients are averaged over every rank that holds the same
parameters, as DDP does under cp alone. Trained against one process, clipping active."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    CLIP,
    FAST,
    assert_same_training,
    checkpoint_tensors,
    read_metrics,
    run_cli,
    train_run,
)
from dtlab.config import check_world, load_config
from dtlab.dims import ParallelDims, layout_name
from dtlab.verify import parse_layouts

CLIPPED = (f"train.grad_clip={CLIP}",)


def _dims(nproc: int, *overrides: str) -> tuple[ParallelDims, str]:
    config = load_config(overrides=[*FAST, "parallel.cp=2", *overrides])
    check_world(config, nproc)
    dims = ParallelDims.from_config(config, nproc)
    return dims, layout_name(dims, config.parallel)


def _groups(dims: ParallelDims, *names: str) -> list[list[int]]:
    """The global ranks of each group over the mesh dimensions ``names`` (flattened), as
    ``init_device_mesh`` lays the world out row-major over ``mesh_dims``."""
    ranks = torch.arange(dims.world_size).view(dims.mesh_shape)
    at = [dims.mesh_dims.index(n) for n in names]
    rest = [i for i in range(ranks.ndim) if i not in at]
    size = math.prod(dims.mesh_shape[i] for i in at)
    return sorted(ranks.permute(*rest, *at).reshape(-1, size).tolist())


@pytest.mark.parametrize(
    ("nproc", "overrides", "name", "mesh_dims", "replicas"),
    [
        (4, ["parallel.strategy=ddp", "parallel.tp=2"], "ddp 1 x cp 2 (ring) x tp 2",
         ("dp_replicate", "cp", "dp_shard", "tp"), [[0, 2], [1, 3]]),
        (8, ["parallel.strategy=ddp", "parallel.tp=2"], "ddp 2 x cp 2 (ring) x tp 2",
         ("dp_replicate", "cp", "dp_shard", "tp"), [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (4, ["parallel.strategy=ddp", "parallel.pp=2"], "ddp 1 x cp 2 (ring) x pp 2 (1f1b)",
         ("pp", "dp_replicate", "cp", "dp_shard"), [[0, 1], [2, 3]]),
        (4, ["parallel.strategy=fsdp", "parallel.sharding=no_shard"],
         "fsdp 2 (no_shard) x cp 2 (ring)", ("dp_replicate", "cp", "dp_shard"), [[0, 1, 2, 3]]),
        (8, ["parallel.strategy=hsdp", "parallel.replicate=2", "parallel.sharding=no_shard",
             "parallel.tp=2"], "hsdp 2x1 (no_shard) x cp 2 (ring) x tp 2",
         ("dp_replicate", "cp", "dp_shard", "tp"), [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ],
    ids=["ddp1xcp2xtp2", "ddp2xcp2xtp2", "ddp1xcp2xpp2", "fsdp2-no_shardxcp2", "hsdp-no_shardxtp2"],
)  # fmt: skip
def test_fsdp2_replicates_over_the_data_x_cp_ranks(
    nproc: int, overrides: list[str], name: str, mesh_dims: tuple[str, ...], replicas: list[Any]
) -> None:
    dims, layout = _dims(nproc, *overrides)
    assert layout == name and dims.mesh_dims == mesh_dims
    assert dims.fsdp_enabled and dims.cp_replicates and dims.dp_shard == 1
    # FSDP shards over nothing, replicates over the data x cp ranks (the gradients' average).
    assert (dims.fsdp_shard, dims.fsdp_replicate) == (1, dims.dp * dims.cp)
    assert _groups(dims, "dp_replicate", "cp") == replicas
    # Each rank's part of the sequence (coordinates) is its place in the cp group the attention
    # runs over, and its data-parallel index is shared by its cp group.
    for group in _groups(dims, "cp"):
        assert [dims.coordinates(r)["cp"] for r in group] == list(range(dims.cp))
        assert len({dims.dp_rank(r) for r in group}) == 1
    # The ranks that replicate each parameter: the same tp and pp coordinates.
    for group in replicas:
        place = {(dims.coordinates(r)["tp"], dims.coordinates(r)["pp"]) for r in group}
        assert len(place) == 1


def test_sharded_layouts_keep_cp_next_to_the_shard_dimension() -> None:
    dims, _ = _dims(4, "parallel.strategy=fsdp", "parallel.tp=2")
    assert dims.mesh_dims == ("dp_shard", "cp", "tp") and not dims.cp_replicates
    assert (dims.fsdp_shard, dims.fsdp_replicate) == (2, 1)
    ddp, _ = _dims(4, "parallel.strategy=ddp")  # DDP itself, over every rank
    assert ddp.ddp_enabled and ddp.cp_replicates and ddp.fsdp_replicate == 1
    # A mesh whose dimensions above 1 leave the order of the ranks is refused.
    with pytest.raises(ValueError, match="must keep the order"):
        ParallelDims(dp_replicate=2, cp=2, wrapper=dims.wrapper, mesh_dims=("cp", "dp_replicate"))


def test_verify_layouts_without_a_data_dimension_run_ddp_under_cp() -> None:
    # As tp:2 alone runs without wrapping: the cp ranks average their gradients, so DDP (FSDP2
    # replicating over them beside tp or pp).
    layouts = parse_layouts("single,tp:2xcp:2,cp:2xpp:2,fsdp:2xcp:2,ddp:1xcp:2xtp:2")
    assert [x.nproc for x in layouts] == [1, 4, 4, 4, 4]
    assert layouts[1].overrides == ("parallel.strategy=ddp", "parallel.tp=2", "parallel.cp=2")
    assert layouts[2].overrides[0] == "parallel.strategy=ddp"
    assert layouts[3].overrides[0] == "parallel.strategy=fsdp"


@pytest.fixture(scope="module")
def clipped_single(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """One process with clipping active on every step, and its run directory."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    run = train_run(run_dir, *CLIPPED)
    assert all(m["grad_norm"] > CLIP for m in run), [m["grad_norm"] for m in run]
    return run, run_dir


@pytest.mark.parametrize(
    ("layout", "nproc", "name"),
    [
        (["parallel.strategy=ddp", "parallel.tp=2"], 4, "ddp 1 x cp 2 (ring) x tp 2"),
        (["parallel.strategy=ddp", "parallel.pp=2"], 4, "ddp 1 x cp 2 (ring) x pp 2 (1f1b)"),
        # Two micro-batches: the gradients whole until the last, then averaged over the cp ranks.
        (["parallel.strategy=fsdp", "parallel.sharding=no_shard", "train.micro_batch_size=4"], 2,
         "fsdp 1 (no_shard) x cp 2 (ring)"),
        # Two data-parallel ranks: the gradients averaged over all four data x cp ranks.
        pytest.param(["parallel.strategy=ddp", "parallel.tp=2"], 8, "ddp 2 x cp 2 (ring) x tp 2",
                     marks=pytest.mark.slow),
    ],
    ids=["ddp1xcp2xtp2", "ddp1xcp2xpp2", "fsdp1-no_shardxcp2-accumulation", "ddp2xcp2xtp2"],
)  # fmt: skip
def test_replicated_context_parallel_training_equals_one_process(
    tmp_path: Path,
    clipped_single: tuple[list[dict[str, Any]], Path],
    layout: list[str],
    nproc: int,
    name: str,
) -> None:
    run_dir = tmp_path / "run"
    run = train_run(run_dir, *CLIPPED, "parallel.cp=2", *layout, nproc=nproc)
    _assert_trains_as(run_dir, run, name, clipped_single)


@pytest.mark.slow
def test_fault_tolerant_groups_of_cp_and_tp_ranks_train_as_one_process(
    tmp_path: Path, clipped_single: tuple[list[dict[str, Any]], Path]
) -> None:
    # Two replica groups, each the world of its cp x tp ranks (FSDP2 replicating over its cp
    # ranks), averaged across the groups by torchft.
    pytest.importorskip("torchft")
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--nproc", "8", "--set", *FAST, "train.steps=12", f"run.dir={run_dir}", *CLIPPED,
        "parallel.strategy=ddp", "parallel.cp=2", "parallel.tp=2",
        "parallel.fault_tolerance.enabled=true",
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    for replica in (0, 1):
        group = run_dir / f"replica-{replica}"
        run = read_metrics(group)
        assert all(m["replicas"] == 2 for m in run)
        _assert_trains_as(group, run, "ddp 1 x cp 2 (ring) x tp 2", clipped_single)


def _assert_trains_as(
    run_dir: Path,
    run: list[dict[str, Any]],
    name: str,
    clipped_single: tuple[list[dict[str, Any]], Path],
) -> None:
    """``run`` (in ``run_dir``) laid out as ``name`` and trained as the clipped reference: its
    losses, gradient norms and, after the last step, its parameters."""
    reference, reference_dir = clipped_single
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == name  # really split as named
    assert_same_training(run, reference)
    # The parameters after the last step: a gradient averaged over the data ranks alone (not the
    # cp ranks) would leave the cp ranks' copies apart and the clipped update another.
    got = checkpoint_tensors(run_dir / "checkpoints" / "step-00000012")
    want = checkpoint_tensors(reference_dir / "checkpoints" / "step-00000012")
    params = [k for k in want if k.startswith("model.")]
    assert params and set(params) <= set(got)
    worst = max((got[k] - want[k]).abs().max().item() for k in params)
    assert worst < 1e-4, worst
