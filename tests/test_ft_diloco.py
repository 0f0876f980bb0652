"""DiLoCo's replicas as fault-tolerant replica groups (parallel.diloco with parallel.fault_tolerance),
with real processes, real gloo and a real SIGKILL.

With no fault the run is plain DiLoCo on as many processes: the same losses and the same θ_global.
A replica killed mid-cycle is restarted by its own agent, takes a live peer's state at a cycle's
start, and the run ends with both replicas holding the same θ_global.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, Watched, checkpoint_tensors, read_metrics, run_cli
from dtlab import load_config
from dtlab.config import check_world
from dtlab.errors import ConfigError
from test_fault_tolerance import _signal

pytest.importorskip("torchft")

DILOCO = [
    "parallel.strategy=ddp",
    "parallel.diloco.inner_steps=2",
    # The outer Nesterov step, not the plain average, so that θ_global's momentum is tested too.
    "parallel.diloco.outer_lr=0.7",
    "parallel.diloco.outer_momentum=0.9",
]
FT = ["parallel.fault_tolerance.enabled=true"]


def _args(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [
        "train", "--nproc", "2", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}",
        *DILOCO, *overrides,
    ]  # fmt: skip


def _models(path: Path) -> dict[str, Any]:
    """θ_global: the model tensors of a checkpoint (a DiLoCo run's model is its global model)."""
    tensors = checkpoint_tensors(path)
    out = {k: v for k, v in tensors.items() if k.startswith("model.")}
    assert out, sorted(tensors)[:5]
    return out


@pytest.mark.parametrize(
    "outer",
    [
        [],  # dense float32, averaged by torchft's all-reduce
        # Quantised with error feedback, and SparseLoCo: payloads all-gathered across the groups.
        ["parallel.diloco.quantize=int4"],
        ["parallel.diloco.topk=0.25", "parallel.diloco.chunk=64", "parallel.diloco.quantize=int2"],
    ],
    ids=["dense", "int4", "sparse"],
)
def test_no_fault_equals_plain_diloco(tmp_path: Path, outer: list[str]) -> None:
    steps, counted = 8, "run.comm_bytes=true"  # 4 outer syncs
    plain = run_cli(*_args(tmp_path / "plain", steps, *outer, counted))
    assert plain.returncode == 0, plain.stderr
    ft = run_cli(*_args(tmp_path / "ft", steps, *outer, *FT, counted))
    assert ft.returncode == 0, ft.stderr
    assert "Traceback" not in ft.stderr, ft.stderr
    ref = read_metrics(tmp_path / "plain")  # rank 0's: replica 0 between syncs, the mean at syncs
    for replica in (0, 1):
        run = read_metrics(tmp_path / "ft" / f"replica-{replica}")
        assert [m["step"] for m in run] == list(range(1, steps + 1))
        for m, r in zip(run, ref, strict=True):
            if "outer_sync" in r or replica == 0:  # replica 1's own steps are its own
                assert m["loss"] == pytest.approx(r["loss"], rel=1e-6, abs=0), (replica, m["step"])
            assert ("outer_sync" in m) == ("outer_sync" in r) == (m["step"] % 2 == 0)
            if "outer_sync" in m:
                assert m["replicas"] == 2 and "samples_lost" not in m and "outer_skipped" not in m
            # What crosses the groups through torchft is what crosses plain DiLoCo's replicas,
            # counted alike: the sync and the agreement at each sync, nothing between (the
            # agreement is an all-reduce here, an all-gather there: the same buffer, on the wire
            # twice the bytes).
            for key in ("comm_bytes", "cross_replica_bytes", "cross_replica_collectives"):
                assert m[key] == r[key], (replica, m["step"], key, m[key], r[key])
            assert (m["cross_replica_bytes"] > 0) == (m["wire_bytes"] > 0) == ("outer_sync" in m)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3
    # θ_global after the last sync: plain DiLoCo's, on both replica groups, to float noise.
    final = f"checkpoints/step-{steps:08d}"
    want = _models(tmp_path / "plain" / final)
    for replica in (0, 1):
        got = _models(tmp_path / "ft" / f"replica-{replica}" / final)
        assert set(got) == set(want)
        for k in want:
            assert (got[k] - want[k]).abs().max() <= 1e-6 * want[k].abs().max(), k
    for replica in (0, 1):
        path = tmp_path / "ft" / f"replica-{replica}" / "summary.json"
        ft_figures = json.loads(path.read_text())["fault_tolerance"]
        # Inner steps cross nothing between groups: a quorum at each cycle's start (steps 0, 2,
        # 4, 6), a sync at its end (2, 4, 6, 8), none skipped.
        assert ft_figures["quorums"] == 4 and ft_figures["outer_syncs"] == 4, ft_figures
        assert ft_figures["outer_syncs_skipped"] == 0


@pytest.mark.parametrize("outer", [[], ["parallel.diloco.quantize=int8"]], ids=["dense", "int8"])
def test_killed_replica_rejoins_at_a_sync_with_the_global_model(
    tmp_path: Path, outer: list[str]
) -> None:
    # Two groups needed for a quorum: group 0 waits at its next cycle's start for group 1 to come
    # back, so the rejoin it tests always happens before the run ends.
    steps, run_dir = 24, tmp_path / "run"
    job = Watched(
        *_args(run_dir, steps, *FT, *outer, "parallel.diloco.inner_steps=4",
               "parallel.fault_tolerance.min_replicas=2")
    )  # fmt: skip
    job.wait_for_step(run_dir / "replica-1", 6)  # mid-cycle: the sync after step 8 cannot commit
    _signal(run_dir, 1, signal.SIGKILL)
    assert job.finish() == 0, job.err
    assert "restarting the workers" in job.err
    assert "recovered the state after step" in job.err
    final = f"checkpoints/step-{steps:08d}"
    a = _models(run_dir / "replica-0" / final)
    b = _models(run_dir / "replica-1" / final)
    assert set(a) == set(b)
    differ = [k for k in a if not (a[k] == b[k]).all()]
    assert not differ, f"the replicas end with different global models: {differ[:5]}"
    recovered = json.loads((run_dir / "replica-1" / "summary.json").read_text())
    ft = recovered["fault_tolerance"]
    assert len(ft["recoveries"]) == 1 and ft["recoveries"][0]["to_step"] % 4 == 0, ft
    # Group 0's syncs: every committed one averaged both groups (min_replicas 2); one that group
    # 1's death broke was skipped, with the cycle's samples counted as lost.
    syncs = [m for m in read_metrics(run_dir / "replica-0") if "outer_sync" in m]
    assert [m["step"] for m in syncs] == list(range(4, steps + 1, 4))
    assert all(m["replicas"] == 2 for m in syncs if "outer_skipped" not in m)
    skipped = [m for m in syncs if "outer_skipped" in m]
    assert all(m["samples_lost"] == 8 * 4 for m in skipped)
    zero = json.loads((run_dir / "replica-0" / "summary.json").read_text())["fault_tolerance"]
    assert zero["outer_syncs_skipped"] == len(skipped)
    # What docs/fault-tolerance.md quotes (pytest -s): the recovery, and the syncs it cost.
    print(
        f"recovery {ft['recoveries'][0]}; syncs skipped on group 0: {[m['step'] for m in skipped]}"
    )


def test_hung_replica_is_dropped_at_a_sync_and_catches_up(tmp_path: Path) -> None:
    # min_replicas 1: group 0 syncs alone while group 1 is stopped, then group 1, woken, is behind
    # (its sync did not commit, group 0's did) and takes group 0's state at a cycle's start.
    steps, run_dir = 200, tmp_path / "run"
    job = Watched(
        *_args(run_dir, steps, *FT, "parallel.diloco.inner_steps=4",
               "parallel.fault_tolerance.timeout_s=3",
               "parallel.fault_tolerance.heartbeat_timeout_s=1")
    )  # fmt: skip
    job.wait_for_step(run_dir / "replica-1", 6)
    _signal(run_dir, 1, signal.SIGSTOP)
    try:
        job.wait_for("missing [1]", timeout=60)  # dropped: a quorum without it
        stopped_at = max(m["step"] for m in read_metrics(run_dir / "replica-1"))
        job.wait_for_step(run_dir / "replica-0", stopped_at + 12, timeout=60)  # syncs alone
    finally:
        _signal(run_dir, 1, signal.SIGCONT)
    assert job.finish() == 0, job.err
    assert "recovered the state after step" in job.err
    final = f"checkpoints/step-{steps:08d}"
    a = _models(run_dir / "replica-0" / final)
    b = _models(run_dir / "replica-1" / final)
    assert all((a[k] == b[k]).all() for k in a), "the replicas end with different global models"
    syncs = [m for m in read_metrics(run_dir / "replica-0") if "outer_sync" in m]
    alone = [m for m in syncs if m.get("replicas") == 1]
    assert len(alone) >= 2 and all(m["samples_lost"] == 4 * 4 for m in alone), alone
    one = json.loads((run_dir / "replica-1" / "summary.json").read_text())["fault_tolerance"]
    assert one["outer_syncs_skipped"] >= 1 and len(one["recoveries"]) >= 1, one


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.diloco.fragments=2"], "parallel.diloco.fragments = 2 is not supported"),
        (["parallel.diloco.fragments=2", "parallel.diloco.delay=1"], "fragments = 2"),
        (["parallel.diloco.delay=1"], "parallel.diloco.delay = 1 is not supported"),
        (["parallel.diloco.eager=true"], "parallel.diloco.eager = true is not supported"),
        (["parallel.strategy=hsdp", "parallel.replicate=2"], "parallel.strategy = 'hsdp'"),
    ],
)
def test_refused_with_diloco(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [*FAST, *DILOCO, "parallel.diloco.inner_steps=4", *FT, *overrides])
    assert "allowed:" in str(e.value)


def test_replicas_are_the_groups() -> None:
    ok = load_config(None, [*FAST, *DILOCO, *FT, "parallel.diloco.replicas=2"])
    check_world(ok, 2)
    one = load_config(None, [*FAST, *DILOCO, *FT, "parallel.diloco.replicas=1"])
    with pytest.raises(ConfigError, match=r"replicas = 1 .* \(allowed: null or 2\)"):
        check_world(one, 2)
