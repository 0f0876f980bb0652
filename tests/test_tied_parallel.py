"""Tied embeddings (``model.tie_embeddings``) under tensor parallelism train as one process does.

The output projection reads the embedding's matrix. Under tensor parallelism each rank holds the
embedding's rows of its part of the vocabulary, and computes the logits of those rows from them
(left split over the vocabulary for the vocabulary-parallel loss); the rows' gradient is the sum of
the lookup's and the projection's. ``dtlab verify`` compares every layout with one process, step by
step, with clipping active on every step (a wrong gradient norm would clip otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import CLIP, FAST, read_metrics, run_cli
from dtlab.checkpoint.export import find_checkpoint, load_model_state
from dtlab.config import load_config

TIED = ("model.tie_embeddings=true",)
STEPS = 4


def _verify(tmp_path: Path, layouts: str, *overrides: str) -> dict[str, Any]:
    """``dtlab verify --layouts LAYOUTS`` of FAST + tied embeddings + ``overrides`` (clipped, two
    micro-batches): every layout within loss 1e-5 and parameters 1e-4 of one process, clipping
    active on every reference step, and every checkpoint the one tied matrix under its one name."""
    out = tmp_path / "verify"
    proc = run_cli(
        "verify", "--layouts", layouts, "--steps", str(STEPS), "--out", str(out), "--set", *FAST,
        "train.micro_batch_size=2", f"train.grad_clip={CLIP}", *TIED, *overrides,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads((out / "verify.json").read_text())
    assert result["ok"] and [r["layout"] for r in result["rows"]] == layouts.split(",")[1:]
    for row in result["rows"]:
        assert row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-4, row
    reference = read_metrics(next(out.glob("0-*")))
    assert all(m["grad_norm"] > CLIP for m in reference), [m["grad_norm"] for m in reference]
    for run in sorted(out.glob("[0-9]-*")):
        names = set(load_model_state(find_checkpoint(run, warn=lambda _: None)))
        assert "tok_embeddings.weight" in names and "output.weight" not in names, (run, names)
    return result


def test_tied_embeddings_under_tensor_and_sequence_parallelism_train_as_one_process(
    tmp_path: Path,
) -> None:
    _verify(tmp_path, "single,tp:2,sp:2")


@pytest.mark.slow
def test_tied_embeddings_under_fsdp_x_tensor_parallelism(tmp_path: Path) -> None:
    # FSDP2 gathers the rows of the root's embedding once for both of its uses, and
    # reduce-scatters their summed gradient.
    _verify(tmp_path, "single,fsdp:2xtp:2,fsdp:2xsp:2")


def test_tensor_parallelism_accepts_tied_embeddings() -> None:
    config = load_config(
        overrides=[*FAST, *TIED, "parallel.tp=2", "parallel.sequence_parallel=true"]
    )
    assert config.model.tie_embeddings and config.parallel.tp == 2
