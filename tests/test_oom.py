"""Out-of-memory recovery (``train.oom_retry``): a step that runs out of memory on any rank is taken
again on every rank with smaller micro-batches, and the training stays the same as an uninterrupted
run's (real gloo processes; an injected error and a real allocation failure under RLIMIT_AS)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, assert_same_training, read_metrics, run_cli
from dtlab import load_config
from dtlab.errors import ConfigError
from dtlab.train.oom import smaller_micro_batch


def _train(
    run_dir: Path, nproc: int, *overrides: str, env: dict[str, str] | None = None, expect: int = 0
) -> str:
    args = [
        "train", "--nproc", str(nproc), "--set", *FAST, "train.steps=12", f"run.dir={run_dir}",
        *overrides,
    ]  # fmt: skip
    proc = run_cli(*args, env=env)
    assert proc.returncode == expect, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_smaller_micro_batches_divide_the_old_ones() -> None:
    assert [smaller_micro_batch(n) for n in (8, 6, 5, 3, 2, 1)] == [4, 3, 1, 1, 1, None]


def test_injected_oom_on_one_rank_is_retried_on_every_rank(
    tmp_path: Path, reference_run: list[dict[str, Any]]
) -> None:
    """Rank 1 runs out of memory in step 3 (micro-batches of 2): both ranks take the step again with
    micro-batches of 1 and keep them; every step equals one process's."""
    run_dir = tmp_path / "run"
    opts = ["parallel.strategy=ddp", "train.micro_batch_size=2", "train.oom_retry=true"]
    stderr = _train(run_dir, 2, *opts, env={"DTLAB_FAULTS": "oom@3:r1"})
    assert stderr.count("step 3 ran out of memory on rank 1 with micro-batches of 2") == 1, stderr
    assert "micro-batches of 1: 4 accumulation steps, the same global batch of 8" in stderr
    run = read_metrics(run_dir)
    assert_same_training(run, reference_run)
    retried = {m["step"]: m for m in run if "oom_retries" in m}
    assert list(retried) == [3] and retried[3]["micro_batch_size"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["oom_retries"], summary["micro_batch_size"]) == (1, 1)


def test_an_moe_models_retried_step_counts_its_routing_once(tmp_path: Path) -> None:
    """What a mixture of experts' layers counted in the attempt that ran out of memory is dropped:
    the retried step's expert loads, and the balancing bias they move, are an uninterrupted
    run's (before, rank 0's first attempt was counted too: 1,280 tokens routed for 1,024)."""
    opts = ["model.preset=debug-moe", "parallel.strategy=ddp", "train.micro_batch_size=2",
            "train.oom_retry=true", "train.steps=5"]  # fmt: skip
    _train(tmp_path / "ref", 2, *opts)
    stderr = _train(tmp_path / "run", 2, *opts, env={"DTLAB_FAULTS": "oom@3:r1"})
    assert "step 3 ran out of memory on rank 1" in stderr, stderr
    run, ref = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "ref")
    assert [m["step"] for m in run] == [m["step"] for m in ref] == [1, 2, 3, 4, 5]
    for m, r in zip(run, ref, strict=True):
        assert m["moe_load"] == r["moe_load"], m["step"]
        assert m["moe_bias"] == pytest.approx(r["moe_bias"], abs=1e-7), m["step"]
        assert m["loss"] == pytest.approx(r["loss"], abs=1e-5), m["step"]


def test_real_allocation_failure_under_an_address_space_limit(tmp_path: Path) -> None:
    """Rank 1 caps its address space before step 1 (``memlimit``) below what a micro-batch of 128
    samples needs: the allocator really fails, and the run goes on with smaller micro-batches and the
    losses of one process without any limit."""
    big = ["data.seq_len=128", "train.global_batch_size=256", "train.steps=3"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    _train(ref_dir, 1, *big)
    env = {"DTLAB_FAULTS": "memlimit@1:r1", "DTLAB_MEMLIMIT_MB": "150"}
    # No final checkpoint: under the cap a save's writer threads cannot get their stacks, and the
    # run would rightly fail for want of its final weights (not what this test is about).
    stderr = _train(
        run_dir, 2, *big, "parallel.strategy=ddp", "train.oom_retry=true", "checkpoint.final=false",
        env=env,
    )  # fmt: skip
    assert "[rank1] WARNING step 1:" in stderr and "can't allocate memory" in stderr, stderr
    assert "step 1 ran out of memory on rank 1 with micro-batches of 128" in stderr, stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["oom_retries"] >= 1 and summary["micro_batch_size"] < 128
    run, ref = read_metrics(run_dir), read_metrics(ref_dir)
    assert [m["step"] for m in run] == [1, 2, 3]
    for m, r in zip(run, ref, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=1e-5), m["step"]
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), m["step"]


def test_out_of_memory_at_one_sample_is_a_clear_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stderr = _train(
        run_dir, 1, "train.micro_batch_size=1", "train.oom_retry=true",
        env={"DTLAB_FAULTS": "oom@2"}, expect=2,
    )  # fmt: skip
    assert "step 2 ran out of memory on rank 0 even with micro-batches of one sample" in stderr
    assert not (run_dir / "summary.json").exists()


def test_without_oom_retry_an_out_of_memory_error_stops_the_run(tmp_path: Path) -> None:
    """The feature is what recovers: without it the same fault ends the run."""
    proc = run_cli(
        "train", "--set", *FAST, "train.steps=4", f"run.dir={tmp_path / 'run'}",
        env={"DTLAB_FAULTS": "oom@2"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "injected out of memory" in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=fsdp"], "parallel.strategy = 'fsdp'"),
        (["parallel.strategy=ddp", "parallel.compression=powersgd"], "'powersgd'"),
        (["parallel.strategy=ddp", "parallel.pp=2"], "parallel.pp = 2"),
    ],
)
def test_oom_retry_refuses_layouts_that_meet_before_the_sync(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["train.oom_retry=true", *overrides])
