"""The wait a collective costs inside a model's steps where a job's ranks outnumber the cores
(:mod:`dtlab.analysis.step_wait`), which the plan then counts for every collective of the step
whatever its group."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.plan import predict_step
from dtlab.analysis.probe import ComputeProbe
from dtlab.analysis.step_wait import measure_step_wait, oversubscribed
from dtlab.analysis.steptime import collective_waits, step_microbatches
from dtlab.config import load_config
from dtlab.dims import ParallelDims

SETS = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8"]


def test_ranks_outnumber_the_cores_when_their_threads_do() -> None:
    assert oversubscribed(4, 1, 2) and oversubscribed(2, 2, 3)
    assert not oversubscribed(2, 1, 2) and not oversubscribed(1, 4, 4)


def test_the_ranks_train_in_step_with_a_collective_after_each_blocks_forward_and_backward() -> None:
    cfg = load_config(None, SETS)
    got = measure_step_wait(cfg, 2, 1, batch=1, pairs=2)
    assert got.collectives == 2 * cfg.model.n_layers
    assert len(got.steps_s) == 2 and all(0 < s < 60 for s in got.steps_s)
    assert 0 <= got.wait_s < 1


def _device(waits: dict[str, float], cores: int = 2) -> DeviceProfile:
    rates = {"all_reduce": 1.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
    return DeviceProfile(
        "this", "test", 16.0, {"fp32": 0.1}, 1.0, 1.0, copy_gbps=1.0,
        probe=ComputeProbe(1, cores, 1e-5, 0.01, 0, 64, "test"),
        collective_gbps={**rates, **waits},
    )  # fmt: skip


@pytest.mark.parametrize(
    "layout", [["parallel.strategy=fsdp"], ["parallel.strategy=fsdp", "parallel.tp=2"]]
)
def test_where_the_ranks_outnumber_the_cores_every_collective_waits_the_steps_wait(
    layout: list[str],
) -> None:
    """With a step's wait measured (``step_wait_s``) each collective of the step costs it whole, a
    pair's as much as the world's, and so does the small matrices' wait (``sync_s``) where the
    step's could not be measured; where each rank has its cores, a smaller group waits a share of
    the small matrices' wait."""
    cfg = load_config(None, [*SETS, *layout])
    dims = ParallelDims.from_config(cfg, 4)
    waits = collective_waits(cfg, dims, cfg.model.n_layers, step_microbatches(cfg, dims))

    def exposed(extra: dict[str, float], cores: int = 2) -> float:
        row = predict_step(cfg, 4, 1, _device({"sync_s": 0.0, **extra}, cores))
        assert row.exposed_s is not None
        return row.exposed_s

    none = exposed({})
    whole = exposed({"step_wait_s": 0.004}) - none
    assert whole == pytest.approx(0.004 * sum(waits.values()))
    # 4 ranks of a thread each on 2 cores, the step's wait not measured: the small matrices' whole.
    assert exposed({"sync_s": 0.004}) - none == pytest.approx(whole)
    # On 4 cores, a core each: a group's share.
    scaled = exposed({"sync_s": 0.004}, cores=4) - exposed({}, cores=4)
    assert scaled == pytest.approx(sum(0.004 * n * (min(g, 4) - 1) / 3 for g, n in waits.items()))
    if any(g < 4 for g in waits):
        assert whole > scaled
    # The step's wait replaces the small matrices' where both are measured.
    both = exposed({"sync_s": 0.5, "step_wait_s": 0.004}) - none
    assert both == pytest.approx(whole)


def test_a_device_with_the_steps_wait_says_so() -> None:
    from dtlab.analysis.plan_format import _measured_lines

    dev = replace(_device({"sync_s": 0.002, "step_wait_s": 0.004}), collective_source="measured")
    (line,) = _measured_lines({"collective_gbps": dev.collective_gbps, "collective_source": "m"})
    assert "2 ms per collective beside compute" in line
    assert "4 ms beside the model's steps on more ranks than cores" in line
    assert "sync_s" not in line and "step_wait_s" not in line


def test_where_the_ranks_threads_outnumber_the_cores_the_probe_measures_the_steps_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks of as many threads each as the machine has cores outnumber them (on any machine):
    the probed device carries the step's wait beside the small matrices' (where they do not, it
    does not: ``test_plan_this_device_prints_its_measured_collectives_and_step``)."""
    from dtlab.analysis.devices import this_device
    from dtlab.analysis.probe import with_probe

    cores = os.cpu_count() or 1
    cfg = load_config(None, SETS)
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))
    device, why = with_probe(this_device("fp32"), cfg, 2)
    assert why is None and device.collective_gbps is not None
    assert 0 <= device.collective_gbps["step_wait_s"] < 1
    assert 0 <= device.collective_gbps["sync_s"] < 1


def test_the_steps_wait_is_measured_on_fewer_samples_where_the_ranks_step_would_be_long() -> None:
    from dtlab.analysis.probe import STEP_WAIT_BUDGET_S, _wait_batch
    from dtlab.analysis.probe_step import PROBE_TOKENS

    cfg = load_config(None, SETS)
    most = PROBE_TOKENS // cfg.seq_len
    quick = ComputeProbe(1, 2, 1e-6, 0.01, 0, cfg.seq_len, "test")
    assert _wait_batch(cfg, quick, 8) == most
    # A sample a rank of 8 on 2 cores takes 0.3 s: as many as fit the budget.
    slow = replace(quick, seconds_per_token=0.3 / (4 * cfg.seq_len))
    assert _wait_batch(cfg, slow, 8) == int(STEP_WAIT_BUDGET_S // 0.3) < most
    huge = replace(quick, seconds_per_token=10.0 / cfg.seq_len)
    assert _wait_batch(cfg, huge, 4) == 1


def test_a_process_that_fails_is_named_with_its_last_error_line() -> None:
    cfg = load_config(None, SETS)
    with pytest.raises(RuntimeError, match=r"a process measuring the step's wait exited with 1: "):
        measure_step_wait(cfg, 2, 1, batch=0, pairs=1, timeout_s=120)  # no sample: refused
