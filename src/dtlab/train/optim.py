"""AdamW with decoupled weight decay on matrices only, and gradient clipping that works on shards."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtlab.config import TrainConfig
from dtlab.train.schedules import lr_at


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (or DeMo) over the model's parameters. Build it *after* parallelism is applied: FSDP
    replaces the parameters with sharded ones, and an optimizer holding the old ones would train nothing."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": params, **hyper}
        for params, hyper in zip((decay, no_decay), group_hyperparameters(t), strict=True)
    ]
    if t.optimizer == "demo":
        from dtlab.train.demo import DeMo

        return DeMo(groups, t.lr, t.demo.chunk_size, t.demo.topk, t.demo.decay)
    return torch.optim.AdamW(groups, lr=t.lr, foreach=True)


def group_hyperparameters(t: TrainConfig) -> list[dict[str, object]]:
    """The config's hyper-parameters of the two parameter groups: matrices (decayed), then the rest."""
    common: dict[str, object] = {} if t.optimizer == "demo" else {"betas": t.betas, "eps": t.eps}
    return [{"weight_decay": t.weight_decay, **common}, {"weight_decay": 0.0, **common}]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    t: TrainConfig,
) -> None:
    """Make a resumed optimizer and schedule follow the config given now, not the checkpoint's.

    Loading a checkpoint restores the param groups (lr, betas, eps, weight decay) and the scheduler's
    base learning rates it was saved with; the user's latest word wins. The schedule continues at the
    resumed step: the next step's learning rate is ``lr_at(step)`` of the new config.
    """
    step = scheduler.last_epoch
    for group, hyper in zip(optimizer.param_groups, group_hyperparameters(t), strict=True):
        group.update(hyper)
        group["initial_lr"] = t.lr
        group["lr"] = lr_at(step, t)
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # type: ignore[attr-defined]


def agree_local_norm(norm: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """For gradients that are each rank's own (DeMo): the root mean square of the ranks' norms (the
    same on every rank) and whether any rank's norm is not finite (counted: a MAX can drop a NaN)."""
    import torch.distributed as dist

    nonfinite = not math.isfinite(norm.item())
    if not dist.is_initialized():
        return norm, nonfinite
    from dtlab.parallel.ledger import all_reduce

    t = torch.stack([norm.detach().float() ** 2, norm.new_tensor(float(nonfinite))])
    all_reduce("train_step grad-norm all_reduce", t)
    return (t[0] / dist.get_world_size()).sqrt(), bool(t[1] > 0)


def grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global L2 norm of all gradients; clips them to ``max_norm`` when it is > 0.

    Sharded (DTensor) gradients: each rank holds a slice, so the norm of the local slices is not the
    norm. ``get_total_norm`` returns a DTensor whose ``full_tensor()`` reduces across the mesh.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
