"""What CUDA's fused attention kernels allocate beside their outputs while they run, from PyTorch's
sources (``aten/src/ATen/native/transformers/cuda``): the sizes ``dtlab plan`` counts for a GPU and
``dtlab plan --check`` holds for one (:mod:`dtlab.analysis.check_ring`). Nothing here imports torch."""

from __future__ import annotations

__all__ = ["efficient_blocks", "efficient_workspace_bytes", "flash_backward_rows", "round_up"]


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def flash_backward_rows(tq: int, head_dim: int) -> tuple[int, int]:
    """(query rows, head width) of flash's backward accumulators: the rows rounded up to 128, the
    head dimension to 32 (to 64 past 128)."""
    return round_up(tq, 128), round_up(head_dim, 32 if head_dim <= 128 else 64)


def efficient_blocks(head_dim: int) -> tuple[int, int]:
    """The memory-efficient backward's (query, key) block sizes for float32 on sm80 and newer: 128 x
    64 for a head dimension of 65 to 128, 64 x 64 otherwise (the first kernel of its dispatch
    order whose shared memory fits)."""
    return (128, 64) if 64 < head_dim <= 128 else (64, 64)


def efficient_workspace_bytes(batch: int, heads: int, tq: int, head_dim: int) -> int:
    """The memory-efficient backward's workspace in float32: one accumulator of the query gradient
    per block of queries and of the head dimension, each with a 16-byte header of locks."""
    i, j = efficient_blocks(head_dim)
    return batch * heads * -(-tq // i) * -(-head_dim // j) * (16 + 4 * i * j)
