"""``dtlab plan`` searches the layouts the config leaves open, recommends the fastest that fits, and
prints the ``dtlab train`` line that runs it: a line that loads, passes the world checks, plans to the
recommended row and, on the debug model, trains."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, run_cli, train_run
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.plan import HEADROOM, format_plan, plan
from dtlab.analysis.search import SEARCHED
from dtlab.config import check_world, load_config

H100 = PROFILES["h100"]
LLAMA70B = ["model.preset=llama3.1-70b"]


@pytest.fixture(scope="module")
def llama70b() -> dict[str, Any]:
    """The plan of a newcomer's first try: llama3.1-70b on 8 nodes of 8 H100s, nothing else set."""
    return plan(load_config(overrides=LLAMA70B), 8, 8, H100, None, True, (None, LLAMA70B))


def _same_row(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("per_rank", "comm", "compute_time_s", "recompute_time_s", "step_time_s", "fits"):
        assert a[key] == b[key], key


def test_70b_on_64_gpus_recommends_a_model_parallel_layout_that_fits(
    llama70b: dict[str, Any],
) -> None:
    s = llama70b["search"]
    # Every searched key but the expert-parallel degree: a dense model has no experts to split.
    assert set(s["open"]) == set(SEARCHED) - {"parallel.ep"} and s["fixed"] == []
    rec = s["recommended"]
    assert rec is not None and rec["fits"]
    assert rec["per_rank"]["total_bytes"] <= HEADROOM * 80 * 2**30
    # The global batch of 16 does not split over 64 data-parallel ranks: only tensor or pipeline
    # parallelism runs it, and the search finds them.
    assert rec["settings"]["parallel.tp"] * rec["settings"]["parallel.pp"] > 1
    assert "parallel.tp=8" in rec["set"] or any(x.startswith("parallel.pp=") for x in rec["set"])
    # The fastest shown first, none faster than the recommended by more than the tie margin.
    times = [r["step_time_s"] for r in s["rows"]]
    assert times == sorted(times) and rec["step_time_s"] <= times[0] * 1.1 + 1e-12
    assert all(r["fits"] for r in s["rows"]) and len(s["rows"]) == 5
    # Far faster than the best data-parallel-only layout could be: none of those runs at all here.
    assert all("error" in r for r in llama70b["strategies"])
    assert s["seconds"] < 20, s["seconds"]  # about a second on an idle core
    text = format_plan(llama70b)
    assert "run it: dtlab train --nproc 8 --nnodes 8 --set model.preset=llama3.1-70b " in text
    assert "seq_len 2048 (data.seq_len default" in text
    assert llama70b["recommendation"].startswith(rec["label"])


def test_the_printed_line_loads_passes_the_world_checks_and_plans_to_the_recommended_row(
    llama70b: dict[str, Any],
) -> None:
    rec = llama70b["search"]["recommended"]
    words = shlex.split(rec["command"])
    assert words[:6] == ["dtlab", "train", "--nproc", "8", "--nnodes", "8"]
    assert words[6] == "--set" and words[7:] == [*LLAMA70B, *rec["set"]]
    config = load_config(overrides=words[7:])
    check_world(config, 64)
    again = plan(config, 8, 8, H100, None)
    # The recommended layout, given, is planned as the search costed it, and is still the choice.
    _same_row(again["search"]["as_given"], rec)
    assert again["search"]["as_given"]["label"] == rec["label"]
    assert again["search"]["recommended"]["label"] == rec["label"]
    assert again["search"]["recommended"]["set"] == []  # nothing left to change


def test_keys_the_user_gave_are_kept() -> None:
    given = ["model.preset=tiny", "parallel.tp=2", "train.precision=fp32", "data.seq_len=128"]
    result = plan(load_config(overrides=given), 4, 1, H100, None)
    s = result["search"]
    assert {"parallel.tp", "train.precision"} <= set(s["fixed"])
    assert "parallel.tp" not in s["open"] and "train.activation_checkpointing" in s["open"]
    for r in s["rows"]:
        assert r["settings"]["parallel.tp"] == 2 and r["precision"] == "fp32"
        assert "parallel.tp" not in r["overrides"] and "train.precision" not in r["overrides"]
    # Left open, bf16 wins on an H100 (15 times fp32's peak).
    free = plan(load_config(overrides=["model.preset=tiny", "data.seq_len=128"]), 4, 1, H100, None)
    assert free["search"]["recommended"]["precision"] == "bf16"


def test_nothing_fits_advises_only_what_the_search_did_not_try() -> None:
    config = load_config(overrides=["model.preset=debug", "data.seq_len=64"])
    usable = 1.1 * 2**20  # the state (1.0 MiB at least) fits, no step does
    result = plan(config, 2, 1, H100, usable / HEADROOM / 2**30)
    assert result["search"]["recommended"] is None
    advice = result["recommendation"]
    assert advice.startswith("nothing fits"), advice
    # Checkpointing, bf16 and smaller micro-batches were all tried: not advised again.
    assert "activation_checkpointing" not in advice and "precision" not in advice
    assert "micro_batch_size" not in advice and "data.seq_len" in advice
    assert result["search"]["rows"] and not any(r["fits"] for r in result["search"]["rows"])
    assert "none fits; the closest:" in format_plan(result)


def test_plan_json_carries_the_search_and_keeps_its_keys() -> None:
    proc = run_cli(
        "plan", "--nproc", "2", "--json", "--set", "model.preset=debug", "data.seq_len=64"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in ("model", "device", "assumptions", "strategies", "recommendation", "seq_len"):
        assert key in result
    s = result["search"]
    assert s["rows"] and s["layouts"] >= len(s["rows"]) and s["costed"] >= 1
    rec = s["recommended"]
    assert rec["command"].startswith(
        "dtlab train --nproc 2 --set model.preset=debug data.seq_len=64"
    )
    assert rec["command"].endswith(" ".join(rec["set"]))
    assert result["shape_sources"]["data.seq_len"] == "set"


def test_a_batch_no_layout_splits_is_a_clear_error() -> None:
    # 3 processes: no tensor-parallel degree of 3 splits the debug model's 4 heads, its 2 blocks
    # make no 3 stages, and 16 samples do not split over 3 data-parallel ranks.
    proc = run_cli("plan", "--nproc", "3", "--set", "model.preset=debug")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot be split over 3 ranks" in proc.stderr


def test_the_recommended_line_of_the_debug_model_trains(tmp_path: Path) -> None:
    """The line printed for the debug model on 4 processes trains (here on CPU, gloo)."""
    proc = run_cli("plan", "--nproc", "4", "--json", "--set", *FAST)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)["search"]["recommended"]
    assert rec["fits"] and rec["set"], rec
    metrics = train_run(tmp_path / "run", *rec["set"], nproc=4, steps=3)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["loss"] == m["loss"] and m["loss"] > 0 for m in metrics)
    # The run trained the recommended layout, as dtlab names layouts everywhere.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layout"] == rec["label"], (summary["layout"], rec["label"])
