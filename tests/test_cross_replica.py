"""What crosses replicas, counted per step (``run.comm_bytes``: ``cross_replica_collectives`` and
``cross_replica_bytes``) against the round trips the plan predicts (:mod:`dtlab.analysis.latency`),
and the bench's simulated round trip (``DTLAB_BENCH_RTT_MS``) delaying exactly those collectives."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, read_metrics, run_cli, train_run
from dtlab.analysis.latency import cross_replica_collectives, ddp_bucket_count
from dtlab.analysis.model import param_shapes
from dtlab.config import load_config
from dtlab.errors import DtlabError
from dtlab.metrics.comm import RTT_ENV, bench_rtt_s

CLIPPED = ["train.grad_clip=0.05", "run.comm_bytes=true"]
# An alert that fires on every step it judges: every rank's memory is above a millionth of the machine's.
ALERT = ["alerts.memory_fraction=0.000001"]
DILOCO = ["parallel.diloco.inner_steps=4"]


def _predicted(overrides: list[str], nproc: int) -> float:
    config = load_config(overrides=[*FAST, *overrides])
    predicted = cross_replica_collectives(config, nproc)
    assert predicted is not None
    return predicted


def _check_diloco(metrics: list[dict[str, Any]], overrides: list[str], nproc: int) -> None:
    """Steps without a sync: nothing crosses replicas; a sync step: its fragment's collective, the
    replicas' agreement and the alerts' agreement; the mean over whole cycles: the plan's."""
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for m in metrics:
        assert m["grad_norm"] > 0.05  # clipping is active on every step
        if "outer_sync" in m:
            assert m["cross_replica_collectives"] == 3, m
        else:
            assert m["cross_replica_collectives"] == 0, m
            assert m["cross_replica_bytes"] == 0, m
    # The alert is judged with the syncs only, where the replicas agree (and fires once: it stays on).
    assert [(m["step"], m["alerts"]) for m in metrics if "alerts" in m] == [(4, ["memory"])]
    assert [m["step"] for m in metrics if "outer_sync" in m] == [4, 8]
    mean = statistics.fmean(m["cross_replica_collectives"] for m in metrics)
    assert mean == _predicted(overrides, nproc) == 0.75


def test_sharded_replicas_talk_across_only_with_the_sync(tmp_path: Path) -> None:
    """2 replicas of 2 FSDP ranks (4 processes): every step the replica's own gathers, reduce-scatters
    and step reduction; across replicas only the syncs (each rank's shard with its peer's)."""
    overrides = [*DILOCO, *CLIPPED, *ALERT, "parallel.strategy=fsdp", "parallel.diloco.replicas=2"]
    metrics = train_run(tmp_path / "run", *overrides, nproc=4, steps=8)
    _check_diloco(metrics, overrides, 4)
    assert all(m["comm_bytes"] > 1000 for m in metrics)  # inside the replica, every step
    sync = next(m for m in metrics if "outer_sync" in m)
    assert 0 < sync["cross_replica_bytes"] < sync["comm_bytes"]


def test_replicas_of_one_rank_wait_a_simulated_round_trip_only_at_syncs(tmp_path: Path) -> None:
    """2 replicas of one rank, with a simulated round trip of 150 ms: the sync steps wait for theirs
    (their fragment's collective and the replicas' agreement, in the step), the others for none."""
    overrides = [*DILOCO, *CLIPPED, *ALERT, "parallel.strategy=ddp"]
    args = ["train", "--nproc", "2", "--set", *FAST, "train.steps=8", f"run.dir={tmp_path / 'r'}"]
    proc = run_cli(*args, *overrides, env={RTT_ENV: "150"})
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(tmp_path / "r")
    _check_diloco(metrics, overrides, 2)
    for m in metrics:
        if "outer_sync" in m:
            assert m["step_time_s"] >= 2 * 0.15, m
        else:
            assert m["comm_bytes"] == 0, m


def test_ddp_crosses_every_step_as_predicted(tmp_path: Path) -> None:
    """Plain DDP: every collective crosses replicas, one per bucket and the step's reduction; a
    bucket of 0.1 MiB splits the debug model's 0.5 MiB of gradients into several."""
    overrides = ["parallel.strategy=ddp", "parallel.bucket_mb=0.1", "run.comm_bytes=true"]
    metrics = train_run(tmp_path / "run", *overrides, nproc=2, steps=4)
    config = load_config(overrides=[*FAST, *overrides])
    buckets = ddp_bucket_count(param_shapes(config.model), 0.1)
    assert buckets >= 4
    predicted = _predicted(overrides, 2)
    assert predicted == buckets + 1
    # Step 2 also broadcasts the buckets DDP rebuilt after step 1 (in the order gradients came).
    for m in metrics[2:]:
        assert m["cross_replica_collectives"] == predicted, m
        assert m["cross_replica_bytes"] == m["comm_bytes"], m


def test_a_validation_is_counted_with_its_step(tmp_path: Path) -> None:
    """FSDP with a validation after step 2 of 2 batches: that step's record also counts the
    validation's collectives, apart from the step's own: each unit's all-gather per batch and the
    loss's all-reduce."""
    overrides = [
        "parallel.strategy=fsdp", "run.comm_bytes=true", "data.val_fraction=0.1", "eval.every=2",
        "eval.batches=2",
    ]  # fmt: skip
    metrics = train_run(tmp_path / "run", *overrides, nproc=2, steps=2)
    step, validated = metrics
    assert "val_loss" in validated and "val_loss" not in step
    assert validated["cross_replica_collectives"] == step["cross_replica_collectives"]
    assert validated["eval_cross_replica_collectives"] == 2 * 3 + 1  # 3 units: 2 blocks, the root
    assert validated["eval_comm_bytes"] > 0 and "eval_comm_bytes" not in step


def test_a_diloco_save_between_syncs_is_counted_as_crossing(tmp_path: Path) -> None:
    """A DiLoCo checkpoint is the world's: a save between syncs runs collectives across the
    replicas (DCP's planning, the ranks' RNG states), counted apart from the steps' and reported
    with the next record (checkpoint_*); the final save's, after the last record, in the summary."""
    overrides = [
        *DILOCO, "parallel.strategy=ddp", "run.comm_bytes=true",
        "checkpoint.every=2", "checkpoint.async=false",
    ]  # fmt: skip
    metrics = train_run(tmp_path / "run", *overrides, nproc=2, steps=4)
    assert [("outer_sync" in m) for m in metrics] == [False, False, False, True]
    one, two, after_save, _ = metrics
    for m in (one, two, after_save):  # the steps themselves: nothing crosses between syncs
        assert m["cross_replica_collectives"] == m["comm_bytes"] == 0, m
    assert "checkpoint_comm_bytes" not in one and "checkpoint_comm_bytes" not in two
    assert after_save["checkpoint_cross_replica_collectives"] > 0
    assert after_save["checkpoint_cross_replica_bytes"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["checkpoint_comm_after_last_step"]["cross_replica_collectives"] > 0


@pytest.mark.parametrize("raw", ["abc", "-5", "20000", "nan"])
def test_a_bad_simulated_round_trip_is_named(raw: str) -> None:
    with pytest.raises(DtlabError, match=f"{RTT_ENV}='{raw}'.*0 to 10000"):
        bench_rtt_s({RTT_ENV: raw})
    assert bench_rtt_s({RTT_ENV: "20"}) == 0.02
    assert bench_rtt_s({}) == 0.0


def test_fsdp_crosses_as_predicted_and_the_plan_says_so(tmp_path: Path) -> None:
    """FSDP with 2 micro-batches: per micro-batch each unit's all-gather for forward and again for
    backward and a reduce-scatter per unit, the step's reduction; `dtlab plan --json` gives the same
    figure in each candidate's row."""
    overrides = ["parallel.strategy=fsdp", "train.micro_batch_size=2", "run.comm_bytes=true"]
    metrics = train_run(tmp_path / "run", *overrides, nproc=2, steps=3)
    predicted = _predicted(overrides, 2)
    assert predicted == 3 * (2 * 2 + 2) + 1  # 3 units: 2 blocks and the root
    assert [m["cross_replica_collectives"] for m in metrics] == [predicted] * 3
    proc = run_cli("plan", "--nproc", "2", "--json", "--set", *FAST, "parallel.bucket_mb=0.1")
    assert proc.returncode == 0, proc.stderr
    rows = {r["label"]: r for r in json.loads(proc.stdout)["strategies"]}
    ddp = load_config(overrides=[*FAST, "parallel.strategy=ddp", "parallel.bucket_mb=0.1"])
    trips = rows["ddp"]["comm"]["cross_replica_collectives_per_step"]
    assert (
        trips
        == cross_replica_collectives(ddp, 2)
        == ddp_bucket_count(param_shapes(ddp.model), 0.1) + 1
    )
