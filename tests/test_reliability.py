"""Faults found in a review of the training loop, checkpoints and launcher: one test (or more) per fault.

Every run is the real CLI in fresh processes (gloo on CPU); faults are injected with ``DTLAB_FAULTS``.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, Watched, checkpoint_tensors, read_metrics, real_pid, run_cli
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
        "optim"
    ]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert all(g["betas"] == [0.8, 0.9] and g["eps"] == 1e-6 for g in groups)
    assert all(g["lr"] == pytest.approx(lr_at(9, t)) for g in groups)
    # The config of the run directory records what was trained with.
    assert "lr: 0.001" in (run / "config.yaml").read_text()


# --- 3. the durable tier keeps each run apart -------------------------------------------------------
def test_fault3_same_command_twice_is_two_runs_each_with_its_own_durable_checkpoints(
    tmp_path: Path,
) -> None:
    durable = tmp_path / "durable"
    args = ["train", "--set", *FAST, "train.steps=6", "checkpoint.every=3", "checkpoint.keep=1",
            f"checkpoint.durable_dir={durable}", "run.name=twice"]  # fmt: skip
    for _ in range(2):
        proc = run_cli(*args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "resumed from" not in proc.stderr, proc.stderr  # a finished run is not continued
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert [m["step"] for m in read_metrics(run)] == list(range(1, 7))  # trained, not 0 steps
        # Each run's durable checkpoints are its own, and one run's retention left the other's alone.
        tier = durable / run.name
        assert sorted(p.name for p in tier.glob("step-*")) == ["step-00000006"]
        assert json.loads((tier / "owner.json").read_text())["run_dir"] == str(run.resolve())
        manifest = json.loads((tier / "step-00000006" / "manifest.json").read_text())
        assert manifest["run_dir"] == str(run.resolve())


def test_fault3_a_durable_tier_of_another_run_is_refused(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    common = ["checkpoint.every=3", f"checkpoint.durable_dir={durable}"]
    train(tmp_path / "a" / "exp", *common, nproc=1)
    # Another run directory with the same name: its durable directory would be the first run's.
    proc = train(tmp_path / "b" / "exp", *common, nproc=1, expect=2)
    assert "belongs to the run in" in proc.stderr and str(tmp_path / "a" / "exp") in proc.stderr
    assert not (tmp_path / "b" / "exp" / "metrics.jsonl").exists()


def test_fault3_a_copy_that_exists_is_not_copied_again(tmp_path: Path) -> None:
    from dtlab.checkpoint.manifest import write_manifest
    from dtlab.checkpoint.store import Tier

    ckpt = tmp_path / "step-00000003"
    ckpt.mkdir()
    (ckpt / "data").write_bytes(b"x" * 10)
    write_manifest(ckpt, step=3)
    tier = Tier(tmp_path / "durable", "durable")
    assert tier.put(ckpt, 3) is True
    (tier.local_root / "step-00000003" / "data").write_bytes(b"y" * 10)  # type: ignore[operator]
    assert tier.put(ckpt, 3) is False  # already there: nothing copied (and logged as such)
    assert (tier.local_root / "step-00000003" / "data").read_bytes() == b"y" * 10  # type: ignore[operator]


# --- 4. rollback: every rank loads the same checkpoint ----------------------------------------------
def test_fault4_async_rollback_loads_the_same_checkpoint_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 commits step 6 late (a slow file system) while rank 1's own write is long done: the
    rollback after the bad steps 7-9 must load step 6 on both ranks, as the synchronous run does."""
    common = ["parallel.strategy=ddp", "checkpoint.every=3", "train.max_bad_steps=3"]
    faults = "slowsave@6,nan@7-9"
    sync, async_ = tmp_path / "sync", tmp_path / "async"
    train(sync, *common, steps=12, faults=faults)
    proc = train(async_, *common, "checkpoint.async=true", steps=12, faults=faults)
    assert "rolled back to" in proc.stderr and "step-00000006" in proc.stderr, proc.stderr
    assert [m["loss"] for m in read_metrics(async_)] == [m["loss"] for m in read_metrics(sync)]
    assert_same_tensors(ckpt(async_, 12), ckpt(sync, 12))


def test_an_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    """The copy of step 3's tensors is slow (3 s): step 4's optimizer update waits for it, so every
    async checkpoint holds exactly what the synchronous run's does, and so does the training."""
    common = ["parallel.strategy=ddp", "checkpoint.every=3", "checkpoint.keep=4"]
    sync, async_ = tmp_path / "sync", tmp_path / "async"
    train(sync, *common, steps=9)
    train(async_, *common, "checkpoint.async=true", steps=9, faults="slowstage@3,slowstage@6")
    assert [m["loss"] for m in read_metrics(async_)] == [m["loss"] for m in read_metrics(sync)]
    for step in (3, 6, 9):
        assert_same_tensors(ckpt(async_, step), ckpt(sync, step))
    summary = json.loads((async_ / "summary.json").read_text())
    # The stalls were waited for (less the next step's forward and backward, which overlapped them:
    # well under half a second here), and counted as time the saves blocked training.
    assert summary["checkpoint_blocked_s"] >= 2 * (3.0 - 0.5), summary


# --- 5. retention never deletes what this run just wrote; no silent mix of two runs -----------------
def test_fault5_retention_keeps_the_checkpoint_just_committed(tmp_path: Path) -> None:
    from dtlab.checkpoint.manager import Checkpointer
    from dtlab.checkpoint.manifest import write_manifest
    from dtlab.config import load_config
    from dtlab.parallel.dist import DistInfo

    run = tmp_path / "run"
    config = load_config(None, [*FAST, "checkpoint.keep=3", f"run.dir={run}"])
    ckpt_ = Checkpointer(config, run, DistInfo(0, 1, 0, 1, torch.device("cpu"), None))
    for step in (200, 250, 300, 110):
        d = run / "checkpoints" / (f".tmp-step-{step:08d}" if step == 110 else f"step-{step:08d}")
        d.mkdir(parents=True)
        (d / "data").write_bytes(b"x")
        if step != 110:
            write_manifest(d, step=step)
    ckpt_._commit(110, run / "checkpoints" / ".tmp-step-00000110", 0.0)
    assert (run / "checkpoints" / "step-00000110" / "manifest.json").is_file()
    ckpt_.wait()  # retention runs in the background after the commit
    assert ckpt_.local.committed() == [110, 250, 300]


def test_fault5_a_new_run_in_a_run_directory_that_holds_one_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "checkpoint.every=3", nproc=1, steps=9)
    before = {p.name for p in (run / "checkpoints").iterdir()}
    metrics = (run / "metrics.jsonl").read_bytes()
    for option in ("checkpoint.resume=never", f"checkpoint.resume={run}/checkpoints/step-00000003"):
        proc = train(run, "checkpoint.every=1", option, nproc=1, steps=2, expect=2)
        assert "already holds a run" in proc.stderr or "went on to step 9" in proc.stderr, (
            proc.stderr
        )
        assert {p.name for p in (run / "checkpoints").iterdir()} == before
        assert (run / "metrics.jsonl").read_bytes() == metrics


# --- 6. a run directory belongs to one run at a time and keeps its whole history -------------------
def test_fault6_a_second_run_in_a_busy_run_directory_is_refused(tmp_path: Path) -> None:
    import os
    import signal
    import sys
    import time

    from conftest import cli_env

    run = tmp_path / "run"
    args = [sys.executable, "-m", "dtlab", "train", "--set", *FAST, "train.steps=100000",
            f"run.dir={run}"]  # fmt: skip
    first = subprocess.Popen(args, env=cli_env(), stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_bytes():
            assert first.poll() is None and time.monotonic() < deadline, (
                "the first run did not start"
            )
            time.sleep(0.05)
        config = (run / "config.yaml").read_bytes()
        for nproc in (1, 2):
            opts = ["parallel.strategy=ddp"] if nproc == 2 else []
            proc = train(run, *opts, nproc=nproc, expect=2)
            assert "is in use by another run" in proc.stderr and f"pid {first.pid}" in proc.stderr
        assert (run / "config.yaml").read_bytes() == config
        assert first.poll() is None  # the first run was not disturbed
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # The kernel released the lock of the killed run: the same command resumes it.
    train(run, nproc=1, steps=3)


def test_fault6_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "checkpoint.every=3", nproc=1, steps=6, faults="kill@4", expect=-9)

    def files() -> dict[str, bytes]:  # all but the lock, which names the latest holder
        return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}

    before = files()
    assert "config.yaml" in before and "metrics.jsonl" in before
    proc = train(run, "checkpoint.every=3", "model.n_layers=3", nproc=1, expect=2)
    assert "model.n_layers" in proc.stderr
    assert files() == before


def test_fault6_a_finished_or_resumed_run_keeps_its_whole_history(tmp_path: Path) -> None:
    run, ref = tmp_path / "run", tmp_path / "ref"
    opts = ["checkpoint.every=3", "run.plot=true", "run.log_every=4"]
    train(ref, *opts, nproc=1, steps=9)
    train(run, *opts, nproc=1, steps=9, faults="kill@7", expect=-9)
    train(run, *opts, nproc=1, steps=9)
    want = json.loads((ref / "summary.json").read_text())
    got = json.loads((run / "summary.json").read_text())
    assert (got["initial_loss"], got["final_loss"], got["steps"]) == (
        want["initial_loss"], want["final_loss"], want["steps"],
    )  # fmt: skip
    assert got["initial_loss"] == read_metrics(run)[0]["loss"] and read_metrics(run)[0]["step"] == 1
    # The same command once more (what a requeue does): nothing to train, nothing lost.
    (run / "loss.png").unlink()
    train(run, *opts, nproc=1, steps=9)
    again = json.loads((run / "summary.json").read_text())
    assert (again["initial_loss"], again["final_loss"], again["steps"]) == (
        want["initial_loss"], want["final_loss"], 9,
    )  # fmt: skip
    assert again["median_step_time_s"] is not None and again["tokens_per_s"] > 0
    assert (run / "loss.png").stat().st_size > 0  # drawn again from the logged history


# --- 7. Ctrl-C: the first saves and exits 75, a second aborts; 75 only with a checkpoint ------------
def ctrl_c_args(run: Path, nproc: int, *overrides: str) -> list[str]:
    strategy = ["parallel.strategy=ddp"] if nproc > 1 else []
    return ["train", "--nproc", str(nproc), "--set", *FAST, "train.steps=100000",
            f"run.dir={run}", *strategy, *overrides]  # fmt: skip


@pytest.mark.parametrize("nproc", [1, 2])
def test_fault7_ctrl_c_saves_then_exits_75(tmp_path: Path, nproc: int) -> None:
    import signal

    run = tmp_path / "run"
    w = Watched(*ctrl_c_args(run, nproc, "checkpoint.every=5"))
    w.wait_for("checkpoint step 5 saved")
    w.proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the foreground process
    assert w.finish() == 75, w.err
    assert "Traceback" not in w.err and "Ctrl-C: saving a checkpoint" in w.err, w.err
    stop = json.loads((run / "stopped.json").read_text())
    # Said once, by the launcher with several processes (not again by rank 0).
    assert w.err.count(f"stopped by SIGINT after step {stop['step']}") == 1, w.err
    checkpoint_tensors(Path(stop["checkpoint"]))  # committed and verified
    assert not list((run / "checkpoints").glob(".tmp-*"))  # nothing left half-written
    # The same command resumes from it.
    proc = train(run, *(["parallel.strategy=ddp"] if nproc > 1 else []), nproc=nproc,
                 steps=stop["step"] + 2)  # fmt: skip
    assert f"step-{stop['step']:08d}" in proc.stderr


@pytest.mark.parametrize("nproc", [1, 2])
def test_fault7_second_ctrl_c_aborts_at_once(tmp_path: Path, nproc: int) -> None:
    import signal

    run = tmp_path / "run"
    # The stop's save stalls (a slow disk) long enough for the second Ctrl-C to land in it.
    w = Watched(*ctrl_c_args(run, nproc), env={"DTLAB_FAULTS": "slowsave@1-100000"})
    w.wait_for_file(run / "metrics.jsonl")  # training has begun
    w.proc.send_signal(signal.SIGINT)
    w.wait_for("Ctrl-C: saving a checkpoint")
    w.proc.send_signal(signal.SIGINT)
    code = w.finish(timeout=60)
    assert code == 130, w.err
    assert "aborted by" in w.err and "without saving" in w.err and "Traceback" not in w.err, w.err
    assert not list((run / "checkpoints").glob("step-*"))  # nothing was committed
    assert not (run / "stopped.json").exists()
    leftover = subprocess.run(["pgrep", "-f", f"run.dir={run}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "workers outlived the abort"


@pytest.mark.parametrize("nproc", [1, 2])
def test_fault7_a_stop_without_a_saved_checkpoint_does_not_exit_75(
    tmp_path: Path, nproc: int
) -> None:
    import signal

    run = tmp_path / "run"
    w = Watched(*ctrl_c_args(run, nproc), env={"DTLAB_FAULTS": "failsave@1-100000"})
    w.wait_for_file(run / "metrics.jsonl")  # training has begun
    w.proc.send_signal(signal.SIGINT)
    code = w.finish()
    assert code not in (0, 75), w.err
    assert "could not be saved" in w.err and "Traceback" not in w.err, w.err
    assert not (run / "stopped.json").exists()


# --- 10. smaller ones ---------------------------------------------------------------------------------
def test_fault10_single_node_launch_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every socket the launcher and its workers listen on (stores, gloo) is bound to 127.0.0.1."""
    import signal

    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc")
    run = tmp_path / "run"
    w = Watched(*ctrl_c_args(run, 2))
    try:
        w.wait_for_file(run / "metrics.jsonl")
        pids = subprocess.run(["pgrep", "-f", f"run.dir={run}"], capture_output=True, text=True)
        inodes = set()
        for pid in {real_pid(int(p)) for p in pids.stdout.split()}:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = fd.readlink().as_posix()
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # LISTEN
                    listening.append(f[1].split(":")[0])
        assert listening, "found no listening socket of the run"
        loopback = ("0100007F", "00000000000000000000000001000000")
        assert all(addr in loopback for addr in listening), listening
    finally:
        w.proc.send_signal(signal.SIGINT)
        w.finish()


def test_fault10_a_stopped_prefetch_thread_never_feeds_the_new_position() -> None:
    import threading

    from dtlab.data import BatchLayout, BatchLoader, SyntheticSource

    gate = threading.Event()

    class Slow(SyntheticSource):
        def sample(self, index: int) -> Any:
            if index >= 8:  # step 1 onwards: held until the test lets it go
                gate.wait(30)
            return super().sample(index)

    loader = BatchLoader(Slow(16, 256, 0), BatchLayout(8, 0, 1, 8), prefetch=2)
    reference = BatchLoader(SyntheticSource(16, 256, 0), BatchLayout(8, 0, 1, 8), prefetch=0)
    next(loader)  # step 0; the thread is now building step 1
    old = loader._thread
    assert old is not None
    loader.load_state_dict({"next_step": 5, "global_batch": 8, "source": "synthetic"})  # a rollback
    gate.set()
    old.join(10)
    assert not old.is_alive()  # it stopped after the batch it was building, which went nowhere
    for step in (5, 6, 7):
        got = next(loader)
        want = reference.build_step(step)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want, strict=True)), step
    loader.close()


def test_fault10_demo_grad_norm_and_the_step_flags_are_agreed_in_one_reduction() -> None:
    from conftest import run_worker

    run_worker("norm_worker.py", 2)


def test_fault10_resume_fingerprint_covers_what_the_data_is(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the same paths, other text. " * 400)
    run = tmp_path / "run"
    opts = ["data.source=files", f"data.paths=[{corpus}]", "checkpoint.every=3"]
    train(run, *opts, nproc=1, steps=6, faults="kill@4", expect=-9)
    corpus.write_text("changed under the same name! " * 400)
    proc = train(run, *opts, nproc=1, steps=6, expect=2)
    assert "data.identity" in proc.stderr and "cannot resume" in proc.stderr, proc.stderr


def test_fault10_fetch_refuses_keys_outside_the_checkpoint(tmp_path: Path) -> None:
    import fsspec

    from dtlab.checkpoint.store import Tier
    from dtlab.errors import CheckpointError

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/tier-fetch/step-00000001/data", b"x")
    fs.pipe_file("/tier-fetch/step-00000001/../../escape", b"x")
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        Tier("memory://tier-fetch", "durable").fetch(1, tmp_path / "into")
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


def test_fault10_metrics_say_when_a_step_is_trained_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, "checkpoint.every=3", "train.max_bad_steps=3", nproc=1, steps=10, faults="nan@7-9")
    metrics = read_metrics(run)
    steps = [m["step"] for m in metrics]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 8, 9, 10]
    assert [m.get("rollback") for m in metrics] == [None] * 9 + [1] * 4


# --- attacks: a full disk, a read-only durable tier, a storm of kills -------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A small file system of its own at ``path`` (root only: mount)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=False)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_attack_disk_full_during_checkpoint_writes(tmp_path: Path) -> None:
    """Room for one checkpoint only: later saves fail with ENOSPC. Each failure is reported, nothing
    half-written stays or is ever picked, the first checkpoint stays loadable, and a run that ends
    without its final checkpoint does not exit 0."""
    run = tmp_path / "run"
    with tmpfs(run / "checkpoints", "3m"):
        proc = train(run, "checkpoint.every=3", "checkpoint.keep=1", nproc=1, steps=9, expect=1)
        assert (
            "No space left on device" in proc.stderr
            and "nothing of it was committed" in proc.stderr
        ), proc.stderr
        assert "its final checkpoint could not be saved" in proc.stderr
        assert "the newest committed checkpoint is step 3" in proc.stderr, proc.stderr
        summary = json.loads((run / "summary.json").read_text())
        assert summary["checkpoint_failures"] == 2 and summary["checkpoints_saved"] == 1
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000003"]
        checkpoint_tensors(run / "checkpoints" / "step-00000003")  # verified and loadable
        # The same command resumes from it (and fails the same way to save more).
        proc = train(run, "checkpoint.every=3", "checkpoint.keep=1", nproc=1, steps=9, expect=1)
        assert "resumed from" in proc.stderr and "step-00000003" in proc.stderr


def test_a_save_failed_by_a_full_disk_says_so_whatever_its_threads_met(tmp_path: Path) -> None:
    """A full disk can reach DCP's writer threads as a zip writer's position check alone (a short
    write that raised nothing: seen in the attack above, one run in several): the save's error
    still names the full disk, and only where the disk is full."""
    import errno
    import os

    from dtlab.checkpoint.writer import save_failure

    met = [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")]
    with tmpfs(tmp_path / "ckpt", "1m") as d:
        fd = os.open(d / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 65536):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        full = save_failure(met, 70, 84, d)
        assert full.errno == errno.ENOSPC, full
        assert "No space left on device" in str(full) and "unexpected pos" in str(full)
        assert "70 of 84 items of this rank were not written" in str(full)
        (d / "fill").unlink()
        room = save_failure(met, 70, 84, d)
        assert room.errno == errno.EIO and "No space left" not in str(room), room
        # A thread's own OSError is the cause, whatever the disk holds.
        own = save_failure([*met, OSError(errno.EDQUOT, "Disk quota exceeded")], 1, 2, d)
        assert own.errno == errno.EDQUOT and "quota" in str(own)


def test_attack_read_only_durable_tier(tmp_path: Path) -> None:
    run, durable = tmp_path / "run", tmp_path / "durable"
    with tmpfs(durable, "1m", read_only=True):
        proc = train(run, "checkpoint.every=3", f"checkpoint.durable_dir={durable}", nproc=1)
        assert "to the durable tier" not in proc.stderr  # no copy is claimed
        assert proc.stderr.count("failed: OSError") == 2 and "Read-only file system" in proc.stderr
        assert "the local checkpoint is committed" in proc.stderr
        summary = json.loads((run / "summary.json").read_text())
        assert summary["durable_copy_failures"] == 2 and summary["checkpoints_saved"] == 2
        checkpoint_tensors(run / "checkpoints" / "step-00000006")


def _children(pid: int) -> set[int]:
    """The running child processes of ``pid`` (the launcher's workers)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def _last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = []
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            steps.append(int(json.loads(line)["step"]))
    return max(steps, default=0)


def test_attack_kill_storm_ends_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """Random ranks are killed (-9) or SIGTERMed at random steps, again and again; the launcher
    restarts the workers each time and they resume. The run ends with exactly the losses and the
    final state of a run that was never touched."""
    import os
    import random
    import re
    import signal
    import time

    if not Path("/proc").is_dir():
        pytest.skip("needs /proc to find the workers")
    steps, attacks = 80, 6  # at most ~7 steps a generation: the attacks land well before the end
    common = ["parallel.strategy=ddp", "checkpoint.every=2", "checkpoint.keep=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, *common, steps=steps)
    args = ["train", "--nproc", "2", "--max-restarts", str(attacks + 2), "--set", *FAST,
            f"train.steps={steps}", f"run.dir={run}", *common]  # fmt: skip
    w = Watched(*args)
    rng = random.Random(14)
    done: list[tuple[str, int, int]] = []  # (signal, rank hit, step it came after)
    deadline = time.monotonic() + 400
    for generation in range(attacks):
        # This generation of workers is training (its rank 0 said so, and where it resumed).
        w.wait_for("INFO training", timeout=120)
        while w.err.count("INFO training") <= generation:
            assert time.monotonic() < deadline and w.proc.poll() is None, w.err
            time.sleep(0.01)
        resumed = [int(x) for x in re.findall(r"resumed from \S+ \(step (\d+)\)", w.err)]
        start = resumed[-1] if resumed else 0
        target = min(steps - 2, start + rng.randint(1, 5))
        while _last_step(run) < target or len(_children(real_pid(w.proc.pid))) < 2:
            assert w.proc.poll() is None, w.err
            assert time.monotonic() < deadline, "the storm did not get through"
            time.sleep(0.01)
        workers = sorted(_children(real_pid(w.proc.pid)))
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        victim = rng.choice(workers)
        step = _last_step(run)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, sig)
        done.append((sig.name, workers.index(victim), step))
        while set(workers) & _children(real_pid(w.proc.pid)):  # the launcher replaces both workers
            assert time.monotonic() < deadline and w.proc.poll() is None, w.err
            time.sleep(0.02)
    assert w.finish(timeout=300) == 0, w.err
    assert "Traceback" not in w.err, w.err
    assert w.err.count("INFO training") == attacks + 1  # one start, one restart per attack
    got, want = read_metrics(run), read_metrics(ref)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want, strict=True))
    print(f"kill storm: {done}; max |loss diff| vs uninterrupted = {diff}")
    assert diff == 0.0
    assert_same_tensors(ckpt(run, steps), ckpt(ref, steps))
