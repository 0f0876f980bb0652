"""The MLX engine: same model, same numbers as torch, data parallelism over mlx.launch, resume, watchdog."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import EVAL, FAST, cli_env, read_metrics, run_cli
from dtlab.mlx import mlx_available

pytestmark = pytest.mark.skipif(
    not mlx_available(), reason="MLX is not installed (pip install 'dtlab[mlx]')"
)

MLX = ["--engine", "mlx"]


def mlx_train(run_dir: Path, *overrides: str, nproc: int = 1, steps: int = 12, env=None):
    args = ["train", *MLX, "--nproc", str(nproc), "--set", *FAST, f"train.steps={steps}",
            f"run.dir={run_dir}", *(["parallel.strategy=ddp"] if nproc > 1 else []), *overrides]  # fmt: skip
    return run_cli(*args, env=env, timeout=600)


def ok_metrics(proc: subprocess.CompletedProcess[str], run_dir: Path) -> list[dict[str, Any]]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return read_metrics(run_dir)


def column(metrics: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([m[key] for m in metrics])


@pytest.fixture(scope="module")
def mlx_one(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    d = tmp_path_factory.mktemp("mlx1")
    return ok_metrics(mlx_train(d), d)


@pytest.fixture(scope="module")
def mlx_two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    d = tmp_path_factory.mktemp("mlx2")
    return ok_metrics(mlx_train(d, "checkpoint.every=3", *EVAL, nproc=2), d)


def test_mlx_logits_match_torch_from_exported_weights(tmp_path: Path) -> None:
    """A torch run's checkpoint, exported as safetensors, gives the MLX model the same logits."""
    import mlx.core as mx
    import safetensors.torch
    import torch

    from dtlab.config import load_config
    from dtlab.mlx.model import build_mlx_model, load_safetensors
    from dtlab.models.llama import build_model

    run = tmp_path / "run"
    assert (
        run_cli(
            "train", "--set", *FAST, "train.steps=4", "checkpoint.every=4", f"run.dir={run}"
        ).returncode
        == 0
    )
    exported = run_cli(
        "export", str(run), "--format", "safetensors", "--out", str(tmp_path / "exp")
    )
    assert exported.returncode == 0, exported.stderr
    weights_file = tmp_path / "exp" / "model.safetensors"
    config = load_config(tmp_path / "exp" / "config.yaml")
    torch_model = build_model(config.model, "cpu")
    torch_model.load_state_dict(safetensors.torch.load_file(weights_file))
    mlx_model = build_mlx_model(config.model, weights=load_safetensors(weights_file))
    initial = build_model(config.model, "cpu").state_dict()
    assert not torch.equal(
        torch_model.state_dict()["layers.0.attention.wq.weight"],
        initial["layers.0.attention.wq.weight"],
    )

    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 64))
    with torch.no_grad():
        want = torch_model(torch.from_numpy(tokens)).numpy()
    got = np.array(mlx_model(mx.array(tokens)))
    assert got.shape == want.shape == (2, 64, config.model.vocab_size)
    assert np.abs(got - want).max() < 1e-4


def test_mlx_follows_torch_loss_curve(mlx_one, reference_run) -> None:
    """Same weights, samples, schedule and AdamW: torch and MLX losses agree step by step (float32)."""
    assert len(mlx_one) == len(reference_run) == 12
    diff = np.abs(column(mlx_one, "loss") - column(reference_run, "loss"))
    assert diff.max() < 1e-3, diff
    assert column(mlx_one, "loss")[-1] < column(mlx_one, "loss")[0] - 0.05  # it trains
    np.testing.assert_allclose(
        column(mlx_one, "grad_norm"), column(reference_run, "grad_norm"), rtol=1e-3
    )


def test_mlx_two_ranks_match_one(mlx_one, mlx_two) -> None:
    """Two mlx.launch ranks on halves of the global batch train the same model as one process."""
    assert [m["step"] for m in mlx_two] == list(range(1, 13))
    np.testing.assert_allclose(column(mlx_two, "loss"), column(mlx_one, "loss"), rtol=0, atol=1e-4)
    np.testing.assert_allclose(
        column(mlx_two, "grad_norm"), column(mlx_one, "grad_norm"), rtol=1e-4
    )


def test_mlx_validation_matches_torch(mlx_two, eval_reference) -> None:
    """The MLX engine's validation loss on two ranks: torch's on one, to float32 noise."""
    got = {m["step"]: m["val_loss"] for m in mlx_two if "val_loss" in m}
    want = {m["step"]: m["val_loss"] for m in eval_reference if "val_loss" in m}
    assert got.keys() == want.keys() == {4, 8, 12}
    assert max(abs(got[k] - want[k]) for k in want) < 1e-3, (got, want)


def test_mlx_accumulation_checkpointing_compile_change_nothing(tmp_path: Path, mlx_one) -> None:
    """Micro-batches of 2 (4 accumulated), mx.checkpoint per block and mx.compile: the same training."""
    run = tmp_path / "run"
    m = ok_metrics(
        mlx_train(
            run,
            "train.micro_batch_size=2",
            "train.activation_checkpointing=full",
            "train.compile=true",
        ),
        run,
    )
    np.testing.assert_allclose(column(m, "loss"), column(mlx_one, "loss"), rtol=0, atol=1e-4)


def test_mlx_bf16_trains_close_to_fp32(tmp_path: Path, mlx_one) -> None:
    run = tmp_path / "run"
    m = ok_metrics(mlx_train(run, "train.precision=bf16"), run)
    assert not np.array_equal(column(m, "loss"), column(mlx_one, "loss"))  # bf16 really ran
    np.testing.assert_allclose(column(m, "loss"), column(mlx_one, "loss"), rtol=0, atol=2e-2)


def test_mlx_kill_9_then_same_command_resumes_to_same_end(tmp_path: Path, mlx_two) -> None:
    run = tmp_path / "run"
    killed = mlx_train(run, "checkpoint.every=3", nproc=2, env={"DTLAB_FAULTS": "kill@5:r1"})
    assert killed.returncode != 0
    assert "rank 1 (killed)" in killed.stderr, killed.stderr
    assert "Traceback" not in killed.stderr, killed.stderr
    assert not (run / "summary.json").exists()
    resumed = mlx_train(run, "checkpoint.every=3", nproc=2)
    m = ok_metrics(resumed, run)
    assert "resumed from" in resumed.stderr and "step-00000003" in resumed.stderr
    assert [x["step"] for x in m] == list(range(1, 13))
    np.testing.assert_allclose(column(m, "loss"), column(mlx_two, "loss"), rtol=0, atol=1e-6)
    manifest = (run / "checkpoints" / "step-00000012" / "manifest.json").read_text()
    assert '"engine": "mlx"' in manifest and "model.safetensors" in manifest
    # dtlab export reads an MLX checkpoint as it reads a torch one.
    exported = run_cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 100_000


def test_mlx_sigterm_saves_and_resumes(tmp_path: Path, mlx_two) -> None:
    """A SIGTERM to `dtlab train` reaches the ranks, which agree, save and exit 75; the rerun finishes."""
    run = tmp_path / "run"
    args = ["train", *MLX, "--nproc", "2", "--set", *FAST, "train.steps=12", f"run.dir={run}",
            "parallel.strategy=ddp"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "dtlab", *args], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() and proc.poll() is None:  # training has begun
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    saved = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and "Traceback" not in err
    m = ok_metrics(mlx_train(run, nproc=2), run)
    np.testing.assert_allclose(column(m, "loss"), column(mlx_two, "loss"), rtol=0, atol=1e-6)


def test_mlx_watchdog_names_the_rank_of_a_hung_collective(tmp_path: Path) -> None:
    proc = mlx_train(tmp_path / "run", "parallel.collective_timeout_s=5", nproc=2,
                     env={"DTLAB_FAULTS": "hang@3:r1"})  # fmt: skip
    assert proc.returncode == 1
    assert "[rank0] error: the gradient all_sum of step 4 did not finish within 5 s" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The ranks' ledgers say who is behind, and both ranks dumped theirs.
    assert re.search(
        # #1 is the broadcast of the checkpoint to resume from, #2 the agreement that the metrics
        # sinks opened; step k's all_sum is #k + 2.
        r"Rank 1 \(pid \d+ on .+?\) is behind: its last collective was step 3 #5 'gradient all_sum' "
        r"\(all_sum float32\[\d+\], completed [\d.]+ s ago\); rank 0 waits at step 4 #6 'gradient "
        r"all_sum' \(all_sum float32\[\d+\], issued [\d.]+ s ago, not completed\)",
        proc.stderr,
    ), proc.stderr
    dumps = tmp_path / "run" / "ledger"
    assert {p.name for p in dumps.glob("rank*.json")} == {"rank0.json", "rank1.json"}


def test_missing_mlx_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"
        "from dtlab.cli import main\n"
        f"sys.exit(main(['train', '--engine', 'mlx', '--set', 'run.dir={tmp_path / 'run'}']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env()
    )
    assert proc.returncode == 2
    assert (
        "train.engine = 'mlx' needs the MLX package" in proc.stderr and "pip install" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "parallel.strategy=hsdp"],
            "parallel.strategy = 'hsdp' with parallel.sharding = 'full' is not supported with "
            "train.engine = 'mlx'",
        ),
        (["--set", "train.optimizer=demo"], "train.optimizer = 'demo' is not supported"),
        (["--nnodes", "2"], "--nnodes 2 with train.engine = 'mlx'"),
    ],
)
def test_mlx_unsupported_settings_are_named(args: list[str], message: str) -> None:
    proc = run_cli("train", *MLX, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_mlx_backend_names_are_refused_by_torch() -> None:
    proc = run_cli("train", "--set", "parallel.backend=ring")
    assert proc.returncode == 2 and "parallel.backend = 'ring' is an MLX backend" in proc.stderr


def test_bench_engines_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = run_cli("bench", "--engine", "torch,mlx", "--strategies", "single", "--nproc", "1",
                   "--steps", "3", "--warmup", "1", "--out", str(out), "--set", *FAST, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    import json

    rows = json.loads((out / "results.json").read_text())["engine_rows"]
    assert [r["engine"] for r in rows] == ["torch", "mlx"]
    assert all(r["timed_steps"] == 3 and r["tokens_per_s"] > 0 for r in rows)
    # Same training: the two engines' losses agree.
    np.testing.assert_allclose(rows[0]["losses"], rows[1]["losses"], rtol=0, atol=1e-3)
    report = (out / "report.md").read_text()
    assert "| mlx | single fp32 |" in report and (out / "engines.png").stat().st_size > 0


def test_bench_preloads_the_mlx_blas_into_mlx_runs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtlab.bench.engines import BLAS_ENV, engine_env

    monkeypatch.setenv(BLAS_ENV, "/opt/blas/libopenblas.so.0")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert engine_env("mlx")["LD_PRELOAD"] == "/opt/blas/libopenblas.so.0"
    assert "LD_PRELOAD" not in engine_env("torch")


def test_fault10_mlx_rank0_alone_picks_and_verifies_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = mlx_train(run, "checkpoint.every=3", nproc=2, steps=9, env={"DTLAB_FAULTS": "kill@8:r1"})
    assert proc.returncode != 0
    shard = run / "checkpoints" / "step-00000006" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])  # torn: the newest checkpoint fails verification
    proc = mlx_train(run, "checkpoint.every=3", nproc=2, steps=9)
    ok_metrics(proc, run)
    # One rank verified it (and moved it aside), not each rank on its own.
    assert proc.stderr.count("skipping checkpoint step 6") == 1, proc.stderr
    assert "resumed from" in proc.stderr and "step-00000003" in proc.stderr
    assert (run / "checkpoints" / ".unusable-step-00000006").is_dir()


def _open_mpi() -> bool:
    import shutil

    from dtlab.mlx.launch import open_mpi_version

    mpirun = shutil.which("mpirun")
    return mpirun is not None and open_mpi_version(mpirun) is not None


def test_mlx_auto_backend_is_the_ring() -> None:
    """``auto`` starts the ranks on the ring whatever MPI is installed (mlx.launch's MPI command
    needs Open MPI 5); ``mpi`` only when asked for."""
    from dtlab.mlx.launch import launch_backend

    assert [launch_backend(b) for b in ("auto", "ring", "mpi")] == ["ring", "ring", "mpi"]


@pytest.mark.skipif(not _open_mpi(), reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")
def test_mlx_two_mpi_ranks_match_one(tmp_path: Path, mlx_one) -> None:
    """parallel.backend = 'mpi': two ranks under Open MPI's mpirun (4 or 5) train as one process."""
    run = tmp_path / "mpi"
    metrics = ok_metrics(mlx_train(run, "parallel.backend=mpi", nproc=2), run)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    np.testing.assert_allclose(column(metrics, "loss"), column(mlx_one, "loss"), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("backend", "environ", "joins"),
    [
        ("auto", {}, None),  # no launcher: a group of one
        ("auto", {"MLX_RANK": "1"}, "ring"),
        ("auto", {"MLX_RANK": "1", "MLX_IBV_DEVICES": "/tmp/devs.json"}, "jaccl"),
        ("auto", {"OMPI_COMM_WORLD_RANK": "1"}, "mpi"),
        ("mpi", {"MLX_RANK": "1"}, "mpi"),
        ("jaccl", {"MLX_RANK": "0", "MLX_IBV_DEVICES": "/tmp/devs.json"}, "jaccl"),
    ],
)
def test_a_rank_joins_the_backend_its_launcher_set_up(backend, environ, joins) -> None:
    """Which backend a rank joins with: the launcher's under `auto` (mlx.launch's JACCL ranks see
    their RDMA devices; its ring ranks MLX_RANK only; mpirun's their MPI rank), else the one set."""
    from dtlab.mlx.dist import rank_backend

    assert rank_backend(backend, environ) == joins


def test_jaccl_on_local_ranks_says_how_to_start_it(tmp_path: Path) -> None:
    proc = mlx_train(tmp_path / "run", "parallel.backend=jaccl", nproc=2, steps=2)
    assert proc.returncode == 2, proc.stderr
    assert "mlx.launch --hostfile hosts.json --backend jaccl" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
