"""Tensor parallelism on the MLX engine (``parallel.tp``): each block's matrices split over the
tensor-parallel ranks with MLX's own distributed layers, as the torch engine splits them.

q/k/v and w1/w3 are column-split (:class:`ColumnLinear`, MLX's ``AllToShardedLinear``: each rank
computes its heads, or its part of the hidden features; the gradient of their common input is summed
over the group), wo and w2 row-split (:class:`RowLinear`, ``ShardedToAllLinear``: each rank's partial
product, summed over the group). Every rank of a tensor-parallel group thus holds the same
activations between blocks and the same loss. Unlike the torch engine, which splits the embedding
and the output over the vocabulary, the MLX engine keeps them (and the norms) whole on every rank:
their gradients are the same on every rank of the group (their inputs and the gradients reaching
them are), so they are updated alike.

Checkpoints hold whole tensors (:func:`gather`), so a run resumes at any ``tp``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear, sum_gradients

from dtlab.errors import DtlabError

__all__ = [
    "ColumnLinear",
    "RowLinear",
    "gather",
    "shard",
    "shard_blocks",
    "split_axes",
    "tp_groups",
]

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


class ColumnLinear(AllToShardedLinear):
    """MLX's column-split linear layer, its weight cast to the input's dtype (bf16 compute over
    float32 master weights, as :class:`dtlab.mlx.model.Linear`)."""

    def __call__(self, x: mx.array) -> mx.array:
        x = sum_gradients(self.group)(x)
        return x @ self["weight"].astype(x.dtype).T


class RowLinear(ShardedToAllLinear):
    """MLX's row-split linear layer, its weight cast to the input's dtype."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x @ self["weight"].astype(x.dtype).T, group=self.group)


def split_axes(names: list[str]) -> dict[str, int]:
    """The split parameters among ``names`` and the axis each is split along (0: the output
    features, column-split; 1: the input features, row-split)."""
    axes = {}
    for name in names:
        module = name.rsplit(".", 1)[0]
        if module.endswith(COLUMN):
            axes[name] = 0
        elif module.endswith(ROW):
            axes[name] = 1
    return axes


def shard_blocks(model: Any, group: Any) -> None:
    """Split every block of the MLX ``model`` over ``group`` in place: its matrices, and the heads
    each rank's attention computes (``n_heads`` and ``n_kv_heads`` divided by the group's size)."""
    n = group.size()
    for block in model.layers:
        attention, ffn = block.attention, block.feed_forward
        for name in ("wq", "wk", "wv"):
            setattr(
                attention, name, ColumnLinear.from_linear(getattr(attention, name), group=group)
            )
        attention.wo = RowLinear.from_linear(attention.wo, group=group)
        attention.n_heads //= n
        attention.n_kv_heads //= n
        ffn.w1 = ColumnLinear.from_linear(ffn.w1, group=group)
        ffn.w3 = ColumnLinear.from_linear(ffn.w3, group=group)
        ffn.w2 = RowLinear.from_linear(ffn.w2, group=group)
    mx.eval(model.parameters())


def shard(
    arrays: dict[str, mx.array], axes: dict[str, int], rank: int, n: int
) -> dict[str, mx.array]:
    """This rank's part of whole ``arrays`` (by name; those in ``axes`` split along their axis)."""
    out = {}
    for name, a in arrays.items():
        axis = axes.get(name)
        out[name] = a if axis is None else mx.contiguous(mx.split(a, n, axis=axis)[rank])
    return out


def gather(
    arrays: dict[str, mx.array], axes: dict[str, int], group: Any, run: Any
) -> dict[str, mx.array]:
    """Whole ``arrays`` from every rank's part (a collective: every rank of ``group`` calls it, and
    gets them). ``run(what, fn)`` waits on each gather (the engine's watchdog)."""
    out = {}
    for name, a in arrays.items():
        axis = axes.get(name)
        if axis is None:
            out[name] = a
            continue
        # all_gather stacks along axis 0: a row-split weight is gathered transposed.
        part = a if axis == 0 else a.T
        whole = mx.distributed.all_gather(mx.contiguous(part), group=group)
        out[name] = run("the checkpoint's all_gather", lambda w=whole, t=axis: _evaluated(w, t))
    return out


def _evaluated(whole: mx.array, axis: int) -> mx.array:
    whole = whole if axis == 0 else mx.contiguous(whole.T)
    mx.eval(whole)
    return whole


def tp_groups(group: Any, tp: int, backend: str) -> tuple[Any, Any]:
    """(tensor-parallel group, data-parallel group) of this rank for ``tp`` ranks per model copy:
    ranks ``k·tp .. k·tp + tp - 1`` hold copy ``k`` (the torch engine's mesh, ``tp`` innermost).
    With ``tp`` the whole world there is no data-parallel group (None); otherwise the world is split,
    which MLX's ring cannot do."""
    world, rank = group.size(), group.rank()
    if tp == world:
        return group, None
    try:
        tp_group = group.split(rank // tp, rank % tp)
        dp_group = group.split(rank % tp, rank // tp)
    except RuntimeError as e:
        raise DtlabError(
            f"parallel.tp = {tp} on {world} MLX ranks needs tensor- and data-parallel groups, which "
            f"the {backend!r} backend cannot make ({e}); use parallel.backend = 'mpi' (Open MPI), "
            f"or parallel.tp = {world} (tensor parallelism alone)"
        ) from None
    return tp_group, dp_group
