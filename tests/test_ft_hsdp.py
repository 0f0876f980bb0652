"""parallel.fault_tolerance under HSDP: each replicate group is a torchft replica group of S ranks that
runs FSDP2 over them, with real processes, real gloo and a real SIGKILL.

With no fault, HSDP 2x2 on 4 processes with fault tolerance is plain HSDP 2x2 (the same losses, gradient
norms with clipping active, and weights); a group that loses one rank is restarted whole by its agent,
each of its ranks recovers its shards of the model and optimizer from the same rank of the live group,
and both groups end with the same weights.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    FAST,
    Watched,
    assert_groups_match,
    checkpoint_tensors,
    read_metrics,
    real_pid,
    run_cli,
)
from dtlab import load_config
from dtlab.errors import ConfigError

pytest.importorskip("torchft")

HSDP = ["parallel.strategy=hsdp", "parallel.replicate=2"]
FT = ["parallel.fault_tolerance.enabled=true"]
# Below the debug model's gradient norm (0.66 to 0.72 in its first steps): clipping is active.
CLIP = "train.grad_clip=0.5"


def _train_args(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [
        "train", "--nproc", "4", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}",
        *HSDP, CLIP, *overrides,
    ]  # fmt: skip


def _group_rank_pid(run_dir: Path, replica: int, rank: int) -> int:
    """Rank ``rank`` of replica group ``replica``'s training process (not its agent), found by its
    run directory and its RANK in the environment its agent gave it."""
    want = f"run.dir={run_dir / f'replica-{replica}'}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in cmd and b"dtlab.fault_tolerance" not in cmd and f"RANK={rank}".encode() in env:
            found.append(int(proc.name))
    assert len(found) == 1, f"rank {rank} of replica group {replica}: {found}"
    return found[0]


def _weights(run_dir: Path, steps: int) -> dict[str, Any]:
    tensors = checkpoint_tensors(run_dir / f"checkpoints/step-{steps:08d}")
    assert any(k.startswith("model.") for k in tensors) and any(
        k.startswith("optim.") for k in tensors
    )
    return tensors


def test_no_fault_equals_plain_hsdp(tmp_path: Path) -> None:
    steps = 4
    plain = run_cli(*_train_args(tmp_path / "plain", steps))
    assert plain.returncode == 0, plain.stderr
    ft = run_cli(*_train_args(tmp_path / "ft", steps, *FT))
    assert ft.returncode == 0, ft.stderr
    assert "Traceback" not in ft.stderr, ft.stderr
    assert "2 replica groups of 2 ranks" in ft.stderr
    # Each group's start line splits the global batch over every group's ranks, not its own.
    assert "global batch 8 = 4 data-parallel ranks x 1 micro-batch x 2" in ft.stderr, ft.stderr
    ref = read_metrics(tmp_path / "plain")
    assert any(r["grad_norm"] > 0.5 for r in ref)  # clipping is active in the reference
    # The same samples (data-parallel rank group * 2 + rank), the same average: float noise.
    assert_groups_match(tmp_path / "ft", ref, steps, norm_rel=1e-5)
    want = _weights(tmp_path / "plain", steps)
    for replica in (0, 1):
        got = _weights(tmp_path / "ft" / f"replica-{replica}", steps)
        assert set(got) == set(want)
        for k, t in want.items():
            assert got[k].allclose(t, rtol=1e-5, atol=1e-7), k
    record = json.loads((tmp_path / "ft" / "fault_tolerance.json").read_text())
    assert record["exit_codes"] == {"0": 0, "1": 0}


def test_group_that_loses_a_rank_restarts_whole_and_recovers_its_shards(tmp_path: Path) -> None:
    # Both groups needed for a step: group 0 waits for group 1 to come back.
    steps, run_dir = 20, tmp_path / "run"
    job = Watched(*_train_args(run_dir, steps, *FT, "parallel.fault_tolerance.min_replicas=2"))
    job.wait_for_step(run_dir / "replica-1", 5)
    # One rank of group 1 dies: its agent restarts the whole group (its other rank too).
    os.kill(real_pid(_group_rank_pid(run_dir, 1, 1)), signal.SIGKILL)
    killed_at = time.time()
    assert job.finish() == 0, job.err
    assert "restarting the workers" in job.err
    assert "recovered the state after step" in job.err
    summary = json.loads((run_dir / "replica-1" / "summary.json").read_text())["fault_tolerance"]
    recovered = summary["recoveries"]
    assert len(recovered) == 1 and recovered[0]["to_step"] >= 5, recovered
    # The figures docs/fault-tolerance.md quotes (pytest -s): from the kill to the group's rejoin
    # (its agent's restart, its new processes' start-up, the recovery), and the recovery alone.
    events = (run_dir / "replica-1" / "ft_events.jsonl").read_text().splitlines()
    rejoined = next(e for e in map(json.loads, events) if e["event"] == "recovered")["time"]
    print(f"kill -> rejoined {rejoined - killed_at:.2f} s, recovery {recovered[0]}")
    # Every shard of both ranks (model and optimizer) came from the live group: the same weights.
    a, b = _weights(run_dir / "replica-0", steps), _weights(run_dir / "replica-1", steps)
    assert set(a) == set(b)
    differ = [k for k in a if not (a[k] == b[k]).all()]
    assert not differ, f"replica groups end with different tensors: {differ[:5]}"
    assert all(m["replicas"] == 2 for m in read_metrics(run_dir / "replica-0"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=fsdp"], "parallel.strategy = 'fsdp' is not supported"),
        ([*HSDP, "parallel.sharding=no_shard"], "parallel.sharding = 'no_shard' is not supported"),
        ([*HSDP, "parallel.tp=2"], "parallel.tp = 2 is not supported"),
        ([*HSDP, "parallel.pp=2"], "parallel.pp = 2 is not supported"),
        ([*HSDP, "parallel.compression=bf16"], "parallel.compression = 'bf16'"),
    ],
)
def test_refused_with_hsdp(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*FT, *overrides])


def test_groups_and_their_degrees() -> None:
    from dtlab.dims import DPWrapper
    from dtlab.parallel.dist import group_dims
    from dtlab.parallel.ft import replica_groups

    config = load_config(None, [*FAST, *HSDP, *FT])
    assert replica_groups(config, 4) == (2, 2)
    dims = group_dims(config, 2)  # a group's world: FSDP over its 2 ranks, no replicate dimension
    assert (dims.dp_replicate, dims.dp_shard, dims.wrapper) == (1, 2, DPWrapper.FSDP)
    ddp = load_config(None, [*FAST, "parallel.strategy=ddp", *FT])
    assert replica_groups(ddp, 4) == (4, 1)
