"""Faults found in a review of the training loop, checkpoints and launcher: one test (or more) per fault.

Every run is the real CLI in fresh processes (gloo on CPU); faults are injected with ``DTLAB_FAULTS``.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, checkpoint_tensors, read_metrics, run_cli
from dtlab.bench.sweep import compression_overrides

COMPRESSIONS = ["powersgd", "dct", "dct-quant", "demo"]


def train(
    run_dir: Path,
    *overrides: str,
    nproc: int = 2,
    steps: int = 6,
    faults: str | None = None,
    expect: int = 0,
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    args = ["train", *extra, "--nproc", str(nproc), "--set", *FAST, f"train.steps={steps}"]
    args += [f"run.dir={run_dir}", *overrides]
    proc = run_cli(*args, env={"DTLAB_FAULTS": faults} if faults else None)
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def ckpt(run_dir: Path, step: int) -> dict[str, Any]:
    return checkpoint_tensors(run_dir / "checkpoints" / f"step-{step:08d}")


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def compressed(name: str) -> list[str]:
    return ["parallel.strategy=ddp", *compression_overrides(name),
            "parallel.compression_options.start_step=2"]  # fmt: skip


# --- 1. a non-finite step must not poison compression or optimizer state ---------------------------
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_fault1_skipped_step_leaves_compression_state_unchanged(
    tmp_path: Path, compression: str
) -> None:
    run = tmp_path / "run"
    train(run, *compressed(compression), "checkpoint.every=1", "checkpoint.keep=10", faults="nan@4")
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics if m.get("bad")] == [4]
    after = metrics[4:]
    assert after and all(m["loss"] is not None and math.isfinite(m["loss"]) for m in after)
    assert all(m["grad_norm"] is not None and math.isfinite(m["grad_norm"]) for m in after)
    # Everything the checkpoint holds (weights, AdamW moments, residuals, EF21 estimates, PowerSGD
    # memories, DeMo momenta) after the skipped step equals what it held before it.
    before, skipped = ckpt(run, 3), ckpt(run, 4)
    assert any(k.startswith("comm.") for k in before) or compression == "demo"
    assert_same_tensors(before, skipped)


def fp16_run(run: Path, compression: str) -> tuple[list[int], list[float]]:
    """fp16 with an injected overflow at step 4: (skipped steps, loss scales); the state after the
    skipped step must equal the state before it."""
    opts = [
        *compressed(compression),
        "train.precision=fp16",
        "checkpoint.every=1",
        "checkpoint.keep=10",
    ]
    train(run, *opts, steps=8, faults="nan@4")
    metrics = read_metrics(run)
    assert all(m["loss"] is not None and math.isfinite(m["loss"]) for m in metrics[4:])
    assert_same_tensors(ckpt(run, 3), ckpt(run, 4))
    return [m["step"] for m in metrics if m["skipped"]], [m["loss_scale"] for m in metrics]


@pytest.fixture(scope="module")
def fp16_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[int], list[float]]:
    skipped, scales = fp16_run(tmp_path_factory.mktemp("fp16-plain"), "none")
    assert skipped == [4] and scales[3] == scales[2] / 2 == scales[-1], (skipped, scales)
    return skipped, scales


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_fault1_fp16_overflow_under_compression_recovers_like_plain_ddp(
    tmp_path: Path, compression: str, fp16_plain: tuple[list[int], list[float]]
) -> None:
    """One overflowed step is skipped, the scale halves once and training goes on, as in plain DDP."""
    assert fp16_run(tmp_path / "run", compression) == fp16_plain


# --- 2. a resumed run takes the hyper-parameters given now ------------------------------------------
def test_fault2_resume_takes_the_new_learning_rate_and_optimizer_settings(tmp_path: Path) -> None:
    from dtlab.config import load_config
    from dtlab.train.schedules import lr_at

    run = tmp_path / "run"
    train(run, "checkpoint.every=3", nproc=1, steps=12, faults="kill@7", expect=-9)
    new = ["train.lr=1e-3", "train.min_lr=2e-4", "train.warmup_steps=8", "train.schedule=linear",
           "train.weight_decay=0.05", "train.betas=[0.8, 0.9]", "train.eps=1e-6"]  # fmt: skip
    proc = train(run, "checkpoint.every=3", *new, nproc=1, steps=12)
    assert (
        "train.lr: 0.003 -> 0.001" in proc.stderr
        and "train.schedule: 'cosine' -> 'linear'" in proc.stderr
    )
    t = load_config(None, [*FAST, "train.steps=12", *new]).train
    lrs = {m["step"]: m["lr"] for m in read_metrics(run)}
    # The new schedule, continued at the resumed step (step k uses lr_at(k - 1)).
    assert [lrs[k] for k in range(7, 13)] == pytest.approx([lr_at(k - 1, t) for k in range(7, 13)])
    groups = json.loads((run / "checkpoints" / "step-00000009" / "state.json").read_text())[
        "optim_param_groups"
    ]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert all(g["betas"] == [0.8, 0.9] and g["eps"] == 1e-6 for g in groups)
    assert all(g["lr"] == pytest.approx(lr_at(9, t)) for g in groups)
    # The config of the run directory records what was trained with.
    assert "lr: 0.001" in (run / "config.yaml").read_text()
