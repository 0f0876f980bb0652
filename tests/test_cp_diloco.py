"""Context parallelism inside DiLoCo's replicas and inside fault-tolerant replica groups.

DiLoCo's replicas split the data-parallel ranks; each replica's ranks are its data x cp ranks (DDP
over them, or FSDP sharding over them), and the outer syncs run between the ranks of the same (data,
cp) coordinates. Splitting each sequence changes nothing DiLoCo does: 2 replicas with cp 2 inside
(4 processes) train as 2 replicas of one rank (2 processes), over four outer syncs with clipping
active, θ_global and each replica's own weights and outer momentum included. Fault-tolerant replica
groups of cp ranks likewise train as one process does (plain, and as DiLoCo's replicas).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, TOL, checkpoint_tensors, read_metrics, run_cli, train_run
from dtlab.config import check_world, load_config
from dtlab.dims import ParallelDims, layout_name
from dtlab.errors import ConfigError
from dtlab.parallel.ft import replica_groups
from dtlab.train.diloco import outer_peers, replica_members
from dtlab.verify import parse_layouts

STEPS = 8
# Nesterov outer steps (the DiLoCo paper's lr 0.7, momentum 0.9) every 2 inner steps (4 syncs),
# clipping below every step's norm (0.86 to 0.96 here): the replica's own norm decides each update.
CLIP = 0.5
DILOCO = [
    "parallel.diloco.inner_steps=2", "parallel.diloco.outer_lr=0.7",
    "parallel.diloco.outer_momentum=0.9", f"train.grad_clip={CLIP}",
]  # fmt: skip
# What float32 rounding leaves of the same training after 8 Adam steps: the ring's merged attention
# rounds otherwise than one kernel (one process against cp:2 without DiLoCo: 1.4e-5 here), and the
# Nesterov outer steps carry it on (measured: 2.2e-5; a wrong sync group moves the loss by 4e-3).
PARAM_TOL = 1e-4
FT = "parallel.fault_tolerance.enabled=true"


def _dims(world: int, *overrides: str) -> ParallelDims:
    return ParallelDims.from_config(load_config(overrides=[*FAST, *overrides]), world)


def test_replicas_split_the_data_ranks_and_each_replica_its_sequences() -> None:
    ddp = _dims(4, "parallel.strategy=ddp", "parallel.cp=2", *DILOCO)
    assert (ddp.diloco, ddp.dp_replicate, ddp.cp, ddp.dp) == (2, 1, 2, 2)
    assert ddp.mesh_dims == ("diloco", "dp_replicate", "cp") and ddp.replica_ranks == 2
    # Each replica's cp ranks read the same samples; the replicas read those of one rank of two.
    assert [ddp.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [ddp.coordinates(r)["cp"] for r in range(4)] == [0, 1, 0, 1]
    assert replica_members(ddp) == [[0, 1], [2, 3]]
    # Each rank syncs with the rank of the other replica that holds the same part of the sequence.
    assert outer_peers(ddp) == [[0, 2], [1, 3]]
    assert layout_name(ddp, load_config(overrides=["parallel.strategy=ddp"]).parallel) == (
        "diloco 2 x ddp 1 x cp 2 (ring)"
    )
    # FSDP shards each replica over its data x cp ranks: one data rank per replica is enough.
    fsdp = _dims(4, "parallel.strategy=fsdp", "parallel.cp=2", *DILOCO)
    assert (fsdp.diloco, fsdp.dp_shard, fsdp.cp, fsdp.fsdp_shard) == (2, 1, 2, 2)
    assert outer_peers(fsdp) == [[0, 2], [1, 3]]
    # 2 replicas of ddp 2 x cp 2: the peers hold the same (data, cp) coordinates.
    big = _dims(8, "parallel.strategy=ddp", "parallel.cp=2", "parallel.diloco.replicas=2", *DILOCO)
    assert (big.diloco, big.dp_replicate, big.cp, big.replica_ranks) == (2, 2, 2, 4)
    assert replica_members(big) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert outer_peers(big) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Fault-tolerant groups: one per data-parallel rank, each its cp ranks.
    ft = load_config(overrides=[FT, "parallel.strategy=ddp", "parallel.cp=2"])
    assert replica_groups(ft, 4) == (2, 2)
    # dtlab verify's DiLoCo and ft layouts take cp: replicas (groups) of 2 cp ranks each.
    layouts = parse_layouts("diloco:2:2,diloco:2:2xcp:2,ft:2xcp:2")
    assert [x.nproc for x in layouts] == [2, 4, 4]
    assert all("parallel.cp=2" in x.overrides for x in layouts[1:])


def test_a_diloco_replica_count_fault_tolerant_groups_cannot_make_is_named() -> None:
    # Each DiLoCo replica is one fault-tolerant group: of its cp ranks, one per data-parallel rank.
    replicas = "parallel.diloco.replicas=2"
    config = load_config(
        overrides=[*FAST, "parallel.strategy=ddp", "parallel.cp=2", *DILOCO, FT, replicas]
    )
    message = "each DiLoCo replica is one fault-tolerant replica group of its 2 cp ranks"
    with pytest.raises(ConfigError, match=re.escape(f"{message} (allowed: null or 1)")):
        check_world(config, 2)


@pytest.fixture(scope="module")
def diloco_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 DiLoCo replicas of one DDP rank each: the run every layout below must equal."""
    run_dir = tmp_path_factory.mktemp("diloco") / "ref"
    train_run(run_dir, "parallel.strategy=ddp", *DILOCO, nproc=2, steps=STEPS)
    return run_dir


def _same_steps(run: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    """Every step's loss and gradient norm equal to the reference's, clipping active on each."""
    assert [m["step"] for m in run] == [m["step"] for m in ref] == list(range(1, STEPS + 1))
    assert all(m["grad_norm"] > CLIP for m in ref)
    for m, r in zip(run, ref, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=TOL), m["step"]
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), m["step"]
        assert m["tokens"] == r["tokens"]
    assert run[-1]["loss"] < run[0]["loss"] - 0.3  # it trains


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(run_dir / "checkpoints" / f"step-{STEPS:08d}")


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> float:
    keys = [k for k in want if k.startswith(prefix)]
    assert keys and all(got[k].shape == want[k].shape for k in keys), prefix
    return max((got[k] - want[k]).abs().max().item() for k in keys)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_diloco_with_cp_inside_trains_as_diloco_without(
    tmp_path: Path, diloco_reference: Path, strategy: str
) -> None:
    run_dir = tmp_path / "run"
    run = train_run(
        run_dir, f"parallel.strategy={strategy}", "parallel.cp=2", *DILOCO, nproc=4, steps=STEPS
    )
    ref = read_metrics(diloco_reference)
    # Replica 0's own figures between syncs, the replicas' mean loss at each of the 4 syncs.
    _same_steps(run, ref)
    assert [m.get("outer_sync") for m in run] == [m.get("outer_sync") for m in ref]
    assert sum("outer_sync" in m for m in run) == STEPS // 2
    got, want = _final(run_dir), _final(diloco_reference)
    # θ_global, what the checkpoint calls the model.
    assert _max_diff(got, want, "model.") < PARAM_TOL
    if strategy == "ddp":
        # Every rank of a replica holds its whole state: cp rank c of replica i is reference rank i.
        for rank in range(4):
            mine = {k.replace(f"rank{rank}.", f"rank{rank // 2}.", 1): v for k, v in got.items()}
            for part in ("replica", "global", "momentum", "inner"):
                assert _max_diff(mine, want, f"comm.rank{rank // 2}.{part}.") < PARAM_TOL


def test_a_diloco_checkpoint_resumes_on_its_own_cp_layout_only(
    tmp_path: Path, diloco_reference: Path
) -> None:
    # Each rank's replica state is its own: the 2 replicas of one rank are not 2 of 2 cp ranks.
    run_dir = tmp_path / "run"
    shutil.copytree(diloco_reference, run_dir)
    proc = run_cli(
        "train", "--nproc", "4", "--set", *FAST, f"train.steps={STEPS + 2}", f"run.dir={run_dir}",
        "parallel.strategy=ddp", "parallel.cp=2", *DILOCO,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        "saved by 2 DiLoCo replicas of 1 rank on 2 processes" in proc.stderr
        and "this run: 2 DiLoCo replicas of 2 ranks (1 data-parallel x cp 2) on 4 processes"
        in proc.stderr
    ), proc.stderr[-3000:]


@pytest.mark.parametrize("diloco", [False, True], ids=["ddp", "diloco"])
def test_fault_tolerant_groups_of_cp_ranks_train_as_their_reference(
    tmp_path: Path, diloco: bool
) -> None:
    """2 replica groups of 2 cp ranks (4 processes): plain, as one process trains; as DiLoCo's
    replicas, as 2 DiLoCo replicas of one rank."""
    pytest.importorskip("torchft")
    common = ["parallel.strategy=ddp", *(DILOCO if diloco else [f"train.grad_clip={CLIP}"])]
    if diloco:
        ref_dir = tmp_path / "ref"
        train_run(ref_dir, *common, nproc=2, steps=STEPS)
    else:
        ref_dir = tmp_path / "single"
        train_run(ref_dir, *common[1:], steps=STEPS)
    run_dir = tmp_path / "ft"
    proc = run_cli(
        "train", "--nproc", "4", "--set", *FAST, f"train.steps={STEPS}", f"run.dir={run_dir}",
        *common, "parallel.cp=2", FT,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "2 replica groups of 2 ranks" in proc.stderr, proc.stderr[-3000:]
    ref, want = read_metrics(ref_dir), _final(ref_dir)
    for group in (0, 1):
        where = run_dir / f"replica-{group}"
        run = read_metrics(where)
        assert all(m["replicas"] == 2 for m in run if not diloco or "outer_sync" in m)
        if diloco:  # between syncs a group's record is its own replica's: compare the syncs
            run, ref_g = ([m for m in x if "outer_sync" in m] for x in (run, ref))
            assert [m["loss"] for m in run] == pytest.approx([m["loss"] for m in ref_g], abs=TOL)
        else:
            _same_steps(run, ref)
        assert _max_diff(_final(where), want, "model.") < PARAM_TOL
