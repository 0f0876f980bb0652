"""``python -m dtlab.bench.gputruth``: its CPU smoke (the harness end to end on the debug model) and
its refusal of a GPU grid without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtlab.bench import gputruth


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke; a GPU runs the real grid")
def test_the_smoke_grid_trains_each_run_and_the_plan_predicts_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run of the smoke grid trains through dtlab.train in this process (one compiled) and
    leaves its figures; ``compare`` gives each the plan's peak and step beside them."""
    out = tmp_path / "truth.json"
    assert gputruth.main(["measure", "--grid", "smoke", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [r["name"] for r in runs] == [r.name for r in gputruth.grid("smoke")]
    for r in runs:
        assert r["ok"], r
        assert r["peak_allocated_bytes"] > 0 and r["median_step_time_s"] > 0
        assert len(r["losses"]) == r["steps"] and all(x == x for x in r["losses"])  # not NaN
    compared = tmp_path / "compared.json"
    assert gputruth.main(["compare", "--json", str(out), "--out", str(compared)]) == 0
    rows = json.loads(compared.read_text())["compared"]
    assert [r["name"] for r in rows] == [r["name"] for r in runs]
    assert all(r["plan"]["per_rank"]["total_bytes"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert all(r["name"] in printed for r in runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_the_full_grid_needs_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gputruth.main(["measure", "--json", str(tmp_path / "x.json")]) == 2
    assert "--grid full: needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--grid 'nope': allowed: full, smoke"):
        gputruth.grid("nope")
