"""Checkpoints across engines: an MLX run resumes on the torch engine and a torch run on the MLX
engine, at other layouts, continuing as the uninterrupted run (dtlab.checkpoint.engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import FAST, read_metrics, run_cli
from dtlab.mlx import mlx_available
from test_mlx import column, mlx_train, ok_metrics

pytestmark = pytest.mark.skipif(
    not mlx_available(), reason="MLX is not installed (pip install 'dtlab[mlx]')"
)

STEPS = 8
# Clipping on every step (the debug model's norms are above 0.5), a checkpoint at step 4, and rank 1
# killed at step 6: the resume starts from step 4 and trains steps 5-8 again.
RUN = ["train.grad_clip=0.5", "checkpoint.every=4"]
KILL = {"DTLAB_FAULTS": "kill@6:r1"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One MLX process, 8 steps: the run every resume here must continue as (the torch engine's
    own layouts are held to it within 1e-3 in test_mlx_tp / test_mlx_fsdp)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    return ok_metrics(mlx_train(d, *RUN, steps=STEPS), d)


def _torch(run_dir: Path, *overrides: str, nproc: int, env: dict[str, str] | None = None):
    return run_cli(
        "train", "--nproc", str(nproc), "--set", *FAST, f"train.steps={STEPS}",
        f"run.dir={run_dir}", *RUN, *overrides, env=env,
    )  # fmt: skip


def _continues(proc: Any, run_dir: Path, ref: list[dict[str, Any]]) -> None:
    m = ok_metrics(proc, run_dir)
    assert "resumed from" in proc.stderr and "step-00000004" in proc.stderr, proc.stderr
    assert [x["step"] for x in m] == list(range(1, STEPS + 1))
    # Steps 5-8 trained on the other engine from the checkpoint: the uninterrupted run's losses and
    # clipped norms (a schedule restarted at step 0 or moments lost are off by 1e-2 and more).
    np.testing.assert_allclose(column(m, "loss"), column(ref, "loss"), rtol=0, atol=1e-3)
    np.testing.assert_allclose(column(m, "grad_norm"), column(ref, "grad_norm"), rtol=1e-3)
    np.testing.assert_allclose(column(m, "lr"), column(ref, "lr"), rtol=1e-6)


def test_mlx_tp2_checkpoint_resumes_on_torch_fsdp2(tmp_path: Path, uninterrupted) -> None:
    """An MLX tp 2 run killed after its step-4 checkpoint goes on as torch FSDP 2 (DCP reads the
    MLX files and shards them), continuing as the uninterrupted run."""
    run = tmp_path / "run"
    killed = mlx_train(run, *RUN, "parallel.tp=2", nproc=2, steps=STEPS, env=KILL)
    assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr
    resumed = _torch(run, "parallel.strategy=fsdp", nproc=2)
    assert "train.engine: 'mlx' -> 'torch'" in resumed.stderr, resumed.stderr
    _continues(resumed, run, uninterrupted)


def test_torch_tp2_checkpoint_resumes_on_mlx_tp2(tmp_path: Path, uninterrupted) -> None:
    """A torch tp 2 run killed after its step-4 checkpoint goes on as MLX tp 2 (the DCP shards read
    whole, each rank keeping its part), continuing as the uninterrupted run."""
    run = tmp_path / "run"
    killed = _torch(run, "parallel.strategy=ddp", "parallel.tp=2", nproc=2, env=KILL)
    assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr
    resumed = mlx_train(run, *RUN, "parallel.tp=2", nproc=2, steps=STEPS)
    assert "train.engine: 'torch' -> 'mlx'" in resumed.stderr, resumed.stderr
    _continues(resumed, run, uninterrupted)


def test_a_torch_checkpoint_the_mlx_engine_cannot_take_over_is_refused(tmp_path: Path) -> None:
    """Muon's state is not AdamW's: the MLX engine refuses it before loading, naming what to do."""
    run = tmp_path / "run"
    saved = _torch(run, "train.optimizer=muon", "checkpoint.every=2", nproc=1)
    assert saved.returncode == 0, saved.stderr
    proc = mlx_train(run, *RUN, steps=STEPS)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "train.optimizer = 'muon', whose state the MLX engine cannot take over" in proc.stderr
    assert "dtlab export" in proc.stderr
    assert read_metrics(run)[-1]["step"] == STEPS  # the torch run's metrics are kept
