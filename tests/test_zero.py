"""ZeRO-1 (``parallel.sharding: optimizer`` on DDP): each rank keeps its even share of the optimizer
state, the gradients are reduce-scattered and the parameters all-gathered (DDP's bytes on the wire), and
the training is still one process's, on real gloo processes; its checkpoints load on any layout."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    FAST,
    TOL,
    assert_same_training,
    checkpoint_tensors,
    read_metrics,
    run_cli,
    run_worker,
    train_run,
)
from dtlab import load_config
from dtlab.analysis.model import bus_bytes, ddp_comm_bytes, param_shapes, plan_step
from dtlab.errors import ConfigError
from dtlab.parallel.zero import _fill_slots, rows_of, slot_numel

ZERO = ["parallel.strategy=ddp", "parallel.sharding=optimizer"]


def test_rows_split_as_torch_chunk_and_the_plan_shares_evenly() -> None:
    """Each rank's rows of a parameter are torch.chunk's (FSDP2's, DTensor's Shard(0)); on the model
    that whole-tensor ownership split worst, the fullest rank holds the even share."""
    for rows in (1, 3, 5, 8, 13):
        for ranks in (1, 2, 4, 8):
            chunks = torch.arange(rows).chunk(ranks)
            spans = [rows_of(rows, ranks, r) for r in range(ranks)]
            got = [list(range(a, b)) for a, b in spans if b > a]
            assert got == [c.tolist() for c in chunks], (rows, ranks, spans)
    assert slot_numel([(5, 3), (8,)], 4) == 2 * 3 + 2
    # llama3.2-1b over 8 ranks: every dim 0 divides by 8, so each rank holds exactly 1/8 of the
    # moments (plus a step counter per tensor) and the collectives carry no padding.
    config = load_config(overrides=["model.preset=llama3.2-1b", *ZERO])
    zero, shapes = plan_step(config, 8), param_shapes(config.model)
    params = sum(s.numel for s in shapes)
    assert zero.optimizer_bytes == 2 * 4 * params // 8 + 4 * len(shapes)
    assert round(zero.optimizer_bytes / 2**30, 2) == 1.15
    gradients = bus_bytes(ddp_comm_bytes(shapes, config, 8), {}, 8)  # DDP's ring all-reduce
    assert zero.comm_bus_bytes["all_to_all"] + zero.comm_bus_bytes["all_gather"] == gradients


@pytest.mark.parametrize(("rows", "ranks"), [(8, 4), (7, 4), (5, 4), (1, 4), (3, 2), (0, 3)])
def test_a_gradient_fills_its_slots_rank_major_with_zeros_after(rows: int, ranks: int) -> None:
    """A flat buffer is not zeroed first: each parameter's columns get its rows, rank r's in slot r,
    and zeros for the last ranks' padding, whatever the buffer held (here NaN)."""
    grad = torch.arange(1.0, rows * 3 + 1).view(rows, 3)
    width = -(-rows // ranks) * 3
    buffer = torch.full((ranks, width + 5), float("nan"))  # a column range of a wider buffer
    _fill_slots(buffer[:, 2 : 2 + width], grad.reshape(-1))
    padded = torch.cat([grad.reshape(-1), torch.zeros(ranks * width - grad.numel())])
    assert torch.equal(buffer[:, 2 : 2 + width], padded.view(ranks, width))
    assert buffer[:, :2].isnan().all() and buffer[:, 2 + width :].isnan().all()  # nothing else


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        ("zero1-2", 2, []),
        ("zero1-2-accumulation", 2, ["train.micro_batch_size=2"]),
        ("zero1-4-accumulation-clipped", 4, ["train.micro_batch_size=1", "train.grad_clip=0.1"]),
    ],
)
def test_zero1_matches_single_process_with_an_even_share_and_ddp_bytes(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    name: str,
    nproc: int,
    overrides: list[str],
) -> None:
    run_dir = tmp_path / name
    run = train_run(run_dir, *ZERO, "run.comm_bytes=true", *overrides, nproc=nproc)
    # Clipped below every step's norm: each rank clips its rows by the whole averaged gradient's norm.
    clipped = "train.grad_clip=0.1" in overrides
    assert_same_training(
        run, request.getfixturevalue("clipped_reference" if clipped else "reference_run")
    )
    # The optimizer state each rank holds, measured, is the plan's ZeRO-1 share and at most 1/N of
    # DDP's moments (the debug model's dim 0s all divide by 2 and 4), plus a step counter per tensor.
    config = load_config(overrides=[*FAST, *ZERO, *overrides])
    shapes = param_shapes(config.model)
    zero, ddp = plan_step(config, nproc), plan_step(config.model_copy(deep=True), 1)
    summary = json.loads((run_dir / "summary.json").read_text())
    measured, counters = summary["optimizer_state_bytes"], 4 * len(shapes)
    assert measured == zero.optimizer_bytes
    assert measured - counters <= (ddp.optimizer_bytes - counters) / nproc, measured
    # The bytes each step moves are predicted to the byte, on every step: the reduce-scatter (an
    # all-to-all of the ranks' slots), the all-gather and the step's reduction. On the wire (what
    # one rank sends, (N - 1) / N of each buffer) that is DDP's ring all-reduce of the same model's
    # gradients, plus the reduction.
    assert set(zero.comm_bytes) == {"all_to_all", "all_gather", "all_reduce"}
    assert {m["comm_bytes"] for m in run} == {sum(zero.comm_bytes.values())}
    assert {m["wire_bytes"] for m in run} == {round(sum(zero.comm_bus_bytes.values()))}
    ddp_wire = bus_bytes(ddp_comm_bytes(shapes, config, nproc), {}, nproc)
    assert {m["wire_bytes"] for m in run} == {round(ddp_wire + zero.comm_bus_bytes["all_reduce"])}


def test_plain_ddp_holds_the_whole_state(tmp_path: Path) -> None:
    """The figures ZeRO-1 is compared with, measured the same way: DDP's ranks each hold all of the
    state, and send the plan's all-reduce on the wire."""
    run_dir = tmp_path / "ddp"
    run = train_run(run_dir, "parallel.strategy=ddp", "run.comm_bytes=true", nproc=2, steps=3)
    measured = json.loads((run_dir / "summary.json").read_text())["optimizer_state_bytes"]
    config = load_config(overrides=[*FAST, "parallel.strategy=ddp"])
    ddp = plan_step(config, 2)
    assert measured == ddp.optimizer_bytes
    zero = plan_step(load_config(overrides=[*FAST, *ZERO]), 2).optimizer_bytes
    assert zero < 0.51 * measured
    # But in step 2, where DDP broadcasts the bucket layout it rebuilt after the first backward.
    wire = {m["step"]: m["wire_bytes"] for m in run}
    assert wire[1] == wire[3] == round(sum(ddp.comm_bus_bytes.values()))


def test_zero1_bad_step_changes_nothing(tmp_path: Path) -> None:
    """A non-finite step under ZeRO-1 (bf16 reduce-scatter): its gradients are reduce-scattered and
    judged, but no rank steps its rows and nothing is gathered; parameters and the sharded optimizer
    state are exactly as before it."""
    run_dir = tmp_path / "run"
    overrides = [*ZERO, "parallel.compression=bf16", "run.comm_bytes=true"]
    args = ["train", "--nproc", "2", "--set", *FAST, "train.steps=3", f"run.dir={run_dir}",
            "checkpoint.every=1", "checkpoint.keep=10", *overrides]  # fmt: skip
    proc = run_cli(*args, env={"DTLAB_FAULTS": "nan@2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_metrics(run_dir)
    assert [m.get("bad", False) for m in run] == [False, True, False]
    before = checkpoint_tensors(run_dir / "checkpoints" / "step-00000001")
    after = checkpoint_tensors(run_dir / "checkpoints" / "step-00000002")
    assert before.keys() == after.keys() and any(k.startswith("optim.") for k in before)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    # Predicted to the byte, with half-precision gradients; the bad step gathers nothing.
    plan = plan_step(load_config(overrides=[*FAST, *overrides]), 2).comm_bytes
    assert plan["all_to_all"] * 2 == plan["all_gather"]
    counted = [m["comm_bytes"] for m in run]
    whole = sum(plan.values())
    assert counted == [whole, whole - plan["all_gather"], whole]


def _train(run_dir: Path, nproc: int, *overrides: str, faults: str | None = None) -> int:
    args = [
        "train", "--nproc", str(nproc), "--set", *FAST, "train.steps=12", "checkpoint.every=3",
        f"run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    proc = run_cli(*args, env={"DTLAB_FAULTS": faults} if faults else None)
    if faults is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode


@pytest.mark.parametrize(
    ("first", "second"),
    [((2, ZERO), (1, ["parallel.strategy=single"])), ((1, []), (4, ZERO))],
    ids=["zero1x2-then-single", "single-then-zero1x4"],
)
def test_kill9_resume_reshards_the_optimizer_state(
    tmp_path: Path,
    reference_run: list[dict[str, Any]],
    first: tuple[int, list[str]],
    second: tuple[int, list[str]],
) -> None:
    """Killed after step 7, resumed from step 6 on another layout: each rank's share of the state was
    saved under the whole model's names, so one process (or four ranks' other shares) loads it."""
    run_dir = tmp_path / "run"
    code = _train(run_dir, first[0], *first[1], faults="kill@7")
    assert code == (1 if first[0] > 1 else -signal.SIGKILL)
    _train(run_dir, second[0], *second[1])
    run = read_metrics(run_dir)
    assert [m["step"] for m in run] == list(range(1, 13))
    for m, r in zip(run, reference_run, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=TOL), m["step"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=fsdp"], "parallel.strategy = 'fsdp' allows: full, shard_grad_op"),
        (["parallel.strategy=single"], "'single' has none .allowed: parallel.strategy = 'ddp'"),
        (["parallel.strategy=ddp", "train.optimizer=demo"], "train.optimizer = 'demo' is not"),
        (
            ["parallel.strategy=ddp", "parallel.compression=powersgd"],
            "parallel.compression = 'powersgd' is not supported .* allowed: none, fp16, bf16",
        ),
        (["parallel.strategy=ddp", "parallel.tp=2"], "parallel.tp = 2 is not supported"),
        (
            ["parallel.strategy=ddp", "parallel.diloco.inner_steps=4"],
            "parallel.diloco.inner_steps = 4 is not supported",
        ),
    ],
)
def test_zero1_refuses_what_it_does_not_shard(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["parallel.sharding=optimizer", *overrides])


def test_nccl_reduce_scatters_and_gloo_all_to_alls_to_the_same_rows() -> None:
    # NCCL: reduce_scatter_tensor (a ring, one slot held); gloo: its reduce-scatter is an all-reduce,
    # so an all-to-all and a local sum. Both paths run here on gloo and agree.
    from dtlab.parallel.zero import reduce_method

    assert reduce_method("nccl") == "reduce_scatter"
    assert reduce_method("gloo") == "all_to_all"
    assert reduce_method("fake") == "all_to_all"  # the plan's check counts a CPU run's
    # The plan names the collective its device's ranks run, with the same bytes.
    config = load_config(None, [*FAST, "parallel.strategy=ddp", "parallel.sharding=optimizer"])
    cpu, cuda = plan_step(config, 2).comm_bytes, plan_step(config, 2, device_type="cuda").comm_bytes
    assert cpu["all_to_all"] == cuda["reduce_scatter"] > 0 and "reduce_scatter" not in cpu
    run_worker("zero_reduce_worker.py", 3)
