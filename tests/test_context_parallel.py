"""Context parallelism's ring attention (:mod:`dtlab.parallel.context`): each sequence split over the
ranks in zigzag chunks, equal to one process's causal attention, forward and backward."""

from __future__ import annotations

import pytest
import torch

from conftest import run_worker
from dtlab.parallel.context import shard_sequence, unshard_sequence, zigzag_chunks


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(16).reshape(1, 16)
    parts = [shard_sequence(x, 4, r) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(unshard_sequence(parts), x)
    with pytest.raises(ValueError, match="a sequence of 12 does not split into 8 chunks"):
        shard_sequence(torch.zeros(1, 12), 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_context_parallel_attention_equals_one_process_forward_and_backward(
    cp: int, dtype: str, method: str
) -> None:
    run_worker("ring_attention_worker.py", cp, dtype, method, "4")


@pytest.mark.parametrize("kv_heads", ["2", "1"])
def test_alltoall_attention_with_grouped_key_value_heads(kv_heads: str) -> None:
    # 4 query heads over 2 ranks: 2 key/value heads split with them; 1 is expanded first.
    run_worker("ring_attention_worker.py", 2, "float64", "alltoall", kv_heads)
