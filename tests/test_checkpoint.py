"""Checkpoints: a run killed at any moment and started again ends where an uninterrupted run ends.

Every run here is the real CLI in fresh processes (gloo on CPU); crashes are real SIGKILLs, either
injected at a step (``DTLAB_FAULTS``) or sent from outside.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    FAST,
    checkpoint_tensors,
    cli_env,
    kill_job,
    read_metrics,
    run_cli,
    run_worker,
)
from dtlab.checkpoint.manifest import verify_checkpoint, write_manifest
from dtlab.errors import CheckpointError

STEPS = 12
STRATEGIES = {
    "single": (1, ["parallel.strategy=single"]),
    "ddp": (2, ["parallel.strategy=ddp"]),
    "fsdp": (2, ["parallel.strategy=fsdp"]),
}


def train_args(run_dir: Path, nproc: int, *overrides: str, steps: int = STEPS) -> list[str]:
    return [
        "train",
        "--nproc",
        str(nproc),
        "--set",
        *FAST,
        f"train.steps={steps}",
        "checkpoint.every=3",
        f"run.dir={run_dir}",
        *overrides,
    ]


def train(
    run_dir: Path,
    nproc: int,
    *overrides: str,
    faults: str | None = None,
    expect: int = 0,
    steps: int = STEPS,
    extra: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {"DTLAB_FAULTS": faults} if faults else None
    args = train_args(run_dir, nproc, *overrides, steps=steps)
    proc = run_cli(args[0], *(extra or []), *args[1:], env=env)
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the final checkpoint (parameters and AdamW state), unsharded."""
    return checkpoint_tensors(run_dir / "checkpoints" / f"step-{STEPS:08d}")


def losses(run_dir: Path) -> list[float]:
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    return [m["loss"] for m in metrics]


def assert_same_run(run: Path, ref: Path, exact: bool = True) -> None:
    a, b = losses(run), losses(ref)
    assert len(a) == len(b) == STEPS
    if exact:
        assert a == b  # bit for bit: fp32 on CPU is deterministic
    else:
        assert a == pytest.approx(b, abs=1e-5)
    sa, sb = final_state(run), final_state(ref)
    assert sa.keys() == sb.keys()
    for k in sa:
        if exact:
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted run of each strategy (with checkpoints every 3 steps)."""
    out = {}
    for name, (nproc, overrides) in STRATEGIES.items():
        out[name] = tmp_path_factory.mktemp(f"ref-{name}")
        train(out[name], nproc, *overrides)
    return out


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_kill9_then_same_command_ends_like_uninterrupted(
    tmp_path: Path, references: dict[str, Path], strategy: str
) -> None:
    nproc, overrides = STRATEGIES[strategy]
    run = tmp_path / "run"
    # Every rank SIGKILLs itself after step 7: the last checkpoint is step 6.
    train(run, nproc, *overrides, faults="kill@7", expect=1 if nproc > 1 else -signal.SIGKILL)
    assert not (run / "summary.json").exists()
    proc = train(run, nproc, *overrides)
    assert "resumed from" in proc.stderr and "step-00000006" in proc.stderr, proc.stderr
    assert_same_run(run, references[strategy])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000006")


@pytest.mark.parametrize("compression", ["powersgd", "dct", "dct-quant", "demo"])
def test_compressed_runs_resume_exactly(tmp_path: Path, compression: str) -> None:
    """Error-feedback residuals, EF21 estimates, PowerSGD's memories and DeMo's per-rank momenta are
    in the checkpoint: resume stays exact."""
    from dtlab.bench.sweep import compression_overrides

    opts = [
        "parallel.strategy=ddp",
        *compression_overrides(compression),
        "parallel.compression_options.start_step=2",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, 2, *opts)
    train(run, 2, *opts, faults="kill@7", expect=1)
    train(run, 2, *opts)
    assert_same_run(run, ref)


def test_an_optimizer_without_state_resumes(tmp_path: Path) -> None:
    """Plain SGD keeps no per-parameter state, so its checkpoint holds no optimizer tensors: a resume
    still loads (it crashed reading the param groups as a flattened state dict) and ends exactly."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, 1, "train.optimizer=sgd")
    train(run, 1, "train.optimizer=sgd", faults="kill@7", expect=-signal.SIGKILL)
    proc = train(run, 1, "train.optimizer=sgd")
    assert "step-00000006" in proc.stderr
    assert_same_run(run, ref)


def test_kill9_from_outside_at_any_moment(tmp_path: Path, references: dict[str, Path]) -> None:
    """SIGKILL to the launcher and its workers at a moment the test does not choose (maybe mid-save)."""
    run = tmp_path / "run"
    nproc, overrides = STRATEGIES["ddp"]
    args = [sys.executable, "-m", "dtlab", *train_args(run, nproc, *overrides, steps=STEPS)]
    proc = subprocess.Popen(
        args,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step-00000006").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    kill_job(proc, run)
    if (run / "summary.json").exists():
        pytest.skip("the run finished before the kill arrived")
    train(run, nproc, *overrides)
    assert_same_run(run, references["ddp"])


@pytest.mark.parametrize(("first", "second"), [("ddp", "single"), ("single", "fsdp")])
def test_resume_on_another_world_size_and_strategy(
    tmp_path: Path, references: dict[str, Path], first: str, second: str
) -> None:
    run = tmp_path / "run"
    train(
        run,
        STRATEGIES[first][0],
        *STRATEGIES[first][1],
        faults="kill@7",
        expect=1 if first != "single" else -signal.SIGKILL,
    )
    train(run, STRATEGIES[second][0], *STRATEGIES[second][1])
    # Same samples, different reduction order: equal to float32 noise.
    assert_same_run(run, references[second], exact=False)


def test_max_restarts_recovers_a_killed_worker(tmp_path: Path, references: dict[str, Path]) -> None:
    run = tmp_path / "run"
    # Rank 1 is killed after step 8; the agent restarts both workers, which resume from step 6.
    proc = train(run, 2, "parallel.strategy=ddp", faults="kill@8:r1", extra=["--max-restarts", "1"])
    assert "resumed from" in proc.stderr and "step-00000006" in proc.stderr, proc.stderr
    # The restart is said once, in one line; the surviving rank's broken collective is not a traceback.
    assert proc.stderr.count("rank 1 died (SIGKILL); restarting the workers (restart 1 of 1)") == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_same_run(run, references["ddp"])


def test_torn_checkpoints_are_never_loaded(tmp_path: Path, references: dict[str, Path]) -> None:
    run = tmp_path / "run"
    # Killed while saving step 9: shards written, no manifest, never renamed into place.
    train(run, 1, faults="killsave@9", expect=-signal.SIGKILL)
    assert (run / "checkpoints" / ".tmp-step-00000009").is_dir()
    assert not (run / "checkpoints" / "step-00000009").exists()
    # And the newest committed one is damaged afterwards (a disk that lost the end of a file).
    shard = next((run / "checkpoints" / "step-00000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    proc = train(run, 1)
    assert f"'{shard}' has" in proc.stderr and "truncated" in proc.stderr, proc.stderr
    assert "step-00000003" in proc.stderr
    assert_same_run(run, references["single"])


def test_explicit_resume_of_a_corrupt_checkpoint_is_an_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, 1, steps=3)
    ckpt = run / "checkpoints" / "step-00000003"
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    shard.write_bytes(bytes(data))
    proc = train(tmp_path / "other", 1, f"checkpoint.resume={ckpt}", expect=2)
    assert "does not match its CRC-32 checksum" in proc.stderr and "Traceback" not in proc.stderr


def test_a_crafted_checkpoint_runs_no_code_on_resume(tmp_path: Path) -> None:
    import pickle

    run = tmp_path / "run"
    train(run, 1, steps=3)
    ckpt = run / "checkpoints" / "step-00000003"
    marker = tmp_path / "pwned"

    class RunsCommand:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch '{marker}'",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCommand()))
    write_manifest(ckpt, **{k: v for k, v in verify_checkpoint_fields(ckpt).items()})
    proc = train(run, 1, steps=6, expect=2)
    assert not marker.exists()
    assert "Traceback" not in proc.stderr and "posix.system" in proc.stderr, proc.stderr


def test_a_format_1_manifest_is_still_verified(tmp_path: Path) -> None:
    """Checkpoints written before the CRC-32 manifest (SHA-256, format 1) load and are checked."""
    import hashlib

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    data = b"z" * 3000
    (ckpt / "a.bin").write_bytes(data)
    files = {"a.bin": {"bytes": 3000, "sha256": hashlib.sha256(data).hexdigest()}}
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "step": 4, "files": files}))
    assert verify_checkpoint(ckpt)["step"] == 4
    (ckpt / "a.bin").write_bytes(b"y" + data[1:])
    with pytest.raises(CheckpointError, match="does not match its SHA-256 checksum"):
        verify_checkpoint(ckpt)
    (ckpt / "manifest.json").write_text(json.dumps({"format": 3, "step": 4, "files": files}))
    with pytest.raises(CheckpointError, match="has format 3; this dtlab reads formats 1, 2"):
        verify_checkpoint(ckpt)


def verify_checkpoint_fields(ckpt: Path) -> dict[str, object]:
    """The manifest's own fields (not files or versions), to write a manifest that matches new files."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return {
        k: v
        for k, v in manifest.items()
        if k not in ("files", "format", "torch_version", "dtlab_version")
    }


def test_sigterm_saves_and_exits_then_resumes(tmp_path: Path, references: dict[str, Path]) -> None:
    run = tmp_path / "run"
    # Only rank 1 is signalled; the ranks agree at the step boundary and all stop after step 5.
    proc = train(run, 2, "parallel.strategy=ddp", faults="sigterm@5:r1", expect=75)
    assert "stopped by SIGTERM after step 5" in proc.stderr, proc.stderr
    verify_checkpoint(run / "checkpoints" / "step-00000005")
    train(run, 2, "parallel.strategy=ddp")
    assert_same_run(run, references["ddp"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_the_launcher(tmp_path: Path, sig: signal.Signals) -> None:
    run = tmp_path / "run"
    args = [sys.executable, "-m", "dtlab", *train_args(run, 2, "parallel.strategy=ddp", steps=400)]
    proc = subprocess.Popen(
        args, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step-00000003").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.02)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert time.monotonic() - t0 < 30  # within the launcher's grace period
    assert f"stopped by {sig.name}" in err
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    manifest = verify_checkpoint(newest)  # complete, committed
    assert 3 <= manifest["step"] < 400
    assert f"after step {manifest['step']}" in err


def test_nan_steps_are_skipped_then_rolled_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, 1, "train.max_bad_steps=3", faults="nan@2,nan@7-9")
    metrics = read_metrics(run)
    bad = [m["step"] for m in metrics if m.get("bad")]
    # Step 2 is skipped alone; 7, 8, 9 in a row trigger the rollback to step 6, then 7.. run clean.
    assert bad == [2, 7, 8, 9], bad
    assert "rolled back to" in proc.stderr and "step-00000006" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["bad_steps"] == 4 and summary["rollbacks"] == 1
    # No NaN leaked into a step that was taken (JSON has no NaN: it would be null).
    good = [m for m in metrics if not m.get("bad")]
    assert all(m["loss"] is not None and math.isfinite(m["loss"]) for m in good)


def test_bad_steps_without_a_checkpoint_stop_clearly(tmp_path: Path) -> None:
    proc = train(tmp_path / "run", 1, "checkpoint.every=0", faults="nan@2-4", expect=2)
    assert "no checkpoint to roll back to" in proc.stderr and "Traceback" not in proc.stderr


def test_retention_async_and_durable_tier(tmp_path: Path, references: dict[str, Path]) -> None:
    run, durable = tmp_path / "run", tmp_path / "durable"
    common = [
        "checkpoint.keep=2",
        "checkpoint.async=true",
        f"checkpoint.durable_dir=file://{durable}",
        "checkpoint.durable_every=6",
    ]
    train(run, 2, "parallel.strategy=ddp", *common, faults="kill@11", expect=1)
    local = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    # keep=2; the async save of step 9 may or may not have committed before the kill after step 11,
    # and the kill may land between its commit and the pruning of step 3 (the next commit prunes it).
    assert local in (
        ["step-00000003", "step-00000006"],
        ["step-00000006", "step-00000009"],
        ["step-00000003", "step-00000006", "step-00000009"],
    ), local
    # The durable tier keeps this run's checkpoints in a directory of its own (named after run.dir).
    assert sorted(p.name for p in (durable / "run").glob("step-*")) == ["step-00000006"]
    # The node and its local disk are gone: resume from the durable tier.
    for p in (run / "checkpoints").iterdir():
        subprocess.run(["rm", "-rf", str(p)], check=True)
    proc = train(run, 2, "parallel.strategy=ddp", *common)
    assert "step-00000006" in proc.stderr
    assert_same_run(run, references["ddp"])
    assert sorted(p.name for p in (durable / "run").glob("step-*")) == [
        "step-00000006",
        "step-00000012",
    ]


def test_a_failed_background_save_is_reported_not_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, 2, "parallel.strategy=ddp", "checkpoint.async=true", faults="failsave@6")
    assert "checkpoint of step 6 failed: OSError" in proc.stderr, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoint_failures"] == 1 and summary["checkpoints_saved"] == 3
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [
        "step-00000003",
        "step-00000009",
        "step-00000012",
    ]  # 6 failed, its temp dir cleaned


def test_unsafe_config_change_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, 1, steps=3)
    proc = train(run, 1, "train.global_batch_size=16", expect=2)
    assert "train.global_batch_size = 8 in the checkpoint, 16 now" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Safe changes (more steps, other logging) continue the run.
    train(run, 1, "run.log_every=2", steps=6)
    assert json.loads((run / "summary.json").read_text())["resumed_from"].endswith("step-00000003")


def test_same_command_without_run_dir_finds_the_unfinished_run(tmp_path: Path) -> None:
    args = ["train", "--set", *FAST, "train.steps=6", "checkpoint.every=2", "run.name=again"]
    first = run_cli(*args, cwd=tmp_path, env={"DTLAB_FAULTS": "kill@5"})
    assert first.returncode == -signal.SIGKILL
    second = run_cli(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    assert json.loads((runs[0] / "summary.json").read_text())["resumed_from"].endswith(
        "step-00000004"
    )
    # Finished: the same command now starts a new run.
    assert run_cli(*args, cwd=tmp_path).returncode == 0
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_manifest_detects_every_kind_of_damage(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "a.bin").write_bytes(b"x" * 1000)
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        verify_checkpoint(ckpt)
    write_manifest(ckpt, step=1)
    assert verify_checkpoint(ckpt)["step"] == 1
    (ckpt / "a.bin").write_bytes(b"x" * 999)
    with pytest.raises(CheckpointError, match=r"a\.bin' has 999 bytes"):
        verify_checkpoint(ckpt)
    (ckpt / "a.bin").write_bytes(b"x" * 500 + b"\x78\x79" + b"x" * 498)  # one bit flipped
    with pytest.raises(CheckpointError, match="does not match its CRC-32 checksum"):
        verify_checkpoint(ckpt)
    (ckpt / "a.bin").unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        verify_checkpoint(ckpt)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        verify_checkpoint(ckpt)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_async_staging_stages_what_this_rank_writes_into_its_own_host_buffers(
    tmp_path: Path, strategy: str
) -> None:
    """2 gloo processes: a staged DTensor's local tensor is the stager's CPU buffer itself under the
    live spec (no copy, no move to the mesh's device), equal to the live shard; each replicated tensor
    (DDP's model and optimizer state, FSDP's optimizer step counts) is staged by one rank only, so the
    ranks pin one copy between them; the stager copied on the rank's own device; the async save loads
    back as saved."""
    run_worker("stager_worker.py", 2, str(tmp_path / "run"), "cpu", strategy)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one per rank)")
def test_async_staging_on_two_gpus_copies_on_each_ranks_own_gpu(tmp_path: Path) -> None:
    """FSDP on 2 GPUs over NCCL: each rank stages on a side stream of its own GPU, after the kernels
    that wrote the tensors (a long kernel still runs when the save is asked for): the staged data
    equals the live tensors, and nothing is allocated, nor a CUDA context opened, on the other
    rank's GPU; the async save loads back as saved."""
    run_worker("stager_worker.py", 2, str(tmp_path / "run"), "cuda", "fsdp")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("background", [False, True])
def test_a_background_save_writes_at_the_lowest_priority_and_checksums_once(
    tmp_path: Path, background: bool
) -> None:
    """Each file DCP writes is written by a thread that (in a background save only) gives way to
    training, and without torch.save's own CRC-32 of each record (the manifest's covers the bytes);
    the thread's CRC option is restored after the file."""
    import threading

    from dtlab.checkpoint.writer import _ChecksummingFileSystem

    fs = _ChecksummingFileSystem(background)
    seen: dict[str, object] = {}

    def write() -> None:
        tid = threading.get_native_id()
        with fs.create_stream(tmp_path / "f.distcp", "wb") as stream:
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
            seen["crc"] = torch.serialization.get_crc32_options()
            torch.save(torch.arange(10), stream)
        seen["crc_after"] = torch.serialization.get_crc32_options()

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # a new thread's
    assert seen == {"nice": 19 if background else base, "crc": False, "crc_after": True}
    assert fs.checksums["f.distcp"][1] == (tmp_path / "f.distcp").stat().st_size
