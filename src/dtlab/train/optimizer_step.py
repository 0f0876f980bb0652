"""One optimizer step of the torch engine, as every layout takes it: forward and backward of the
rank's micro-batches, the ranks' agreement (one reduction; across fault-tolerant replica groups, an
average and a commit vote), the update the agreement allows. And the validation's forward.

What concerns a step besides its batch is carried by the objects that own it: the faults injected
into it (:class:`StepFaults`), who agrees on it (:class:`StepPeers`), ``train.oom_retry`` by the
config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dtlab.config import Config
from dtlab.data.loader import MicroBatch
from dtlab.parallel.apply import ParallelModel
from dtlab.parallel.compression import reduce_dtype
from dtlab.parallel.ledger import recorded
from dtlab.runtime.faults import FAULTS_ENV
from dtlab.train.loss import token_loss
from dtlab.train.oom import StepOutOfMemory, agree_out_of_memory, is_out_of_memory
from dtlab.train.precision import LossScaler, autocast
from dtlab.train.routing import forget_routing, moe_aux_loss, routing_counts, routing_step
from dtlab.train.step import StepValues, clip_gradients, reduce_step

if TYPE_CHECKING:
    from dtlab.parallel.ft import Replicas

__all__ = [
    "StepFaults", "StepPeers", "accumulate_gradients", "evaluate", "forward_loss", "train_step",
]  # fmt: skip


def forward_loss(
    module: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    device: torch.device,
    compiled: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy over the micro-batch's tokens (computed in float32 under any precision),
    compiled under ``train.compile`` (``compiled``: see :mod:`dtlab.train.loss`)."""
    with autocast(precision, device):
        logits = module(inputs)
    return token_loss(logits, targets, compiled)


@dataclass(frozen=True)
class StepFaults:
    """The faults injected into one step (:mod:`dtlab.runtime.faults`): a NaN loss, gradients left
    unsynchronised, an out-of-memory error after the first micro-batch's backward, the loss (and so
    the gradients) multiplied by ``loss_factor`` (a spike)."""

    nan: bool = False
    skip_sync: bool = False
    oom: bool = False
    loss_factor: float = 1.0


@dataclass(frozen=True)
class StepPeers:
    """Who agrees on a step: ``group`` of ``size`` ranks (a DiLoCo replica's; None: every rank),
    and across fault-tolerant replica groups, ``replicas`` (parallel.fault_tolerance)."""

    group: Any = None
    size: int | None = None
    replicas: Replicas | None = None


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: LossScaler,
    micro_batches: list[MicroBatch],
    config: Config,
    device: torch.device,
    *,
    stop_signal: int = 0,
    before_update: Callable[[], None] | None = None,
    faults: StepFaults = StepFaults(),
    peers: StepPeers = StepPeers(),
) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches: forward and backward, the ranks'
    agreement, the update; returns the step's metrics.

    ``before_update()`` runs before the step first changes a tensor a checkpoint holds in place: an
    async save still copying them (:meth:`Checkpointer.staged`) finishes first. That is the optimizer
    step, or with a compression hook the backward (the hooks fold their state in there).

    ``stop_signal`` is the stop signal this rank caught (0: none); the ranks agree on it in the step's
    one reduction, and ``"stop"`` in the metrics names the agreed signal. A step whose global loss or
    gradient norm is not finite changes no parameter (``bad`` in the metrics); under fp16 an overflow
    only lowers the loss scale (``skipped``), as loss scaling intends.

    With ``train.oom_retry`` the ranks agree, before any gradient is synchronised, whether one ran out
    of memory (:mod:`dtlab.train.oom`); if one did, every rank raises StepOutOfMemory with nothing
    changed, for the caller to take the step again with smaller micro-batches. Under fault tolerance
    (``peers.replicas``) the gradients and loss are averaged over the groups in the quorum, and a step
    that does not commit everywhere changes nothing (``{"uncommitted": True}``, for the caller to take
    it again).
    """
    if scaler.enabled:
        pm.compression.set_scale(scaler.scale)  # hooks keep their state in unscaled units
    pm.refresh_float8_scales()
    hooked = pm.compression.hook_state is not None
    if before_update is not None and hooked:
        before_update()
    loss_sum = _forward_backward(pm, scaler, micro_batches, config, device, faults)
    agreed = _agree(pm, scaler, loss_sum, stop_signal, device, peers)
    if agreed is None:  # not committed by every fault-tolerant replica group: nothing changes
        pm.compression.rollback()
        clear_gradients(_stepped(optimizer), _bucket_views(pm))
        forget_routing(pm.module)
        return {"uncommitted": True}
    later = before_update if not hooked else None  # after the clipping, before the optimizer step
    return _update(pm, optimizer, scheduler, scaler, config, *agreed, before_update=later)


def _forward_backward(
    pm: ParallelModel,
    scaler: LossScaler,
    micro_batches: list[MicroBatch],
    config: Config,
    device: torch.device,
    faults: StepFaults,
) -> torch.Tensor:
    """Every micro-batch's forward and backward, the gradients synchronised (under
    ``train.oom_retry`` once the ranks agreed that none ran out of memory) and settled; returns this
    rank's loss, summed over its micro-batches."""
    f = faults
    args = (pm, scaler, micro_batches, config, device, f.nan, f.skip_sync, f.oom, f.loss_factor)
    loss_sum = _accumulate_agreed(*args) if config.train.oom_retry else accumulate_gradients(*args)
    pm.settle_gradients()
    return loss_sum


def _agree(
    pm: ParallelModel,
    scaler: LossScaler,
    loss_sum: torch.Tensor,
    stop_signal: int,
    device: torch.device,
    peers: StepPeers,
) -> tuple[StepValues, list[torch.nn.Parameter]] | None:
    """The ranks' agreement on the step (its loss, flags, stop signal and gradient norm, in one
    reduction), after the average across fault-tolerant replica groups; None where a group did not
    commit the step."""
    params = [p for p in pm.optimized.parameters() if p.grad is not None]
    if peers.replicas is not None:  # across the replica groups, before anything is judged
        held = [g for p in params if (g := p.grad) is not None]
        loss_sum = peers.replicas.average(held, loss_sum, routing_counts(pm.module))
    found = scaler.unscale_(params, device)  # this rank's overflow flag (fp16), no collective
    local = pm.compression.local_gradients  # each rank's own gradients (DeMo)
    grads = [g for p in params if (g := p.grad) is not None]
    r = reduce_step(
        loss_sum, found, stop_signal, grads, local, pp=pm.dims.pp, group=peers.group,
        group_size=peers.size,
    )  # fmt: skip
    if peers.replicas is not None and not peers.replicas.should_commit():
        return None
    return r, params


def _update(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: LossScaler,
    config: Config,
    r: StepValues,
    params: list[torch.nn.Parameter],
    before_update: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """The update the agreement allows: clip and step, or (a step that is not finite, an fp16
    overflow) nothing but the loss scale; then the routing figures, the schedule and the metrics.
    ``before_update()`` runs after the clipping, before the optimizer step."""
    if config.train.grad_clip > 0:
        clip_gradients(params, config.train.grad_clip, r.clip_norm_t)
    # Loss, norm and flags are agreed by every rank, so every rank takes the same decision.
    local = pm.compression.local_gradients
    found_inf = scaler.enabled and r.flagged
    nonfinite = r.flagged if local else not math.isfinite(r.norm)
    bad = not math.isfinite(r.loss) or (not scaler.enabled and nonfinite)
    if before_update is not None:
        before_update()
    # Judged before anything is folded in: a skipped step leaves the optimizer and compression
    # state exactly as they were (the hooks' new state waits until it is committed).
    if not found_inf and not bad:
        optimizer.step()
        pm.after_update()
        pm.compression.commit()
    else:
        pm.compression.rollback()
    # MoE: the step's expert loads agreed, and the balancing bias moved only by a step taken.
    routing = routing_step(
        pm.module, update=not found_inf and not bad, copies=pm.dims.tp, args=pm.model.args,
        stages=pm.dims.pp_enabled,
    )  # fmt: skip
    scaler.update(found_inf)
    views = _bucket_views(pm)
    clear_gradients(_stepped(optimizer), views)
    if pm.zero is not None:  # ZeRO-1: the optimizer holds only this rank's share of the parameters
        clear_gradients(pm.module.parameters(), views)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    out: dict[str, Any] = {"loss": r.loss, "lr": lr, "grad_norm": r.norm}
    if scaler.enabled:
        out.update(loss_scale=scaler.scale, skipped=found_inf)
    if bad:
        out["bad"] = True
    if r.stop is not None:
        out["stop"] = r.stop
    out.update(routing)
    return out


def _stepped(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    return (p for group in optimizer.param_groups for p in group["params"])


def _bucket_views(pm: ParallelModel) -> bool:
    """The module's gradients are views of DDP's buckets (``gradient_as_bucket_view``)."""
    return isinstance(pm.module, DistributedDataParallel) and pm.module.gradient_as_bucket_view


def clear_gradients(params: Iterable[torch.nn.Parameter], bucket_views: bool) -> None:
    """Drop ``params``' gradients after a step; with ``bucket_views`` (DDP's
    ``gradient_as_bucket_view``) zero in place those that are views of its buckets, which its
    reducer keeps anyway: dropped, the next step's unsynchronised micro-batches would make new
    gradients beside the buckets, a second copy of every gradient until the last micro-batch's
    sync (measured by `dtlab plan --check`); zeroed, they accumulate into the buckets. The values
    are the same (0 + g is g)."""
    views: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        if bucket_views and p.grad._base is not None:
            views.append(p.grad)
        else:
            p.grad = None
    if views:
        torch._foreach_zero_(views)


def _accumulate_agreed(
    pm: ParallelModel,
    scaler: LossScaler,
    micro_batches: list[MicroBatch],
    config: Config,
    device: torch.device,
    inject_nan: bool,
    skip_sync: bool,
    inject_oom: bool,
    loss_factor: float = 1.0,
) -> torch.Tensor:
    """:func:`accumulate_gradients` with every micro-batch unsynchronised, then the ranks' agreement on
    an out-of-memory error, then the gradient sync: StepOutOfMemory on every rank if any ran out."""
    failed = ""
    try:
        loss_sum = accumulate_gradients(
            pm, scaler, micro_batches, config, device, inject_nan, True, inject_oom, loss_factor
        )
    except Exception as e:  # only an allocation failure; the frames holding tensors go with ``e``
        if not is_out_of_memory(e):
            raise
        failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    ranks = agree_out_of_memory(bool(failed), device)
    if ranks:
        clear_gradients(pm.module.parameters(), _bucket_views(pm))
        forget_routing(pm.module)
        raise StepOutOfMemory(ranks, int(micro_batches[0][0].shape[0]), failed)
    if not skip_sync:
        pm.sync_gradients(reduce_dtype(config))
    return loss_sum


def accumulate_gradients(
    pm: ParallelModel,
    scaler: LossScaler,
    micro_batches: list[MicroBatch],
    config: Config,
    device: torch.device,
    inject_nan: bool = False,
    skip_sync: bool = False,
    inject_oom: bool = False,
    loss_factor: float = 1.0,
) -> torch.Tensor:
    """Forward and backward of every micro-batch, gradients synchronised on the last one only;
    returns this rank's loss, summed over its micro-batches (each divided by their number).

    Pipeline parallel: the rank's micro-batches together are its batch, which the schedule splits into
    its own micro-batches; the loss is the last stage's (0 on the other stages).
    """
    if pm.pipeline is not None:
        inputs = torch.cat([x for x, _ in micro_batches]).to(device, non_blocking=True)
        targets = torch.cat([y for _, y in micro_batches]).to(device, non_blocking=True)
        pm.pipeline.inject_nan = inject_nan
        with (
            autocast(config.train.precision, device),
            pm.loss_context(),
            recorded("pipeline schedule", "send/recv"),
        ):
            return pm.pipeline.step(inputs, targets)
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = (
            inputs.to(device, non_blocking=True),
            targets.to(device, non_blocking=True),
        )
        # The last micro-batch synchronises gradients; the others accumulate locally (FSDP's in
        # its shards: ParallelModel.grad_sync).
        with pm.grad_sync(i == accum - 1, skip=skip_sync), pm.loss_context():
            # Every micro-batch has the same number of tokens, so mean/accum summed over micro-batches and
            # averaged over ranks is the mean over every token of the global batch.
            loss = (
                forward_loss(
                    pm.module, inputs, targets, config.train.precision, device, config.train.compile
                )
                / accum
            )
            if inject_nan:
                loss = loss * float("nan")
            if loss_factor != 1.0:
                loss = loss * loss_factor
            # MoE's auxiliary balancing loss is trained on but not reported in the loss.
            objective = loss + aux / accum if (aux := moe_aux_loss(pm.module)) is not None else loss
            scaler.scale_loss(objective).backward()
        if inject_oom and i == 0:
            raise torch.OutOfMemoryError(
                f"{FAULTS_ENV}: injected out of memory after the first micro-batch's backward"
            )
        # Tensor parallel: the loss is a replicated DTensor, the same on every rank of the group.
        loss_sum += loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()  # type: ignore[attr-defined]
    return loss_sum


def evaluate(
    pm: ParallelModel, batches: list[list[MicroBatch]], config: Config, device: torch.device
) -> float:
    """The mean validation loss over every token of ``batches`` (each one step's worth of this rank's
    micro-batches), agreed by every rank in one all-reduce: a forward without gradients, under the
    training precision. It changes no state: the model has no dropout, and the random number
    generators are restored in case a layer draws from them."""
    total = torch.zeros((), device=device)
    pm.refresh_float8_scales()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for micro_batches in batches:
            if pm.pipeline is not None:
                inputs = torch.cat([x for x, _ in micro_batches]).to(device)
                targets = torch.cat([y for _, y in micro_batches]).to(device)
                with autocast(config.train.precision, device), pm.loss_context():
                    total += pm.pipeline.evaluate(inputs, targets)
                continue
            for inputs, targets in micro_batches:
                with pm.loss_context():
                    loss = forward_loss(
                        pm.module, inputs.to(device), targets.to(device), config.train.precision,
                        device, config.train.compile,
                    ) / len(micro_batches)  # fmt: skip
                total += loss.to_local() if isinstance(loss, DTensor) else loss  # type: ignore[attr-defined]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(total)  # recorded by the caller, with the forward's collectives
        # Every rank holding a loss (the last pipeline stage's) summed its own; tensor-parallel ranks
        # hold the same loss, as in the training step's reduction.
        total /= world // pm.dims.pp
    return float(total) / len(batches)
