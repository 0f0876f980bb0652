"""parallel.fault_tolerance with tensor parallelism inside each replica group: a DDP group is the
world of its ``parallel.tp`` ranks, with real processes, real gloo and a real SIGKILL.

With no fault, 2 groups of 2 tensor-parallel ranks on 4 processes train as plain DDP 2 x TP 2 (the
same losses, gradient norms with clipping active, and weights); a group that loses one rank is
restarted whole by its agent, each of its ranks recovers its shards from the same rank of the live
group, and both groups end with the same weights.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import (
    FAST,
    Watched,
    assert_groups_match,
    read_metrics,
    real_pid,
    run_cli,
)
from dtlab import load_config
from dtlab.errors import ConfigError, DtlabError
from dtlab.parallel.ft import replica_groups
from test_ft_hsdp import _group_rank_pid, _weights

pytest.importorskip("torchft")

TP = ["parallel.strategy=ddp", "parallel.tp=2"]
FT = ["parallel.fault_tolerance.enabled=true"]
# Below the debug model's gradient norm (0.66 to 0.72 in its first steps): clipping is active.
CLIP = "train.grad_clip=0.5"


def _train_args(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [
        "train", "--nproc", "4", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}",
        *TP, CLIP, *overrides,
    ]  # fmt: skip


def test_no_fault_equals_plain_ddp_with_tp(tmp_path: Path) -> None:
    steps = 4
    plain = run_cli(*_train_args(tmp_path / "plain", steps))
    assert plain.returncode == 0, plain.stderr
    ft = run_cli(*_train_args(tmp_path / "ft", steps, *FT))
    assert ft.returncode == 0, ft.stderr
    assert "Traceback" not in ft.stderr, ft.stderr
    assert "2 replica groups of 2 ranks" in ft.stderr, ft.stderr
    ref = read_metrics(tmp_path / "plain")
    assert any(r["grad_norm"] > 0.5 for r in ref)  # clipping is active in the reference
    assert_groups_match(tmp_path / "ft", ref, steps, norm_rel=1e-5)
    want = _weights(tmp_path / "plain", steps)
    for replica in (0, 1):
        got = _weights(tmp_path / "ft" / f"replica-{replica}", steps)
        assert set(got) == set(want)
        for k, t in want.items():
            assert got[k].allclose(t, rtol=1e-5, atol=1e-7), k


def test_tp_group_that_loses_a_rank_restarts_whole_and_recovers_its_shards(tmp_path: Path) -> None:
    steps, run_dir = 20, tmp_path / "run"
    job = Watched(*_train_args(run_dir, steps, *FT, "parallel.fault_tolerance.min_replicas=2"))
    job.wait_for_step(run_dir / "replica-1", 5)
    os.kill(real_pid(_group_rank_pid(run_dir, 1, 1)), signal.SIGKILL)  # one TP rank of group 1
    assert job.finish() == 0, job.err
    assert "restarting the workers" in job.err
    assert "recovered the state after step" in job.err
    summary = json.loads((run_dir / "replica-1" / "summary.json").read_text())["fault_tolerance"]
    assert len(summary["recoveries"]) == 1, summary
    a, b = _weights(run_dir / "replica-0", steps), _weights(run_dir / "replica-1", steps)
    assert set(a) == set(b)
    differ = [k for k in a if not (a[k] == b[k]).all()]
    assert not differ, f"replica groups end with different tensors: {differ[:5]}"


def test_tp_groups_need_whole_groups_and_refuse_pipelines() -> None:
    config = load_config(None, [*FT, *TP])
    assert replica_groups(config, 4) == (2, 2)
    with pytest.raises(DtlabError, match="--nproc must be a multiple of 2"):
        replica_groups(config, 3)
    with pytest.raises(ConfigError, match=r"parallel\.pp = 2"):
        load_config(None, [*FT, "parallel.strategy=ddp", "parallel.pp=2"])
