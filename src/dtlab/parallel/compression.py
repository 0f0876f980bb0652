"""Gradient compression for DDP (communication hooks) and FSDP/HSDP (reduce dtype).

- ``fp16`` / ``bf16``: DDP all-reduces each bucket in half precision (a hook that, unlike torch's bf16
  one, works on gloo too); FSDP and HSDP
  reduce-scatter (and all-reduce) gradients in that dtype (``MixedPrecisionPolicy.reduce_dtype``), and
  otherwise in float32, also when ``train.precision`` bf16/fp16 has them gather and compute in half
  precision.
- ``powersgd``: torch's PowerSGD hook (Vogels et al. 2019): each gradient matrix is approximated by
  ``P Q^T`` of rank r; only P and Q are all-reduced; error feedback keeps what the approximation missed.
- ``dct``: dtlab's hook in the spirit of DeMo (arXiv 2411.19870): the bucket is cut into chunks, each chunk
  goes through an orthonormal DCT-II, the ``topk`` largest coefficients of each chunk are exchanged as
  (index, value) pairs with an all-gather, averaged, and transformed back. With error feedback the
  coefficients not sent stay in a per-bucket residual and are added to the next step's gradient.
  With ``coding: quant`` every coefficient is sent instead, quantised to ``bits`` bits with one bfloat16
  step per chunk, and error feedback is EF21 (Richtarik et al. 2021): each rank keeps an estimate ``h`` of
  its own (transformed) gradient and sends the quantised difference ``g - h``; all ranks keep the same
  estimate ``H`` of the mean, and the hook returns ``H``. The optimizer sees a dense, smoothly tracked
  gradient rather than the bursts of top-k error feedback, which AdamW's second moment handles badly.

Every hook returns the *average* over ranks, like DDP's own all-reduce.

A hook runs during backward, before the step is judged (finite loss and gradients, no fp16 overflow). So
no hook folds a step into its state directly: the new state waits in ``pending`` (PowerSGD: the old one
in a backup) until the training step calls :meth:`CompressionState.commit` for a step it takes or
:meth:`CompressionState.rollback` for one it skips. State is kept in unscaled gradient units (under fp16
a hook sees gradients multiplied by the loss scale, which changes over the run).
"""

# No `from __future__ import annotations` here: DDP checks a hook's annotations against the real
# dist.GradBucket and torch.futures.Future types, not their names.
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from dtlab.config import Config
from dtlab.parallel.dist import all_gather_flat
from dtlab.runtime.placement import placed_state

# How a hook gathers a flat tensor from every rank (``all_gather_flat``'s signature): the plan plays a
# hook's work on a bucket with one that sends nothing (dtlab.analysis.hook_memory).
Gather = Callable[..., Any]


def dct_basis(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` [n, n]: ``D @ x`` transforms, ``D.T @ c`` inverts (D D^T = I)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi / n * (i + 0.5) * k) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype)


@functools.lru_cache(maxsize=16)
def dct_basis_on(n: int, device: torch.device) -> torch.Tensor:
    """The float32 ``dct_basis(n)`` on ``device``, built once (read-only: callers never modify it)."""
    return dct_basis(n).to(device)


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    """``t * scale`` as a new tensor; ``t`` itself when the scale is 1 (no work, bit-exact)."""
    return t if scale == 1.0 else t * scale


@dataclass
class DCTState:
    """The dct hook's settings and its error-feedback residuals (one per DDP bucket)."""

    chunk_size: int
    topk: int
    error_feedback: bool
    group: Any = None
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # this step's, until committed
    scale: float = 1.0  # the loss scale of the gradients the hook sees (fp16)

    def basis(self, device: torch.device) -> torch.Tensor:
        return dct_basis_on(self.chunk_size, device)

    def commit(self) -> None:
        self.residuals.update(self.pending)
        self.pending.clear()

    def rollback(self) -> None:
        self.pending.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual.{i}": r for i, r in sorted(self.residuals.items())}

    def load_state_dict(
        self, state: dict[str, torch.Tensor], device: torch.device | None = None
    ) -> None:
        """The residuals of ``state``, each a copy of its own on ``device`` (the device of the buckets
        they are added to; None: where ``state`` holds them)."""
        placed = placed_state(state, device)
        self.residuals = {int(k.split(".")[1]): v for k, v in placed.items()}
        self.pending.clear()


def dct_compress(
    grad: torch.Tensor, state: DCTState, bucket_index: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Top-k DCT coefficients of each chunk of ``grad`` (flat): (indices [chunks, k], values, chunk count).

    What is not sent becomes the bucket's pending residual (error feedback), kept once the step commits.
    """
    n, c = grad.numel(), state.chunk_size
    chunks = math.ceil(n / c)
    x = grad.float()
    if state.error_feedback and bucket_index in state.residuals:
        x = x + _scaled(state.residuals[bucket_index], state.scale)
    padded = torch.zeros(chunks * c, device=grad.device)
    padded[:n] = x
    basis = state.basis(grad.device)
    coeffs = padded.view(chunks, c) @ basis.T
    idx = coeffs.abs().topk(state.topk, dim=1).indices
    vals = coeffs.gather(1, idx)
    if state.error_feedback:
        kept = torch.zeros_like(coeffs).scatter_(1, idx, vals)
        residual = ((coeffs - kept) @ basis).flatten()[:n].clone()
        state.pending[bucket_index] = _scaled(residual, 1.0 / state.scale)
    return idx, vals, chunks


def dct_decompress(
    idx: torch.Tensor,
    vals: torch.Tensor,
    chunks: int,
    n: int,
    state: DCTState,
    device: torch.device,
) -> torch.Tensor:
    """Sum the (index, value) pairs of all ranks (stacked along dim 0) and transform back: flat [n]."""
    c = state.chunk_size
    coeffs = torch.zeros(chunks, c, device=device)
    for i, v in zip(idx, vals, strict=True):
        coeffs.scatter_add_(1, i.long(), v)
    return (coeffs @ state.basis(device)).flatten()[:n]


def dct_hook(state: DCTState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: exchange the top-k DCT coefficients of each chunk, return the average."""
    buf = bucket.buffer()
    dct_reduce(buf, state, bucket.index(), dist.get_world_size(state.group), all_gather_flat)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def dct_reduce(buf: torch.Tensor, state: DCTState, index: int, world: int, gather: Gather) -> None:
    """Bucket ``index``'s top-k DCT coefficients gathered from ``world`` ranks with ``gather``
    (``all_gather_flat``'s signature) and averaged into ``buf``."""
    idx, vals, chunks = dct_compress(buf, state, index)
    # Flat buffers: every backend (gloo too) gathers along dim 0 into world x the input's size.
    all_idx = torch.empty(world * idx.numel(), dtype=torch.int32, device=buf.device)
    all_vals = torch.empty(world * vals.numel(), dtype=vals.dtype, device=buf.device)
    gather(all_idx, idx.to(torch.int32).flatten(), group=state.group)
    gather(all_vals, vals.flatten(), group=state.group)
    avg = dct_decompress(
        all_idx.view(world, *idx.shape), all_vals.view(world, *vals.shape), chunks, buf.numel(),
        state, buf.device,
    ) / world  # fmt: skip
    buf.copy_(avg.to(buf.dtype))


# Quantised DCT coefficients: a chunk's step is this many chunk RMS over 2^bits levels (+-2.4 RMS).
QUANT_RANGE = 4.8


@dataclass
class QuantDCTState:
    """The dct hook with ``coding: quant``: its settings and the EF21 estimates (per DDP bucket)."""

    chunk_size: int
    bits: int
    error_feedback: bool
    group: Any = None
    own: dict[int, torch.Tensor] = field(default_factory=dict)  # h: this rank's gradient estimate
    mean: dict[int, torch.Tensor] = field(default_factory=dict)  # H: the ranks' mean (same on all)
    # This step's new (own, mean) per bucket, until the step is committed.
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    scale: float = 1.0  # the loss scale of the gradients the hook sees (fp16)

    def commit(self) -> None:
        for i, (own, mean) in self.pending.items():
            self.own[i], self.mean[i] = own, mean
        self.pending.clear()

    def rollback(self) -> None:
        self.pending.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"own.{i}": t for i, t in sorted(self.own.items())}
        return out | {f"mean.{i}": t for i, t in sorted(self.mean.items())}

    def load_state_dict(
        self, state: dict[str, torch.Tensor], device: torch.device | None = None
    ) -> None:
        """The estimates of ``state``, each a copy of its own on ``device`` (the device of the buckets
        they are used with; None: where ``state`` holds them)."""
        placed = placed_state(state, device)
        for prefix, d in (("own.", self.own), ("mean.", self.mean)):
            d.clear()
            d.update({int(k[len(prefix) :]): v for k, v in placed.items() if k.startswith(prefix)})
        self.pending.clear()


def quantize(d: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Midrise quantisation of each row of ``d`` [chunks, c]: (codes in 0 .. 2^bits - 1, bf16 steps [chunks, 1])."""
    half = 2 ** (bits - 1)
    step = (QUANT_RANGE / 2**bits * d.pow(2).mean(dim=1, keepdim=True).sqrt()).to(torch.bfloat16)
    codes = (d / (step.float() + 1e-30)).floor().clamp(-half, half - 1) + half
    return codes.to(torch.uint8), step


def dequantize(codes: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    return (codes.float() - 2 ** (bits - 1) + 0.5) * step.float()


def pack_codes(codes: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """(codes [chunks, c], bf16 step [chunks, 1]) -> uint8 [chunks * (bits c / 8 + 2)]: 8 codes in ``bits`` bytes."""
    chunks, c = codes.shape
    shifts = bits * torch.arange(8, dtype=torch.int32, device=codes.device)
    word = (codes.view(chunks, c // 8, 8).to(torch.int32) << shifts).sum(dim=2)
    packed = torch.stack([(word >> (8 * b)) & 0xFF for b in range(bits)], dim=2).to(torch.uint8)
    steps = step.contiguous().view(torch.uint8).view(chunks, 2)
    return torch.cat([packed.view(chunks, -1), steps], dim=1).flatten()


def unpack_codes(
    payload: torch.Tensor, chunks: int, c: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_codes`."""
    p = payload.view(chunks, bits * c // 8 + 2)
    b = p[:, : bits * c // 8].view(chunks, c // 8, bits).to(torch.int32)
    word = b[..., 0].clone()
    for i in range(1, bits):
        word |= b[..., i] << (8 * i)
    shifts = bits * torch.arange(8, dtype=torch.int32, device=payload.device)
    codes = (word[..., None] >> shifts) & (2**bits - 1)
    step = p[:, bits * c // 8 :].contiguous().view(torch.bfloat16).view(chunks, 1)
    return codes.view(chunks, c).to(torch.uint8), step


def quant_dct_hook(
    state: QuantDCTState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: every DCT coefficient in ``bits`` bits (EF21), all-gathered, averaged."""
    buf = bucket.buffer()
    world, rank = dist.get_world_size(state.group), dist.get_rank(state.group)
    quant_dct_reduce(buf, state, bucket.index(), world, rank, all_gather_flat)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def quant_dct_reduce(
    buf: torch.Tensor, state: QuantDCTState, i: int, world: int, rank: int, gather: Gather
) -> None:
    """Bucket ``i``'s quantised DCT coefficients (EF21) gathered from ``world`` ranks with
    ``gather`` (``all_gather_flat``'s signature), decoded by every rank alike and averaged into
    ``buf``; ``rank``: this rank's index in the group."""
    n, c, bits = buf.numel(), state.chunk_size, state.bits
    chunks = math.ceil(n / c)
    padded = torch.zeros(chunks * c, device=buf.device)
    padded[:n] = buf.float()
    basis = dct_basis_on(c, buf.device)
    x = padded.view(chunks, c) @ basis.T
    zero = torch.zeros_like(x)
    if state.error_feedback:  # the estimates, in the units of this step's (scaled) gradients
        own = _scaled(state.own.get(i, zero), state.scale)
        mean = _scaled(state.mean.get(i, zero), state.scale)
    else:
        own, mean = zero, zero
    payload = pack_codes(*quantize(x - own, bits), bits)
    gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buf.device)
    gather(gathered, payload, group=state.group)
    # Every rank decodes the same payloads (its own among them) and adds them up in the same order:
    # the means stay equal everywhere. One payload decoded at a time (not every rank's at once:
    # that held the world's coefficients in float32, world times the bucket).
    total = torch.zeros_like(x)
    for r, row in enumerate(gathered.view(world, -1)):
        decoded = dequantize(*unpack_codes(row, chunks, c, bits), bits)
        total += decoded
        if r == rank:
            own = own + decoded
        del decoded
    mean = mean + total / world
    if state.error_feedback:
        state.pending[i] = (_scaled(own, 1.0 / state.scale), _scaled(mean, 1.0 / state.scale))
    buf.copy_((mean @ basis).flatten()[:n].to(buf.dtype))


def local_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that communicates nothing: every rank keeps its own gradients, for an
    optimizer that exchanges something smaller itself (``train.optimizer: demo``)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@dataclass
class PowerSGDGuard:
    """torch's PowerSGD state, with what the current step replaced kept aside until it is judged.

    torch's hook updates its state in place during backward: a new error per bucket (a new tensor),
    P and Q written into their memories, the iteration counter and its random generator. The guard
    keeps the previous values of all of them for the step in flight, so a skipped step restores them.
    """

    state: powersgd.PowerSGDState
    scale: float = 1.0  # the loss scale of the gradients the hook sees (fp16)
    backup: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)
    before: tuple[int, Any] | None = None  # (iter, rng state) before this step's first bucket

    def commit(self) -> None:
        self.backup.clear()
        self.before = None

    def rollback(self) -> None:
        s = self.state
        for i, saved in self.backup.items():
            for d, value in zip(
                (s.error_dict, s.p_memory_dict, s.q_memory_dict), saved, strict=True
            ):
                if value is None:
                    d.pop(i, None)
                else:
                    d[i] = value
        if self.before is not None:
            s.iter = self.before[0]
            s.rng.set_state(self.before[1])
        self.commit()


def guarded_powersgd_hook(
    guard: PowerSGDGuard, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD hook, keeping what it replaces (see :class:`PowerSGDGuard`); the error memory
    is kept in unscaled units, so a change of the fp16 loss scale does not change its meaning."""
    s, i = guard.state, bucket.index()
    if guard.before is None:
        guard.before = (s.iter, s.rng.get_state())
    if i not in guard.backup:
        p, q = s.p_memory_dict.get(i), s.q_memory_dict.get(i)
        # The error is replaced by a new tensor (the old one is never written); P and Q are written in place.
        guard.backup[i] = (
            s.error_dict.get(i),
            None if p is None else p.clone(),
            None if q is None else q.clone(),
        )
    scale = guard.scale
    if scale == 1.0:
        return powersgd.powerSGD_hook(s, bucket)
    if i in s.error_dict:
        s.error_dict[i] = s.error_dict[i] * scale

    def unscale(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        if i in s.error_dict:
            s.error_dict[i] = s.error_dict[i] / scale
        return fut.value()

    return powersgd.powerSGD_hook(s, bucket).then(unscale)


@dataclass
class LowPrecisionState:
    """The dtype a bucket is all-reduced in."""

    dtype: torch.dtype
    group: Any = None


def low_precision_hook(
    state: LowPrecisionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce the bucket in ``state.dtype`` (half the bytes), return the mean.

    torch's own bf16 hook is NCCL-only; this one works on any backend that sums the dtype.
    """
    buf = bucket.buffer()
    world = dist.get_world_size(state.group)
    low = buf.to(state.dtype).div_(world)
    fut = dist.all_reduce(low, group=state.group, async_op=True).get_future()  # type: ignore[union-attr]

    def back(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


@dataclass
class CompressionState:
    """What a compression hook keeps between steps (part of the checkpoint), or nothing."""

    kind: str
    hook_state: Any = None
    # The hook leaves each rank its own gradients (DeMo's optimizer exchanges them itself): norms differ
    # between ranks, so the step agrees on a non-finite one, reports their root mean square, and each
    # rank clips by its own.
    local_gradients: bool = False
    # The device of the model's parameters, hence of the buckets the hook sees: where a loaded
    # state goes (a checkpoint loads it into CPU templates). None: where it was loaded.
    device: torch.device | None = None

    def set_scale(self, scale: float) -> None:
        """The loss scale the next backward's gradients carry (fp16), so that state stays unscaled."""
        if isinstance(self.hook_state, (DCTState, QuantDCTState, PowerSGDGuard)):
            self.hook_state.scale = scale

    def commit(self) -> None:
        """Keep what the hook computed for the step just taken."""
        if isinstance(self.hook_state, (DCTState, QuantDCTState, PowerSGDGuard)):
            self.hook_state.commit()

    def rollback(self) -> None:
        """Forget what the hook computed for a step that is skipped: the state is as before it."""
        if isinstance(self.hook_state, (DCTState, QuantDCTState, PowerSGDGuard)):
            self.hook_state.rollback()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors of this rank's compression state (error feedback residuals, PowerSGD's memories)."""
        s = self.hook_state
        if isinstance(s, (DCTState, QuantDCTState)):
            return s.state_dict()
        if isinstance(s, PowerSGDGuard):
            s = s.state
            out = {f"error.{k}": v for k, v in s.error_dict.items()}
            out |= {f"p.{k}": v for k, v in s.p_memory_dict.items()}
            out |= {f"q.{k}": v for k, v in s.q_memory_dict.items()}
            out["iter"] = torch.tensor(s.iter)
            return out
        return {}

    def held(self) -> list[torch.Tensor]:
        """The tensors the hook keeps from step to step: its state (but PowerSGD's counter, a
        number) and the DCT's basis, built once on the hook's device (not saved)."""
        out = [t for k, t in self.state_dict().items() if k != "iter"]
        s = self.hook_state
        if isinstance(s, (DCTState, QuantDCTState)) and self.device is not None:
            out.append(dct_basis_on(s.chunk_size, self.device))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's compression state from ``state``, on :attr:`device`, where the hook uses it."""
        s = self.hook_state
        if isinstance(s, (DCTState, QuantDCTState)):
            s.load_state_dict(state, self.device)
        elif isinstance(s, PowerSGDGuard):
            s.commit()
            s = s.state
            iters = state.get("iter")
            placed = placed_state({k: v for k, v in state.items() if k != "iter"}, self.device)
            for prefix, d in (
                ("error.", s.error_dict),
                ("p.", s.p_memory_dict),
                ("q.", s.q_memory_dict),
            ):
                d.clear()
                d.update(
                    {int(k[len(prefix) :]): v for k, v in placed.items() if k.startswith(prefix)}
                )
            s.iter = int(iters.item()) if iters is not None else s.iter


def apply_ddp_compression(ddp: DistributedDataParallel, config: Config) -> CompressionState:
    """Register the configured communication hook on a DDP module."""
    kind, o = config.parallel.compression, config.parallel.compression_options
    # DDP's module lives on one device (the rank's): its buckets, and any state of the hook's.
    device = next(ddp.module.parameters()).device
    if config.parallel.diloco.inner_steps and dist.get_world_size(ddp.process_group) > 1:
        # DiLoCo replicas of several DDP ranks: plain DDP inside a replica, whose gradients are its
        # own (the replicas exchange pseudo-gradients every H steps). Its first bucket layout is kept,
        # as under a hook: a resumed run all-reduces in the same chunks as an uninterrupted one, and
        # no step carries the rebuild's broadcasts.
        _keep_bucket_layout(ddp)
        return CompressionState(kind)
    if config.train.optimizer == "demo" or config.parallel.diloco.inner_steps:
        # Each rank keeps its own gradients: DeMo and DiLoCo exchange something else themselves. The
        # bucket layout then matters to nobody: no rebuild (two broadcasts on the second step). A
        # one-rank DiLoCo replica's gradients are the replica's, agreed on by no one else.
        ddp.register_comm_hook(None, local_hook)
        _keep_bucket_layout(ddp)
        return CompressionState(kind, local_gradients=config.train.optimizer == "demo")
    if kind in ("fp16", "bf16"):
        dtype = torch.float16 if kind == "fp16" else torch.bfloat16
        ddp.register_comm_hook(LowPrecisionState(dtype), low_precision_hook)
    elif kind == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=o.rank,
            start_powerSGD_iter=o.start_step,
            use_error_feedback=o.error_feedback,
            warm_start=o.warm_start,
        )
        guard = PowerSGDGuard(state)
        ddp.register_comm_hook(guard, guarded_powersgd_hook)
        _keep_bucket_layout(ddp)
        return CompressionState(kind, guard, device=device)
    elif kind == "dct" and o.coding == "quant":
        qstate = QuantDCTState(o.chunk_size, o.bits, o.error_feedback)
        ddp.register_comm_hook(qstate, quant_dct_hook)
        _keep_bucket_layout(ddp)
        return CompressionState(kind, qstate, device=device)
    elif kind == "dct":
        dstate = DCTState(o.chunk_size, o.topk, o.error_feedback)
        ddp.register_comm_hook(dstate, dct_hook)
        _keep_bucket_layout(ddp)
        return CompressionState(kind, dstate, device=device)
    return CompressionState(kind)


class _NoRebuildReducer:
    """DDP's reducer, except that it never rebuilds its buckets."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _keep_bucket_layout(ddp: DistributedDataParallel) -> None:
    """Keep DDP's first bucket layout for the whole run.

    DDP re-orders its buckets once, after the first step, by the order gradients became ready. A
    compression hook's state (error feedback, PowerSGD memories) is per bucket and its chunks follow
    the bucket's layout, so a run resumed from a checkpoint would compress its first step with the
    initial layout where the uninterrupted run used the rebuilt one. With one layout throughout, a
    resumed run stays exact.
    """
    ddp.reducer = _NoRebuildReducer(ddp.reducer)  # type: ignore[assignment]


def reduce_dtype(config: Config) -> torch.dtype | None:
    """The dtype gradients are reduced in under fp16/bf16 compression (FSDP/HSDP's reduce-scatter and
    all-reduce, ZeRO-1's, the deferred DDP sync's); None: float32, the gradients' own. Under
    ``train.precision`` bf16/fp16 FSDP computes the gradients in half precision, and None still means
    float32 there (:func:`dtlab.parallel.apply.mixed_precision_policy` says so explicitly)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.parallel.compression)
