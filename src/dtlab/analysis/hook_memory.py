"""What a DDP communication hook holds (:mod:`dtlab.parallel.compression`): its state from step to
step, which the plan counts with the optimizer's, and what its step makes in backward and keeps to
the step's end, beside the state it replaces until the step is judged (committed or rolled back).

- ``powersgd``: torch's hook keeps, per gradient bucket, the error feedback (the bucket's size) and
  (with ``warm_start``) P and Q (for each gradient worth compressing, viewed as ``n x m``: ``n x r``
  and ``m x r``, where ``(n + m) r`` is under half of ``n m``, torch's ``min_compression_rate``);
  each step makes a new error tensor, and :class:`dtlab.parallel.compression.PowerSGDGuard` keeps
  the old one and a copy of P and Q until the step commits.
- ``dct`` (``coding: topk``): the residual of each bucket (its size), the step's new one pending
  beside it until the commit.
- ``dct`` (``coding: quant``): EF21's estimates, this rank's and the ranks' mean, each the bucket's
  DCT chunks (padded to whole chunks), the step's new pair pending beside them.

Without error feedback only PowerSGD's P and Q are kept. All in the gradients' dtype (float32 under
DDP) on the rank's device, and none before PowerSGD's ``start_step`` (the plan counts the steady
state); the DCT's basis (``chunk_size`` squared, float32) is kept too. Under a hook DDP keeps one
bucket of the whole model (:func:`hook_buckets`): the DCT hook's work on it, at backward's end, is
played on fake tensors, and torch's PowerSGD hook's counted from its source (:func:`hook_work`)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from dtlab.analysis.played import play
from dtlab.analysis.shapes import ParamShape
from dtlab.config import Config
from dtlab.dims import ParallelDims

__all__ = ["hook_buckets", "hook_bytes", "hook_work", "stateful_hook"]

FP32 = 4


def stateful_hook(config: Config, dims: ParallelDims) -> bool:
    """Whether the rank's DDP runs a hook that keeps state from step to step (PowerSGD, the DCT),
    and with it DDP's first bucket layout (:func:`hook_buckets`)."""
    p = config.parallel
    if p.compression not in ("powersgd", "dct") or not dims.ddp_enabled or dims.shard_optimizer:
        return False
    # No hook of these: FSDP2 beside a pipeline, or a local one (DiLoCo, DeMo).
    return not (dims.pp_enabled or p.diloco.inner_steps or config.train.optimizer == "demo")


def hook_buckets(shapes: list[ParamShape]) -> list[int]:
    """The gradient buckets a compression hook works on: DDP's first layout, kept for the whole run
    (:func:`dtlab.parallel.compression._keep_bucket_layout`), which torch builds as one bucket of
    every gradient (it buckets by ``bucket_mb`` only at its first rebuild, where unused parameters
    are not searched for): the hook runs once, at backward's end, on the whole model."""
    return [sum(s.numel for s in shapes)]


def _powersgd_split(shapes: list[ParamShape], rank: int) -> tuple[int, int]:
    """(Elements of P and Q over the gradients torch's PowerSGD compresses, elements of the
    gradients it leaves whole: the vectors, and matrices too small to gain)."""
    pq = whole = 0
    for s in shapes:
        n = s.shape[0] if s.shape else 1
        m = s.numel // max(1, n)
        r = min(n, m, rank)
        if 2 * (n + m) * r < n * m:  # torch's _should_compress, min_compression_rate 2
            pq += (n + m) * r
        else:
            whole += s.numel
    return pq, whole


@functools.lru_cache(maxsize=256)
def _played_bucket(numel: int, coding: str, chunk: int, topk: int, bits: int,
                   error_feedback: bool, world: int) -> int:  # fmt: skip
    """The most the DCT hook's work on one bucket of ``numel`` float32 gradients holds at once
    beyond the bucket (its new state included, the old not), played on fake tensors with a gather
    that sends nothing: exact for what the trainer's code makes and frees."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtlab.parallel import compression as c

    def gather(*_: Any, **__: Any) -> None:
        return None

    c.dct_basis_on(chunk, torch.device("cpu"))  # built for real outside the fake mode (cached)
    with FakeTensorMode(allow_non_fake_inputs=True):
        buf = torch.empty(numel)
        rows = math.ceil(numel / chunk)
        if coding == "quant":
            q = c.QuantDCTState(chunk, bits, error_feedback)
            if error_feedback:  # the steady state: the estimates of the step before
                q.own[0], q.mean[0] = torch.zeros(rows, chunk), torch.zeros(rows, chunk)
            return play(lambda: c.quant_dct_reduce(buf, q, 0, world, 0, gather), buf)
        d = c.DCTState(chunk, topk, error_feedback)
        if error_feedback:
            d.residuals[0] = torch.zeros(numel)
        return play(lambda: c.dct_reduce(buf, d, 0, world, gather), buf)


def hook_work(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> int:
    """What the DCT's or PowerSGD's hook holds at once as it works on its bucket at backward's end
    (under a hook the whole model's, :func:`hook_buckets`), its new state included; 0 for other
    hooks.

    torch's PowerSGD hook (read from its source, measured by a real gloo run's MemTracker): with
    error feedback a copy of the bucket (the gradients with the old error added), kept until the
    new error is made from it; the gradients it leaves whole, concatenated for their all-reduce;
    and the new state (the new error beside the copy, and P and Q: the guard's copies of the
    old ones, or without ``warm_start`` new ones)."""
    p = config.parallel
    if p.compression not in ("dct", "powersgd") or not stateful_hook(config, dims):
        return 0
    o = p.compression_options
    (bucket,) = hook_buckets(shapes)
    if p.compression == "powersgd":
        pq, whole = _powersgd_split(shapes, o.rank)
        error = bucket if o.error_feedback else 0  # the bucket's copy, and the new error
        return FP32 * (2 * error + whole + pq)
    return _played_bucket(bucket, o.coding, o.chunk_size, o.topk, o.bits, o.error_feedback,
                          dims.dp)  # fmt: skip


def hook_bytes(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> tuple[int, int]:
    """(bytes the rank's DDP hook keeps between steps, bytes its step makes in backward and keeps
    to the step's end) for the rank's parameters ``shapes`` (its tensor-parallel parts); (0, 0)
    without a hook that keeps state."""
    p = config.parallel
    kind, o = p.compression, p.compression_options
    if not stateful_hook(config, dims):
        return 0, 0
    buckets = hook_buckets(shapes)
    if kind == "powersgd":
        # P and Q are kept from step to step (and copied by the guard each step) with warm_start
        # only; without it the hook makes them anew and drops them at its end.
        pq = _powersgd_split(shapes, o.rank)[0] if o.warm_start else 0
        error = sum(buckets) if o.error_feedback else 0
        return FP32 * (error + pq), FP32 * (error + pq)
    c = o.chunk_size
    basis = FP32 * c * c  # the DCT's matrix, built once on the device
    if not o.error_feedback:
        return basis, 0
    if o.coding == "quant":
        estimates = FP32 * 2 * sum(math.ceil(n / c) * c for n in buckets)
        return basis + estimates, estimates
    return basis + FP32 * sum(buckets), FP32 * sum(buckets)
