"""FSDP on the MLX engine: MLX's fully_shard over every block and the model trains the same model as one
MLX process and as the torch engine's FSDP, holds a share of the state per rank, and checkpoints whole
tensors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import FAST, run_cli, train_run
from dtlab.mlx import mlx_available
from test_mlx import _open_mpi, mlx_train, ok_metrics
from test_mlx_tp import CLIP, STEPS, _same
from test_mlx_tp import mlx_clipped as one_mlx_process

# The reference of test_mlx_tp (one MLX process, clipping on every step), a fixture of this module too.
mlx_clipped = one_mlx_process

pytestmark = pytest.mark.skipif(
    not mlx_available(), reason="MLX is not installed (pip install 'dtlab[mlx]')"
)

FSDP = ["parallel.strategy=fsdp"]


def test_mlx_fsdp2_matches_one_process_and_torch_fsdp2(tmp_path: Path, mlx_clipped) -> None:
    """fsdp 2 on the ring: one MLX process's losses and clipped norms within 1e-4, torch's fsdp 2
    within 1e-3, and about half the state per rank (the parameters and AdamW moments split)."""
    run = tmp_path / "fsdp2"
    proc = mlx_train(run, *CLIP, *FSDP, nproc=2, steps=STEPS)
    m = ok_metrics(proc, run)
    assert "mlx fsdp 2 on" in proc.stderr and "2 data-parallel ranks" in proc.stderr, proc.stderr
    # The ring has no reduce-scatter: the run says how it reduces instead.
    assert "this backend has no reduce-scatter" in proc.stderr, proc.stderr
    _same(m, mlx_clipped, 1e-4)
    torch_fsdp = train_run(tmp_path / "torch", *CLIP, *FSDP, nproc=2, steps=STEPS)
    _same(m, torch_fsdp, 1e-3)
    # What MLX holds between steps: the split state (measured 1.06 MB against 2.11 MB).
    held, whole = m[-1]["memory_active_bytes"], mlx_clipped[-1]["memory_active_bytes"]
    assert held < 0.6 * whole, (held, whole)


def test_dtlab_verify_engine_mlx_proves_fsdp(tmp_path: Path) -> None:
    """`dtlab verify --engine mlx` of fsdp:2: loss, norms, parameters, the resume (on the layout and
    on one process) and the export, each within tolerance (fsdp:4 too, as docs/mlx.md shows)."""
    proc = run_cli(
        "verify", "--engine", "mlx", "--layouts", "single,fsdp:2", "--steps", "6",
        "--checks", "all", "--out", str(tmp_path / "verify"), "--set", "model.preset=debug",
        "data.source=synthetic", "data.seq_len=64", "train.global_batch_size=8", *CLIP,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for layout, procs in (("fsdp:2", 2),):
        rows = [line for line in proc.stdout.splitlines() if line.startswith(f"{layout} ")]
        kinds = {
            "loss": rf"^{layout}\s+{procs}\s", "resume": r"\sresume\s+\d",
            "resume on single": "resume on single", "export": r"\sexport\s",
            "resume on torch": "resume on torch single",
        }  # fmt: skip
        for kind, pattern in kinds.items():
            found = [line for line in rows if re.search(pattern, line)]
            assert found and all(line.rstrip().endswith("ok") for line in found), (
                layout, kind, proc.stdout,
            )  # fmt: skip


@pytest.mark.skipif(not _open_mpi(), reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")
def test_mlx_fsdp2_tp2_under_mpi_matches_one_process_torch_and_resumes(
    tmp_path: Path, mlx_clipped
) -> None:
    """fsdp 2 x tp 2 on 4 ranks under MPI (each tensor-parallel part's rows split over the 2
    data-parallel ranks): one MLX process within 1e-4 and the torch engine's fsdp 2 x tp 2 within
    1e-3; killed after its step-5 checkpoint, it goes on as one MLX process to the same end; the
    ranks leave without MPI's teardown abort (the split groups freed before MPI finalizes)."""
    run = tmp_path / "fsdp2tp2"
    layout = [*CLIP, *FSDP, "parallel.tp=2", "parallel.backend=mpi", "checkpoint.every=5"]
    proc = mlx_train(run, *layout, nproc=4, steps=STEPS)
    m = ok_metrics(proc, run)
    assert "mlx fsdp 2 x tp 2 on" in proc.stderr, proc.stderr
    assert "MPI_FINALIZE" not in proc.stderr and "MPI_FINALIZE" not in proc.stdout
    _same(m, mlx_clipped, 1e-4)
    torch_run = train_run(tmp_path / "torch", *CLIP, *FSDP, "parallel.tp=2", nproc=4, steps=STEPS)
    _same(m, torch_run, 1e-3)
    killed = tmp_path / "killed"
    out = mlx_train(killed, *layout, nproc=4, steps=STEPS, env={"DTLAB_FAULTS": "kill@7:r3"})
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    resumed = mlx_train(killed, *CLIP, "checkpoint.every=5", steps=STEPS)
    assert "step-00000005" in resumed.stderr, resumed.stderr
    _same(ok_metrics(resumed, killed), mlx_clipped, 1e-4)


def test_mlx_fsdp_uneven_rows_are_a_clear_error(tmp_path: Path) -> None:
    """Every parameter's rows split over the ranks: 3 ranks and a vocabulary of 256 say which."""
    proc = mlx_train(tmp_path / "run", *FSDP, "train.global_batch_size=6", nproc=3, steps=2)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "do not divide by 3: tok_embeddings.weight (256, 64)" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.sharding=shard_grad_op"], "with parallel.sharding = 'shard_grad_op' is not"),
        (
            ["train.activation_checkpointing=full"],
            "'full' is not supported with train.engine = 'mlx' and parallel.strategy = fsdp",
        ),
    ],
)
def test_mlx_fsdp_refusals_name_what_is_allowed(overrides: list[str], message: str) -> None:
    proc = run_cli("train", "--engine", "mlx", "--nproc", "2", "--set", *FSDP, *overrides)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_mlx_fsdp_checkpoint_names_are_the_models() -> None:
    """The wrappers' `module` segments never reach a name outside the engine."""
    from dtlab.mlx.fsdp import plain_name

    assert (
        plain_name("module.layers.0.module.attention.wq.weight") == "layers.0.attention.wq.weight"
    )
    assert plain_name("module.tok_embeddings.weight") == "tok_embeddings.weight"


def test_bench_engines_compares_fsdp_and_tensor_parallel_runs(tmp_path: Path) -> None:
    """`dtlab bench --engine torch,mlx` measures the sharded layouts on both engines side by side;
    a strategy refused (hsdp on 2 processes) is named with the reason and not run on either."""
    import json

    import numpy as np

    for name, extra in (("fsdp", ["--strategies", "fsdp,hsdp"]), ("tp", ["--strategies", "ddp"])):
        out = tmp_path / name
        sets = [*FAST, *(["parallel.tp=2"] if name == "tp" else [])]
        proc = run_cli("bench", "--engine", "torch,mlx", *extra, "--nproc", "2", "--steps", "2",
                       "--warmup", "1", "--out", str(out), "--set", *sets, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        rows = json.loads((out / "results.json").read_text())["engine_rows"]
        assert [(r["engine"], r["strategy"], r["nproc"]) for r in rows] == [
            ("torch", "fsdp" if name == "fsdp" else "ddp", 2),
            ("mlx", "fsdp" if name == "fsdp" else "ddp", 2),
        ]
        assert ("tp 2" in rows[1]["layout"]) is (name == "tp"), rows[1]["layout"]
        np.testing.assert_allclose(rows[0]["losses"], rows[1]["losses"], rtol=0, atol=1e-3)
        if name == "fsdp":
            assert "note: hsdp on 2 processes fp32 not run" in proc.stdout, proc.stdout
            assert "(train.engine = torch)" in proc.stdout
