"""Document masks (``data.document_mask``) with context parallelism: each rank holds its zigzag chunks
of a window, the documents are the whole window's; the ring's blocks of the mask and the all-to-all's
whole mask give one process's masked attention, forward and backward, and its training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import FAST, TOL, Metrics, assert_same_training, run_worker, train_run
from dtlab.config import load_config
from dtlab.data.sources import build_data

MASKED = ("data.document_mask=true",)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_context_parallel_attention_within_documents_equals_one_process(
    cp: int, method: str
) -> None:
    # float64, grouped key/value heads; windows whose documents end inside chunks and span whole
    # chunks, so that the ring meets blocks no query attends and rows with no key in a block.
    run_worker("cp_document_mask_worker.py", cp, method)


def _separators_inside_chunks(steps: int, cp: int) -> int:
    """The separators of FAST's training windows over ``steps`` steps that end a document inside
    one of the ``2 cp`` chunks (not at a chunk's end)."""
    config = load_config(overrides=[*FAST, "data.document_mask=true"])
    source = build_data(config).train
    chunk = config.seq_len // (2 * cp)
    found = 0
    for i in range(steps * config.train.global_batch_size):
        where = np.nonzero(source.sample(i)[:-1] == 0)[0]
        found += int(np.sum(where % chunk != chunk - 1))
    return found


@pytest.fixture(scope="module")
def masked_reference(single_reference: Any) -> Metrics:
    """One process with the document mask, checked to differ from one without it by far more than
    the training comparison's tolerance: a layout that dropped the mask would fail it."""
    assert _separators_inside_chunks(12, cp=2) >= 5  # documents end inside the cp ranks' chunks
    reference: Metrics = single_reference(*MASKED)
    plain: Metrics = single_reference()
    worst = max(abs(m["loss"] - p["loss"]) for m, p in zip(reference, plain, strict=True))
    assert worst > 10 * TOL, worst
    return reference


@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        (["parallel.cp=2"], 2),
        (["parallel.cp=2", "parallel.cp_method=alltoall"], 2),
        (["parallel.strategy=fsdp", "parallel.cp=2"], 4),  # sharded over the 4 data x cp ranks
    ],
    ids=["cp2-ring", "cp2-alltoall", "fsdp2xcp2"],
)
def test_context_parallel_training_within_documents_equals_one_process(
    tmp_path: Path, masked_reference: Metrics, layout: list[str], nproc: int
) -> None:
    # Each rank gathers its window's tokens once per forward for the documents of the whole window.
    run = train_run(tmp_path / "run", "parallel.strategy=ddp", *MASKED, *layout, nproc=nproc)
    assert_same_training(run, masked_reference)


def test_alltoalls_whole_mask_is_made_once_a_forward() -> None:
    # Every layer of a forward gets the same additive mask of the same documents (its backward keeps
    # that one, not a copy of its own), equal to the boolean mask it stands for.
    from dtlab.models.sequence import document_ids, same_document
    from dtlab.parallel.context import whole_mask

    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4]])
    documents = document_ids(tokens, 0)
    first, again = whole_mask(documents, torch.float32), whole_mask(documents, torch.float32)
    assert first is again
    allowed = same_document(documents, documents, causal=True)
    assert torch.equal(first == 0, allowed) and bool((first[~allowed] == float("-inf")).all())
    assert (
        whole_mask(document_ids(tokens.clone(), 0), torch.float32) is not first
    )  # another forward
