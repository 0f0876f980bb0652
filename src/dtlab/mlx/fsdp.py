"""Fully sharded data parallelism on the MLX engine (``parallel.strategy: fsdp``) through MLX's own
``mlx.nn.layers.distributed.fully_shard``.

Every block is a ``FullyShardedModule`` of its own, and so is the model around them (the embedding,
the final norm and the output): each rank holds a contiguous 1/N of every parameter's rows (axis 0),
its gradient and its AdamW moments. A block's parameters are all-gathered when it runs and their
gradients reduce-scattered in the backward (MLX's ``sum_scatter`` divided by N: the ranks' mean, as
DDP's all-reduce gives), so no gradient all-reduce follows the step. The model's own parameters are
gathered for the whole forward (they are read before and after the blocks).

Names: a wrapper puts its module under ``module``; :func:`plain_name` strips those segments, so
checkpoints keep the model's names (and whole tensors: :func:`dtlab.mlx.tensor.gather` along axis 0).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import mlx.core as mx
from mlx.nn.layers.distributed import FullyShardedModule, fully_shard
from mlx.utils import tree_flatten

from dtlab.errors import DtlabError
from dtlab.metrics.logging import logger

__all__ = ["has_sum_scatter", "plain_name", "shard_model"]


def has_sum_scatter(group: Any) -> bool:
    """Whether ``group``'s backend reduce-scatters (MLX 0.32's ring and MPI backends do not:
    ``[ring] sum_scatter not supported``, ``[mpi] sum_scatter not yet implemented``). Every rank
    calls it (a collective where it is supported)."""
    n = group.size()
    try:
        mx.eval(mx.distributed.sum_scatter(mx.zeros((n,)), group=group))
    except (RuntimeError, ValueError):
        return False
    return True


def _gather_all_sum(group: Any, full_shapes: list[Any], shard_sizes: list[int]) -> Any:
    """MLX's ``fully_shard`` gather (every rank's rows of each parameter, all-gathered at once), its
    backward a sum over the ranks followed by this rank's rows, divided by N: MLX's reduce-scatter,
    for backends without one (the ranks' mean, in twice a reduce-scatter's bytes)."""
    n, rank = group.size(), group.rank()
    cuts = list(accumulate(shard_sizes))[:-1]
    shard_shapes = [(shape[0] // n, *shape[1:]) for shape in full_shapes]

    @mx.custom_function
    def gather(shards: list[mx.array]) -> list[mx.array]:
        flat = mx.concatenate([s.reshape(1, -1) for s in shards], axis=1)
        full = mx.distributed.all_gather(flat, group=group)
        parts = mx.split(full, cuts, axis=1)
        return [p.reshape(shape) for p, shape in zip(parts, full_shapes, strict=True)]

    @gather.vjp
    def gather_vjp(shards: list[mx.array], cotangents: list[mx.array], _: Any) -> list[mx.array]:
        rows = mx.concatenate([c.reshape(n, -1) for c in cotangents], axis=1)
        mine = mx.distributed.all_sum(rows, group=group)[rank] / n
        parts = mx.split(mine, cuts, axis=0)
        return [
            p.reshape(shape).astype(s.dtype)
            for p, shape, s in zip(parts, shard_shapes, shards, strict=True)
        ]

    return gather


def _wrap(module: Any, group: Any, reduce_scatters: bool) -> Any:
    """``fully_shard(module)``, its gradients reduced by :func:`_gather_all_sum` where the backend
    has no reduce-scatter."""
    wrapped = fully_shard(module, group=group)
    if reduce_scatters or not isinstance(wrapped, FullyShardedModule):
        return wrapped
    shards: list[tuple[str, Any]] = tree_flatten(wrapped.module.filter_and_map(  # type: ignore[assignment]
        lambda m, k, v: not isinstance(v, FullyShardedModule) and m.valid_parameter_filter(m, k, v)
    ))  # fmt: skip
    n = group.size()
    full = [(a.shape[0] * n, *a.shape[1:]) for _, a in shards]
    wrapped._gather_fn = _gather_all_sum(group, full, [a.size for _, a in shards])
    return wrapped


def plain_name(name: str) -> str:
    """The model's name of a parameter of the wrapped model (``module`` segments dropped: no name of
    the model has one)."""
    return ".".join(part for part in name.split(".") if part != "module")


def shard_model(model: Any, group: Any) -> Any:
    """``model`` with every block and then the model itself wrapped by ``fully_shard`` over
    ``group`` (each parameter's rows split over its ranks); returns the outer wrapper. A parameter
    whose rows do not split evenly is an error that names it."""
    n = group.size()
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    shapes = {name: tuple(a.shape) for name, a in flat}
    uneven = [f"{name} {shape}" for name, shape in shapes.items() if not shape or shape[0] % n]
    if uneven:
        raise DtlabError(
            f"parallel.strategy = 'fsdp' on {n} MLX ranks splits every parameter's first dimension "
            f"over them, and these do not divide by {n}: {', '.join(uneven[:4])}; use a number of "
            "ranks that divides them, or parallel.strategy = 'ddp'"
        )
    native = has_sum_scatter(group)
    if not native and group.rank() == 0:
        logger.info(
            "fsdp on MLX: this backend has no reduce-scatter; each gradient is summed over the %d "
            "ranks (all_sum) and each keeps its rows: the same mean, in twice the bytes",
            n,
        )
    for i, block in enumerate(model.layers):
        model.layers[i] = _wrap(block, group, native)
    wrapped = _wrap(model, group, native)
    mx.eval(wrapped.parameters())
    return wrapped
