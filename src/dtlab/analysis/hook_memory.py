"""What a DDP communication hook holds (:mod:`dtlab.parallel.compression`): its state from step to
step, which the plan counts with the optimizer's, and what its step makes in backward and keeps to
the step's end, beside the state it replaces until the step is judged (committed or rolled back).

- ``powersgd``: torch's hook keeps, per gradient bucket, the error feedback (the bucket's size) and
  P and Q (for each gradient worth compressing, viewed as ``n x m``: ``n x r`` and ``m x r``, where
  ``(n + m) r`` is under half of ``n m``, torch's ``min_compression_rate``); each step makes a new
  error tensor, and :class:`dtlab.parallel.compression.PowerSGDGuard` keeps the old one and a copy
  of P and Q until the step commits.
- ``dct`` (``coding: topk``): the residual of each bucket (its size), the step's new one pending
  beside it until the commit.
- ``dct`` (``coding: quant``): EF21's estimates, this rank's and the ranks' mean, each the bucket's
  DCT chunks (padded to whole chunks), the step's new pair pending beside them.

Without error feedback only PowerSGD's P and Q are kept. All in the gradients' dtype (float32 under
DDP) on the rank's device, and none before PowerSGD's ``start_step`` (the plan counts the steady
state); the DCT's basis (``chunk_size`` squared, float32) is kept too. The hooks' own work on a
bucket in backward is not counted (for ``coding: quant``, whose decoding holds every rank's
coefficients at once, it is the step's peak where the buckets are large against the activations)."""

from __future__ import annotations

import math

from dtlab.analysis.shapes import ParamShape
from dtlab.config import Config
from dtlab.dims import ParallelDims

__all__ = ["ddp_bucket_numels", "hook_bytes"]

FP32 = 4


def ddp_bucket_numels(shapes: list[ParamShape], bucket_mb: float) -> list[int]:
    """DDP's gradient buckets' elements: float32 gradients of the parameters in reverse order, as
    torch's reducer assigns them, each bucket closed once it holds ``bucket_mb`` MiB or more."""
    cap = bucket_mb * 2**20
    out, held = [], 0
    for s in reversed(shapes):
        held += s.numel
        if held * FP32 >= cap:
            out.append(held)
            held = 0
    return [*out, held] if held else out


def _powersgd_pq(shapes: list[ParamShape], rank: int) -> int:
    """Elements of P and Q over the gradients torch's PowerSGD compresses."""
    out = 0
    for s in shapes:
        n = s.shape[0] if s.shape else 1
        m = s.numel // max(1, n)
        r = min(n, m, rank)
        if 2 * (n + m) * r < n * m:  # torch's _should_compress, min_compression_rate 2
            out += (n + m) * r
    return out


def hook_bytes(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> tuple[int, int]:
    """(bytes the rank's DDP hook keeps between steps, bytes its step makes in backward and keeps
    to the step's end) for the rank's parameters ``shapes`` (its tensor-parallel parts); (0, 0)
    without a hook that keeps state."""
    p = config.parallel
    kind, o = p.compression, p.compression_options
    if kind not in ("powersgd", "dct") or not dims.ddp_enabled or dims.shard_optimizer:
        return 0, 0
    if dims.pp_enabled or p.diloco.inner_steps or config.train.optimizer == "demo":
        return 0, 0  # no hook of these: FSDP2 beside a pipeline, or a local one
    buckets = ddp_bucket_numels(shapes, p.bucket_mb)
    if kind == "powersgd":
        pq = _powersgd_pq(shapes, o.rank)
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
