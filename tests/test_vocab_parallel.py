"""The embedding split over the vocabulary under tensor parallelism (dtlab.parallel.vocab)."""

from __future__ import annotations

import pytest
from torch import nn

from conftest import run_worker
from dtlab.parallel.vocab import VocabParallel


def test_each_rank_embeds_its_rows_and_its_gradient_is_its_rows_only() -> None:
    """On two gloo ranks, even and uneven vocabularies, replicated and sequence-split outputs: one
    process's output, and one process's gradient rows held in a storage of those rows only."""
    run_worker("vocab_worker.py", 2)


def test_only_a_plain_embedding_is_split() -> None:
    """An embedding with a padding row or a norm bound would lose it: refused with the reason."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.__new__(DeviceMesh)  # never reached: refused before the mesh is read
    with pytest.raises(ValueError, match="padding_idx"):
        VocabParallel(None)._apply(nn.Embedding(8, 2, padding_idx=0), mesh)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Embedding, got Linear"):
        VocabParallel(None)._apply(nn.Linear(2, 2), mesh)  # type: ignore[arg-type]
