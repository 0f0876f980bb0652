"""Consecutive buckets of bounded size, as DDP's reducer cuts its gradients (a collective per bucket)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["buckets"]


def buckets(sizes: Sequence[int], limit: int) -> Iterator[list[int]]:
    """Indices of consecutive items whose ``sizes`` add up to at most ``limit`` bytes (an item larger
    than ``limit`` alone), in order."""
    bucket: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += n
    if bucket:
        yield bucket
