"""Training features in one process: the stdlib corpus, torch.compile, and the summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import train_run


def test_stdlib_corpus_trains(tmp_path: Path) -> None:
    run = train_run(tmp_path / "stdlib", "data.source=stdlib", "train.lr=1e-2", steps=15)
    # Bytes of Python source: whitespace and keywords alone are easy to learn.
    assert run[-1]["loss"] < run[0]["loss"] - 1.0


def test_compile_matches_eager(tmp_path: Path, reference_run: list[dict[str, Any]]) -> None:
    run = train_run(tmp_path / "compiled", "train.compile=true")
    for m, r in zip(run, reference_run, strict=True):
        # Inductor fuses and reorders reductions: equal up to a small float32 difference.
        assert m["loss"] == pytest.approx(r["loss"], abs=2e-3)
    assert run[-1]["loss"] < run[0]["loss"] - 0.3
