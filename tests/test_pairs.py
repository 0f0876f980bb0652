"""Every pair of dtlab's features (dtlab.config.features): the config accepts it or refuses it with
its reason, the table in docs/architecture.md is the config's, and every accepted pair trains as
one process does on the same global batch (or, with DiLoCo or gradient compression, which change
the training, as that feature does alone on DDP).

The runs of every pair take minutes: a few pairs that no other test trains run in `make test`, the
others in `make test-all`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import read_metrics, run_cli
from dtlab.config.features import BASE, FEATURES, markdown, pair_overrides, pairs, verdict

DOC = Path(__file__).parents[1] / "docs" / "architecture.md"
STEPS = 3
# Features that change what is trained: a pair with one is held to that feature alone on DDP.
CHANGES = ("DiLoCo", "compression")
# Pairs run in make test (no other test trains them); every other accepted pair in make test-all.
FAST_PAIRS = {("FT", "compile"), ("EP/MoE", "alerts")}


def test_the_table_in_the_docs_is_the_configs() -> None:
    text = DOC.read_text()
    found = re.search(r"<!-- pairs:begin -->\n(.*?)<!-- pairs:end -->", text, re.S)
    assert found, "docs/architecture.md has no <!-- pairs:begin --> ... <!-- pairs:end --> block"
    assert found.group(1) == markdown(), "run: python -m dtlab.config.features"


@pytest.mark.parametrize(("a", "b"), pairs())
def test_a_refused_pair_names_the_setting_and_what_is_allowed(a: str, b: str) -> None:
    v = verdict(a, b)
    if v.accepted or v.reason is None:
        return
    keys = [o.split("=")[0] for o in (*FEATURES[a], *FEATURES[b])]
    assert any(k in v.reason for k in keys), (a, b, v.reason)
    assert "allow" in v.reason or "use " in v.reason, v.reason


def _accepted() -> list[Any]:
    out = []
    for a, b in pairs():
        v = verdict(a, b)
        if v.accepted:
            marks = [] if (a, b) in FAST_PAIRS else [pytest.mark.slow]
            out.append(pytest.param(a, b, v.nproc, marks=marks, id=f"{a}+{b}"))
    return out


_RUNS: dict[tuple[str, ...], list[dict[str, Any]]] = {}


def _train(where: Path, nproc: int, overrides: list[str]) -> list[dict[str, Any]]:
    key = (str(nproc), *overrides)
    if key not in _RUNS:
        proc = run_cli(
            "train", "--nproc", str(nproc), "--set", *overrides, f"train.steps={STEPS}",
            f"run.dir={where}", "run.comm_bytes=true", "run.log_every=1",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        # A fault-tolerant run: one run directory per replica group, each with every step's figures.
        ft = "parallel.fault_tolerance.enabled=true" in overrides
        _RUNS[key] = read_metrics(where / "replica-0" if ft else where)
    return _RUNS[key]


def _reference(tmp_path_factory: pytest.TempPathFactory, a: str, b: str) -> list[dict[str, Any]]:
    changed = [f for f in (a, b) if f in CHANGES]
    if changed:  # the feature alone, on DDP over 2 ranks (with CP's 2: over 1, DiLoCo's 1 replica)
        ranks = 1 if "CP" in (a, b) else 2
        return _train(tmp_path_factory.mktemp("ref"), ranks, pair_overrides("DDP", changed[0]))
    moe = ["model.preset=debug-moe"] if "EP/MoE" in (a, b) else []
    return _train(tmp_path_factory.mktemp("ref"), 1, [*BASE, *moe])


@pytest.mark.parametrize(("a", "b", "nproc"), _accepted())
def test_an_accepted_pair_trains_as_its_reference(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, a: str, b: str, nproc: int
) -> None:
    run_dir = tmp_path / "run"
    metrics = _train(run_dir, nproc, pair_overrides(a, b))
    ref = _reference(tmp_path_factory, a, b)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m, r in zip(metrics, ref, strict=True):
        if "DiLoCo" in (a, b) and "outer_sync" not in m:
            continue  # between syncs a record is one replica's
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-4), (a, b, m["step"], m, r)
        # What was counted, once: what crossed replicas and what went on the wire are parts of it.
        assert 0 <= m["cross_replica_bytes"] <= m["comm_bytes"], m
    summary = json.loads(
        ((run_dir / "replica-0") if "FT" in (a, b) else run_dir)
        .joinpath("summary.json")
        .read_text()
    )
    assert summary["steps"] == STEPS
