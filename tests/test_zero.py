"""ZeRO-1 (``parallel.sharding: optimizer`` on DDP): each rank keeps a share of the optimizer state and
the training is still one process's, on real gloo processes; its checkpoints load on any layout."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, TOL, assert_same_training, read_metrics, run_cli, train_run
from dtlab import load_config
from dtlab.analysis.model import plan_step
from dtlab.errors import ConfigError
from dtlab.parallel.zero import owners

ZERO = ["parallel.strategy=ddp", "parallel.sharding=optimizer"]


def test_owners_balance_whole_tensors() -> None:
    # Largest first, each to the emptiest rank (ties to the lowest): 10 | 6+3+2 | 5+4.
    assert owners([4, 10, 3, 6, 5, 2], 3) == [2, 0, 1, 1, 2, 1]
    assert owners([7, 7], 4) == [0, 1]  # ranks without a tensor are allowed
    assert owners([1, 2, 3], 1) == [0, 0, 0]


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        ("zero1-2", 2, []),
        ("zero1-2-accumulation", 2, ["train.micro_batch_size=2"]),
        ("zero1-4-accumulation", 4, ["train.micro_batch_size=1"]),
    ],
)
def test_zero1_matches_single_process_with_a_share_of_the_state(
    tmp_path: Path,
    reference_run: list[dict[str, Any]],
    name: str,
    nproc: int,
    overrides: list[str],
) -> None:
    run_dir = tmp_path / name
    run = train_run(run_dir, *ZERO, "run.comm_bytes=true", *overrides, nproc=nproc)
    assert_same_training(run, reference_run)
    # The optimizer state each rank holds, measured, is the plan's ZeRO-1 share: about 1/N of DDP's.
    config = load_config(overrides=[*FAST, *ZERO, *overrides])
    zero, ddp = plan_step(config, nproc), plan_step(config.model_copy(deep=True), 1)
    summary = json.loads((run_dir / "summary.json").read_text())
    measured = summary["optimizer_state_bytes"]
    assert measured == zero.optimizer_bytes
    assert measured < ddp.optimizer_bytes / nproc * 1.2, (measured, ddp.optimizer_bytes)
    # And the bytes each step moves are predicted to the byte: DDP's all-reduce, the owners'
    # broadcasts and the step's reduction (but in step 2, where DDP broadcasts the bucket layout it
    # rebuilt after the first backward, once).
    counted = {m["step"]: m["comm_bytes"] for m in run}
    assert {v for step, v in counted.items() if step != 2} == {sum(zero.comm_bytes.values())}
    assert zero.comm_bytes["broadcast"] == 4 * summary["params"]


def test_plain_ddp_holds_the_whole_state(tmp_path: Path) -> None:
    """The figure ZeRO-1 is compared with, measured the same way: DDP's ranks each hold all of it."""
    run_dir = tmp_path / "ddp"
    train_run(run_dir, "parallel.strategy=ddp", nproc=2, steps=2)
    measured = json.loads((run_dir / "summary.json").read_text())["optimizer_state_bytes"]
    config = load_config(overrides=[*FAST, "parallel.strategy=ddp"])
    assert measured == plan_step(config, 2).optimizer_bytes
    zero = plan_step(load_config(overrides=[*FAST, *ZERO]), 2).optimizer_bytes
    assert zero < 0.55 * measured


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
