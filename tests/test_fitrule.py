"""The fit rule: the bench's outcome classifier, real runs under a memory cap, and the plan's margin."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from dtlab.analysis import fitrule
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.plan import plan
from dtlab.bench.fitrule import (
    GRID,
    OK,
    OOM,
    OTHER,
    Case,
    CgroupUnavailable,
    MemoryCgroup,
    RunResult,
    classify,
    main,
    predicted_bytes,
    rule,
    run_case,
)
from dtlab.config import load_config


def _cgroups() -> str | None:
    """Why this machine cannot cap a run's memory, or None when it can."""
    try:
        MemoryCgroup(None).close()
    except CgroupUnavailable as e:
        return str(e)
    return None


NO_CGROUP = _cgroups()
needs_cgroup = pytest.mark.skipif(NO_CGROUP is not None, reason=f"no memory cgroup: {NO_CGROUP}")


def test_a_run_the_kernel_killed_for_the_cap_ran_out_of_memory() -> None:
    # The launcher exits 1 when the kernel kills a rank: the cgroup's count decides, not the code.
    assert classify(1, 1, "ChildFailedError: exitcode -9") == OOM
    assert classify(-9, 1, "") == OOM
    # Even a run that exited 0 is not a fit when the kernel killed one of its processes.
    assert classify(0, 1, "") == OOM
    assert classify(0, 0, "") == OK


def test_a_failed_allocation_is_out_of_memory_and_anything_else_is_not_a_fit() -> None:
    assert classify(1, 0, "RuntimeError: DefaultCPUAllocator: can't allocate memory") == OOM
    assert classify(1, 0, "MemoryError") == OOM
    assert classify(1, 0, "error: train.micro_batch_size = 3 does not divide 8") == OTHER
    assert classify(None, 0, "timed out after 300 s") == OTHER  # a timeout
    assert classify(-9, 0, "") == OTHER  # killed, but not by the cap


def _run(ratio: float | None, outcome: str) -> RunResult:
    return RunResult("c", 1, [], "default", 100, ratio, 0, None, outcome, 0, 0, 0, 0, 0.0)


def test_the_rule_stops_at_the_first_ratio_where_any_run_failed() -> None:
    runs = [_run(None, OK), _run(0.5, OK), _run(0.6, OK), _run(0.7, OOM), _run(0.8, OK)]
    s = rule(runs)
    assert (s["fits_up_to_ratio"], s["lowest_oom_ratio"], s["runs"]) == (0.6, 0.7, 4)
    # Another error is never a fit: it stops the rule below the first out-of-memory run.
    s = rule([_run(0.5, OK), _run(0.6, OTHER), _run(0.7, OOM)])
    assert (s["fits_up_to_ratio"], s["lowest_oom_ratio"], s["other_errors"]) == (0.5, 0.7, 1)
    assert rule([_run(0.5, OOM)])["fits_up_to_ratio"] is None


def test_bad_ratios_and_mallocs_are_refused_naming_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for args, said in (
        (["--ratios", "0.8,x"], "--ratios '0.8,x': expected comma-separated numbers"),
        (["--ratios", "0.8,-1"], "every ratio must be a positive number"),
        (["--malloc", "jemalloc"], "--malloc 'jemalloc': expected a comma-separated list of"),
    ):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and said in capsys.readouterr().err, args


@needs_cgroup
def test_a_cap_far_below_the_prediction_runs_out_and_one_far_above_fits() -> None:
    case = Case("debug", 1, ("model.preset=debug", "data.seq_len=64", "train.global_batch_size=4"))
    predicted = predicted_bytes(case)
    assert predicted > 0
    # A quarter of the tiny model's prediction: not even torch's import fits in it.
    tiny = GRID[0]
    low = predicted_bytes(tiny) // 4
    outcome, rc, kills, peak, _, _ = run_case(tiny, low, steps=1, timeout=120)
    assert (outcome, kills > 0) == (OOM, True), (outcome, rc, kills)
    assert peak <= low
    # 4 GiB is far above the debug model's need and the process's own baseline.
    high = 4 * 2**30
    outcome, rc, kills, peak, _, tail = run_case(case, high, steps=1, timeout=120)
    assert (outcome, rc, kills) == (OK, 0, 0), tail
    assert predicted < peak < high


def test_the_plan_applies_the_measured_margin_and_says_where_it_comes_from() -> None:
    config = load_config(overrides=["model.preset=debug", "data.seq_len=64"])
    margin = fitrule.usable_fraction("cuda")
    assert margin <= fitrule.MODEL_MARGIN and margin <= fitrule.GPU_PUBLISHED_MARGIN
    assert margin <= fitrule.gpu_modelled_fraction() < fitrule.MODEL_MARGIN
    # A smaller GPU keeps a smaller share: the context and NCCL's buffers take the same bytes.
    assert fitrule.gpu_modelled_fraction(16 * 2**30) < fitrule.gpu_modelled_fraction()
    total = plan(config, 2, 1, PROFILES["h100"], None)["strategies"][0]["per_rank"]["total_bytes"]
    # Memory that puts the prediction just past the margin, then just within it.
    for share, fits in ((margin + 0.02, False), (margin - 0.02, True)):
        p = plan(config, 2, 1, PROFILES["h100"], total / share / 2**30)
        assert p["strategies"][0]["fits"] is fits, (share, p["strategies"][0])
    a = p["assumptions"]
    assert a["usable_memory_fraction"] == margin
    assert f"<= {margin:.0%} of device memory" in a["fit_rule"]
    assert "python -m dtlab.bench.fitrule" in a["fit_rule"] and "2411.06465" in a["fit_rule"]


def test_plan_json_and_header_state_the_rule() -> None:
    proc = run_cli("plan", "configs/debug.yaml", "--nproc", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    a = json.loads(proc.stdout)["assumptions"]
    assert a["fit_rule"] == fitrule.explain("cuda")
    assert f"{fitrule.MODEL_RUNS} runs" in a["fit_rule"]
    proc = run_cli("plan", "configs/debug.yaml", "--nproc", "2", "--device", "this")
    assert proc.returncode == 0, proc.stderr
    assert fitrule.explain("cpu") in proc.stdout
    assert f"<= {fitrule.CPU_MARGIN:.0%} of device memory" in proc.stdout
