"""Tied embeddings (``model.tie_embeddings``) under tensor and pipeline parallelism train as one
process does.

The output projection reads the embedding's matrix. Under tensor parallelism each rank holds the
embedding's rows of its part of the vocabulary and computes the logits of those rows from them (left
split over the vocabulary for the vocabulary-parallel loss); the rows' gradient is the sum of the
lookup's and the projection's. In a pipeline the last stage holds a copy of the embedding under its
name: its gradient is added to the first stage's, the first stage steps it, and the copy receives the
new value. ``dtlab verify`` compares every layout with one process, step by step, with clipping active
on every step (a gradient counted twice in the norm would clip otherwise), and resumes the pipeline's
checkpoint on its own layout and on one process.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, verify_layouts
from dtlab.checkpoint.export import find_checkpoint, load_model_state
from dtlab.config import load_config
from dtlab.errors import ConfigError

TIED = ("model.tie_embeddings=true",)
STEPS = 4


def _verify(tmp_path: Path, layouts: str, *args: str) -> dict[str, Any]:
    """``dtlab verify --layouts LAYOUTS`` of FAST + tied embeddings + the overrides in ``args``
    (clipped, two micro-batches; ``--checks C`` first where given): every layout within loss 1e-5
    and parameters 1e-4 of one process, clipping active on every reference step, and every
    checkpoint the one tied matrix under its one name."""
    checks = tuple(args[:2]) if args[:1] == ("--checks",) else ()
    out = tmp_path / "verify"
    result = verify_layouts(out, layouts, *TIED, *args[len(checks) :], checks=checks, steps=STEPS)
    for run in sorted(out.glob("[0-9]-*")):  # the layouts' runs (a resume's too)
        names = set(load_model_state(find_checkpoint(run, warn=lambda _: None)))
        assert "tok_embeddings.weight" in names and "output.weight" not in names, (run, names)
    return result


def test_tied_embeddings_under_tensor_sequence_and_pipeline_parallelism(tmp_path: Path) -> None:
    result = _verify(tmp_path, "single,tp:2,sp:2,pp:2", "--checks", "resume")
    checks = {(r["layout"], c["check"]): c for r in result["state"] for c in r["checks"]}
    # The pipeline's checkpoint (the embedding saved by its first stage and its copy by the last,
    # under one name; the optimizer state by the first only) resumes exactly, also on one process.
    for check in ("resume", "resume on single"):
        c = checks[("pp:2", check)]
        assert c["ok"] and c["max_loss_diff"] <= 1e-5 and c["max_param_diff"] <= 1e-4, c


@pytest.mark.slow
def test_tied_embeddings_with_data_parallelism_and_other_schedules(tmp_path: Path) -> None:
    # FSDP2 gathers the rows of the root's embedding once for both of its uses and reduce-scatters
    # their summed gradient; a pipeline sends the copy's gradient after DDP's or FSDP's reduction.
    _verify(tmp_path, "single,fsdp:2xtp:2,fsdp:2xsp:2,pp:2xtp:2,ddp:2xpp:2,fsdp:2xpp:2")


@pytest.mark.slow
def test_tied_embeddings_with_several_stages_per_rank_and_four_stages(tmp_path: Path) -> None:
    _verify(
        tmp_path, "single,pp:2:interleaved_1f1b,pp:2:interleaved_zb,pp:2:looped_bfs",
        "model.n_layers=4", "parallel.pp_stages_per_rank=2", "parallel.pp_microbatches=2",
    )  # fmt: skip
    _verify(tmp_path / "four", "single,pp:4", "model.n_layers=4", "parallel.pp_microbatches=4")


def test_tensor_and_pipeline_parallelism_accept_tied_embeddings() -> None:
    tp = load_config(overrides=[*FAST, *TIED, "parallel.tp=2", "parallel.sequence_parallel=true"])
    assert tp.model.tie_embeddings and tp.parallel.tp == 2
    pp = load_config(overrides=[*FAST, *TIED, "parallel.pp=2", "parallel.pp_schedule=gpipe"])
    assert pp.model.tie_embeddings and pp.parallel.pp == 2


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_schedule_refuses_tied_embeddings(schedule: str) -> None:
    # A V holds the first and the last stage on one rank: the copy is kept across two ranks only.
    message = (
        f"model.tie_embeddings = true is not supported with parallel.pp_schedule = '{schedule}': a "
        "V places the first and the last stage on one rank"
    )
    v = [
        *FAST,
        "parallel.pp=2",
        f"parallel.pp_schedule={schedule}",
        "parallel.pp_stages_per_rank=2",
    ]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=[*v, *TIED, "model.n_layers=4"])
    load_config(overrides=[*v, "model.n_layers=4"])
