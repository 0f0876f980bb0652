"""The CLI end to end: help, a full run's outputs, and every bad-input path (clear message, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import FAST, run_cli
from dtlab.config import load_config


def test_help_lists_commands_and_train_flags() -> None:
    top = run_cli("--help")
    assert top.returncode == 0 and "train" in top.stdout
    train = run_cli("train", "--help")
    assert train.returncode == 0
    for flag in (
        "--nproc",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--max-restarts",
        "--set",
    ):
        assert flag in train.stdout


def test_run_directory_has_every_output(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train",
        "--set",
        *FAST,
        "train.steps=6",
        f"run.dir={run_dir}",
        "run.tensorboard=true",
        "run.plot=true",
        "run.log_every=2",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"run dir           {run_dir}" in proc.stdout and "loss curve" in proc.stdout
    # config.yaml: the fully resolved config, loadable as is.
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.run.dir == str(run_dir) and cfg.data.seq_len == 64
    # metrics.jsonl: logged steps with the promised fields; tokens count every rank's tokens.
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 4, 6]
    for m in lines:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s"} <= set(
            m
        )
        assert m["tokens"] == m["step"] * 8 * 64
        assert m["tokens_per_s"] == pytest.approx(8 * 64 / m["step_time_s"], rel=1e-6)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_loss"] == lines[-1]["loss"]
    assert summary["peak_memory_bytes"] > 0 and summary["tokens_per_s"] > 0
    # TensorBoard holds the same curve as metrics.jsonl (scalars are stored as float32).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "grad_norm"):
        scalars = events.Scalars(f"train/{key}")
        assert [e.step for e in scalars] == [m["step"] for m in lines]
        assert [e.value for e in scalars] == pytest.approx([m[key] for m in lines], rel=1e-6)
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_python_dash_m_and_config_command(tmp_path: Path) -> None:
    proc = run_cli("config", "--set", "train.lr=1e-4")
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout)["train"]["lr"] == 1e-4
    keys = run_cli("config", "--keys")
    assert "parallel.strategy" in keys.stdout


def test_two_process_launch_writes_one_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "ddp"
    proc = run_cli(
        "train",
        "--nproc",
        "2",
        "--set",
        *FAST,
        "train.steps=4",
        f"run.dir={run_dir}",
        "parallel.strategy=ddp",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("dtlab run finished") == 1  # only rank 0 reports
    assert "ddp 2 on 2 processes (fp32)" in proc.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "train.lr=fast"], "train.lr = 'fast'"),
        (["--set", "train.stpes=3"], "unknown key 'train.stpes'"),
        (["--set", "parallel.strategy=zero"], "parallel.strategy = 'zero'"),
        (["--set", "train.steps=-5"], "train.steps = -5"),
        (["--set", "model.n_heads=5"], "model.dim = 64 must be divisible by model.n_heads = 5"),
        (
            ["--set", "train.global_batch_size=10", "train.micro_batch_size=4"],
            "train.global_batch_size = 10",
        ),
        (
            ["--nproc", "3", "--set", "parallel.strategy=ddp", "train.global_batch_size=16"],
            "16 samples cannot be split over 3 ranks",
        ),
        (
            ["--nproc", "4", "--set", "parallel.strategy=ddp", "train.global_batch_size=2"],
            "2 samples cannot be split over 4 ranks",
        ),
        (["--nproc", "2"], "'single' runs one process"),
        (["--nproc", "4", "--set", "parallel.strategy=hsdp"], "needs parallel.replicate"),
        (["missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["BROKEN"], "not valid YAML"),
        (
            ["--set", "data.source=files", "data.paths=[nowhere.txt]"],
            "'nowhere.txt' does not exist",
        ),
        (["--set", "data.source=files", "data.paths=[EMPTY]"], "is empty"),
        (
            [
                "--nproc",
                "2",
                "--set",
                "parallel.strategy=ddp",
                "data.source=files",
                "data.paths=[EMPTY]",
            ],
            "is empty",
        ),
        (
            ["--set", "parallel.backend=nccl", "parallel.strategy=ddp"],
            "parallel.backend = 'nccl' needs CUDA",
        ),
        (["--set", "run.dir=FILE"], "cannot be created"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path: Path, args: list[str], needle: str) -> None:
    broken = write(tmp_path / "broken.yaml", "train: {lr: 1\n")
    empty = write(tmp_path / "empty.txt", "")
    a_file = write(tmp_path / "file", "x")
    args = [
        a.replace("BROKEN", str(broken))
        .replace("EMPTY", str(empty))
        .replace("FILE", str(a_file / "sub"))
        for a in args
    ]
    positional = args[:1] if not args[0].startswith("--") else []
    # Small defaults first, so the case's own --set values come later and win.
    proc = run_cli(
        "train",
        *positional,
        "--set",
        "model.preset=debug",
        "train.steps=2",
        *args[len(positional) :],
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("runs/*/summary.json"))


@pytest.mark.parametrize(
    "args", [["--nproc", "0"], ["--nproc", "two"], ["--max-restarts", "-1"], ["--bogus"]]
)
def test_bad_flags_exit_with_usage(args: list[str]) -> None:
    proc = run_cli("train", *args)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "Traceback" not in proc.stderr


def test_busy_master_port_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Someone else's server on the port: the rendezvous cannot start there.
        proc = run_cli(
            "train",
            "--nproc",
            "2",
            "--master-port",
            str(port),
            "--set",
            *FAST,
            "parallel.strategy=ddp",
            "train.steps=1",
            f"run.dir={tmp_path / 'run'}",
            timeout=240,
        )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"localhost:{port}" in proc.stderr, proc.stderr[-3000:]


def test_json_safe_replaces_non_finite_floats() -> None:
    from dtlab.metrics.sinks import json_safe

    value = {"loss": float("nan"), "rows": [1.5, float("inf"), {"x": -float("inf")}], "n": 3}
    text = json.dumps(json_safe(value), allow_nan=False)
    assert json.loads(text) == {"loss": None, "rows": [1.5, None, {"x": None}], "n": 3}
